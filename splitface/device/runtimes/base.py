"""What every layer runtime offers the engine, and the padding to an exported batch size.

A module of its own (not the package's `__init__`) so that the runtimes, which `splitface/export/verify.py`
imports, do not import the package that exports and verifies.
"""
from __future__ import annotations

from typing import Protocol

import torch


class NotTrainable(ValueError):
    """The export has no training program for this device part (e.g. a split after IResNet's batch norms)."""


class LayerRuntime(Protocol):
    name: str
    batch_size: int
    static_weights: bool  # computes with weights fixed at export: refused for a layer that trains
    trainable: bool  # False: `weight_grads` raises NotTrainable, so the layer must stay frozen (or use torch)

    def release(self, images: torch.Tensor, noise: torch.Tensor, weights: list[torch.Tensor],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """layer(images) [* mask] + noise, for at most `batch_size` images; `mask` only where the export took one."""

    def weight_grads(self, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor,
                     weights: list[torch.Tensor], mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """d sum(release * grad) / d weights, in `named_parameters` order."""


def mask_args(manifest, n: int, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The release program's mask argument, padded to the batch: ones where the caller gives none
    (nothing hidden), and a clear error for a mask the program cannot apply."""
    if manifest.mask_shape is None:
        if mask is not None:
            raise ValueError("these programs were exported without a mask input; re-export with the release "
                             "transform's mask (splitface-export --release dct --dct-keep K)")
        return []
    shape = (n, *manifest.mask_shape[1:])
    if mask is None:
        mask = torch.ones(shape)
    elif tuple(mask.shape) != shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)}; the programs take {shape} for {n} images")
    return [padded(mask.to(torch.float32), manifest.batch_size)]


def training_args(manifest, name: str, grad: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The server's gradient as the layer's output sees it: masked values got none. Refuses a layer
    the export could not train, naming why, instead of returning a wrong or empty gradient."""
    if not manifest.trainable:
        raise NotTrainable(f"the {name} programs cannot train this device part ({manifest.training_refusal}); "
                           "keep the layer frozen or train it with --backend torch")
    return grad if mask is None else grad * mask


def require_gemm(manifest, artifacts, backend: str) -> None:
    """Refuses artifacts without the im2col programs, naming why (`Manifest.gemm_refusal`: the layer is not
    conv + ReLU + LRN as they cover, or the export was made without --gemm)."""
    if manifest.gemm_refusal is not None:
        raise ValueError(f"the {backend} backend runs the im2col programs, and {artifacts} has none "
                         f"({manifest.gemm_refusal}); export with `splitface-export --gemm`, or use --backend "
                         "executorch or torch")


def padded(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Zero rows up to the exported batch size: zero gradient rows add nothing to the weight gradient."""
    if len(x) > batch_size:
        raise ValueError(f"batch of {len(x)} exceeds the exported batch size {batch_size}")
    if len(x) == batch_size:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((batch_size - len(x), *x.shape[1:]))]).contiguous()
