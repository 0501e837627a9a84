"""Face-recognition backbones that can be cut into a device part and a server part.

Models live in the shared core because the phone needs the layers up to the split and the server the
rest, and neither side imports the other. A model is
described by a small, serialisable :class:`ModelSpec` (spec.py) so device and server can
agree on the architecture over the wire, and is built as an ordered set of
named stages so the split point is a name both sides understand.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Iterator, Mapping

import numpy as np
import torch
from torch import nn

from splitface.common.transforms import TRANSFORMS, transform_range
from splitface.common.models.iresnet import iter_iresnet_stages
from splitface.common.models.lrn import PaperLRN
from splitface.common.models.spec import DEFAULT_SPLIT, LATER_KEYS, PRESETS, RELEASE_KEYS, ModelSpec, resolve_spec
from splitface.common.models.vgg_face import iter_vgg_face_stages

__all__ = [
    "ModelSpec",
    "PRESETS",
    "DEFAULT_SPLIT",
    "Backbone",
    "Stages",
    "PaperLRN",
    "resolve_spec",
    "build_backbone",
    "build_device_part",
    "stage_names",
    "split_backbone",
    "activation_shape",
    "split_shape",
    "release_range",
    "RELEASE_KEYS",
    "LATER_KEYS",
    "build_classifier",
    "to_input",
]

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


def _init_weights(module: nn.Module, skip: bool = False) -> None:
    """Standard VGG / arcface-style init, so results do not hinge on PyTorch defaults.

    skip=True draws from the global RNG exactly what the init would, touching nothing (for layers that
    exist only as shapes on the meta device: see `build_device_part`).
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            if skip:
                _skip_normal(m.weight.numel())
            else:
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None and not skip:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            if skip:
                _skip_normal(m.weight.numel())
            else:
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) and not skip:
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# Draws that layers built on the meta device would have taken from the global (CPU) RNG. torch's CPU kernels take
# one 32-bit word per value for uniform_ (float32), and for normal_ on n >= 16 values n uniforms plus 16 more when
# n is not a multiple of 16 (the last 16 are redrawn); fewer than 16 normals are simply drawn. A test holds a
# device-only build equal to the full one, so a torch that draws differently fails loudly, not silently.
_SKIP_CHUNK = 1 << 20


def _skip_uniform(n: int) -> None:
    buffer = torch.empty(min(n, _SKIP_CHUNK))
    while n > 0:
        buffer[:min(n, _SKIP_CHUNK)].uniform_()
        n -= _SKIP_CHUNK


def _skip_normal(n: int) -> None:
    if n < 16:
        torch.empty(n).normal_()
    else:
        _skip_uniform(n + (16 if n % 16 else 0))


def _skip_construction(module: nn.Module) -> None:
    """Draw what constructing `module` on the CPU would have drawn (torch's default reset_parameters)."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):  # kaiming_uniform_ weight, uniform_ bias
            _skip_uniform(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0))
        elif any(True for _ in m.parameters(recurse=False)) and not isinstance(
                m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.PReLU)):  # those start from constants
            raise NotImplementedError(f"cannot replay the initial draws of {type(m).__name__} built on meta")


def _iter_stages(spec: ModelSpec) -> Iterator[tuple[str, nn.Module]]:
    if spec.family == "vgg_face":
        return iter_vgg_face_stages(spec.input_size, spec.width, spec.fc_width, spec.dropout)
    return iter_iresnet_stages(spec.input_size, spec.depth, spec.width, spec.embedding_size, spec.dropout)


def _stages(spec: ModelSpec) -> "OrderedDict[str, nn.Module]":
    return OrderedDict(_iter_stages(spec))


def build_backbone(spec: ModelSpec) -> Backbone:
    """Deterministic given ``torch.manual_seed``; respects a ``torch.device(...)`` context (e.g. meta)."""
    backbone = Backbone(spec, _stages(spec))
    _init_weights(backbone)
    return backbone


def build_device_part(spec: ModelSpec, split: str) -> Stages:
    """The device part of ``split_backbone(build_backbone(spec), split)``, and nothing else of the model.

    Same weights from the same seed, and the global RNG left where the full build leaves it (so a device
    head built next starts the same too), but every stage the device does not run (the server's tail, the
    server's stage of a release transform, and with ``dct`` the backbone's own stages) exists only as
    shapes on the meta device: no memory, and its random draws are replayed without being stored.
    """
    names = stage_names(spec)
    cut = _cut_index(names, split)
    transform = TRANSFORMS.get(spec.release)
    real = 0 if transform is not None and transform.replaces_device else cut
    stages: OrderedDict[str, nn.Module] = OrderedDict()
    building = _iter_stages(spec)
    for i in range(len(names)):
        with torch.device("meta") if i >= real else contextlib.nullcontext():
            name, stage = next(building)
        if i >= real:
            _skip_construction(stage)
        stages[name] = stage
    for i, stage in enumerate(stages.values()):
        _init_weights(stage, skip=i >= real)
    device, _ = _cut(spec, split, OrderedDict(list(stages.items())[:real]), OrderedDict(), real_server=False)
    return device


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
    cut = _cut_index(names, split)
    device_stages = OrderedDict((n, backbone.stages[n]) for n in names[:cut])
    server_stages = OrderedDict((n, backbone.stages[n]) for n in names[cut:])
    return _cut(backbone.spec, split, device_stages, server_stages)


def _cut_index(names: list[str], split: str) -> int:
    """How many stages the device runs when the model is split after `split`."""
    if split not in names:
        raise ValueError(f"unknown split {split!r}; valid splits: {names[:-1]}")
    cut = names.index(split) + 1
    if cut == len(names):
        raise ValueError(
            f"cannot split at the last stage {split!r}: the server needs at least one stage; "
            f"valid splits: {names[:-1]}"
        )
    return cut


def _cut(spec: ModelSpec, split: str, device_stages: "OrderedDict[str, nn.Module]",
         server_stages: "OrderedDict[str, nn.Module]", real_server: bool = True) -> tuple[Stages, Stages]:
    """The two parts with what a release transform or release_pool puts at the cut. real_server=False: the
    server's transform stage is built on meta (its draws replayed), for a device that never runs it."""
    if spec.release != "none":
        # Drawn from the global RNG right after the backbone, so both sides (same seed) get the same stages.
        transform = TRANSFORMS[spec.release]
        shape = split_shape(spec, split)
        device_stage = transform.device(spec, shape)
        with contextlib.nullcontext() if real_server else torch.device("meta"):
            server_stage = transform.server(spec, shape)
        if not real_server:
            _skip_construction(server_stage)
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


def release_range(spec: ModelSpec, split: str) -> tuple[float, float] | None:
    """[lo, hi] holding every value an honest device releases at `split` before its privacy noise, or None where
    nothing bounds it a priori (a later stage's output, released as it is). A stage ending in the paper's LRN gives
    [0, 1) (ReLU inputs: a / sqrt(2 + a^2 + ...) < 1), and so does its average (release_pool); a transform has its
    own range (transforms.transform_range). Clipping (the per-image mechanism) scales towards 0, inside each range."""
    if spec.release != "none":
        return transform_range(spec)
    stage = _stages_on_meta(spec)[split]
    last = stage[-1] if isinstance(stage, nn.Sequential) and len(stage) else stage
    return (0.0, 1.0) if isinstance(last, PaperLRN) else None


def _stages_on_meta(spec: ModelSpec) -> "OrderedDict[str, nn.Module]":
    with torch.device("meta"):
        return _stages(spec)


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
