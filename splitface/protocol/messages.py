"""Message types, their fields, and (de)serialisation with validation.

One websocket binary message is one msgpack map with a `type`. A decoded message is a
plain dict whose tensor fields are float32 numpy arrays; to encode, tensor fields may be
numpy arrays (sent as f32) or maps from `encode_tensor` (any encoding). Named-tensor fields
(federated weights and updates) are maps from a name to a tensor, decoded the same way. A packed FORWARD
(SPEC.md section 5.12) decodes to its patches and its checked `visible` map; the server's session unpacks it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from splitface.protocol.errors import ErrorCode, ProtocolError, brief
from splitface.protocol.patches import check_packed, is_visible_field
from splitface.protocol.tensor import decode_tensor, encode_tensor

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
# Model-map keys added after protocol 1 was first published, with their defaults (SPEC.md section 6): a client
# written before one may leave it out, and the server compares maps without these keys at their defaults
LATER_MODEL_KEYS: dict[str, Any] = {"dct_stem_blocks": 0}


def model_identity(model: dict[str, Any]) -> dict[str, Any]:
    """A model map as the handshake compares it: without the later keys that are at their defaults."""
    return {k: v for k, v in model.items() if k not in LATER_MODEL_KEYS or v != LATER_MODEL_KEYS[k]}

HELLO = "hello"
WELCOME = "welcome"
ERROR = "error"
FORWARD = "forward"
BACKWARD = "backward"
EMBEDDINGS = "embeddings"
EMBEDDING_GRAD = "embedding_grad"
EVAL_RESULT = "eval_result"
# federated rounds (SPEC.md section 15)
ROUND_REQUEST = "round_request"
ROUND_START = "round_start"
ROUND_WAIT = "round_wait"
MODEL_REQUEST = "model_request"
MODEL = "model"
UPDATE = "update"
UPDATE_ACK = "update_ack"
# U-shaped split: PrivacyFace's sanitised clusters, relayed between device-head devices (SPEC.md section 8.1)
CLUSTERS = "clusters"
# U-shaped split, opt-in: FedGC's correction of the device heads' class embeddings (SPEC.md section 8.2)
CLASS_EMBEDDINGS = "class_embeddings"

HEADS = ("server", "device")
MODES = ("split", "federated")
# HELLO fields that only a split session has: required there, refused in a federated HELLO
SPLIT_HELLO_FIELDS = ("split", "head", "encodings", "batch_size")
MAX_NAMED_TENSORS = 4096
MAX_TENSOR_NAME = 256

# A message given whole or as parts (a sender may write a tensor's bytes without joining them first).
Message = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


def message_size(data: Message) -> int:
    """Bytes of a message given whole or as parts."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    return sum(memoryview(p).nbytes for p in data)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_label_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def _is_finite_number(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


# ROUND_START's `config`: how the device trains this round (splitface.device.federated.LocalConfig without its clip
# norm, which travels as its own field), keys in this order.
LOCAL_CONFIG: dict[str, Callable[[Any], bool]] = {
    "epochs": lambda v: is_int(v) and v >= 1,
    "batch_size": lambda v: is_int(v) and v >= 2,
    "lr": lambda v: _is_finite_number(v) and v > 0,
    "head_lr_scale": lambda v: _is_finite_number(v) and v > 0,
    "momentum": lambda v: _is_finite_number(v) and 0 <= v < 1,
    "weight_decay": lambda v: _is_finite_number(v) and v >= 0,
    "flip": lambda v: isinstance(v, bool),
}


def _is_local_config(v: Any) -> bool:
    return isinstance(v, dict) and list(v) == list(LOCAL_CONFIG) and all(LOCAL_CONFIG[k](x) for k, x in v.items())


