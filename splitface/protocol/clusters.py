"""The server's relay of PrivacyFace's sanitised clusters between device-head devices (SPEC.md section 8.1).

In U-shaped split training every device keeps its own head (its people's class centres), so its softmax
never sees another device's people as negatives. PrivacyFace's answer: each device releases a few
differentially private cluster centres of its head (splitface/common/dplc.py) and trains against the
other devices' releases (the consensus-aware loss). The server only relays: it keeps each device's latest
release (in memory; a restarted server has none until devices send theirs again) and answers a device's
CLUSTERS with everyone else's. Sans-I/O, shared by the server's sessions like `session.RoundBoard`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from splitface.protocol.errors import ErrorCode, ProtocolError

MAX_CLASSES = 4096  # rows of one device's head (SPEC.md section 8.2)
MAX_CLUSTERS = 64  # rows one device may release (DPLC's Q; the reference device uses 2)
NORM_TOLERANCE = 0.05  # rows are unit vectors, within f16/i8 rounding


def check_release(clusters: np.ndarray, embedding_dim: int) -> np.ndarray:
    """A device's release as the server accepts it: [P, embedding_dim], 0 <= P <= MAX_CLUSTERS, unit rows."""
    shape = tuple(clusters.shape)
    if len(shape) != 2 or shape[1] != embedding_dim or not 0 <= shape[0] <= MAX_CLUSTERS:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"clusters shape {list(shape)} is not [P, {embedding_dim}] with "
                                                  f"0 <= P <= {MAX_CLUSTERS}")
    norms = np.linalg.norm(clusters.astype(np.float64), axis=1)
    if np.any(np.abs(norms - 1.0) > NORM_TOLERANCE):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"clusters must be unit vectors; row norms {norms.round(3).tolist()}")
    return clusters


class ClusterRelay:
    """Each device's latest release, by device id."""

    def __init__(self, embedding_dim: int):
        self.embedding_dim = embedding_dim
        self.latest: dict[str, np.ndarray] = {}

    def exchange(self, device_id: str, clusters: np.ndarray) -> np.ndarray:
        """Store `device_id`'s release (replacing its previous one) and return every other device's latest,
        concatenated in device-id order ([0, embedding_dim] when there are none)."""
        self.latest[device_id] = check_release(clusters, self.embedding_dim).astype(np.float32)
        others = [self.latest[d] for d in sorted(self.latest) if d != device_id]
        return np.concatenate(others) if others else np.zeros((0, self.embedding_dim), np.float32)


class HeadBoard:
    """FedGC on device heads (SPEC.md section 8.2, opt-in): each device's latest uploaded class embeddings; an
    upload is corrected together with every other device's latest by `correct` (the server's FedGC step:
    {device: head} -> {device: corrected head}), the corrected heads are kept, and the uploader gets its own."""

    def __init__(self, embedding_dim: int, correct: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]):
        self.embedding_dim, self.correct = embedding_dim, correct
        self.latest: dict[str, np.ndarray] = {}

    def upload(self, device_id: str, head: np.ndarray) -> np.ndarray:
        shape = tuple(head.shape)
        if len(shape) != 2 or shape[1] != self.embedding_dim or not 1 <= shape[0] <= MAX_CLASSES:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"class embeddings shape {list(shape)} is not [C, "
                                                      f"{self.embedding_dim}] with 1 <= C <= {MAX_CLASSES}")
        if not np.all(np.linalg.norm(head.astype(np.float64), axis=1) > 0):
            raise ProtocolError(ErrorCode.BAD_TENSOR, "class embeddings must be non-zero rows")
        heads = {**self.latest, device_id: head.astype(np.float32)}
        self.latest = {d: np.asarray(h, np.float32) for d, h in self.correct(heads).items()}
        return self.latest[device_id]
