"""Saved backbones (e.g. one pre-trained on a public split): one file format for both sides.

The device loads only the stages it runs; the server only the rest. A file never carries
a classifier: identities differ between the public and the private set.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitface.common.transforms import TRANSFORMS
from splitface.common.models import RELEASE_KEYS, ModelSpec

RELEASE_STAGES = {*TRANSFORMS, *(f"{name}_server" for name in TRANSFORMS)}

FORMAT = "splitface-backbone-1"


def save_backbone(path: Path, spec: ModelSpec, backbone: nn.Module, meta: dict[str, Any] | None = None,
                  release_stages: dict[str, torch.Tensor] | None = None) -> None:
    """`release_stages`: the transform's stages at the cut (keys `stages.<transform>[_server].*`, as the
    parts from `split_backbone` name them), when they were trained with the backbone (attacker-aware
    pre-training); the file then only loads into a model with the same release transform."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = dict(backbone.state_dict())
    if release_stages:
        strays = [k for k in release_stages if k.split(".")[1] not in RELEASE_STAGES]
        if strays:
            raise ValueError(f"not release-stage keys: {strays[:5]}")
        state.update(release_stages)
    torch.save({"format": FORMAT, "spec": spec.to_dict(), "state": state, "meta": meta or {}}, path)


def load_into(part: nn.Module, path: Path, spec: ModelSpec) -> dict[str, Any]:
    """Load the saved weights of the stages `part` holds; returns the file's metadata."""
    saved = torch.load(Path(path), map_location="cpu", weights_only=True)
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path}: not a splitface backbone file")
    has_release = any(k.split(".")[1] in RELEASE_STAGES for k in saved["state"])
    ignored = () if has_release else RELEASE_KEYS   # trained release stages fit only the same transform
    # a file saved before a ModelSpec field existed holds that field's default
    saved_spec = {k: v for k, v in ModelSpec.from_dict(saved["spec"]).to_dict().items() if k not in ignored}
    wanted = {k: v for k, v in spec.to_dict().items() if k not in ignored}
    if saved_spec != wanted:
        raise ValueError(f"{path} holds {saved['spec']}, not {spec.to_dict()}")
    own = part.state_dict()
    state = {k: v for k, v in saved["state"].items() if k in own}
    # A plain backbone file has no release stages: the transform's stages at the cut keep their seeded start.
    missing = {k for k in set(own) - set(state) if has_release or k.split(".")[1] not in RELEASE_STAGES}
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)[:5]}")
    part.load_state_dict(state, strict=False)  # only release stages can be missing (checked above)
    return saved["meta"]