TENSOR = "tensor"
TENSORS = "tensors"
# field -> (check, required); TENSOR marks a tensor field, TENSORS a map from names to tensors.
Check = Callable[[Any], bool] | str
SCHEMA: dict[str, dict[str, tuple[Check, bool]]] = {
    HELLO: {
        "protocol_version": (is_int, True),
        "device_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 128, True),
        "token": (lambda v: isinstance(v, str) and len(v) <= 256, True),
        "model": (lambda v: isinstance(v, dict), True),
        # split, head, encodings, batch_size: required in split mode, absent in federated mode (`_check_mode`)
        "split": (lambda v: isinstance(v, str), False),
        "head": (lambda v: isinstance(v, str), False),
        "encodings": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()), False),
        "batch_size": (lambda v: is_int(v) and v > 0, False),
        "num_classes": (lambda v: is_int(v) and v > 0, False),
        "mode": (lambda v: v in MODES, False),
    },
    WELCOME: {
        "session_id": (lambda v: isinstance(v, str), True),
        "resume_from": (lambda v: is_int(v) and v >= 1, True),
        "durable_through": (lambda v: is_int(v) and v >= 0, True),
        "activation_shape": (lambda v: isinstance(v, list) and all(is_int(x) for x in v), True),
        "embedding_dim": (is_int, True),
        "limits": (lambda v: isinstance(v, dict), True),
        "spent_epsilon": (lambda v: _is_finite_number(v) and v >= 0, False),
    },
    ERROR: {
        "code": (lambda v: isinstance(v, str), True),
        "message": (lambda v: isinstance(v, str), True),
        "batch_id": (is_int, False),
    },
    FORWARD: {
        "batch_id": (lambda v: is_int(v) and v >= 0, True),
        "activations": (TENSOR, True),
        # the packed form of a patch-masked release (SPEC.md section 5.12): activations are then its patches
        "visible": (is_visible_field, False),
        "labels": (_is_label_list, False),
        "eval": (lambda v: isinstance(v, bool), False),
        "spent_epsilon": (lambda v: _is_finite_number(v) and v >= 0, False),
    },
    BACKWARD: {
        "batch_id": (is_int, True),
        "grad": (TENSOR, True),
        "loss": (_is_number, False),
        "n_correct": (is_int, False),
        "server_s": (lambda v: _is_number(v) and v >= 0, False),
        "durable_through": (lambda v: is_int(v) and v >= 0, True),
    },
    EMBEDDINGS: {
        "batch_id": (is_int, True),
        "embeddings": (TENSOR, True),
        "eval": (lambda v: isinstance(v, bool), False),
        "server_s": (lambda v: _is_number(v) and v >= 0, False),
    },
    EMBEDDING_GRAD: {
        "batch_id": (lambda v: is_int(v) and v >= 1, True),
        "grad": (TENSOR, True),
    },
    EVAL_RESULT: {
        "batch_id": (is_int, True),
        "loss": (_is_number, True),
        "n_correct": (is_int, True),
        "n": (is_int, True),
    },
    ROUND_REQUEST: {},
    ROUND_START: {
        "round_id": (lambda v: is_int(v) and v >= 1, True),
        "seed": (lambda v: is_int(v) and 0 <= v < 2**64, True),
        "config": (_is_local_config, True),
        "clip_norm": (lambda v: _is_finite_number(v) and v > 0, False),
        "deadline_s": (lambda v: _is_finite_number(v) and v >= 0, True),
        "max_message_bytes": (lambda v: is_int(v) and v > 0, True),
    },
    ROUND_WAIT: {
        "closed_round": (lambda v: is_int(v) and v >= 0, True),
        "retry_after_s": (lambda v: _is_finite_number(v) and v >= 0, True),
        "finished": (lambda v: isinstance(v, bool), True),
    },
    MODEL_REQUEST: {
        "round_id": (lambda v: is_int(v) and v >= 1, True),
    },
    MODEL: {
        "round_id": (lambda v: is_int(v) and v >= 1, True),
        "weights": (TENSORS, True),
        "head": (TENSORS, False),
    },
    UPDATE: {
        "round_id": (lambda v: is_int(v) and v >= 1, True),
        "delta": (TENSORS, True),
        "norm": (lambda v: _is_finite_number(v) and v >= 0, True),
        "examples": (lambda v: is_int(v) and v >= 1, True),
        "loss": (_is_finite_number, True),
    },
    UPDATE_ACK: {
        "round_id": (lambda v: is_int(v) and v >= 1, True),
    },
    CLUSTERS: {
        "clusters": (TENSOR, True),
    },
    CLASS_EMBEDDINGS: {
        "class_embeddings": (TENSOR, True),
    },
}


