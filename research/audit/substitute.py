"""The substitute-client attack (after FORA, Xu et al. CVPR 2024): when the devices train their own
layer, the server does not know its weights, but it sees what the layer releases. It fits its own
copy so that the copy's releases of public faces match the recorded releases in distribution
(maximum mean discrepancy, Gaussian kernels at several bandwidths, on pooled releases), then makes
its attack training pairs with that copy instead of the seeded initial layer.

The releases are noised by the published mechanism on both sides (its noise is additive, so the
gradient passes through it). Nothing here needs the private images or the labels.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitface.device.trainer import privatize
from splitface.common.models import ModelSpec
from splitface.device.privacy.mechanisms import Mechanism, noise_generator


def pooled_features(releases: torch.Tensor, size: int = 8) -> torch.Tensor:
    return F.adaptive_avg_pool2d(releases, min(size, releases.shape[-1])).flatten(1)


def mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared MMD with a sum of Gaussian kernels whose bandwidths scale with the data's median distance."""
    xy = torch.cat([x, y])
    d2 = torch.cdist(xy, xy).pow(2)
    scale = d2.detach().median().clamp_min(1e-8)
    k = sum(torch.exp(-d2 / (scale * b)) for b in (0.25, 0.5, 1.0, 2.0, 4.0))
    n = len(x)
    return k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean()


def fit_substitute(layer: nn.Module, spec: ModelSpec, mechanism: Mechanism, public: np.ndarray, recorded: np.ndarray,
                   steps: int = 150, batch: int = 64, lr: float = 1e-3, seed: int = 0) -> tuple[nn.Module, dict]:
    """A copy of `layer` (the attacker's starting point, e.g. the seeded initial layer) moved so that its
    releases of `public` faces match `recorded` releases. Returns (substitute, {mmd before, after})."""
    substitute = copy.deepcopy(layer).eval()
    params = [p for p in substitute.parameters()]
    if not params:
        return substitute, {"skipped": "the device part has no parameters: the attacker knows it exactly"}
    for p in params:
        p.requires_grad_(True)
    rng = np.random.default_rng(seed)
    target = torch.from_numpy(np.asarray(recorded, np.float32))
    images = torch.from_numpy(np.asarray(public, np.float32))
    optimizer = torch.optim.Adam(params, lr=lr)
    batch = min(batch, len(images), len(target))

    def discrepancy(step: int) -> torch.Tensor:
        x = images[rng.choice(len(images), batch, replace=False)]
        y = target[rng.choice(len(target), batch, replace=False)]
        released = privatize(spec, mechanism, substitute(x), noise_generator(seed, 7, step))
        return mmd(pooled_features(released), pooled_features(y))

    with torch.no_grad():
        before = float(np.mean([discrepancy(-1 - i).item() for i in range(5)]))
    for step in range(steps):
        loss = discrepancy(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = float(np.mean([discrepancy(-100 - i).item() for i in range(5)]))
    substitute.requires_grad_(False)
    return substitute, {"steps": steps, "mmd_before": before, "mmd_after": after}
