"""Reconstruct faces from the activations the server received: ridge regression fitted on public
faces (the mission's baseline attack: a linear map learned from public images run through the
public device layer and the mechanism's noise).

Fitted in dual form, (X X^T + lambda I)^-1 over the public set, so the cost grows with the number of
public images rather than with the 16x64x64 (or 64x224x224) activation size. Activations are
average-pooled and images downsampled first to keep the public set's Gram matrix small.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from research.audit.metrics import linkage_rate


def pooled(activations: np.ndarray, pool: int) -> np.ndarray:
    x = torch.from_numpy(np.asarray(activations, dtype=np.float32))
    if pool > 1:
        x = F.avg_pool2d(x, pool)
    return x.flatten(1).numpy().astype(np.float64)


def resized(images: np.ndarray, size: int) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size), area-averaged."""
    x = torch.from_numpy(np.asarray(images, dtype=np.float32))
    if x.shape[-1] != size:
        x = F.interpolate(x, size=(size, size), mode="area")
    return x.numpy()


class RidgeInversion:
    def __init__(self, ridge: float = 1e-2, pool: int = 2, image_size: int = 32):
        self.ridge, self.pool, self.image_size = ridge, pool, image_size

    def fit(self, activations: np.ndarray, images: np.ndarray) -> "RidgeInversion":
        """`activations`: the public images' releases (N, C, H, W); `images`: those images in [0, 1]."""
        x = pooled(activations, self.pool)
        y = resized(images, self.image_size).reshape(len(images), -1).astype(np.float64)
        self.x_mean, self.y_mean = x.mean(0), y.mean(0)
        self.x_train = x - self.x_mean
        gram = self.x_train @ self.x_train.T
        # lambda relative to the Gram matrix's mean diagonal: the same setting works at any noise level
        lam = self.ridge * np.trace(gram) / len(gram)
        self.coef = np.linalg.solve(gram + lam * np.eye(len(gram)), y - self.y_mean)
        return self

    def reconstruct(self, activations: np.ndarray, batch: int = 512) -> np.ndarray:
        out = []
        for i in range(0, len(activations), batch):
            x = pooled(activations[i:i + batch], self.pool) - self.x_mean
            out.append((x @ self.x_train.T) @ self.coef + self.y_mean)
        size = self.image_size
        return np.clip(np.concatenate(out), 0, 1).reshape(-1, 3, size, size).astype(np.float32)


def tuned_inversion(public_releases: np.ndarray, public_images: np.ndarray, image_size: int = 32,
                    pools: tuple[int, ...] = (2, 4, 8), ridges: tuple[float, ...] = (1e-2, 1e-1, 1.0)
                    ) -> tuple[RidgeInversion, dict]:
    """What an attacker can do without private data: choose pool and ridge by image linkage on a
    held-out quarter of the public faces, then refit on all of them."""
    n = len(public_images) * 3 // 4
    held = resized(public_images[n:], image_size).reshape(len(public_images) - n, -1)
    best, best_score = (pools[0], ridges[0]), -1.0
    for pool in pools:
        for ridge in ridges:
            recon = RidgeInversion(ridge, pool, image_size).fit(public_releases[:n], public_images[:n]) \
                .reconstruct(public_releases[n:])
            score = linkage_rate(recon.reshape(len(recon), -1), held)
            if score > best_score:
                best, best_score = (pool, ridge), score
    chosen = {"pool": best[0], "ridge": best[1], "public_holdout_linkage": best_score}
    return RidgeInversion(best[1], best[0], image_size).fit(public_releases, public_images), chosen
