"""The device's side of a connection, sans I/O: it builds the device's messages and checks the server's replies.

Split (`ClientSession`) and federated (`FederatedClientSession`) devices; every client shell, Python or
JVM, follows the same rules, so they are written once here and pinned by the test vectors.
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
        message = m.decode(data, max_size=max(self.max_message_bytes, m.DEFAULT_MAX_MESSAGE_BYTES))
        if message["type"] == m.ERROR:
            raise RemoteError(message["code"], message["message"], message.get("batch_id"))
        if message["type"] not in expect:
            raise ProtocolError(ErrorCode.BAD_STATE, f"expected {sorted(expect)}, got {message['type']}")
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
        message = m.decode(data, max_size=max(self.max_message_bytes, m.DEFAULT_MAX_MESSAGE_BYTES))
        if message["type"] == m.ERROR:
            raise RemoteError(message["code"], message["message"], message.get("batch_id"))
        if message["type"] not in expect:
            raise ProtocolError(ErrorCode.BAD_STATE, f"expected {sorted(expect)}, got {message['type']}")
        if round_id is not None and message.get("round_id") != round_id:
            raise ProtocolError(ErrorCode.BAD_STATE, f"reply for round {message.get('round_id')}, expected {round_id}")
        if message["type"] == m.ROUND_START:
            self.max_message_bytes = message["max_message_bytes"]
        return message
