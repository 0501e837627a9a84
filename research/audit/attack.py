"""The curious server's attacks, scored. Each returns plain figures next to their reference points:
what the same recognizer does on clean photos (the upper bound) and what a guesser gets (chance).

- reconstruction: images back from the releases, then face retrieval on them;
- identity matching: releases straight to a strong recognizer's embedding (`matcher.py`);
- server-model linkage: the server's own trained model as the recognizer;
- label leakage from the embedding gradients a device head returns;
- membership inference from the server classifier's loss.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from splitface.device.trainer import privatize
from splitface.common.models import ModelSpec
from splitface.device.privacy.mechanisms import Mechanism, noise_generator

from research.audit.inversion import resized
from research.audit.metrics import chance_risk, cosine, linkage_rate, psnr, reidentification_risk, roc_auc, ssim
from research.audit.recognizer import Recognizer


@torch.no_grad()
def layer_outputs(layer: nn.Module, images: np.ndarray, batch: int = 128) -> np.ndarray:
    """Images in [0, 1] through a device layer (in batches: whole-set tensors thrash memory)."""
    return np.concatenate([layer(torch.from_numpy(images[i:i + batch])).numpy() for i in range(0, len(images), batch)])


@torch.no_grad()
def privatized(outputs: np.ndarray, mechanism: Mechanism, seed: int, spec: ModelSpec | None = None) -> np.ndarray:
    """The device SDK's own release (the transform's random subset where `spec` has one, then the
    mechanism) on layer outputs, with randomness of the attacker's own (it lacks the device's secret);
    a fresh seed is a fresh draw."""
    x, generator = torch.from_numpy(outputs), noise_generator(seed, 1)
    return (mechanism.privatize(x, generator) if spec is None else privatize(spec, mechanism, x, generator)).numpy()


def releases(layer: nn.Module, images: np.ndarray, mechanism: Mechanism, seed: int,
             spec: ModelSpec | None = None) -> np.ndarray:
    """What a device would send for these images: how the attacker prepares its public training pairs."""
    return privatized(layer_outputs(layer, images), mechanism, seed, spec)


def retrieval_report(queries: np.ndarray, query_ids: np.ndarray, gallery: np.ndarray, gallery_ids: np.ndarray,
                     ks: Sequence[int] = (1, 5)) -> dict:
    """R(A, S, K) and its chance level, for each K."""
    out = {}
    for k in ks:
        out[f"risk@{k}"] = reidentification_risk(queries, query_ids, gallery, gallery_ids, k)
        out[f"risk@{k}_chance"] = chance_risk(queries, query_ids, gallery, gallery_ids, k)
    return out


def reconstruction_report(recon: np.ndarray, originals: np.ndarray, identities: np.ndarray,
                          photo_identities: np.ndarray, recognizers: dict[str, Recognizer],
                          references: dict[str, tuple[np.ndarray, np.ndarray]], ks: Sequence[int] = (1, 5)) -> dict:
    """`recon`: reconstructions of `originals` (private training images of `identities`, [0, 1]).
    `references[name]`: recognizer `name`'s embeddings of the attacker's other real photos of those
    people (`photo_identities`) and of the clean originals, computed once per run. Image quality and
    linkage, then per recognizer: face linkage and R(A, S, K) on the reconstructions and on the clean
    originals (the upper bound)."""
    target = resized(originals, recon.shape[-1])
    flat = lambda a: a.reshape(len(a), -1)  # noqa: E731
    report = {"images": len(originals), "identities": int(len(np.unique(identities))),
              "queries": len(photo_identities), "psnr_db": float(np.mean(psnr(recon, target))),
              "ssim": float(np.mean(ssim(recon, target))), "linkage_pixels": linkage_rate(flat(recon), flat(target)),
              "linkage_pixels_chance": 1 / len(originals), "recognizers": {}}
    for name, recognizer in recognizers.items():
        (queries, clean), gallery = references[name], recognizer.embed(recon)
        r = {"linkage_face": linkage_rate(gallery, clean), **retrieval_report(queries, photo_identities, gallery,
                                                                                identities, ks)}
        for k in ks:
            r[f"risk@{k}_clean_upper_bound"] = reidentification_risk(queries, photo_identities, clean, identities, k)
        report["recognizers"][name] = r
    return report


def label_leakage(grads: np.ndarray, labels: np.ndarray, batch_ids: np.ndarray) -> dict:
    """Device head: what the embedding gradients a device returns say about its labels.

    Compared within a batch (one model state). Direction: the cosine of two samples' gradients,
    scored as a same-identity detector (AUC), and whether each sample's most similar gradient in
    its batch shares its identity (with that rate's chance level). Norm (Li et al. 2022, one
    identity against the rest, averaged): the gradient norm as a detector of each identity."""
    same, sims, nn_hits, nn_chance = [], [], [], []
    for b in np.unique(batch_ids):
        sel = np.flatnonzero(batch_ids == b)
        if len(sel) < 2:
            continue
        cos, y = cosine(grads[sel], grads[sel]), labels[sel]
        upper = np.triu_indices(len(sel), 1)
        sims.append(cos[upper])
        same.append((y[:, None] == y[None, :])[upper])
        np.fill_diagonal(cos, -np.inf)
        nn_hits.append(y[cos.argmax(1)] == y)
        nn_chance.append([(np.sum(y == yi) - 1) / (len(y) - 1) for yi in y])
    sims, same = np.concatenate(sims), np.concatenate(same)
    norms = np.linalg.norm(grads, axis=1)
    per_identity = [roc_auc(norms[labels == c], norms[labels != c]) for c in np.unique(labels)
                    if 2 <= np.sum(labels == c) < len(labels)]
    return {"samples": len(labels), "same_identity_pairs": int(same.sum()), "pairs": len(same),
            "direction_auc": roc_auc(sims[same], sims[~same]) if same.any() and (~same).any() else None,
            "nearest_gradient_same_identity": float(np.concatenate(nn_hits).mean()),
            "nearest_gradient_same_identity_chance": float(np.concatenate(nn_chance).mean()),
            "norm_auc_one_vs_rest_mean": float(np.mean(per_identity)) if per_identity else None}


def membership_inference(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> dict:
    """Loss-threshold attack (Yeom et al. 2018): a lower loss says "trained on". AUC 0.5 = no signal."""
    return {"members": len(member_losses), "non_members": len(nonmember_losses),
            "auc": roc_auc(-np.asarray(member_losses), -np.asarray(nonmember_losses)),
            "mean_loss_members": float(np.mean(member_losses)), "mean_loss_non_members": float(np.mean(nonmember_losses))}
