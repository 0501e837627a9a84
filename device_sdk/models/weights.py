"""Saved backbones (e.g. one pre-trained on a public split): one file format for both sides.

The device loads only the stages it runs; the server only the rest. A file never carries
a classifier: identities differ between the public and the private set.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..transforms import TRANSFORMS
from . import RELEASE_KEYS, ModelSpec

RELEASE_STAGES = {*TRANSFORMS, *(f"{name}_server" for name in TRANSFORMS)}

FORMAT = "splitface-backbone-1"


def save_backbone(path: Path, spec: ModelSpec, backbone: nn.Module, meta: dict[str, Any] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "spec": spec.to_dict(), "state": backbone.state_dict(), "meta": meta or {}}, path)


def load_into(part: nn.Module, path: Path, spec: ModelSpec) -> dict[str, Any]:
    """Load the saved weights of the stages `part` holds; returns the file's metadata."""
    saved = torch.load(Path(path), map_location="cpu", weights_only=True)
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path}: not a splitface backbone file")
    saved_spec = {k: v for k, v in saved["spec"].items() if k not in RELEASE_KEYS}
    wanted = {k: v for k, v in spec.to_dict().items() if k not in RELEASE_KEYS}
    if saved_spec != wanted:
        raise ValueError(f"{path} holds {saved['spec']}, not {spec.to_dict()}")
    own = part.state_dict()
    state = {k: v for k, v in saved["state"].items() if k in own}
    # A release transform's stages at the cut are not in a backbone file: they keep their seeded start.
    missing = {k for k in set(own) - set(state) if k.split(".")[1] not in RELEASE_STAGES}
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)[:5]}")
    part.load_state_dict(state, strict=False)  # only release stages can be missing (checked above)
    return saved["meta"]
