"""The attacker's face recognizer, trained on public faces only.

`Eigenfaces`: PCA of standardised greyscale faces, whitened (Turk & Pentland 1991). Weak against
modern recognizers but honest and fast; the audit always reports its re-identification rate on
clean photos next to every attack result, so the attack's numbers can be read against it.

`PublicBackbone`: a face-recognition backbone pre-trained on public LFW people
(`splitface-server pretrain`), its embedding as the recognizer: the stronger attacker.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from device_sdk.models import ModelSpec, build_backbone
from device_sdk.models.weights import load_into

from .inversion import resized


class Recognizer(Protocol):
    def embed(self, images: np.ndarray) -> np.ndarray: ...


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


class PublicBackbone:
    def __init__(self, weights: Path):
        saved = torch.load(Path(weights), map_location="cpu", weights_only=True)
        self.spec = ModelSpec.from_dict(saved["spec"])
        torch.manual_seed(0)
        self.net = build_backbone(self.spec)
        load_into(self.net, weights, self.spec)
        self.net.eval()

    @torch.no_grad()
    def embed(self, images: np.ndarray, batch: int = 256) -> np.ndarray:
        """(N, 3, H, W) in [0, 1], any size: resized to the backbone's input (reconstructions are smaller)."""
        size = self.spec.input_size
        out = []
        for i in range(0, len(images), batch):
            x = torch.from_numpy(np.asarray(images[i:i + batch], np.float32))
            if x.shape[-1] != size:
                x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            out.append(self.net(x).numpy())
        return np.concatenate(out)
