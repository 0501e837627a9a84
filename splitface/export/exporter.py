"""The export tool as the runtimes' `Exporter`: a simulated device with an empty artifacts folder exports its
own programs through it (a phone gets them from `splitface-export` instead)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from splitface.device.runtimes.manifest import Manifest
from splitface.export.artifacts import write_strip_ptes
from splitface.export.verify import export_verified


class ProgramExporter:
    """Writes and verifies the device programs (`splitface.device.runtimes.Exporter`)."""

    def export(self, layer: nn.Module, input_size: int, batch_size: int, out: Path,
               real_images: np.ndarray | None = None, *, mask: tuple[int, ...] | None = None,
               gemm: bool = False) -> Manifest:
        return export_verified(layer, input_size, batch_size, out, real_images, mask=mask, gemm=gemm)

    def write_strips(self, layer: nn.Module, rows: int, width: int, out: Path) -> tuple[Path, Path]:
        return write_strip_ptes(layer, rows, width, out)


EXPORTER = ProgramExporter()
