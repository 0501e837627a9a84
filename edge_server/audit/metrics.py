"""What an attack achieved, in the units reviewers use: PSNR and SSIM of reconstructions, image
linkage, the re-identification risk R(A, S, K) of the face-retrieval papers, and ROC AUC.

All inputs are numpy arrays; images are (N, C, H, W) floats in [0, 1]; embeddings are (N, D).
"""
from __future__ import annotations

import numpy as np


def psnr(reconstructed: np.ndarray, original: np.ndarray, peak: float = 1.0) -> np.ndarray:
    """Per-image peak signal-to-noise ratio in dB (inf for a perfect copy)."""
    mse = ((reconstructed - original) ** 2).reshape(len(original), -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        return 10 * np.log10(peak ** 2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size) - size // 2
    g = np.exp(-x ** 2 / (2 * sigma ** 2))
    return g / g.sum()


def _blur(x: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Separable 'valid' Gaussian filter over the last two axes."""
    k = len(window)
    rows = sum(window[i] * x[..., i:x.shape[-2] - k + 1 + i, :] for i in range(k))
    return sum(window[i] * rows[..., i:x.shape[-1] - k + 1 + i] for i in range(k))


def ssim(reconstructed: np.ndarray, original: np.ndarray, peak: float = 1.0) -> np.ndarray:
    """Per-image structural similarity (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5,
    K1 = 0.01, K2 = 0.03), averaged over channels and positions."""
    window = _gaussian_window(min(11, original.shape[-1], original.shape[-2]) | 1)
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    x, y = reconstructed.astype(np.float64), original.astype(np.float64)
    mx, my = _blur(x, window), _blur(y, window)
    vx, vy = _blur(x * x, window) - mx ** 2, _blur(y * y, window) - my ** 2
    cov = _blur(x * y, window) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.reshape(len(original), -1).mean(axis=1)


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
    """P(score of a random positive > score of a random negative), ties counted half (Mann-Whitney U)."""
    pos, neg = np.asarray(positive_scores, dtype=np.float64), np.asarray(negative_scores, dtype=np.float64)
    scores = np.concatenate([pos, neg])
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):   # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))
