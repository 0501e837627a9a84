"""What an attack achieved, in the units reviewers use: PSNR and SSIM of reconstructions, image
linkage, the re-identification risk R(A, S, K) of the face-retrieval papers, and ROC AUC (PSNR and SSIM
from scikit-image, ROC AUC from scikit-learn).

All inputs are numpy arrays; images are (N, C, H, W) floats in [0, 1]; embeddings are (N, D).
"""
from __future__ import annotations

import numpy as np
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from sklearn.metrics import roc_auc_score


def psnr(reconstructed: np.ndarray, original: np.ndarray, peak: float = 1.0) -> np.ndarray:
    """Per-image peak signal-to-noise ratio in dB (inf for a perfect copy): scikit-image's."""
    with np.errstate(divide="ignore"):
        return np.array([peak_signal_noise_ratio(o, r, data_range=peak) for r, o in zip(reconstructed, original)])


def ssim(reconstructed: np.ndarray, original: np.ndarray, peak: float = 1.0) -> np.ndarray:
    """Per-image structural similarity as Wang et al. 2004 define it (11x11 Gaussian window, sigma 1.5,
    K1 = 0.01, K2 = 0.03), averaged over channels and positions: scikit-image's."""
    return np.array([structural_similarity(r.astype(np.float64), o.astype(np.float64), channel_axis=0,
                                           data_range=peak, gaussian_weights=True, sigma=1.5,
                                           use_sample_covariance=False)
                     for r, o in zip(reconstructed, original)])


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return a @ b.T


def linkage_rate(reconstructed: np.ndarray, originals: np.ndarray) -> float:
    """Share of reconstructions whose most similar original (cosine, in the given embedding) is their
    own source: row i of `reconstructed` comes from row i of `originals`."""
    nearest = cosine(reconstructed, originals).argmax(axis=1)
    return float((nearest == np.arange(len(originals))).mean())


def reidentification_risk(queries: np.ndarray, query_ids: np.ndarray, gallery: np.ndarray, gallery_ids: np.ndarray,
                          k: int) -> float:
    """R(A, S, K): share of attacker queries (real photos) whose true identity is among the identities
    of the K most similar gallery items (reconstructions); identities are ranked by their best item."""
    sims = cosine(queries, gallery)
    identities = np.unique(gallery_ids)
    # best similarity per identity, then the top-K identities per query
    per_identity = np.stack([sims[:, gallery_ids == i].max(axis=1) for i in identities], axis=1)
    top = identities[np.argsort(-per_identity, axis=1, kind="stable")[:, :k]]
    return float((top == np.asarray(query_ids)[:, None]).any(axis=1).mean())


def chance_risk(queries: np.ndarray, query_ids: np.ndarray, gallery: np.ndarray, gallery_ids: np.ndarray, k: int,
                rounds: int = 50, seed: int = 0) -> float:
    """R(A, S, K) when the gallery says nothing about who is who: the mean risk over random
    reassignments of the gallery's identities (group sizes kept). Not K / #identities: an identity
    with more gallery items wins the best-item ranking more often, and the people with most photos
    are also queried most, so with unbalanced data chance is well above K / #identities."""
    rng = np.random.default_rng(seed)
    return float(np.mean([reidentification_risk(queries, query_ids, gallery, rng.permutation(gallery_ids), k)
                          for _ in range(rounds)]))


def roc_auc(positive_scores: np.ndarray, negative_scores: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counted half: scikit-learn's."""
    pos, neg = np.asarray(positive_scores, dtype=np.float64), np.asarray(negative_scores, dtype=np.float64)
    return float(roc_auc_score(np.r_[np.ones(len(pos)), np.zeros(len(neg))], np.r_[pos, neg]))
