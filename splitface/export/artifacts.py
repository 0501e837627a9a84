"""Write the device programs to disk: ExecuTorch (XNNPACK release, portable training) and ONNX.

Artifacts of one export, all for a batch size fixed at export time:
- release.pte       ExecuTorch, lowered to XNNPACK: (images, noise[, mask], *weights) -> released
- train.pte         ExecuTorch joint forward-backward on portable kernels:
                    (images, noise, server_grad) -> (surrogate loss, released) + weight gradients;
                    its weights live in the program and are overwritten in place before each call
- release_gemm.pte  ExecuTorch, every large op in XNNPACK with the weights as inputs (`gemm=True`, and only
  vjp_gemm.pte      for conv + ReLU + LRN with a stride-1 conv: `splitface/export/gemm_programs.py`): the release as
                    above, and (images, server_grad, weight, bias) -> weight gradients in closed form
                    (im2col^T @ the gradient through LRN and ReLU); the `executorch-xnnpack` backend
- release.onnx      ONNX: (images, noise[, mask], *weights) -> released
- vjp.onnx          ONNX: (images, server_grad, *weights) -> weight gradients
  (train.pte and vjp.onnx only when the layer has parameters, the dct release has none, and only
  when `LayerVJP` covers its modules: a deeper split's batch norms get release programs only, and
  the manifest says why the runtimes refuse to train it)
The mask input exists when the release transform hides part of each release (the dct release's
random channel subset, `mask_shape`): released = layer(images) * mask + noise.
- manifest.json     shapes, weight names, batch size, how weights are loaded, verification results

Weights: loaded at run time (inputs, or copied into the training program's parameters), so
one export serves a layer that trains; `static_weights=True` instead bakes a frozen (public)
layer's weights into release.pte, which lets XNNPACK run the conv too. Such an artifact serves
only a frozen layer: the manifest records the baked weights' digest, and the ExecuTorch runtime
refuses a layer that trains and any release whose weights are not the baked ones.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from splitface.common.models import ModelSpec

from splitface.export.gemm_programs import (GemmReleaseProgram, GemmWeightGrad, gemm_refusal, strip_constants,
                                            strip_example)
from splitface.export.programs import LayerVJP, ReleaseProgram, TrainingProgram, param_names, training_refusal
from splitface.device.runtimes.manifest import (NO_GEMM, RELEASE_GEMM_PTE, RELEASE_ONNX, RELEASE_PTE,
                                               RELEASE_STRIP_PTE, TRAIN_PTE, VJP_GEMM_PTE, VJP_ONNX, VJP_STRIP_PTE, Manifest,
                                               weights_digest)

def example_inputs(layer: nn.Module, batch_size: int, input_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.rand(batch_size, 3, input_size, input_size)
    with torch.no_grad():
        return images, torch.zeros_like(layer(images))


def weights_of(layer: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in layer.parameters()]


def transform_mask(spec: "ModelSpec", layer: nn.Module) -> tuple[int, ...] | None:
    """One image's mask shape if `spec`'s release transform hides part of each release, else None: the
    transform's own mask function (`release_mask`) decides, so the programs and the engine agree."""
    from splitface.common.transforms import release_mask

    training = layer.training
    with torch.no_grad():  # in eval mode: a batch norm's running statistics must not see this zero image
        shape = tuple(layer.eval()(torch.zeros(1, 3, spec.input_size, spec.input_size)).shape[1:])
    layer.train(training)
    mask = release_mask(spec, 1, shape, torch.Generator().manual_seed(0))
    return None if mask is None else tuple(mask.shape[1:])


def example_mask(mask_shape: list[int] | tuple[int, ...] | None) -> list[torch.Tensor]:
    """The mask argument of a release program: none, or a 0/1 tensor of the transform's mask shape."""
    if mask_shape is None:
        return []
    return [(torch.rand(tuple(mask_shape), generator=torch.Generator().manual_seed(0)) < 0.5).float()]


def export_release_pte(layer: nn.Module, images: torch.Tensor, noise: torch.Tensor, static_weights: bool,
                       mask_shape: list[int] | None = None) -> bytes:
    program = ReleaseProgram(layer, weights_as_inputs=not static_weights, masked=mask_shape is not None).eval()
    args = (images, noise, *example_mask(mask_shape), *([] if static_weights else weights_of(layer)))
    return lower_to_xnnpack(program, args)


