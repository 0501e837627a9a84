"""Face-recognition backbones that can be cut into a device part and a server part.

Models live in the device SDK (not the edge server) because the phone needs the
layers up to the split, and a device must never import server code. A model is
described by a small, serialisable :class:`ModelSpec` so device and server can
agree on the architecture over the wire, and is built as an ordered set of
named stages so the split point is a name both sides understand.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from ..transforms import RELEASES, TRANSFORMS, dct_channels
from .iresnet import LAYERS as IRESNET_LAYERS
from .iresnet import iresnet_stages
from .lrn import PaperLRN
from .vgg_face import vgg_face_stages

__all__ = [
    "ModelSpec",
    "PRESETS",
    "DEFAULT_SPLIT",
    "Backbone",
    "Stages",
    "PaperLRN",
    "resolve_spec",
    "build_backbone",
    "stage_names",
    "split_backbone",
    "activation_shape",
    "split_shape",
    "RELEASE_KEYS",
    "build_classifier",
    "to_input",
]

FAMILIES = ("vgg_face", "iresnet")
# Keys that change only what is released at the cut, not the backbone's own stages (saved weights ignore them).
RELEASE_KEYS = ("release_pool", "release", "bottleneck_channels", "bottleneck_stride", "dct_drop", "dct_keep")


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
    # A release transform at the cut (device_sdk/transforms): "none", "bottleneck" or "dct".
    release: str = "none"
    bottleneck_channels: int = 8  # bottleneck: channels the device releases (1x1 conv, then tanh)
    bottleneck_stride: int = 1  # bottleneck: stride of that conv (the server upsamples back)
    dct_drop: int = 1  # dct: lowest zig-zag frequencies of each colour not released (1: the DC only)
    dct_keep: int = 0  # dct: > 0 releases a random subset of this many channels per image, the rest zeroed

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
        if min(self.bottleneck_channels, self.bottleneck_stride) < 1:
            raise ValueError("bottleneck_channels and bottleneck_stride must be >= 1")
        if not 0 <= self.dct_drop < 64:
            raise ValueError(f"dct_drop must be in [0, 64), got {self.dct_drop}")
        if not 0 <= self.dct_keep <= dct_channels(self) or (self.dct_keep and self.release != "dct"):
            raise ValueError(f"dct_keep must be 0 or, with release 'dct', at most {dct_channels(self)}; "
                             f"got {self.dct_keep}")

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
            kwargs[k] = str(v) if k in ("family", "release") else float(v) if k == "dropout" else int(v)
        return cls(**kwargs)

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


class Stages(nn.Module):
    """Runs named stages in order; the unit that both whole and split models are made of.

    Keys in ``stages`` keep the backbone's names, so a part's state_dict keys
    are exactly the backbone's keys for those stages.
    """

    def __init__(self, stages: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleDict(stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages.values():
            x = stage(x)
        return x

    def stage_names(self) -> list[str]:
        return list(self.stages.keys())


class Backbone(Stages):
    """Whole backbone: image (N, 3, S, S) -> embedding (N, spec.embedding_dim)."""

    def __init__(self, spec: ModelSpec, stages: Mapping[str, nn.Module]) -> None:
        super().__init__(stages)
        self.spec = spec


def _init_weights(module: nn.Module) -> None:
    # Standard VGG / arcface-style init, so results do not hinge on PyTorch defaults.
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _stages(spec: ModelSpec) -> "OrderedDict[str, nn.Module]":
    if spec.family == "vgg_face":
        return vgg_face_stages(spec.input_size, spec.width, spec.fc_width, spec.dropout)
    return iresnet_stages(spec.input_size, spec.depth, spec.width, spec.embedding_size, spec.dropout)


def build_backbone(spec: ModelSpec) -> Backbone:
    """Deterministic given ``torch.manual_seed``; respects a ``torch.device(...)`` context (e.g. meta)."""
    backbone = Backbone(spec, _stages(spec))
    _init_weights(backbone)
    return backbone


def stage_names(spec: ModelSpec) -> list[str]:
    """Valid split points, in order (built on the meta device, so free at any size)."""
    with torch.device("meta"):
        return list(_stages(spec).keys())


def split_backbone(backbone: Backbone, split: str) -> tuple[Stages, Stages]:
    """Cut into (device part, server part) sharing the backbone's parameter objects.

    Sharing (not copying) means training either part trains the backbone, and
    ``server(device(x))`` is bit-for-bit ``backbone(x)``. With a release transform (``spec.release``)
    or ``release_pool``, the parts also hold the transform's device and server stages at the cut, and
    the whole model is the two parts in sequence; with ``dct`` the device part is the transform
    alone and the backbone's stages up to the split are in neither part.
    """
    names = list(backbone.stages.keys())
    if split not in names:
        raise ValueError(f"unknown split {split!r}; valid splits: {names[:-1]}")
    cut = names.index(split) + 1
    if cut == len(names):
        raise ValueError(
            f"cannot split at the last stage {split!r}: the server needs at least one stage; "
            f"valid splits: {names[:-1]}"
        )
    device_stages = OrderedDict((n, backbone.stages[n]) for n in names[:cut])
    server_stages = OrderedDict((n, backbone.stages[n]) for n in names[cut:])
    spec = backbone.spec
    if spec.release != "none":
        # Drawn from the global RNG right after the backbone, so both sides (same seed) get the same stages.
        transform = TRANSFORMS[spec.release]
        shape = split_shape(spec, split)
        device_stage, server_stage = transform.device(spec, shape), transform.server(spec, shape)
        if transform.replaces_device:
            device_stages.clear()
        device_stages[spec.release] = device_stage
        server_stages = OrderedDict([(f"{spec.release}_server", server_stage), *server_stages.items()])
    k = spec.release_pool
    if k > 1:
        device_stages["release_pool"] = nn.AvgPool2d(k)
        server_stages = OrderedDict([("release_upsample", nn.Upsample(scale_factor=k, mode="nearest")),
                                     *server_stages.items()])
    return Stages(device_stages), Stages(server_stages)


def split_shape(spec: ModelSpec, split: str) -> tuple[int, int, int]:
    """(C, H, W) of the backbone's own output at `split` (before any release transform), on the meta device."""
    with torch.device("meta"):
        x = torch.empty(1, 3, spec.input_size, spec.input_size)
        for name, stage in _stages(spec).items():
            x = stage.eval()(x)
            if name == split:
                if x.dim() != 4:
                    raise ValueError(f"split {split!r} has no (C, H, W) output for a release transform")
                return int(x.shape[1]), int(x.shape[2]), int(x.shape[3])
    raise ValueError(f"unknown split {split!r}; valid splits: {stage_names(spec)[:-1]}")


def activation_shape(spec: ModelSpec, split: str) -> tuple[int, int, int]:
    """(C, H, W) the device sends per image, from a shape-only pass on the meta device."""
    with torch.device("meta"):
        device, _ = split_backbone(Backbone(spec, _stages(spec)), split)
        device.eval()
        out = device(torch.empty(1, 3, spec.input_size, spec.input_size))
    if out.dim() != 4:
        raise ValueError(f"split {split!r} does not produce a (C, H, W) activation (got shape {tuple(out.shape)})")
    return int(out.shape[1]), int(out.shape[2]), int(out.shape[3])


def to_input(images: np.ndarray) -> torch.Tensor:
    """uint8 NCHW images -> float in [0, 1], the scale the device layer's privacy analysis assumes."""
    return torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)


def build_classifier(spec: ModelSpec, num_classes: int) -> nn.Linear:
    """Plain softmax head (fc8 for VGG-Face): embedding -> class logits."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    head = nn.Linear(spec.embedding_dim, num_classes)
    nn.init.normal_(head.weight, 0.0, 0.01)
    nn.init.zeros_(head.bias)
    return head
