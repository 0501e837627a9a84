"""Where the device layer runs: eager PyTorch, ExecuTorch (`executorch`: the conv on portable kernels, a
training program; `executorch-xnnpack`: the im2col programs, all of it in XNNPACK; `native`: strips of them
through the C++ runner, no Python binding) or ONNX Runtime.

A non-torch runtime executes programs exported by `splitface/export/` for a fixed batch size; the engine
keeps everything else (weights and optimiser in torch, noise, accountant, budget guard), so the
backends differ only in who computes the release and the weight gradient.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
from torch import nn

from splitface.device.runtimes.base import LayerRuntime, NotTrainable, padded
from splitface.device.runtimes.manifest import MANIFEST, Manifest

__all__ = ["BACKENDS", "Exporter", "LayerRuntime", "NotTrainable", "padded", "load_runtime"]


class Exporter(Protocol):
    """What writes the programs that the runtimes load: the export tool (`splitface.export.exporter.EXPORTER`),
    which a phone does not carry. A simulator passes it so that a first run exports its own programs."""

    def export(self, layer: nn.Module, input_size: int, batch_size: int, out: Path,
               real_images: np.ndarray | None = None, *, mask: tuple[int, ...] | None = None,
               gemm: bool = False) -> Manifest: ...

    def write_strips(self, layer: nn.Module, rows: int, width: int, out: Path) -> tuple[Path, Path]: ...

BACKENDS = ("torch", "executorch", "onnxruntime", "executorch-xnnpack", "native")
GEMM_BACKENDS = ("executorch-xnnpack", "native")  # run the im2col programs: their export needs --gemm


def load_runtime(backend: str, layer: nn.Module, input_size: int, batch_size: int, artifacts: Path,
                 threads: int | None = None, real_images: np.ndarray | None = None,
                 mask: tuple[int, ...] | None = None, exporter: Exporter | None = None) -> LayerRuntime:
    """The runtime for `backend` on the programs in `artifacts`; if there are none, `exporter` writes and
    verifies them first.

    `mask`: one image's mask shape when the release transform has one (`splitface.export.artifacts.transform_mask`),
    so that an export made here takes the mask as a program input. `executorch-xnnpack` and `native` export
    the im2col programs too, and refuse artifacts exported without them; `native` builds its runner (CMake and
    a C++ compiler) and checks it against eager PyTorch on every load."""
    if backend not in BACKENDS or backend == "torch":
        raise ValueError(f"backend must be one of {BACKENDS[1:]} here, not {backend!r}")
    if not (artifacts / MANIFEST).exists():
        if exporter is None:
            raise FileNotFoundError(f"{artifacts}: no exported programs (write them with splitface-export)")
        exporter.export(layer, input_size, batch_size, artifacts, real_images, mask=mask, gemm=backend in GEMM_BACKENDS)
    manifest = Manifest.load(artifacts)
    lrn_max = [m.input_max for m in layer.modules() if hasattr(m, "input_max")]
    layer_max = lrn_max[0] if lrn_max else None
    if manifest.batch_size != batch_size or manifest.input_max != layer_max:
        raise ValueError(f"artifacts in {artifacts} were exported for batch {manifest.batch_size} and LRN input clamp "
                         f"{manifest.input_max}; this device needs batch {batch_size} and clamp {layer_max}: re-export")
    if backend == "executorch":
        from splitface.device.runtimes.executorch_runtime import ExecuTorchRuntime
        return ExecuTorchRuntime(artifacts, manifest, threads)
    if backend == "executorch-xnnpack":
        from splitface.device.runtimes.executorch_gemm import ExecuTorchGemmRuntime
        return ExecuTorchGemmRuntime(artifacts, manifest, threads)
    if backend == "native":
        from splitface.device.runtimes.native_runtime import NativeRuntime
        return NativeRuntime(layer, artifacts, manifest, threads, exporter=exporter)
    from splitface.device.runtimes.onnx_runtime import OnnxRuntime
    return OnnxRuntime(artifacts, manifest, threads)
