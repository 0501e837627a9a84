"""What a curious edge server keeps: the training releases each device sent, exactly as received
(and, with the device head, the embedding gradients), for the privacy audit to attack.

Off unless asked (`splitface-server serve --record-max N`). Up to N samples per device, keyed by
batch id, so a batch replayed after a server restart replaces itself instead of appearing twice
(a replayed batch carries the same noise: it is the same release). Written next to the checkpoint
as <run dir>/recordings/<device id>.npz: activations (float16, as many bytes as a 100 MB batch
deserves), labels (-1 where the device head kept them), batch ids, and embedding gradients.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


class Recorder:
    def __init__(self, directory: Path, max_per_device: int):
        if max_per_device < 1:
            raise ValueError(f"max_per_device must be >= 1, got {max_per_device}")
        self.directory, self.max_per_device = directory, max_per_device
        self.batches: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        for f in sorted(directory.glob("*.npz")) if directory.is_dir() else []:
            self.batches[f.stem] = _load(f)

    def _room(self, device_id: str, batch_id: int, n: int) -> bool:
        kept = self.batches.setdefault(device_id, {})
        others = sum(len(b["activations"]) for k, b in kept.items() if k != batch_id)
        return others + n <= self.max_per_device

    def record(self, device_id: str, batch_id: int, activations: np.ndarray, labels: np.ndarray | None) -> None:
        n = len(activations)
        if not self._room(device_id, batch_id, n):
            return
        self.batches[device_id][batch_id] = {
            "activations": np.asarray(activations, dtype=np.float16),
            "labels": np.full(n, -1, np.int64) if labels is None else np.asarray(labels, np.int64),
            "embedding_grads": np.zeros((n, 0), np.float32)}

    def record_embedding_grad(self, device_id: str, batch_id: int, grad: np.ndarray) -> None:
        batch = self.batches.get(device_id, {}).get(batch_id)
        if batch is not None:
            batch["embedding_grads"] = np.asarray(grad, np.float32)

    def flush(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for device_id, kept in self.batches.items():
            ids = sorted(kept)
            if not ids:
                continue
            tmp = self.directory / f".{device_id}.tmp.npz"
            dim = max(kept[b]["embedding_grads"].shape[1] for b in ids)
            np.savez(tmp, batch_ids=np.concatenate([np.full(len(kept[b]["labels"]), b) for b in ids]),
                     rows=np.concatenate([np.arange(len(kept[b]["labels"])) for b in ids]),
                     activations=np.concatenate([kept[b]["activations"] for b in ids]),
                     labels=np.concatenate([kept[b]["labels"] for b in ids]),
                     embedding_grads=np.concatenate([_width(kept[b]["embedding_grads"], dim) for b in ids]))
            tmp.replace(self.directory / f"{device_id}.npz")


def _width(grads: np.ndarray, dim: int) -> np.ndarray:
    """Rows without a recorded gradient (server head) become NaN of the common width."""
    if grads.shape[1] == dim:
        return grads
    return np.full((len(grads), dim), np.nan, np.float32)


def _load(path: Path) -> dict[int, dict[str, np.ndarray]]:
    with np.load(path) as f:
        data = {k: f[k] for k in f.files}
    out = {}
    for b in np.unique(data["batch_ids"]):
        sel = data["batch_ids"] == b
        out[int(b)] = {"activations": data["activations"][sel], "labels": data["labels"][sel],
                       "embedding_grads": data["embedding_grads"][sel]}
    return out


def load_recordings(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    """device id -> the arrays of its .npz (what the audit reads)."""
    out = {}
    for f in sorted(directory.glob("*.npz")):
        with np.load(f) as data:
            out[f.stem] = {k: data[k] for k in data.files}
    return out
