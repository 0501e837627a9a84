"""The server's side of a device connection, sans I/O: it turns received bytes into actions and knows no sockets.

The server shell feeds every message to `ServerSession.receive` and carries out the returned action. Batch
sequencing (apply once, replay the last reply on a retry) lives here so that every shell behaves the same;
a federated session asks the shared `RoundBoard` (round_board.py) what to answer.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from splitface.protocol import messages as m
from splitface.protocol.clusters import ClusterRelay, HeadBoard
from splitface.protocol.errors import ErrorCode, ProtocolError, brief
from splitface.protocol.messages import Message
from splitface.protocol.patches import check_packed, unpack
from splitface.protocol.round_board import RoundBoard
from splitface.protocol.tensor import ENCODINGS, encode_tensor


@dataclass(frozen=True)
class ServerInfo:
    """What a server trains, announced and enforced at the handshake."""
    model: dict[str, Any]
    split: str
    activation_shape: tuple[int, ...]
    embedding_dim: int
    num_classes: int
    max_batch: int
    max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES
    heads: tuple[str, ...] = m.HEADS
    encodings: tuple[str, ...] = ENCODINGS


@dataclass
class DeviceRecord:
    """Per-device progress the server keeps across connections (and checkpoints)."""
    last_applied: int = 0
    last_reply: Message | None = None   # bytes, or a BACKWARD's parts (ServerSession.applied_parts)


# Actions returned by ServerSession.receive.
@dataclass
class Reply:
    data: Message   # bytes, or the parts of a replayed BACKWARD (messages.encode_parts)
    close: bool = False


@dataclass
class Admit:
    """A valid, authenticated HELLO: the shell makes this the device's only connection, then sends `welcome()`."""
    device_id: str


@dataclass
class Train:
    """Server head: forward, loss, backward, step; answer with `applied`."""
    batch_id: int
    activations: np.ndarray
    labels: np.ndarray
    visible: np.ndarray | None = None  # packed FORWARD (SPEC.md 5.12): bool [N, GH, GW], the patches that travelled


@dataclass
class Evaluate:
    """Server head, eval flag: forward and loss without a step; answer with `eval_result`."""
    batch_id: int
    activations: np.ndarray
    labels: np.ndarray
    visible: np.ndarray | None = None  # packed FORWARD (SPEC.md 5.12): bool [N, GH, GW], the patches that travelled


@dataclass
class Embed:
    """Device head: forward to embeddings; answer with `embedded` (train) or `eval_embeddings`."""
    batch_id: int
    activations: np.ndarray
    eval: bool
    visible: np.ndarray | None = None  # packed FORWARD (SPEC.md 5.12): bool [N, GH, GW], the patches that travelled


@dataclass
class TrainTail:
    """Device head: backward from the device's embedding gradient, step; answer with `applied`."""
    batch_id: int
    grad: np.ndarray


Action = Reply | Admit | Train | Evaluate | Embed | TrainTail

Authenticator = Callable[[str, str], bool]


GRADIENT_ROUNDING = ("nearest", "stochastic")


