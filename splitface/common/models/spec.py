"""ModelSpec: everything needed to rebuild a backbone identically on device and server, and the presets.

Both sides compare it whole in HELLO, so it is validated on construction: a bad spec from a peer fails here,
not deep in a build. The release transforms check their own keys (`Transform.check`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from splitface.common.models.iresnet import LAYERS as IRESNET_LAYERS
from splitface.common.transforms import RELEASES, TRANSFORMS

FAMILIES = ("vgg_face", "iresnet")
# Keys that change only the release at the cut and the transform's stages on either side of it, not the
# backbone's own stages (saved weights ignore them).
RELEASE_KEYS = ("release_pool", "release", "bottleneck_channels", "bottleneck_stride", "dct_drop", "dct_keep",
                "dct_stem_blocks", "mask_ratio", "mask_patch")
# Keys added after the wire protocol was first published (its messages.LATER_MODEL_KEYS, with their defaults):
# a map, a recorded command or a cache name from before one leaves it out, which reads as its default.
LATER_KEYS = ("dct_stem_blocks",)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a backbone identically on device and server."""

    family: str  # "vgg_face" | "iresnet"
    input_size: int
    width: int = 64
    fc_width: int = 4096  # vgg_face embedding size
    depth: int = 50  # iresnet 18 | 34 | 50 | 100
    embedding_size: int = 512  # iresnet
    dropout: float = 0.5  # vgg fc6/fc7 dropout; iresnet dropout before fc
    # k > 1: the device average-pools its output k x k before release (k^2 fewer values to clip,
    # noise and send) and the server upsamples it back; applied only where the model is split.
    release_pool: int = 1
    # A release transform at the cut (splitface/common/transforms): "none", "bottleneck", "dct" or "mask".
    release: str = "none"
    bottleneck_channels: int = 8  # bottleneck: channels the device releases (1x1 conv, then tanh)
    bottleneck_stride: int = 1  # bottleneck: stride of that conv (the server upsamples back)
    dct_drop: int = 1  # dct: lowest zig-zag frequencies of each colour not released (1: the DC only)
    dct_keep: int = 0  # dct: > 0 releases a random subset of this many channels per image, the rest zeroed
    dct_stem_blocks: int = 0  # dct: residual blocks in the server's stage after its first conv (0: that conv alone)
    mask_ratio: float = 0.75  # mask (FaceMAE): share of each image's patches zeroed before release
    mask_patch: int = 8  # mask: side of the square patches, a power of two dividing input_size

    def __post_init__(self) -> None:
        # Fail at spec time (e.g. when a peer sends one) rather than deep in a build.
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        if self.family == "iresnet" and self.depth not in IRESNET_LAYERS:
            raise ValueError(f"iresnet depth must be one of {sorted(IRESNET_LAYERS)}, got {self.depth}")
        multiple = 32 if self.family == "vgg_face" else 16
        if self.input_size < multiple or self.input_size % multiple:
            raise ValueError(f"{self.family} input_size must be a positive multiple of {multiple}, got {self.input_size}")
        if min(self.width, self.fc_width, self.embedding_size) < 1:
            raise ValueError("width, fc_width and embedding_size must be >= 1")
        if self.release_pool < 1:
            raise ValueError(f"release_pool must be >= 1, got {self.release_pool}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.release not in RELEASES:
            raise ValueError(f"unknown release {self.release!r}; expected one of {RELEASES}")
        if self.release != "none" and self.release_pool != 1:
            raise ValueError("release_pool and a release transform do not combine; use one")
        for transform in TRANSFORMS.values():  # each checks its own keys, whichever release is chosen
            transform.check(self)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of str/int/float, safe for JSON and msgpack."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        """Inverse of :meth:`to_dict`; rejects unknown keys so typos are not silently ignored."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown ModelSpec keys {sorted(unknown)}; valid keys: {list(fields)}")
        missing = {"family", "input_size"} - set(d)
        if missing:
            raise ValueError(f"ModelSpec dict is missing {sorted(missing)}")
        kwargs: dict[str, Any] = {}
        for k, v in d.items():
            kind = fields[k].type   # "str" | "int" | "float" (postponed annotations)
            kwargs[k] = str(v) if kind == "str" else float(v) if kind == "float" else int(v)
        return cls(**kwargs)

    def compact_dict(self) -> dict[str, Any]:
        """`to_dict` less the later keys at their defaults: what names this model where a name made before those
        keys existed must stay the same (cache keys, recorded commands)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {k: v for k, v in self.to_dict().items() if k not in LATER_KEYS or v != defaults[k]}

    @property
    def embedding_dim(self) -> int:
        return self.fc_width if self.family == "vgg_face" else self.embedding_size


PRESETS: dict[str, ModelSpec] = {
    "vgg_face": ModelSpec("vgg_face", 224),  # full size (GPU)
    "vgg_face_small": ModelSpec("vgg_face", 64, width=16, fc_width=256, dropout=0.0),  # CPU/CI
    "iresnet18": ModelSpec("iresnet", 112, depth=18, dropout=0.0),
    "iresnet50": ModelSpec("iresnet", 112, depth=50, dropout=0.0),
    "iresnet_small": ModelSpec("iresnet", 64, width=16, depth=18, embedding_size=128, dropout=0.0),  # CPU/CI
}

DEFAULT_SPLIT = "conv1"


def resolve_spec(name_or_dict: str | Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """Accept what a CLI flag or a peer's message carries: a preset name or a spec dict."""
    if isinstance(name_or_dict, ModelSpec):
        return name_or_dict
    if isinstance(name_or_dict, str):
        if name_or_dict in PRESETS:
            return PRESETS[name_or_dict]
        raise ValueError(f"unknown model preset {name_or_dict!r}; presets: {sorted(PRESETS)}")
    if isinstance(name_or_dict, Mapping):
        return ModelSpec.from_dict(name_or_dict)
    raise ValueError(
        f"expected a preset name ({sorted(PRESETS)}) or a ModelSpec dict, got {type(name_or_dict).__name__}"
    )
