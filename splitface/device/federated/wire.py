"""What a federated round carries over the wire, and back: model state, the local training config and the
update, as float32 numpy arrays keyed by name (SPEC.md section 15).

One definition for both ends: the server encodes the global model with `state_to_wire`, the device rebuilds
it with `state_from_wire`; `upload_shapes` is the set of names and shapes an upload must have. f32 on the
wire is exact, so a device process trains from bit-for-bit the state an in-process client gets.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
import torch

from splitface.common.models import ModelSpec, build_backbone
from splitface.device.federated.local_round import HEAD_PREFIX, LocalConfig


def state_to_wire(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A state dict as float32 arrays (integer buffers such as batch norm's step count included: exact below 2^24)."""
    out = {}
    for name, value in state.items():
        if not value.is_floating_point() and value.numel() and int(value.abs().max()) >= 2 ** 24:
            raise ValueError(f"{name}: integer values of 2^24 or more do not survive float32")
        out[name] = value.detach().to(torch.float32).contiguous().numpy()
    return out


def state_from_wire(wire: Mapping[str, np.ndarray], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict `wire` encodes, with the names, shapes and dtypes of `like` (a module's own state)."""
    if set(wire) != set(like):
        raise ValueError(f"model names differ: missing {sorted(set(like) - set(wire))[:3]}, "
                         f"unexpected {sorted(set(wire) - set(like))[:3]}")
    out = {}
    for name, ref in like.items():
        value = torch.from_numpy(np.array(wire[name], dtype=np.float32))
        if tuple(value.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)}, the model's is {tuple(ref.shape)}")
        out[name] = value.to(ref.dtype)
    return out


def backbone_template(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The backbone's state dict (names, shapes, dtypes), built without touching the caller's random state."""
    with torch.random.fork_rng():
        return build_backbone(spec).state_dict()


def upload_shapes(spec: ModelSpec, head_shape: tuple[int, int] | None = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an upload: the backbone's parameters, and "head.weight"/"head.bias" with a global head
    of `head_shape` (classes, embedding dim)."""
    with torch.random.fork_rng():
        shapes = {k: tuple(p.shape) for k, p in build_backbone(spec).named_parameters()}
    if head_shape is not None:
        shapes.update({HEAD_PREFIX + "weight": tuple(head_shape), HEAD_PREFIX + "bias": (head_shape[0],)})
    return shapes


def config_to_wire(config: LocalConfig) -> tuple[dict[str, Any], float | None]:
    """(ROUND_START's config map, its clip_norm: None when not clipped)."""
    fields = dataclasses.asdict(config)
    clip = fields.pop("clip_norm")
    wire = {k: float(v) if isinstance(v, float) else v for k, v in fields.items()}
    return wire, None if math.isinf(clip) else float(clip)


def config_from_wire(config: Mapping[str, Any], clip_norm: float | None) -> LocalConfig:
    return LocalConfig(**config, clip_norm=math.inf if clip_norm is None else clip_norm)
