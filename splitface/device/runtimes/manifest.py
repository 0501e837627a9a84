"""What an export wrote, as the runtimes read it: the program files' names and the manifest beside them.

It lives with the runtimes (not with the exporter) so that a device loads programs without the export toolchain."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

RELEASE_PTE, TRAIN_PTE, RELEASE_ONNX, VJP_ONNX, MANIFEST = (
    "release.pte", "train.pte", "release.onnx", "vjp.onnx", "manifest.json")
RELEASE_GEMM_PTE, VJP_GEMM_PTE = "release_gemm.pte", "vjp_gemm.pte"
RELEASE_STRIP_PTE, VJP_STRIP_PTE = "release_strip.pte", "vjp_strip.pte"  # the native runner's strip programs
# The strip programs' format, in the name of the folder that the native backend keeps them in, so that programs of
# an earlier format are exported anew rather than refused. 2: only the conv's GEMMs and the clamp; the runner does
# the LRN and its backward (splitface/device/runtimes/native/lrn.h).
STRIP_FORMAT = 2
NO_GEMM = "not exported (export with --gemm)"


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
    mask_shape: list[int] | None = None  # the release program's mask input, when the transform has one
    training_refusal: str | None = None  # why no training program was exported for a layer with parameters
    gemm_refusal: str | None = NO_GEMM  # why release_gemm.pte / vjp_gemm.pte are absent; None: they exist

    @property
    def trainable(self) -> bool:
        """Whether the runtimes can compute this layer's weight gradient (trivially so without parameters)."""
        return self.training_refusal is None

    def save(self, out: Path) -> None:
        (out / MANIFEST).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, out: Path) -> "Manifest":
        return cls(**json.loads((out / MANIFEST).read_text()))


def weights_digest(weights: list[torch.Tensor]) -> str:
    """SHA-256 of the weights' float32 bytes, in order: tells a runtime whether baked-in weights are these."""
    h = hashlib.sha256()
    for w in weights:
        h.update(str(tuple(w.shape)).encode())
        h.update(w.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
