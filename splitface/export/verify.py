"""Export the device programs and check them against PyTorch before anyone uses them (the checks: the
runtimes' parity module, splitface/device/runtimes/parity.py). A mismatch raises; the CLI exits non-zero."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from splitface.device.runtimes.manifest import Manifest
from splitface.device.runtimes.parity import verify
from splitface.export.artifacts import export_all


def export_verified(layer: nn.Module, input_size: int, batch_size: int, out: Path, real_images: np.ndarray | None = None,
                    static_weights: bool = False, mask: tuple[int, ...] | None = None, gemm: bool = False) -> Manifest:
    export_all(layer, input_size, batch_size, out, static_weights, mask, gemm)
    verify(layer, out, real_images)
    return Manifest.load(out)
