"""Identity matching straight from the releases (the FaceLinkGen-style attack).

The curious server does not need a picture of the face: it needs to know whose face it is. It
trains a network from releases to a strong recognizer's embedding of the clean face, on public
faces that it passes through its copy of the device part and the published mechanism (fresh noise
every epoch, so it learns to see through the noise). It then embeds every private release and
ranks them against real photos of people, embedded by the same recognizer: R(A, S, K).

This attacker is adaptive by construction: it knows the release transform and its parameters and
trains on releases made by the same transform.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class MatcherNet(nn.Module):
    """Release (C, H, W) -> embedding: pooled to at most 32 x 32, then strided convs down to 4 x 4."""

    def __init__(self, channels: int, size: int, width: int, dim: int):
        super().__init__()
        self.size = min(size, 32)
        layers, c, s = [_block(channels, width, 1)], width, self.size
        while s > 4:
            layers.append(_block(c, min(2 * c, 4 * width), 2))
            c, s = min(2 * c, 4 * width), (s + 1) // 2   # stride 2, padding 1: rounds up
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(c * s * s, dim)

    def forward(self, releases: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(releases, self.size) if releases.shape[-1] != self.size else releases
        return self.fc(torch.flatten(self.body(x), 1))


class IdentityMatcher:
    def __init__(self, epochs: int = 24, width: int = 48, batch_size: int = 64, lr: float = 2e-3, seed: int = 0):
        self.epochs, self.width, self.batch_size, self.lr, self.seed = epochs, width, batch_size, lr, seed

    def fit(self, release: Callable[[int], np.ndarray], targets: np.ndarray) -> "IdentityMatcher":
        """`release(seed)`: releases of the public faces, noise drawn from `seed`; `targets`: the
        recognizer's embeddings of the same faces, clean. Loss: 1 - cosine."""
        torch.manual_seed(self.seed)
        y = F.normalize(torch.from_numpy(np.asarray(targets, np.float32)), dim=1)
        self.net = None
        for epoch in range(self.epochs):
            x = torch.from_numpy(release(self.seed * 1000 + epoch))
            if self.net is None:
                self.net = MatcherNet(x.shape[1], x.shape[-1], self.width, y.shape[1])
                opt = torch.optim.AdamW(self.net.parameters(), lr=self.lr, weight_decay=1e-4)
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, self.lr, total_steps=self.epochs * (
                    -(-len(y) // self.batch_size)))
                self.net.train()
            order = torch.randperm(len(y))
            for i in range(0, len(order), self.batch_size):
                idx = order[i:i + self.batch_size]
                loss = 1 - F.cosine_similarity(self.net(x[idx]), y[idx]).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        self.net.eval()
        return self

    @torch.no_grad()
    def embed(self, releases: np.ndarray, batch: int = 256) -> np.ndarray:
        return np.concatenate([self.net(torch.from_numpy(np.asarray(releases[i:i + batch], np.float32))).numpy()
                               for i in range(0, len(releases), batch)])