def lower_to_xnnpack(program: nn.Module, args: tuple, constants: dict | None = None) -> bytes:
    """A .pte of `program` with XnnpackPartitioner: whatever XNNPACK accepts runs there, the rest on portable kernels.
    `constants`: constant methods (name -> int or float) that the program carries for its caller."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(torch.export.export(program, args), partitioner=[XnnpackPartitioner()],
                                       constant_methods=constants)
    return edge.to_executorch().buffer


def export_gemm_ptes(layer: nn.Module, images: torch.Tensor, noise: torch.Tensor,
                     mask_shape: list[int] | None) -> tuple[bytes, bytes]:
    """release_gemm.pte and vjp_gemm.pte: the release and its weight gradient, XNNPACK with weights as inputs."""
    weights = weights_of(layer)
    release = lower_to_xnnpack(GemmReleaseProgram(layer, masked=mask_shape is not None).eval(),
                               (images, noise, *example_mask(mask_shape), *weights))
    return release, lower_to_xnnpack(GemmWeightGrad(layer).eval(), (images, noise, *weights))


# The strip gradient program's constant method that says its gradient input is the conv's (the runner computes it):
# a program without it took the release's gradient, and the runner refuses it (strip_layer.cpp).
STRIP_GRAD_MARK = "takes_conv_gradient"


def export_strip_ptes(layer: nn.Module, rows: int, width: int) -> tuple[bytes, bytes]:
    """release_strip.pte and vjp_strip.pte: the im2col programs over one padded strip of `rows` image rows
    (batch 1, no noise input), which the native runner (splitface/device/runtimes/native) runs strip by strip.
    The release program ends at the LRN's input (and the conv's output) and carries the constants of what the
    runner computes after it (`strip_constants`); the gradient program takes the conv's gradient, and says so
    (`STRIP_GRAD_MARK`)."""
    strip = strip_example(layer, rows, width)
    weights = weights_of(layer)
    with torch.no_grad():
        grad = torch.zeros_like(GemmReleaseProgram(layer, strip=True)(strip, *weights)[1])
    release = lower_to_xnnpack(GemmReleaseProgram(layer, strip=True).eval(), (strip, *weights),
                               strip_constants(layer))
    return release, lower_to_xnnpack(GemmWeightGrad(layer, strip=True).eval(), (strip, grad, *weights),
                                     {STRIP_GRAD_MARK: 1})


def write_strip_ptes(layer: nn.Module, rows: int, width: int, out: Path) -> tuple[Path, Path]:
    """release_strip.pte and vjp_strip.pte for strips of `rows` rows in `out`, exported unless both are there
    already (the programs take the weights as inputs, so only the layer's shape, its clamp and the LRN's constants
    are in them; the native backend keeps them in a folder named for their format, `manifest.STRIP_FORMAT`)."""
    release, vjp = out / RELEASE_STRIP_PTE, out / VJP_STRIP_PTE
    if not (release.exists() and vjp.exists()):
        out.mkdir(parents=True, exist_ok=True)
        release_bytes, vjp_bytes = export_strip_ptes(layer, rows, width)
        release.write_bytes(release_bytes)
        vjp.write_bytes(vjp_bytes)
    return release, vjp


def export_train_pte(layer: nn.Module, images: torch.Tensor, noise: torch.Tensor) -> bytes:
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    program = TrainingProgram(layer)
    joint = _export_forward_backward(torch.export.export(program, (images, noise, noise), strict=False))
    return to_edge(joint).to_executorch().buffer


def export_onnx(module: nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str]) -> None:
    program = torch.onnx.export(module, args, dynamo=True, input_names=input_names, output_names=output_names,
                                verbose=False)
    program.save(str(path))


def manifest_of(layer: nn.Module, images: torch.Tensor, noise: torch.Tensor, static_weights: bool = False,
                mask_shape: list[int] | None = None, gemm: bool = False) -> Manifest:
    """What `export_all` records for `layer` on these example inputs, before anything is exported: which
    programs it can have (`training_refusal`, `gemm_refusal`) and what they take."""
    weights = weights_of(layer)
    refusal = training_refusal(layer)
    lrn_max = [m.input_max for m in layer.modules() if hasattr(m, "input_max")]
    return Manifest(len(images), list(images.shape), list(noise.shape), param_names(layer), static_weights,
                    lrn_max[0] if lrn_max else None,
                    weights_digest=weights_digest(weights) if static_weights else None,
                    mask_shape=mask_shape, training_refusal=refusal,
                    gemm_refusal=(gemm_refusal(layer) or refusal) if gemm else NO_GEMM)


def export_all(layer: nn.Module, input_size: int, batch_size: int, out: Path, static_weights: bool = False,
               mask: tuple[int, ...] | None = None, gemm: bool = False) -> Manifest:
    """Every artifact for `layer` (its current weights and clamp), into `out`; not yet verified.

    `mask`: one image's mask shape, when the release transform zeroes part of each release
    (`splitface.common.transforms.release_mask`: (channels, 1, 1)); the release programs then take the
    batch's mask as an input. `gemm`: also the im2col programs (`splitface/export/gemm_programs.py`) when they
    cover the layer; the manifest's `gemm_refusal` says why not otherwise.
    """
    out.mkdir(parents=True, exist_ok=True)
    layer = layer.eval()
    images, noise = example_inputs(layer, batch_size, input_size)
    names = param_names(layer)
    weights = weights_of(layer)
    mask_shape = None
    if mask is not None:
        release = tuple(noise.shape[1:])
        if len(mask) != len(release) or any(m not in (1, r) for m, r in zip(mask, release)):
            raise ValueError(f"a mask of shape {tuple(mask)} per image does not broadcast over the release {release}")
        mask_shape = [batch_size, *mask]
    manifest = manifest_of(layer, images, noise, static_weights, mask_shape, gemm)
    refusal = manifest.training_refusal
    (out / RELEASE_PTE).write_bytes(export_release_pte(layer, images, noise, static_weights, mask_shape))
    export_onnx(ReleaseProgram(layer, weights_as_inputs=True, masked=mask_shape is not None),
                (images, noise, *example_mask(mask_shape), *weights), out / RELEASE_ONNX,
                ["images", "noise", *(["mask"] if mask_shape else []), *names], ["released"])
    if names and refusal is None:  # nothing to train (the dct release), or no program that trains it correctly
        (out / TRAIN_PTE).write_bytes(export_train_pte(layer, images, noise))
        export_onnx(LayerVJP(layer), (images, noise, *weights), out / VJP_ONNX,
                    ["images", "grad", *names], [f"grad:{n}" for n in names])
    if manifest.gemm_refusal is None:
        release, vjp = export_gemm_ptes(layer, images, noise, mask_shape)
        (out / RELEASE_GEMM_PTE).write_bytes(release)
        (out / VJP_GEMM_PTE).write_bytes(vjp)
    manifest.save(out)
    return manifest
