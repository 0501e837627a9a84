"""Write the device programs to disk: ExecuTorch (XNNPACK release, portable training) and ONNX.

Artifacts of one export, all for a batch size fixed at export time:
- release.pte       ExecuTorch, lowered to XNNPACK: (images, noise, *weights) -> released
- train.pte         ExecuTorch joint forward-backward on portable kernels:
                    (images, noise, server_grad) -> (surrogate loss, released) + weight gradients;
                    its weights live in the program and are overwritten in place before each call
- release.onnx      ONNX: (images, noise, *weights) -> released
- vjp.onnx          ONNX: (images, server_grad, *weights) -> weight gradients
  (train.pte and vjp.onnx only when the layer has parameters: the dct release has none)
- manifest.json     shapes, weight names, batch size, how weights are loaded, verification results

Weights: loaded at run time (inputs, or copied into the training program's parameters), so
one export serves a layer that trains; `static_weights=True` instead bakes a frozen (public)
layer's weights into release.pte, which lets XNNPACK run the conv too. Such an artifact serves
only a frozen layer: the manifest records the baked weights' digest, and the ExecuTorch runtime
refuses a layer that trains and any release whose weights are not the baked ones.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .programs import LayerVJP, ReleaseProgram, TrainingProgram, param_names

RELEASE_PTE, TRAIN_PTE, RELEASE_ONNX, VJP_ONNX, MANIFEST = (
    "release.pte", "train.pte", "release.onnx", "vjp.onnx", "manifest.json")


@dataclass
class Manifest:
    batch_size: int
    input_shape: list[int]
    activation_shape: list[int]
    weight_names: list[str]
    static_weights: bool
    input_max: float | None
    weights: str = "loaded at run time: release programs take them as inputs; train.pte's are overwritten in place"
    verification: dict = field(default_factory=dict)
    weights_digest: str | None = None  # static_weights: digest of the weights baked into release.pte

    def save(self, out: Path) -> None:
        (out / MANIFEST).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, out: Path) -> "Manifest":
        return cls(**json.loads((out / MANIFEST).read_text()))


def example_inputs(layer: nn.Module, batch_size: int, input_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.rand(batch_size, 3, input_size, input_size)
    with torch.no_grad():
        return images, torch.zeros_like(layer(images))


def weights_of(layer: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in layer.parameters()]


def weights_digest(weights: list[torch.Tensor]) -> str:
    """SHA-256 of the weights' float32 bytes, in order: tells a runtime whether baked-in weights are these."""
    h = hashlib.sha256()
    for w in weights:
        h.update(str(tuple(w.shape)).encode())
        h.update(w.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def export_release_pte(layer: nn.Module, images: torch.Tensor, noise: torch.Tensor, static_weights: bool) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = ReleaseProgram(layer, weights_as_inputs=not static_weights).eval()
    args = (images, noise) if static_weights else (images, noise, *weights_of(layer))
    edge = to_edge_transform_and_lower(torch.export.export(program, args), partitioner=[XnnpackPartitioner()])
    return edge.to_executorch().buffer


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


def export_all(layer: nn.Module, input_size: int, batch_size: int, out: Path, static_weights: bool = False) -> Manifest:
    """Every artifact for `layer` (its current weights and clamp), into `out`; not yet verified."""
    out.mkdir(parents=True, exist_ok=True)
    layer = layer.eval()
    images, noise = example_inputs(layer, batch_size, input_size)
    names = param_names(layer)
    weights = weights_of(layer)
    (out / RELEASE_PTE).write_bytes(export_release_pte(layer, images, noise, static_weights))
    export_onnx(ReleaseProgram(layer, weights_as_inputs=True), (images, noise, *weights), out / RELEASE_ONNX,
                ["images", "noise", *names], ["released"])
    if names:  # a layer without parameters (the dct release) has nothing to train: no backward programs
        (out / TRAIN_PTE).write_bytes(export_train_pte(layer, images, noise))
        export_onnx(LayerVJP(layer), (images, noise, *weights), out / VJP_ONNX,
                    ["images", "grad", *names], [f"grad:{n}" for n in names])
    lrn_max = [m.input_max for m in layer.modules() if hasattr(m, "input_max")]
    manifest = Manifest(batch_size, list(images.shape), list(noise.shape), names, static_weights,
                        lrn_max[0] if lrn_max else None,
                        weights_digest=weights_digest(weights) if static_weights else None)
    manifest.save(out)
    return manifest
