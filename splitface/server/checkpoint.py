"""Atomic checkpoints: a crash or kill mid-write leaves the previous checkpoint intact, and a state holding a
non-finite value is never written (a resumed server must not inherit a poisoned model)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from splitface.protocol.messages import Message
from splitface.net.transport import fragments

FORMAT = 1


class RefusedState(ValueError):
    """The state to save is not written; the previous checkpoint is kept."""


class NonFiniteState(RefusedState):
    """The state to save holds NaN or infinity; the previous checkpoint is kept."""


class ImplausibleStatistics(RefusedState):
    """The batch norms' running statistics moved further since the last checkpoint than the batches in between
    could move them (ServerTrainer.statistics_beyond); the previous checkpoint is kept."""


def non_finite(state: Any, where: str = "") -> list[str]:
    """Paths of the floating-point tensors in a nested state that hold NaN or infinity."""
    if isinstance(state, torch.Tensor):
        return [where or "."] if state.is_floating_point() and not bool(torch.isfinite(state).all()) else []
    if isinstance(state, dict):
        return [p for k, v in state.items() for p in non_finite(v, f"{where}/{k}")]
    if isinstance(state, (list, tuple)):
        return [p for i, v in enumerate(state) for p in non_finite(v, f"{where}/{i}")]
    return []


def _write_atomically(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ReplyStore:
    """Each device's last reply, as the exact bytes a retry must get again, in a file of its own beside the
    checkpoint, which names it. A reply is a whole gradient (4 MB for 16 images at vgg_face_small's conv1):
    kept in the checkpoint, 32 of them made every checkpoint 126 MB and rewrote them all each time. Here a
    checkpoint writes only the replies that are new since the last one, and a reply the device has
    acknowledged (by sending its next batch) is deleted once a checkpoint no longer names it."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    @staticmethod
    def name(device_id: str, batch_id: int) -> str:
        """A file name for any device id (ids are the peer's strings: hashed, never used as paths)."""
        return f"{hashlib.sha256(device_id.encode()).hexdigest()[:24]}-{batch_id}.msgpack"

    def save(self, device_id: str, batch_id: int, reply: Message) -> str:
        """The reply's file name, written durably unless an earlier checkpoint wrote it already; the reply is
        bytes or a BACKWARD's parts, written one after the other (the same bytes)."""
        name = self.name(device_id, batch_id)
        path = self.folder / name
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, lambda f: f.writelines(fragments(reply)))
        return name

    def load(self, name: str) -> bytes:
        return (self.folder / Path(name).name).read_bytes()

    def prune(self, keep: set[str]) -> None:
        """Delete the replies the latest checkpoint does not name (call only once it is written)."""
        if self.folder.is_dir():
            for path in self.folder.glob("*.msgpack"):
                if path.name not in keep:
                    path.unlink(missing_ok=True)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*.msgpack")) if self.folder.is_dir() else 0


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` atomically; raises NonFiniteState (writing nothing) if any tensor in it is not finite."""
    path = Path(path)
    bad = non_finite(state)
    if bad:
        raise NonFiniteState(f"refusing to checkpoint {len(bad)} non-finite tensors ({', '.join(bad[:3])}...); "
                             f"{path} keeps the last good state")
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, lambda f: torch.save({"format": FORMAT, **state}, f))


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    path = Path(path)
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT}")
    return state
