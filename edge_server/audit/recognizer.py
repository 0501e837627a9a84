"""The attacker's face recognizer, trained on public faces only.

`Eigenfaces`: PCA of standardised greyscale faces, whitened (Turk & Pentland 1991). Weak against
modern recognizers but honest and fast; the audit always reports its re-identification rate on
clean photos next to every attack result, so the attack's numbers can be read against it.
"""
from __future__ import annotations

import numpy as np

from .inversion import resized


def grey(images: np.ndarray, size: int) -> np.ndarray:
    g = resized(images, size).mean(axis=1).reshape(len(images), -1).astype(np.float64)
    g -= g.mean(axis=1, keepdims=True)             # per-image brightness and contrast do not identify anyone
    return g / np.maximum(g.std(axis=1, keepdims=True), 1e-8)


class Eigenfaces:
    def __init__(self, components: int = 64, size: int = 32, skip: int = 1):
        # the first components mostly code lighting; skipping them is the classic remedy
        self.components, self.size, self.skip = components, size, skip

    def fit(self, public_images: np.ndarray) -> "Eigenfaces":
        x = grey(public_images, self.size)
        self.mean = x.mean(0)
        _, s, vt = np.linalg.svd(x - self.mean, full_matrices=False)
        keep = slice(self.skip, self.skip + self.components)
        self.basis, self.scale = vt[keep], s[keep] / np.sqrt(len(x))
        return self

    def embed(self, images: np.ndarray) -> np.ndarray:
        return ((grey(images, self.size) - self.mean) @ self.basis.T) / self.scale
