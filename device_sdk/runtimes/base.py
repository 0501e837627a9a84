"""What every layer runtime offers the engine, and the padding to an exported batch size.

A module of its own (not the package's `__init__`) so that the runtimes, which `export/verify.py`
imports, do not import the package that exports and verifies.
"""
from __future__ import annotations

from typing import Protocol

import torch


class LayerRuntime(Protocol):
    name: str
    batch_size: int
    static_weights: bool  # computes with weights fixed at export: refused for a layer that trains

    def release(self, images: torch.Tensor, noise: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """layer(images) + noise, for exactly `batch_size` images."""

    def weight_grads(self, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor,
                     weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """d sum(release * grad) / d weights, in `named_parameters` order."""


def padded(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Zero rows up to the exported batch size: zero gradient rows add nothing to the weight gradient."""
    if len(x) > batch_size:
        raise ValueError(f"batch of {len(x)} exceeds the exported batch size {batch_size}")
    if len(x) == batch_size:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((batch_size - len(x), *x.shape[1:]))]).contiguous()
