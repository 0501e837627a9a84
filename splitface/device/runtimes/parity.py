"""Every exported program checked against PyTorch before anyone uses it, through the same runtime classes
the device uses. A mismatch raises; the CLI exits non-zero.

Tolerances (float32 throughout):
- released values (in [0, 1) plus noise): max |runtime - torch| <= 1e-4;
- weight gradients: max |runtime - torch| <= 1e-3 * max |torch| (sums over a batch of
  64x64..224x224 maps reorder differently in each runtime; relative to the gradient's scale).
Each check runs on random images and, when given, real face images, with the layer's weights
and with perturbed weights (which proves the weights are read at run time, not baked in), and
with a random 0/1 mask when the release program takes one. A layer the export could not train
(`Manifest.training_refusal`) is checked for its release, and its runtimes must refuse to train.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from splitface.device.runtimes.manifest import Manifest

RELEASE_ATOL = 1e-4
GRAD_RTOL = 1e-3


class ExportMismatch(RuntimeError):
    pass


def reference(layer: nn.Module, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor,
              weights: list[torch.Tensor], mask: torch.Tensor | None = None,
              grads: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Eager PyTorch: the release and (if `grads`) d sum(release * grad) / d weights, for the given weights."""
    names = [n for n, _ in layer.named_parameters()]
    leaves = [w.detach().clone().requires_grad_(True) for w in weights]
    activations = torch.func.functional_call(layer, dict(zip(names, leaves)), (images,))
    released = (activations if mask is None else activations * mask) + noise
    if not leaves or not grads:  # nothing to differentiate (the dct release), or not asked
        return released.detach(), []
    weight_grads = torch.autograd.grad((released * grad).sum(), leaves)
    return released.detach(), [g.detach() for g in weight_grads]


def check(layer: nn.Module, runtime, images: torch.Tensor, weights: list[torch.Tensor], label: str,
          seed: int = 0, mask_shape: list[int] | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        shape = layer(images[:1]).shape[1:]
    noise = 0.1 * torch.randn((len(images), *shape), generator=g)
    grad = torch.randn((len(images), *shape), generator=g)
    mask = None if mask_shape is None else (torch.rand(mask_shape, generator=g) < 0.5).float()
    trains = runtime.manifest.trainable
    want_release, want_grads = reference(layer, images, noise, grad, weights, mask, grads=trains)
    got_release = runtime.release(images, noise, weights, mask)
    got_grads = runtime.weight_grads(images, noise, grad, weights, mask) if trains else []
    release_err = float((got_release - want_release).abs().max())
    grad_err = max((float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got_grads, want_grads)),
                   default=0.0)
    result = {"release_max_abs_err": release_err, "grad_max_rel_err": grad_err,
              "ok": release_err <= RELEASE_ATOL and grad_err <= GRAD_RTOL}
    if not result["ok"]:
        raise ExportMismatch(f"{runtime.name} on {label}: release error {release_err:.3g} (tolerance {RELEASE_ATOL}), "
                             f"gradient error {grad_err:.3g} (tolerance {GRAD_RTOL})")
    return result


def weight_variants(layer: nn.Module, static_weights: bool = False) -> dict[str, list[torch.Tensor]]:
    """The layer's weights and, unless the program bakes them in, perturbed ones: a program that reads its
    weights at run time must follow them."""
    weights = [p.detach().clone() for p in layer.parameters()]
    variants = {"weights": weights}
    if weights and not static_weights:
        g = torch.Generator().manual_seed(2)
        variants["perturbed weights"] = [w + 0.05 * w.abs().mean() * torch.randn(w.shape, generator=g) for w in weights]
    return variants


def verify(layer: nn.Module, artifacts: Path, real_images: np.ndarray | None = None) -> dict:
    from splitface.common.models import to_input
    from splitface.device.runtimes.executorch_gemm import ExecuTorchGemmRuntime
    from splitface.device.runtimes.executorch_runtime import ExecuTorchRuntime
    from splitface.device.runtimes.onnx_runtime import OnnxRuntime

    manifest = Manifest.load(artifacts)
    n, shape = manifest.batch_size, manifest.input_shape
    inputs = {"random": torch.rand(shape, generator=torch.Generator().manual_seed(1))}
    if real_images is not None:
        inputs["real"] = to_input(real_images[:n])
    variants = weight_variants(layer, manifest.static_weights)
    results = {}
    runtimes = [ExecuTorchRuntime(artifacts, manifest), OnnxRuntime(artifacts, manifest)]
    if manifest.gemm_refusal is None:
        runtimes.append(ExecuTorchGemmRuntime(artifacts, manifest))
    for runtime in runtimes:
        for input_name, images in inputs.items():
            for weight_name, ws in variants.items():
                label = f"{input_name} images, {weight_name}"
                results[f"{runtime.name}: {label}"] = check(layer, runtime, images, ws, label,
                                                            mask_shape=manifest.mask_shape)
    manifest.verification = {"release_atol": RELEASE_ATOL, "grad_rtol": GRAD_RTOL, "checks": results}
    manifest.save(artifacts)
    return manifest.verification
