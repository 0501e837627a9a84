"""An inversion network: a small convolutional decoder from releases back to images, trained by the
attacker on public faces run through the device layer (white-box or surrogate) and the published
mechanism. Fresh noise every epoch, so the decoder learns to see through the noise rather than
memorise one draw of it.

Same interface as `RidgeInversion` (fit, reconstruct, image_size), so one report serves both.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from research.audit.inversion import resized


class DecoderNet(nn.Module):
    def __init__(self, channels: int, width: int, image_size: int):
        super().__init__()
        self.image_size = image_size
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 3, 3, padding=1))

    def forward(self, releases: torch.Tensor) -> torch.Tensor:
        # work at the output resolution: averaging the release down is the first thing any denoiser does
        x = F.adaptive_avg_pool2d(releases, self.image_size) if releases.shape[-1] >= self.image_size else \
            F.interpolate(releases, size=(self.image_size, self.image_size), mode="nearest")
        return torch.sigmoid(self.body(x))


class DecoderInversion:
    def __init__(self, image_size: int = 32, width: int = 32, epochs: int = 12, batch_size: int = 32,
                 lr: float = 2e-3, seed: int = 0):
        self.image_size, self.width, self.epochs = image_size, width, epochs
        self.batch_size, self.lr, self.seed = batch_size, lr, seed

    def fit(self, release: Callable[[int], np.ndarray], images: np.ndarray) -> "DecoderInversion":
        """`release(seed)`: the releases of the public `images` (in [0, 1]), noise drawn from `seed`."""
        torch.manual_seed(self.seed)
        target = torch.from_numpy(resized(images, self.image_size))
        self.net = None
        for epoch in range(self.epochs):
            x = torch.from_numpy(release(self.seed * 1000 + epoch))
            if self.net is None:
                self.net = DecoderNet(x.shape[1], self.width, self.image_size)
                opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.epochs)
                self.net.train()
            order = torch.randperm(len(images))
            for i in range(0, len(order), self.batch_size):
                idx = order[i:i + self.batch_size]
                loss = F.mse_loss(self.net(x[idx]), target[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        self.net.eval()
        return self

    @torch.no_grad()
    def reconstruct(self, activations: np.ndarray, batch: int = 256) -> np.ndarray:
        return np.concatenate([self.net(torch.from_numpy(np.asarray(activations[i:i + batch], np.float32))).numpy()
                               for i in range(0, len(activations), batch)])
