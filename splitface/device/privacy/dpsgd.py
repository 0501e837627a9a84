"""DP-SGD for the device layer, so that its trained weights are themselves DP w.r.t. each image.

Without it, a device layer trained on the server's gradients carries information about every
training image, and every later release is a function of those weights: no per-image figure holds.
"""
from __future__ import annotations

import torch
from dp_accounting import dp_event
from torch import nn
from torch.func import functional_call, grad, vmap


def per_sample_grads(layer: nn.Module, inputs: torch.Tensor, output_grads: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients of sum(layer(x_i) * g_i) w.r.t. the trainable parameters, shape (N, *param.shape).

    vmap over single samples is exact because the device layer (conv1 + ReLU + LRN) has no op that
    couples a batch (no batch norm).
    """
    params = {k: p.detach() for k, p in layer.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in layer.named_parameters() if not p.requires_grad}
    buffers = {k: b.detach() for k, b in layer.named_buffers()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        out = functional_call(layer, {**p, **frozen, **buffers}, (x.unsqueeze(0),))
        return (out * g.unsqueeze(0)).sum()

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, inputs.detach(), output_grads.detach())


def clipped_noisy_grad(per_sample: dict[str, torch.Tensor], clip_norm: float, noise_multiplier: float,
                       generator: torch.Generator, batch_size: int | None = None) -> dict[str, torch.Tensor]:
    """DP-SGD's gradient: clip each sample's flat gradient (all parameters together) to L2 ``clip_norm``,
    sum, add N(0, (noise_multiplier * clip_norm)^2) per coordinate, divide by ``batch_size`` (default N).

    The noise is drawn from ``generator`` in parameter order, so a replayed step gets the same noise.
    """
    if not clip_norm > 0 or noise_multiplier < 0:
        raise ValueError(f"need clip_norm > 0 and noise_multiplier >= 0, got {clip_norm=}, {noise_multiplier=}")
    names = list(per_sample)
    n = per_sample[names[0]].shape[0]
    sq = sum(per_sample[k].flatten(1).pow(2).sum(1) for k in names)
    factor = (clip_norm / sq.sqrt().clamp_min(1e-12)).clamp(max=1.0)
    denom = float(batch_size if batch_size is not None else n)
    out: dict[str, torch.Tensor] = {}
    for k in names:
        g = per_sample[k]
        summed = (g * factor.reshape(-1, *([1] * (g.dim() - 1)))).sum(0)
        noise = torch.randn(summed.shape, generator=generator, dtype=summed.dtype).to(summed.device)
        out[k] = (summed + noise_multiplier * clip_norm * noise) / denom
    return out


def dpsgd_event(noise_multiplier: float) -> dp_event.DpEvent:
    """One step in which an image takes part: GaussianDpEvent(z) (REPLACE_ONE: the clipped sum moves by <= 2C).

    No amplification by subsampling is claimed: batches are a seeded shuffle, every image is in
    exactly one batch per epoch, not Poisson-sampled, so each participation counts in full. Per
    identity, k of its images in one step share the noise: record it with ``joint=True``.
    """
    return dp_event.GaussianDpEvent(noise_multiplier)
