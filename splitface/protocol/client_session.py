"""The device's side of a connection, sans I/O: it builds the device's messages and checks the server's replies.

Split (`ClientSession`) and federated (`FederatedClientSession`) devices. What a device does after a
WELCOME (resume, re-send its batch in flight, or roll back) is decided here, once (`welcome_decision`), so
that every client shell, Python or JVM, follows the same rule, pinned by vectors/reconnect/.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode, ProtocolError, RemoteError, brief
from splitface.protocol.messages import message_size
from splitface.protocol.patches import pack
from splitface.protocol.tensor import encode_tensor


def _reply(data: bytes, expect: set[str], max_message_bytes: int) -> dict[str, Any]:
    """A server message of one of the expected types (never refused for a size under the spec's floor); ERROR
    becomes RemoteError."""
    message = m.decode(data, max_size=max(max_message_bytes, m.DEFAULT_MAX_MESSAGE_BYTES))
    if message["type"] == m.ERROR:
        raise RemoteError(message["code"], message["message"], message.get("batch_id"))
    if message["type"] not in expect:
        raise ProtocolError(ErrorCode.BAD_STATE, f"expected {sorted(expect)}, got {message['type']}")
    return message


@dataclass(frozen=True)
class Resume:
    """Go on at `next_batch` (the device's last committed batch + 1). `resend`: the device holds that batch's
    FORWARD (in flight when the connection dropped) and re-sends those exact bytes; `replay`: the server has
    applied that batch already, so it answers the FORWARD with its cached BACKWARD and applies nothing (a device
    that does not hold the bytes, one restarted from its training state, makes the same batch again)."""
    next_batch: int
    resend: bool
    replay: bool
    forget_before: int  # the device's snapshots of batches before this one can never be needed (SPEC.md section 11)


@dataclass(frozen=True)
class Rollback:
    """The server restarted from an older checkpoint: restore the snapshot of `batch_id` (the server's last applied
    batch), drop the later ones and any batch in flight, and go on at `batch_id + 1`."""
    batch_id: int
    forget_before: int


class CannotResume(ProtocolError):
    """WELCOME's progress cannot be reconciled with the device's: the device must stop (SPEC.md section 10).
    `reason`: "server_ahead" (the server claims a batch this device never sent: the device lost its state) or
    "durable_ahead" (the checkpoint covers a batch the server says it has not applied)."""

    def __init__(self, reason: str, message: str, server_applied: int, committed: int):
        super().__init__(ErrorCode.BAD_STATE, message)
        self.reason = reason
        self.server_applied = server_applied
        self.committed = committed


def welcome_decision(committed: int, in_flight: int | None, resume_from: int, durable_through: int) -> Resume | Rollback:
    """SPEC.md section 10's reconciliation: the device's last committed batch `committed` (C) and the batch whose
    FORWARD it holds unanswered `in_flight` (None, or C + 1), against WELCOME's `resume_from` (R + 1) and
    `durable_through`. R == C or C + 1: resume at C + 1; R < C: roll back to R; else CannotResume."""
    if in_flight is not None and in_flight != committed + 1:
        raise ValueError(f"the batch in flight is {in_flight}, but only batch {committed + 1} can be (committed: {committed})")
    applied = resume_from - 1
    if applied > committed + 1:
        raise CannotResume("server_ahead", f"server has applied batch {applied}, device only {committed}", applied,
                           committed)
    if durable_through > applied:
        raise CannotResume("durable_ahead", f"server's checkpoint covers batch {durable_through}, but it has applied "
                                            f"only {applied}", applied, committed)
    forget_before = min(durable_through, committed)
    if applied < committed:
        return Rollback(applied, forget_before)
    return Resume(committed + 1, in_flight is not None, applied == committed + 1, forget_before)


@dataclass
class ClientSession:
    """The device's side: builds messages and checks replies."""
    device_id: str
    token: str
    model: dict[str, Any]
    split: str
    head: str
    batch_size: int
    num_classes: int | None = None
    encodings: dict[str, str] = field(default_factory=lambda: {"activations": "f32", "gradients": "f32"})
    welcome: dict[str, Any] | None = None
    # a patch-masked release (FaceMAE's `mask`): FORWARDs carry only its non-zero patches of this side, and where
    # they go (SPEC.md section 5.12); None: the dense tensor
    pack_patch: int | None = None

    def hello(self) -> bytes:
        message: dict[str, Any] = {
            "type": m.HELLO, "protocol_version": m.PROTOCOL_VERSION, "device_id": self.device_id,
            "token": self.token, "model": self.model, "split": self.split, "head": self.head,
            "encodings": dict(self.encodings), "batch_size": self.batch_size,
        }
        if self.num_classes is not None:
            message["num_classes"] = self.num_classes
        return m.encode(message)

    def accept_welcome(self, data: bytes) -> dict[str, Any]:
        """The WELCOME, whose limits the device must then obey: refused (bad_message) if it has none usable."""
        welcome = self.receive(data, {m.WELCOME})
        limits = welcome["limits"]
        if not all(m.is_int(limits.get(k)) and limits[k] > 0 for k in ("max_message_bytes", "max_batch")):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"welcome: limits need int max_message_bytes and max_batch > 0, "
                                                       f"got {brief(limits)}")
        self.welcome = welcome
        return welcome

    def reconcile(self, committed: int, in_flight: int | None = None) -> Resume | Rollback:
        """What to do after the accepted WELCOME, given the device's last committed batch and the batch whose FORWARD
        it holds unanswered (`welcome_decision`); raises CannotResume if the device must stop. Separate from
        `accept_welcome` so that a shell can first check WELCOME's `spent_epsilon` (SPEC.md section 5.11)."""
        if self.welcome is None:
            raise ProtocolError(ErrorCode.BAD_STATE, "no welcome accepted yet")
        return welcome_decision(committed, in_flight, self.welcome["resume_from"], self.welcome["durable_through"])

    @property
    def max_message_bytes(self) -> int:
        return self.welcome["limits"]["max_message_bytes"] if self.welcome else m.DEFAULT_MAX_MESSAGE_BYTES

    def forward(self, batch_id: int, activations: np.ndarray, labels: np.ndarray | None = None, eval: bool = False,
                spent_epsilon: float | None = None, integer_step: float | None = None) -> bytes:
        """FORWARD; `spent_epsilon`: the device's spent epsilon with this release counted (None: no formal
        mechanism, the field is omitted). `integer_step`: the release is integers in this public step (the
        discrete Gaussian's): they go as i8 at that scale, exactly, whatever the activation encoding."""
        return b"".join(self.forward_parts(batch_id, activations, labels, eval, spent_epsilon, integer_step))

    def forward_parts(self, batch_id: int, activations: np.ndarray, labels: np.ndarray | None = None,
                      eval: bool = False, spent_epsilon: float | None = None,
                      integer_step: float | None = None) -> list[m.Part]:
        """`forward`'s bytes as parts (messages.encode_parts): f32 activations are not copied but sent from
        their own buffer, so they must not change until the message is sent (and re-sent on a retry)."""
        wire = (encode_tensor(activations, "i8", scale=integer_step) if integer_step is not None
                else encode_tensor(activations, self.encodings.get("activations", "f32")))
        message: dict[str, Any] = {"type": m.FORWARD, "batch_id": batch_id, "activations": wire}
        if self.pack_patch is not None:
            message["activations"], message["visible"] = pack(wire, self.pack_patch)
        if labels is not None:
            if self.head == "device":
                raise ValueError("device head: labels stay on the device")
            message["labels"] = [int(y) for y in labels]
        if eval:
            message["eval"] = True
        if spent_epsilon is not None:
            if not (math.isfinite(spent_epsilon) and spent_epsilon >= 0):
                raise ValueError(f"spent_epsilon must be finite and >= 0 (None: no formal mechanism), got {spent_epsilon}")
            message["spent_epsilon"] = float(spent_epsilon)
        return self._checked(m.encode_parts(message))

    def embedding_grad(self, batch_id: int, grad: np.ndarray) -> bytes:
        return self._checked(m.encode({"type": m.EMBEDDING_GRAD, "batch_id": batch_id,
                                       "grad": encode_tensor(grad, self.encodings.get("gradients", "f32"))}))

    def clusters(self, clusters: np.ndarray) -> bytes:
        """CLUSTERS (device head, SPEC.md section 8.1): this device's latest DPLC release, [P, embedding_dim],
        in f32 (a few rows: exactness costs nothing)."""
        if self.head != "device":
            raise ValueError("clusters are relayed between device heads only")
        return self._checked(m.encode({"type": m.CLUSTERS, "clusters": encode_tensor(np.asarray(clusters, np.float32),
                                                                                       "f32")}))

    def class_embeddings(self, head: np.ndarray) -> bytes:
        """CLASS_EMBEDDINGS (device head, opt-in FedGC, SPEC.md section 8.2): this device's head, [C, embedding_dim]."""
        if self.head != "device":
            raise ValueError("class embeddings are corrected for device heads only")
        return self._checked(m.encode({"type": m.CLASS_EMBEDDINGS,
                                       "class_embeddings": encode_tensor(np.asarray(head, np.float32), "f32")}))

    def _checked(self, data: Any) -> Any:
        """`data` (bytes, or a message's parts) if the server accepts a message of its size."""
        size = message_size(data)
        if size > self.max_message_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"message of {size} bytes exceeds the server's limit of {self.max_message_bytes}")
        return data

    def receive(self, data: bytes, expect: set[str], batch_id: int | None = None) -> dict[str, Any]:
        """A validated reply of one of the expected types; ERROR becomes RemoteError."""
        message = _reply(data, expect, self.max_message_bytes)
        if batch_id is not None and message.get("batch_id") != batch_id:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"reply for batch {message.get('batch_id')}, expected {batch_id}")
        return message


