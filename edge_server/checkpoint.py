"""Atomic checkpoints: a crash or kill mid-write leaves the previous checkpoint intact, and a state holding a
non-finite value is never written (a resumed server must not inherit a poisoned model)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = 1


class NonFiniteState(ValueError):
    """The state to save holds NaN or infinity; the previous checkpoint is kept."""


def non_finite(state: Any, where: str = "") -> list[str]:
    """Paths of the floating-point tensors in a nested state that hold NaN or infinity."""
    if isinstance(state, torch.Tensor):
        return [where or "."] if state.is_floating_point() and not bool(torch.isfinite(state).all()) else []
    if isinstance(state, dict):
        return [p for k, v in state.items() for p in non_finite(v, f"{where}/{k}")]
    if isinstance(state, (list, tuple)):
        return [p for i, v in enumerate(state) for p in non_finite(v, f"{where}/{i}")]
    return []


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` atomically; raises NonFiniteState (writing nothing) if any tensor in it is not finite."""
    path = Path(path)
    bad = non_finite(state)
    if bad:
        raise NonFiniteState(f"refusing to checkpoint {len(bad)} non-finite tensors ({', '.join(bad[:3])}...); "
                             f"{path} keeps the last good state")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    path = Path(path)
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT}")
    return state