def wire_form(message: dict[str, Any]) -> dict[str, Any]:
    """The map that goes on the wire: numpy tensor fields as f32 wire tensors, numpy scalars as plain numbers."""
    mtype = message.get("type")
    if mtype not in SCHEMA:
        raise ValueError(f"cannot encode unknown message type {mtype!r}")
    wire = {}
    for key, value in message.items():
        if isinstance(value, np.ndarray):
            value = encode_tensor(value, "f32")
        elif isinstance(value, (np.integer, np.floating)):
            value = value.item()
        elif SCHEMA[mtype].get(key, (None,))[0] == TENSORS:
            value = {name: encode_tensor(t, "f32") if isinstance(t, np.ndarray) else t for name, t in value.items()}
        wire[key] = value
    return wire


# Zero-copy codec (docs/transport.md). Encoding: a bin of at least VIEW_BIN_MIN bytes inside the message's maps
# is not copied into the packed bytes but handed out as its own part (a view of the tensor). Decoding: in a
# `bytes` message of at least VIEW_MESSAGE_MIN bytes, every bin of at least VIEW_BIN_MIN bytes under a "data"
# key becomes a read-only memoryview of the message instead of a copy. ZERO_COPY = False restores plain
# msgpack.packb / unpackb (the benchmark's baseline); the bytes on the wire are the same either way.
ZERO_COPY = True
VIEW_BIN_MIN = 1 << 16
VIEW_MESSAGE_MIN = 1 << 20
# Map nesting that encode_parts walks (message -> field -> named tensors -> tensor); deeper maps are packed whole.
_PARTS_DEPTH = 3
# Most msgpack objects _tensor_bins walks before it leaves a message to plain unpackb (bounds its Python loop).
_MAX_WALK = 1 << 17
_PLACEHOLDER_EXT = 0x5F  # ext type standing for a tensor's bin in the short copy that unpackb parses
Part = bytes | memoryview


def encode_parts(message: dict[str, Any]) -> list[Part]:
    """The msgpack bytes of `message` as consecutive parts (joined, exactly `msgpack.packb`'s bytes).

    Large bins are views of the caller's buffers, not copies: the tensors must not change until the parts
    are sent. A message without large bins is one `bytes` part."""
    wire = wire_form(message)
    packer = msgpack.Packer(use_bin_type=True)
    if not ZERO_COPY:
        return [packer.pack(wire)]
    parts: list[Part] = []
    head = bytearray()
    _pack_parts(wire, packer, head, parts, 0)
    if head:
        parts.append(bytes(head))
    return parts


def _has_large_bin(value: Any, depth: int) -> bool:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return memoryview(value).nbytes >= VIEW_BIN_MIN
    return type(value) is dict and depth <= _PARTS_DEPTH and any(_has_large_bin(v, depth + 1) for v in value.values())


def _pack_parts(value: Any, packer: msgpack.Packer, head: bytearray, parts: list[Part], depth: int) -> None:
    """Append `value` to head/parts as msgpack.packb would write it, large bins as views of their buffers."""
    if type(value) is dict and depth <= _PARTS_DEPTH and _has_large_bin(value, depth):
        head += packer.pack_map_header(len(value))
        for k, v in value.items():
            head += packer.pack(k)
            _pack_parts(v, packer, head, parts, depth + 1)
        return
    if isinstance(value, (bytes, bytearray, memoryview)):
        view = memoryview(value)
        if view.c_contiguous and VIEW_BIN_MIN <= view.nbytes < 2**32:
            view = view.cast("B")
            head += _bin_header(len(view))
            parts.append(bytes(head))
            head.clear()
            parts.append(view)
            return
    head += packer.pack(value)


def _bin_header(n: int) -> bytes:
    """msgpack's header of a bin of n < 2**32 bytes: bin 8, bin 16 or bin 32, the shortest that fits (as packb)."""
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    return b"\xc5" + n.to_bytes(2, "big") if n < 2**16 else b"\xc6" + n.to_bytes(4, "big")


def encode(message: dict[str, Any]) -> bytes:
    """msgpack bytes of a message; numpy tensor fields go out as f32."""
    parts = encode_parts(message)
    return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)