@dataclass
class FederatedClientSession:
    """A federated device's side: builds its messages and checks the server's replies."""
    device_id: str
    token: str
    model: dict[str, Any]
    max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES  # the server's, from its latest ROUND_START

    def hello(self) -> bytes:
        return m.encode({"type": m.HELLO, "protocol_version": m.PROTOCOL_VERSION, "device_id": self.device_id,
                         "token": self.token, "model": self.model, "mode": "federated"})

    def round_request(self) -> bytes:
        return m.encode({"type": m.ROUND_REQUEST})

    def model_request(self, round_id: int) -> bytes:
        return m.encode({"type": m.MODEL_REQUEST, "round_id": round_id})

    def update(self, round_id: int, delta: dict[str, np.ndarray], norm: float, examples: int, loss: float,
               encoding: str = "f32") -> bytes:
        """UPDATE with the tensors in name order; raises too_large beyond the server's limit."""
        data = m.encode({"type": m.UPDATE, "round_id": round_id,
                         "delta": {k: encode_tensor(delta[k], encoding) for k in sorted(delta)},
                         "norm": float(norm), "examples": int(examples), "loss": float(loss)})
        if len(data) > self.max_message_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"update of {len(data)} bytes exceeds the server's limit of {self.max_message_bytes}")
        return data

    def receive(self, data: bytes, expect: set[str], round_id: int | None = None) -> dict[str, Any]:
        """A validated reply of one of the expected types; ERROR becomes RemoteError."""
        message = _reply(data, expect, self.max_message_bytes)
        if round_id is not None and message.get("round_id") != round_id:
            raise ProtocolError(ErrorCode.BAD_STATE, f"reply for round {message.get('round_id')}, expected {round_id}")
        if message["type"] == m.ROUND_START:
            self.max_message_bytes = message["max_message_bytes"]
        return message
