"""The device's training progress on disk, beside its privacy state: the last batch it committed and its
snapshots back to the server's `durable_through` (SPEC.md section 11), so that a device killed mid-epoch and
restarted rejoins the same server run where it stopped, with the same data order.

Without it a restarted device would begin again at batch 0 while the server held its later batches, and the
client's reconcile could only refuse. Written like the privacy state (privacy/state.py): an index
file, atomic and checksummed, names the committed batch and the SHA-256 of each snapshot file; a snapshot
file is written (atomically) before the index names it, so after a crash the index is the old one or the new
one and every file it names is whole. A file that fails its checks is an error, never a reason to start
again: starting again would replay batches the server already applied.

With the device head the index also names the head step of the batch in flight (its classifier gradient, loss
and correct count), saved before its EMBEDDING_GRAD leaves: if the server applied that batch and the device died
before committing it, the restarted device's re-sent FORWARD is answered by BACKWARD alone (SPEC.md section 8),
and only the kept head step lets it commit the batch whole.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from splitface.device.privacy.state import StateFileError, read_state, state_path, write_atomic, write_state

FORMAT = "splitface-device-training-state"
WHAT = "training state"


def progress_path(state_dir: Path, device_id: str) -> Path:
    """Where a device keeps its training progress in `state_dir` (its snapshots go in the folder beside it)."""
    return state_path(state_dir, device_id, "training")


class TrainingProgress:
    """The durable copy of a DeviceTrainer's `committed` and `snapshots`. `identity`: what the state is for
    (model, split, head, classes); a file for another configuration is refused."""

    def __init__(self, path: Path, identity: dict[str, Any]):
        self.path = Path(path)
        self.folder = self.path.with_suffix("")   # <device>.training/
        self.identity = identity
        self._digests: dict[int, str] = {}   # batch id -> SHA-256 of its snapshot file, as the index names them
        self._head: tuple[int, str] | None = None   # (batch id, SHA-256) of the kept head step of the batch in flight
        self._committed = 0

    def _snapshot_file(self, batch_id: int) -> Path:
        return self.folder / f"{batch_id}.pt"

    def _head_file(self, batch_id: int) -> Path:
        return self.folder / f"{batch_id}.head.pt"

    def _read(self, file: Path, digest: str, what: str) -> Any:
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise StateFileError(f"{file}: {what} unreadable ({exc}); refusing to train") from exc
        if hashlib.sha256(data).hexdigest() != digest:
            raise StateFileError(f"{file}: {what} fails its checksum; refusing to train")
        return torch.load(io.BytesIO(data), weights_only=True)

    def _write(self, file: Path, value: Any) -> str:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        write_atomic(file, buffer.getvalue())
        return hashlib.sha256(buffer.getvalue()).hexdigest()

    def load(self) -> tuple[int, dict[int, dict[str, Any]], dict[str, Any] | None] | None:
        """(committed, snapshots, the kept head step of batch committed + 1 or None) from disk, or None if this
        device has no progress yet; StateFileError if the index or a file it names fails its checks, or is for
        another configuration."""
        if not self.path.exists():
            return None
        state = read_state(self.path, FORMAT, WHAT)
        if state.get("identity") != self.identity:
            raise StateFileError(f"{self.path}: training state of {state.get('identity')}, not of this device's "
                                 f"{self.identity}; refusing to train (use another --state-dir for another run)")
        try:
            committed = int(state["committed"])
            digests = {int(k): str(v) for k, v in state["snapshots"].items()}
            head = None if state.get("head") is None else (int(state["head"][0]), str(state["head"][1]))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise StateFileError(f"{self.path}: {WHAT} is malformed ({exc!r}); refusing to train") from exc
        snapshots = {b: self._read(self._snapshot_file(b), d, f"snapshot of batch {b}") for b, d in digests.items()}
        if committed not in snapshots:
            raise StateFileError(f"{self.path}: no snapshot of the committed batch {committed}; refusing to train")
        kept = None
        if head is not None and head[0] == committed + 1:
            kept = self._read(self._head_file(head[0]), head[1], f"head step of batch {head[0]}")
        self._digests, self._head = digests, head if kept is not None else None
        self._prune()
        return committed, snapshots, kept

    def save(self, committed: int, snapshots: dict[int, dict[str, Any]]) -> None:
        """Make `committed` and exactly these snapshots durable: new snapshot files first, then the index, then
        the files it no longer names are deleted."""
        for batch_id in sorted(set(snapshots) - set(self._digests)):
            self._digests[batch_id] = self._write(self._snapshot_file(batch_id), snapshots[batch_id])
        self._digests = {k: v for k, v in self._digests.items() if k in snapshots}
        if self._head is not None and self._head[0] != committed + 1:
            self._head = None   # committed (or rolled back past): its head step is in the snapshot, or void
        self._committed = committed
        self._index()

    def save_head(self, batch_id: int, step: dict[str, Any]) -> None:
        """Keep the head step of batch `batch_id` (the one after the committed batch) until it is committed."""
        self._head = (batch_id, self._write(self._head_file(batch_id), step))
        self._index()

    def _index(self) -> None:
        write_state(self.path, {"identity": self.identity, "committed": self._committed,
                                "snapshots": {str(k): v for k, v in sorted(self._digests.items())},
                                "head": list(self._head) if self._head is not None else None}, FORMAT)
        self._prune()

    def _prune(self) -> None:
        """Delete the files the index does not name (forgotten ones, or one written before a crash)."""
        keep = {self._snapshot_file(b).name for b in self._digests}
        if self._head is not None:
            keep.add(self._head_file(self._head[0]).name)
        if self.folder.is_dir():
            for file in self.folder.iterdir():
                if file.name not in keep:
                    file.unlink(missing_ok=True)