def decode(data: bytes, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Validated message from bytes, tensors as float32 arrays; raises ProtocolError.

    The f32 tensors of a large `bytes` message are read-only views of `data` (see `_unpack`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "expected a binary websocket message, got text")
    if len(data) > max_size:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds the limit of {max_size}")
    try:
        message = _unpack(data)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a map with a string `type`")
    mtype = message["type"]
    schema = SCHEMA.get(mtype)
    if schema is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {brief(mtype)}")
    batch_id = message.get("batch_id") if is_int(message.get("batch_id")) else None
    unexpected = set(message) - set(schema) - {"type"}
    if unexpected:
        # str() first: msgpack also allows bin keys, and str and bytes do not sort together.
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{mtype}: unexpected fields {brief(sorted(map(str, unexpected)))}",
                            batch_id)
    for field, (check, required) in schema.items():
        if field not in message:
            if required:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{mtype}: missing field {field!r}", batch_id)
            continue
        if check == TENSOR:
            try:
                message[field] = decode_tensor(message[field], field=field)
            except ProtocolError as exc:
                raise ProtocolError(exc.code, f"{mtype}: {exc.message}", batch_id) from None
        elif check == TENSORS:
            message[field] = _decode_named_tensors(mtype, field, message[field])
        elif not check(message[field]):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{mtype}: field {field!r} has a wrong type or value", batch_id)
    if mtype == HELLO:
        _check_mode(message)
    if mtype == FORWARD and "visible" in message:
        try:
            check_packed(message["activations"], message["visible"])
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{mtype}: {exc.message}", batch_id) from None
    return message


def _unpack(data: bytes | bytearray | memoryview) -> Any:
    """msgpack.unpackb(data, raw=False, strict_map_key=True), with the tensors' bins of a large `bytes` message as
    memoryviews of `data` instead of copies.

    `_tensor_bins` finds those bins; unpackb then parses a short copy of the message in which each of them is a
    placeholder ext, which `ext_hook` turns into the view, with unpackb's own limits for the whole message. Any
    message the walk does not fully understand (malformed, truncated, trailing bytes, too many objects, an ext
    of the placeholder's type) goes to plain unpackb, which accepts or refuses it as it always did. Only
    immutable `bytes` (or a memoryview of a slice of them) are viewed, so nothing can change a decoded tensor
    behind its back."""
    bins = _tensor_bins(data) if ZERO_COPY and _immutable(data) and len(data) >= VIEW_MESSAGE_MIN else None
    if not bins:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    view = memoryview(data)
    short, views, at = [], [], 0
    for i, (start, payload, end) in enumerate(bins):
        short += (data[at:start], b"\xd6" + _PLACEHOLDER_EXT.to_bytes(1, "big") + i.to_bytes(4, "big"))  # fixext 4
        views.append(view[payload:end])
        at = end
    short.append(data[at:])

    def ext_hook(code: int, payload: bytes) -> Any:
        return views[int.from_bytes(payload, "big")] if code == _PLACEHOLDER_EXT else msgpack.ExtType(code, payload)

    n = len(data)   # unpackb's limits for `data` itself (msgpack derives them from the buffer's size)
    return msgpack.unpackb(b"".join(short), raw=False, strict_map_key=True, ext_hook=ext_hook, max_str_len=n,
                           max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=n)


def _immutable(data: bytes | bytearray | memoryview) -> bool:
    """Whether `data` is `bytes`, or a flat byte view of `bytes` (transport.receive hands a message at an offset
    inside the bytes it assembled): memory that nothing can write to."""
    if type(data) is bytes:
        return True
    return isinstance(data, memoryview) and type(data.obj) is bytes and data.format == "B" and data.ndim == 1 \
        and data.c_contiguous


def tensor_offset(head: bytes | bytearray | memoryview) -> int | None:
    """Where the bytes of the first tensor that decode would view start, in a message that begins with `head`
    (any prefix of it); None where `head` ends before that tensor's header, or the message has no such tensor.

    transport.receive places a message so that this offset falls on an aligned address: decode then views the
    tensor instead of copying it to align it."""
    bins = _tensor_bins(head, first=True)
    return bins[0][1] if bins else None


