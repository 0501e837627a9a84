"""The federated rounds' rules on the server (SPEC.md section 15), sans I/O.

One board is shared by every federated session, so who may download which round's model and which
uploads count is decided in one place, the same for every shell.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode, ProtocolError, brief


@dataclass
class FederatedRound:
    """One round as the server published it (SPEC.md section 15)."""
    round_id: int
    seeds: dict[str, int]                    # the devices sampled for this round -> their training seed
    config: dict[str, Any]                   # ROUND_START's config (messages.LOCAL_CONFIG)
    clip_norm: float | None                  # the bound on every update's L2 norm; None: not clipped
    upload_shapes: dict[str, tuple[int, ...]]
    model: bytes                             # the MODEL message, encoded once for every device
    quorum: int                              # uploads that close the round before its deadline
    deadline: float                          # on the board's clock
    uploads: dict[str, dict[str, Any]] = field(default_factory=dict)
    closed: bool = False


class RoundBoard:
    """The federated rounds' shared state on the server: one board for all federated sessions (like the
    per-device records of split sessions). The engine opens a round and later closes it (at its quorum,
    signalled through `on_complete`, or at its deadline) and takes the accepted uploads; sessions ask it
    what to answer. Every refusal happens here, before an upload is stored, so a refused upload can never
    reach the global model. Not thread-safe: use it from the server's event loop only."""

    def __init__(self, model: dict[str, Any], completed: int = 0, retry_after_s: float = 1.0,
                 max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.completed = completed  # the last round whose update the engine applied and checkpointed
        self.retry_after_s = retry_after_s
        self.max_message_bytes = max_message_bytes
        self.clock = clock
        self.current: FederatedRound | None = None
        self.finished = False
        self.on_complete: Callable[[int], None] | None = None

    def open(self, round_id: int, seeds: dict[str, int], config: dict[str, Any], clip_norm: float | None,
             upload_shapes: dict[str, tuple[int, ...]], weights: dict[str, np.ndarray],
             head: dict[str, np.ndarray] | None, quorum: int, deadline_s: float) -> FederatedRound:
        """Publish round `round_id`; the rounds before it are complete (the engine opens a round only after
        checkpointing the previous one)."""
        if self.current is not None and not self.current.closed:
            raise RuntimeError(f"round {self.current.round_id} is still open")
        if round_id <= self.completed:
            raise ValueError(f"round {round_id} was completed already (last completed: {self.completed})")
        if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip_norm must be finite and > 0 (None: not clipped), got {clip_norm}")
        model: dict[str, Any] = {"type": m.MODEL, "round_id": round_id, "weights": dict(sorted(weights.items()))}
        if head is not None:
            model["head"] = dict(sorted(head.items()))
        self.completed = round_id - 1
        self.current = FederatedRound(round_id, dict(seeds), dict(config), clip_norm,
                                      {k: tuple(v) for k, v in upload_shapes.items()}, m.encode(model),
                                      max(1, min(quorum, len(seeds))), self.clock() + deadline_s)
        return self.current

    def close(self) -> dict[str, dict[str, Any]]:
        """End the open round: later uploads for it are late (round_closed). Returns the accepted uploads."""
        if self.current is None:
            raise RuntimeError("no round is open")
        self.current.closed = True
        return self.current.uploads

    def finish(self) -> None:
        """The run is over: devices are told so and stop asking."""
        self.finished = True

    def _open_for(self, device_id: str) -> FederatedRound | None:
        r = self.current
        if r is None or r.closed or device_id not in r.seeds or device_id in r.uploads:
            return None
        if self.clock() > r.deadline:
            return None
        return r

    def offer(self, device_id: str) -> bytes:
        """ROUND_START when this device has work in the open round, else ROUND_WAIT."""
        r = self._open_for(device_id)
        if r is None:
            closed = self.completed if self.current is None or not self.current.closed else self.current.round_id
            return m.encode({"type": m.ROUND_WAIT, "closed_round": closed,
                             "retry_after_s": float(self.retry_after_s), "finished": self.finished})
        start: dict[str, Any] = {"type": m.ROUND_START, "round_id": r.round_id, "seed": r.seeds[device_id],
                                 "config": r.config}
        if r.clip_norm is not None:
            start["clip_norm"] = float(r.clip_norm)
        start["deadline_s"] = float(max(0.0, r.deadline - self.clock()))
        start["max_message_bytes"] = self.max_message_bytes
        return m.encode(start)

    def _round(self, device_id: str, round_id: int) -> FederatedRound:
        """The open round `round_id` if this device may take part in it now; else the error that says why."""
        r = self.current
        if r is None or round_id > r.round_id:
            raise ProtocolError(ErrorCode.BAD_STATE, f"round {round_id} is not open")
        if round_id < r.round_id or r.closed or self.clock() > r.deadline:
            raise ProtocolError(ErrorCode.ROUND_CLOSED, f"round {round_id} is closed; ask for the next round")
        if device_id not in r.seeds:
            raise ProtocolError(ErrorCode.BAD_STATE, f"{device_id} was not sampled for round {round_id}")
        if device_id in r.uploads:
            raise ProtocolError(ErrorCode.BAD_STATE, f"{device_id} already uploaded its update for round {round_id}")
        return r

    def model_for(self, device_id: str, round_id: int) -> bytes:
        return self._round(device_id, round_id).model

    def accept(self, device_id: str, update: dict[str, Any]) -> bytes:
        """Store a valid upload and answer UPDATE_ACK; refuse (ProtocolError) a late, repeated, misshapen or
        over-long one. Reaching the quorum closes the round and calls `on_complete`."""
        r = self._round(device_id, update["round_id"])
        delta = update["delta"]
        if set(delta) != set(r.upload_shapes):
            missing, extra = sorted(set(r.upload_shapes) - set(delta)), sorted(set(delta) - set(r.upload_shapes))
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"update names differ from the model's: missing "
                                                      f"{brief(missing[:3])}, unexpected {brief(extra[:3])}")
        for name, value in delta.items():
            if tuple(value.shape) != r.upload_shapes[name]:
                raise ProtocolError(ErrorCode.BAD_TENSOR, f"update {brief(name)}: shape {list(value.shape)}, the "
                                                          f"model's is {list(r.upload_shapes[name])}")
        norm = update_norm(delta)
        if r.clip_norm is not None and norm > r.clip_norm:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"update norm {norm:.6g} exceeds the round's clip norm "
                                                      f"{r.clip_norm:.6g}")
        if norm > update["norm"] * (1 + 1e-6):
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"update norm {norm:.6g} exceeds the norm it claims "
                                                      f"({update['norm']:.6g})")
        r.uploads[device_id] = update
        if len(r.uploads) >= r.quorum:
            r.closed = True
            if self.on_complete is not None:
                self.on_complete(r.round_id)
        return m.encode({"type": m.UPDATE_ACK, "round_id": r.round_id})


def update_norm(delta: dict[str, np.ndarray]) -> float:
    """L2 norm of all of an update's tensors together, in float64."""
    return math.sqrt(sum(float(np.dot(v.reshape(-1).astype(np.float64), v.reshape(-1).astype(np.float64)))
                         for v in delta.values()))

