"""Model updates as named tensors: the difference a client uploads, its norm, and clipping to a norm.

Clipping lives on the device side because the device clips before upload (its update then never
leaves unclipped); the server re-checks the norm it is sent with the same function.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

Delta = dict[str, torch.Tensor]


def flat_delta(delta: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """All entries of an update in one float64 vector, in sorted-name order (the same on every side)."""
    if not delta:
        raise ValueError("empty update")
    return torch.cat([delta[k].detach().reshape(-1).double() for k in sorted(delta)])


def delta_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of the whole update (all tensors together), in float64."""
    return float(torch.linalg.vector_norm(flat_delta(delta)))


def clip_delta(delta: Mapping[str, torch.Tensor], clip_norm: float) -> tuple[Delta, float]:
    """Scale the update so its joint L2 norm is at most `clip_norm`; returns (clipped, norm before).

    The scale is computed in float64 and a float32 rounding margin is taken off it, so the clipped
    float32 update's norm never exceeds `clip_norm` (a contribution bound the accountant relies on).
    `clip_norm = inf` returns the update unchanged (non-private runs).
    """
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 (inf: no clipping), got {clip_norm}")
    norm = delta_norm(delta)
    if not math.isfinite(norm):
        raise ValueError("update has non-finite values")
    if norm <= clip_norm or math.isinf(clip_norm):
        return {k: v.detach().clone() for k, v in delta.items()}, norm
    scale = clip_norm / norm * (1.0 - 1e-6)
    return {k: (v.detach().double() * scale).to(v.dtype) for k, v in delta.items()}, norm