# msgpack's head byte -> (bytes of the header after it holding a length, fixed bytes after that); see _tensor_bins
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0),     # bin 8/16/32
          0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1),     # ext 8/16/32 (length, then the type byte)
          0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0)}     # str 8/16/32
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2,
          0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}   # nil, bools, numbers, fixext 1..16
_DATA_KEY = b"\xa4data"


def _tensor_bins(data: bytes | memoryview, first: bool = False) -> list[tuple[int, int, int]] | None:
    """(start, payload start, end) of each bin of at least VIEW_BIN_MIN bytes that is the value of a "data" key,
    from a walk over the message's msgpack objects; None where the walk stops short of a plain, whole message.

    `first`: only the first such bin, as soon as its header is read (`data` may be the message's beginning)."""
    n, pos, steps, found = len(data), 0, 0, []
    stack = [[1, False, False]]   # per open container: items left, is a map, the last key was "data"
    while stack:
        frame = stack[-1]
        if frame[0] == 0:
            stack.pop()
            continue
        is_key = frame[1] and frame[0] % 2 == 0
        data_value = frame[1] and not is_key and frame[2]
        frame[0] -= 1
        steps += 1
        if steps > _MAX_WALK or pos >= n:
            return None
        b = data[pos]
        if is_key:
            frame[2] = data[pos:pos + 5] == _DATA_KEY
        if b <= 0x7f or b >= 0xe0:                         # fixint
            pos += 1
        elif b <= 0x8f:                                    # fixmap
            pos += 1
            stack.append([2 * (b & 0x0f), True, False])
        elif b <= 0x9f:                                    # fixarray
            pos += 1
            stack.append([b & 0x0f, False, False])
        elif b <= 0xbf:                                    # fixstr
            pos += 1 + (b & 0x1f)
        elif b in _FIXED:
            if 0xd4 <= b <= 0xd8 and pos + 1 < n and data[pos + 1] == _PLACEHOLDER_EXT:   # fixext of that type
                return None
            pos += 1 + _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            length = int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            start, pos = pos, pos + 1 + width + extra
            if extra and (pos > n or data[pos - 1] == _PLACEHOLDER_EXT):
                return None
            if data_value and b <= 0xc6 and length >= VIEW_BIN_MIN:
                if first:   # its whole header must be in `data`, or the length was read short
                    return [(start, pos, pos + length)] if pos <= n else None
                if pos + length <= n:
                    found.append((start, pos, pos + length))
            pos += length
        elif b in (0xdc, 0xdd, 0xde, 0xdf):                # array 16/32, map 16/32
            width = 2 if b in (0xdc, 0xde) else 4
            count = int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            pos += 1 + width
            stack.append([2 * count if b >= 0xde else count, b >= 0xde, False])
        else:                                              # 0xc1: never used
            return None
    return found if pos == n else None


def _decode_named_tensors(mtype: str, field: str, value: Any) -> dict[str, np.ndarray]:
    """A map from tensor names to tensors (federated weights and updates): 1..MAX_NAMED_TENSORS entries,
    names of 1..MAX_TENSOR_NAME code points, each tensor checked as any other (bad_tensor)."""
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_NAMED_TENSORS or not all(
            isinstance(k, str) and 0 < len(k) <= MAX_TENSOR_NAME for k in value):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{mtype}: field {field!r} must map 1..{MAX_NAMED_TENSORS} names "
                                                   f"to tensors")
    out = {}
    for name, tensor in value.items():
        try:
            out[name] = decode_tensor(tensor, field=f"{field}[{name!r}]")
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{mtype}: {exc.message}") from None
    return out


def _check_mode(hello: dict[str, Any]) -> None:
    """A split HELLO needs split, head, encodings and batch_size; a federated one must not carry them (nor
    num_classes): its model is the whole backbone, trained on the device."""
    if hello.get("mode", "split") == "split":
        for field in SPLIT_HELLO_FIELDS:
            if field not in hello:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"hello: missing field {field!r}")
        return
    extra = [f for f in (*SPLIT_HELLO_FIELDS, "num_classes") if f in hello]
    if extra:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"hello: a federated session has no {extra}")


def error(code: ErrorCode, message: str, batch_id: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": ERROR, "code": code.value, "message": message}
    if batch_id is not None:
        out["batch_id"] = batch_id
    return out
