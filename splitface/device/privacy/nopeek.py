"""NoPeek (Vepakomma et al. 2020): the device adds a distance-correlation penalty between its input images and
what it releases to its own training loss, so that its layer learns releases less like its images.

This is a training-time defence without a formal guarantee: what it buys is measured by the audit
(research/frontier.py). The penalty is computed on the device from its own batch; the server sees nothing of it.
"""
from __future__ import annotations

import torch


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation of two batches (rows are samples), in [0, 1]: 0 only for independent rows."""
    def centred(v: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(v.flatten(1), v.flatten(1))
        return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()

    a, b = centred(x), centred(z)
    dcov_ab, dcov_aa, dcov_bb = (a * b).mean(), (a * a).mean(), (b * b).mean()
    return dcov_ab.clamp_min(0).sqrt() / (dcov_aa.sqrt() * dcov_bb.sqrt()).clamp_min(1e-12).sqrt()