class ServerSession:
    """One device connection on the server."""

    def __init__(self, info: ServerInfo, authenticate: Authenticator,
                 records: dict[str, DeviceRecord], durable_through: Callable[[str], int],
                 board: RoundBoard | None = None, relay: ClusterRelay | None = None,
                 epsilon: dict[str, float] | None = None, heads: HeadBoard | None = None,
                 gradient_rounding: str = "nearest"):
        """`board`: the federated rounds this server hosts (None: split sessions only); `relay`: the device-head
        devices' cluster releases (None: CLUSTERS is `unsupported`); `epsilon`: each device's last reported
        spent epsilon (SPEC.md section 5.11), shared by all sessions and kept in the server's checkpoint, so
        that WELCOME can tell a device that lost its privacy state what it had spent; `heads`: FedGC on device
        heads, opt-in (None: CLASS_EMBEDDINGS is `unsupported`); `gradient_rounding`: how BACKWARD's i8 and i8c
        gradients round, "nearest" (the reference encoder's) or "stochastic" (unbiased: `encode_tensor`'s `dither`)."""
        if gradient_rounding not in GRADIENT_ROUNDING:
            raise ValueError(f"gradient_rounding must be one of {GRADIENT_ROUNDING}, not {gradient_rounding!r}")
        self.info = info
        self.epsilon = epsilon if epsilon is not None else {}
        self.board = board
        self.relay = relay
        self.heads = heads
        self.mode = "split"
        self._authenticate = authenticate
        self._records = records
        self._durable_through = durable_through
        self.session_id = uuid.uuid4().hex
        self.device_id: str | None = None
        self.head: str | None = None
        self.grad_encoding = "f32"
        # an unpredictable stream per session: nothing about the rounding needs to be reproducible
        self._dither = np.random.default_rng() if gradient_rounding == "stochastic" else None
        self.closed = False
        self._pending: tuple[int, int] | None = None  # device head: (batch_id, batch size) awaiting its gradient

    @property
    def record(self) -> DeviceRecord:
        assert self.device_id is not None
        return self._records.setdefault(self.device_id, DeviceRecord())

    def receive(self, data: bytes | memoryview) -> Action:
        """Decide what a received message means (bytes, or transport.receive's view of them); errors come back
        as a Reply."""
        if self.closed:
            return self._refuse(ProtocolError(ErrorCode.BAD_STATE, "session is closed"), close=True)
        try:
            message = m.decode(data, max_size=self.info.max_message_bytes)
            if self.device_id is None:
                return self._handshake(message)
            return self._dispatch(message)
        except ProtocolError as exc:
            return self._refuse(exc, close=exc.fatal or self.device_id is None)

    def _refuse(self, exc: ProtocolError, close: bool) -> Reply:
        if close:
            self.closed = True
        return Reply(m.encode(m.error(exc.code, exc.message, exc.batch_id)), close=close)

    def _handshake(self, hello: dict[str, Any]) -> Admit:
        if hello["type"] != m.HELLO:
            raise ProtocolError(ErrorCode.BAD_STATE, f"expected hello first, got {hello['type']}")
        info = self.info
        if hello["protocol_version"] != m.PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                                f"server speaks protocol {m.PROTOCOL_VERSION}, device sent {hello['protocol_version']}")
        if not self._authenticate(hello["device_id"], hello["token"]):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"unknown device or wrong token for {hello['device_id']!r}")
        if hello.get("mode", "split") == "federated":
            return self._federated_handshake(hello)
        if not info.heads:
            raise ProtocolError(ErrorCode.UNSUPPORTED, "this server hosts no split training")
        if m.model_identity(hello["model"]) != m.model_identity(info.model):
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"server trains model {info.model}, device asked for {brief(hello['model'], 400)}")
        if hello["split"] != info.split:
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"server splits at {info.split!r}, device at {brief(hello['split'])}")
        if hello["head"] not in info.heads:
            raise ProtocolError(ErrorCode.UNSUPPORTED, f"head {brief(hello['head'])} not offered; choose one of {list(info.heads)}")
        if hello["batch_size"] > info.max_batch:
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"batch size {hello['batch_size']} exceeds the server's {info.max_batch}")
        if hello["head"] == "server" and hello.get("num_classes") != info.num_classes:
            sent = "none" if hello.get("num_classes") is None else hello["num_classes"]
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"server head needs num_classes {info.num_classes} in HELLO, "
                                                          f"device sent {sent}")
        encodings = hello["encodings"]
        for role in ("activations", "gradients"):
            if encodings.get(role, "f32") not in info.encodings:
                raise ProtocolError(ErrorCode.UNSUPPORTED,
                                    f"{role} encoding {brief(encodings.get(role))} not offered; choose one of {list(info.encodings)}")
        self.device_id = hello["device_id"]
        self.head = hello["head"]
        self.grad_encoding = encodings.get("gradients", "f32")
        return Admit(self.device_id)

    def _federated_handshake(self, hello: dict[str, Any]) -> Admit:
        if self.board is None:
            raise ProtocolError(ErrorCode.UNSUPPORTED, "this server hosts no federated run")
        if m.model_identity(hello["model"]) != m.model_identity(self.board.model):
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"the federated run trains model {self.board.model}, device "
                                                          f"asked for {brief(hello['model'], 400)}")
        self.device_id = hello["device_id"]
        self.mode = "federated"
        return Admit(self.device_id)

    def welcome(self) -> bytes:
        """WELCOME, built only once the device's earlier connection (if any) has finished; a federated session
        is answered with its first ROUND_START or ROUND_WAIT instead."""
        if self.mode == "federated":
            return self.board.offer(self.device_id)
        info = self.info
        welcome = {
            "type": m.WELCOME,
            "session_id": self.session_id,
            "resume_from": self.record.last_applied + 1,
            "durable_through": self._durable_through(self.device_id),
            "activation_shape": list(info.activation_shape),
            "embedding_dim": info.embedding_dim,
            "limits": {"max_message_bytes": info.max_message_bytes, "max_batch": info.max_batch},
        }
        if self.device_id in self.epsilon:
            welcome["spent_epsilon"] = float(self.epsilon[self.device_id])
        return m.encode(welcome)

    def _dispatch(self, message: dict[str, Any]) -> Action:
        mtype = message["type"]
        if self.mode == "federated":
            return Reply(self._federated(message))
        if mtype == m.FORWARD:
            return self._forward(message)
        if mtype == m.EMBEDDING_GRAD:
            return self._embedding_grad(message)
        if mtype == m.CLUSTERS:
            return Reply(self._clusters(message))
        if mtype == m.CLASS_EMBEDDINGS:
            return Reply(self._class_embeddings(message))
        raise ProtocolError(ErrorCode.BAD_STATE, f"a device may not send {mtype} here", message.get("batch_id"))

    def _federated(self, message: dict[str, Any]) -> bytes:
        mtype, board = message["type"], self.board
        if mtype == m.ROUND_REQUEST:
            return board.offer(self.device_id)
        if mtype == m.MODEL_REQUEST:
            return board.model_for(self.device_id, message["round_id"])
        if mtype == m.UPDATE:
            return board.accept(self.device_id, message)
        raise ProtocolError(ErrorCode.BAD_STATE, f"a federated device may not send {mtype}")

    def _forward(self, message: dict[str, Any]) -> Action:
        batch_id = message["batch_id"]
        activations = message["activations"]
        visible = message.get("visible")
        # packed (SPEC.md section 5.12): checked as the dense tensor it stands for, before that is allocated
        shape = tuple(activations.shape) if visible is None else check_packed(activations, visible)
        if len(shape) != 1 + len(self.info.activation_shape) or shape[1:] != tuple(self.info.activation_shape):
            raise ProtocolError(ErrorCode.BAD_TENSOR,
                                f"activations shape {list(shape)} is not [N, {', '.join(map(str, self.info.activation_shape))}]",
                                batch_id)
        if not 1 <= shape[0] <= self.info.max_batch:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"batch of {shape[0]} outside 1..{self.info.max_batch}", batch_id)
        is_eval = message.get("eval", False)
        labels = self._labels(message, shape[0])
        spent = message.get("spent_epsilon")
        last = self.epsilon.get(self.device_id)
        if spent is not None and last is not None and spent < last:
            raise ProtocolError(ErrorCode.EPSILON_REGRESSED, f"spent_epsilon {spent!r} is below this device's last "
                                                             f"report {last!r}; the batch was not applied", batch_id)
        replay = None if is_eval else self._sequence(batch_id)
        if spent is not None:  # the device's claim, recorded once the release is accepted (SPEC.md section 5.11)
            self.epsilon[self.device_id] = float(spent)
        if replay is not None:
            return replay
        mask = None
        if visible is not None:  # the server gets the dense tensor either way, and the patches that travelled
            activations, mask = unpack(activations, visible, shape)
        if self.head == "server":
            return (Evaluate if is_eval else Train)(batch_id, activations, labels, mask)
        if not is_eval:
            self._pending = (batch_id, shape[0])
        return Embed(batch_id, activations, is_eval, mask)

    def _labels(self, message: dict[str, Any], n: int) -> np.ndarray | None:
        labels = message.get("labels")
        batch_id = message["batch_id"]
        if self.head == "device":
            if labels is not None:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "device head: labels must not leave the device", batch_id)
            return None
        if labels is None:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "server head: forward needs labels", batch_id)
        if len(labels) != n:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{len(labels)} labels for a batch of {n}", batch_id)
        if not all(0 <= y < self.info.num_classes for y in labels):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"labels must lie in 0..{self.info.num_classes - 1}", batch_id)
        return np.asarray(labels, dtype=np.int64)

    def _sequence(self, batch_id: int) -> Reply | None:
        """None when batch_id is the next to apply; the cached reply for a retry; else an error.

        The next batch proves that the device got the reply of the last one and will never retry it, so
        that reply (a whole gradient) is forgotten here (SPEC.md section 10)."""
        record = self.record
        if batch_id == record.last_applied + 1:
            record.last_reply = None
            return None
        if batch_id == record.last_applied and record.last_reply is not None:
            return Reply(record.last_reply)
        retry = f" (or a retry of {record.last_applied})" if record.last_reply is not None else ""
        first = "" if record.last_applied else " (training batch ids start at 1: this device has no batch applied yet)"
        raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"expected batch {record.last_applied + 1}{retry}{first}, got {batch_id}",
                            batch_id)

    def _embedding_grad(self, message: dict[str, Any]) -> Action:
        batch_id = message["batch_id"]
        if self.head != "device":
            raise ProtocolError(ErrorCode.BAD_STATE, "embedding_grad is only for the device head", batch_id)
        replay = self._sequence(batch_id)
        if replay is not None:
            return replay
        if self._pending is None or self._pending[0] != batch_id:
            raise ProtocolError(ErrorCode.BAD_STATE, f"no embeddings outstanding for batch {batch_id}; send its forward first",
                                batch_id)
        expected = (self._pending[1], self.info.embedding_dim)
        if tuple(message["grad"].shape) != expected:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"embedding grad shape {list(message['grad'].shape)} is not {list(expected)}",
                                batch_id)
        self._pending = None
        return TrainTail(batch_id, message["grad"])

    def _clusters(self, message: dict[str, Any]) -> bytes:
        """SPEC.md section 8.1: store this device's release, answer with the other devices' latest."""
        if self.head != "device":
            raise ProtocolError(ErrorCode.BAD_STATE, "clusters are only for the device head")
        if self.relay is None:
            raise ProtocolError(ErrorCode.UNSUPPORTED, "this server relays no clusters")
        others = self.relay.exchange(self.device_id, message["clusters"])
        return m.encode({"type": m.CLUSTERS, "clusters": encode_tensor(others, "f32")})

    def _class_embeddings(self, message: dict[str, Any]) -> bytes:
        """SPEC.md section 8.2: FedGC's correction of this device's head together with the others' latest."""
        if self.head != "device":
            raise ProtocolError(ErrorCode.BAD_STATE, "class embeddings are only for the device head")
        if self.heads is None:
            raise ProtocolError(ErrorCode.UNSUPPORTED, "this server does not correct device heads (FedGC is opt-in)")
        corrected = self.heads.upload(self.device_id, message["class_embeddings"])
        return m.encode({"type": m.CLASS_EMBEDDINGS, "class_embeddings": encode_tensor(corrected, "f32")})

    # Replies the shell asks for once it has done the work.
    def applied(self, batch_id: int, grad: np.ndarray, loss: float | None = None, n_correct: int | None = None,
                server_s: float | None = None) -> bytes:
        """BACKWARD for a batch that has just been applied; remembered for retries (as these bytes)."""
        reply = m.encode(self._backward(batch_id, grad, loss, n_correct, server_s))
        self.record.last_reply = reply
        return reply

    def applied_parts(self, batch_id: int, grad: np.ndarray, loss: float | None = None, n_correct: int | None = None,
                      server_s: float | None = None) -> list[m.Part]:
        """`applied`'s bytes as parts (messages.encode_parts), remembered for retries as they are: an f32 gradient
        is sent from its own buffer, not copied into a message (one pass over 100 MB fewer per batch).

        The parts view `grad`: it must not change while the reply may be sent or replayed (until the next batch;
        the edge server's trainer returns a fresh array per step)."""
        reply = m.encode_parts(self._backward(batch_id, grad, loss, n_correct, server_s))
        self.record.last_reply = reply
        return reply

    def _backward(self, batch_id: int, grad: np.ndarray, loss: float | None, n_correct: int | None,
                  server_s: float | None) -> dict[str, Any]:
        """The BACKWARD message for a batch just applied; records it as the device's last applied batch."""
        reply: dict[str, Any] = {"type": m.BACKWARD, "batch_id": batch_id, "grad": self._gradient(grad)}
        if loss is not None:
            reply["loss"] = float(loss)
        if n_correct is not None:
            reply["n_correct"] = int(n_correct)
        if server_s is not None:
            reply["server_s"] = float(server_s)
        self.record.last_applied = batch_id
        reply["durable_through"] = self._durable_through(self.device_id)
        return reply

    def _gradient(self, grad: np.ndarray) -> dict[str, Any]:
        """BACKWARD's tensor: dithered only where it is i8 or i8c (f16 and f32 round to nearest; their error is tiny)."""
        dither = self._dither if self.grad_encoding in ("i8", "i8c") else None
        return encode_tensor(grad, self.grad_encoding, dither=dither)

    def embedded(self, batch_id: int, embeddings: np.ndarray, eval: bool = False, server_s: float | None = None) -> bytes:
        reply = {"type": m.EMBEDDINGS, "batch_id": batch_id, "embeddings": encode_tensor(embeddings, self.grad_encoding),
                 "eval": eval}
        if server_s is not None:
            reply["server_s"] = float(server_s)
        return m.encode(reply)

    def eval_result(self, batch_id: int, loss: float, n_correct: int, n: int) -> bytes:
        return m.encode({"type": m.EVAL_RESULT, "batch_id": batch_id, "loss": float(loss), "n_correct": int(n_correct), "n": n})

    def failed(self, batch_id: int, reason: str) -> bytes:
        """ERROR for a batch the server could not apply; nothing changed, the device may retry."""
        self._pending = None
        return m.encode(m.error(ErrorCode.SERVER_ERROR, reason, batch_id))

    def close(self) -> None:
        """Connection gone: outstanding embeddings are forgotten (the device re-sends the forward)."""
        self.closed = True
        self._pending = None
