"""The device's training progress on disk, beside its privacy state: the last batch it committed and its
snapshots back to the server's `durable_through` (SPEC.md section 11), so that a device killed mid-epoch and
restarted rejoins the same server run where it stopped, with the same data order.

Without it a restarted device began again at batch 0 while the server held its later batches, and the
client's reconcile could only refuse (issue 28). Written like the privacy state (privacy/state.py): an index
file, atomic and checksummed, names the committed batch and the SHA-256 of each snapshot file; a snapshot
file is written (atomically) before the index names it, so after a crash the index is the old one or the new
one and every file it names is whole. A file that fails its checks is an error, never a reason to start
again: starting again would replay batches the server already applied.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from .privacy.state import StateFileError, read_state, state_path, write_atomic, write_state

FORMAT = "splitface-device-training-state"
WHAT = "training state"


def progress_path(state_dir: Path, device_id: str) -> Path:
    """Where a device keeps its training progress in `state_dir` (its snapshots go in the folder beside it)."""
    return state_path(state_dir, device_id, "training")


class TrainingProgress:
    """The durable copy of a DeviceEngine's `committed` and `snapshots`. `identity`: what the state is for
    (model, split, head, classes); a file for another configuration is refused."""

    def __init__(self, path: Path, identity: dict[str, Any]):
        self.path = Path(path)
        self.folder = self.path.with_suffix("")   # <device>.training/
        self.identity = identity
        self._digests: dict[int, str] = {}   # batch id -> SHA-256 of its snapshot file, as the index names them

    def _snapshot_file(self, batch_id: int) -> Path:
        return self.folder / f"{batch_id}.pt"

    def load(self) -> tuple[int, dict[int, dict[str, Any]]] | None:
        """(committed, snapshots) from disk, or None if this device has no progress yet; StateFileError if the
        index or a snapshot it names fails its checks, or is for another configuration."""
        if not self.path.exists():
            return None
        state = read_state(self.path, FORMAT, WHAT)
        if state.get("identity") != self.identity:
            raise StateFileError(f"{self.path}: training state of {state.get('identity')}, not of this device's "
                                 f"{self.identity}; refusing to train (use another --state-dir for another run)")
        try:
            committed = int(state["committed"])
            digests = {int(k): str(v) for k, v in state["snapshots"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateFileError(f"{self.path}: {WHAT} is malformed ({exc!r}); refusing to train") from exc
        snapshots = {}
        for batch_id, digest in digests.items():
            file = self._snapshot_file(batch_id)
            try:
                data = file.read_bytes()
            except OSError as exc:
                raise StateFileError(f"{file}: snapshot of batch {batch_id} unreadable ({exc}); refusing to train") from exc
            if hashlib.sha256(data).hexdigest() != digest:
                raise StateFileError(f"{file}: snapshot of batch {batch_id} fails its checksum; refusing to train")
            snapshots[batch_id] = torch.load(io.BytesIO(data), weights_only=True)
        if committed not in snapshots:
            raise StateFileError(f"{self.path}: no snapshot of the committed batch {committed}; refusing to train")
        self._digests = digests
        self._prune()
        return committed, snapshots

    def save(self, committed: int, snapshots: dict[int, dict[str, Any]]) -> None:
        """Make `committed` and exactly these snapshots durable: new snapshot files first, then the index, then
        the files it no longer names are deleted."""
        for batch_id in sorted(set(snapshots) - set(self._digests)):
            buffer = io.BytesIO()
            torch.save(snapshots[batch_id], buffer)
            data = buffer.getvalue()
            write_atomic(self._snapshot_file(batch_id), data)
            self._digests[batch_id] = hashlib.sha256(data).hexdigest()
        self._digests = {k: v for k, v in self._digests.items() if k in snapshots}
        write_state(self.path, {"identity": self.identity, "committed": committed,
                                "snapshots": {str(k): v for k, v in sorted(self._digests.items())}}, FORMAT)
        self._prune()

    def _prune(self) -> None:
        """Delete snapshot files the index does not name (forgotten ones, or one written before a crash)."""
        if self.folder.is_dir():
            for file in self.folder.iterdir():
                if not (file.suffix == ".pt" and file.stem.isdigit() and int(file.stem) in self._digests):
                    file.unlink(missing_ok=True)
