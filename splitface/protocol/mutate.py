"""Hostile variants of valid wire messages, for fuzzing a receiver.

One home for the damage that tests/test_fuzz_protocol.py (driven by hypothesis through
`st.randoms()`) and bench/fuzz_server.py (driven by a seeded `random.Random`) inflict: on the
bytes (bit flips, truncation, splices, trailing bytes), on the decoded map (wrong types, missing
and extra keys, other message types, odd batch ids) and on tensors (huge, negative or non-int
shapes, too many dimensions, unknown dtypes, dtype/length mismatch, bad scales, NaN/Inf, huge
finite values). Nothing here validates: a receiver must refuse whatever is not valid.
"""
from __future__ import annotations

import math
import random
import struct
from typing import Any, Callable

import msgpack

INT_MIN, UINT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry
HUGE_DIMS = (2**31, 2**32, 2**62, 2**63, UINT_MAX)
BAD_SCALES = (0.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 3.4e38, True, "1", None, UINT_MAX, [1.0])
BAD_DTYPES = ("f64", "F32", "", "int8", "bf16", 1, None, True, ["f32"], b"f32", {"f32": 1})
MESSAGE_TYPES = ("hello", "welcome", "error", "forward", "backward", "embeddings", "embedding_grad", "eval_result")
Path = tuple[Any, ...]


def _random_bytes(rng: random.Random, n: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(n))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def random_value(rng: random.Random, depth: int = 2) -> Any:
    """Any msgpack value: the wrong type for almost every field."""
    kind = rng.randrange(11 if depth > 0 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-40, 300)
    if kind == 3:
        return rng.choice((INT_MIN, -1, 2**31, 2**32, 2**63, UINT_MAX))
    if kind == 4:
        return rng.choice((0.0, -0.0, 1.5, 1e308, math.nan, math.inf, -math.inf))
    if kind == 5:
        return rng.choice(("", "f32", "forward", "x" * rng.randrange(300), "\u00e9\u4e2d"))
    if kind == 6:
        return _random_bytes(rng, rng.randrange(40))
    if kind == 7:
        return rng.choice(MESSAGE_TYPES)
    if kind == 8:
        return rng.uniform(-1e6, 1e6)
    if kind == 9:
        return [random_value(rng, depth - 1) for _ in range(rng.randrange(5))]
    return {rng.choice(("dtype", "shape", "data", "type", "batch_id", "k")): random_value(rng, depth - 1)
            for _ in range(rng.randrange(4))}


# ---- bytes ------------------------------------------------------------------------------------
def flip_bits(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[:rng.randrange(len(data))] if data else data


def splice(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(data) + 1)
    return data[:at] + _random_bytes(rng, rng.randrange(1, 16)) + data[at + rng.randrange(16):]


def trailing(data: bytes, rng: random.Random) -> bytes:
    return data + rng.choice((b"\x00", b"\xc0", pack({"type": "forward"}), _random_bytes(rng, 8)))


# ---- structure --------------------------------------------------------------------------------
def paths(obj: Any, prefix: Path = ()) -> list[Path]:
    """Every key/index path inside a decoded message (not descending into bin data)."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(paths(value, prefix + (key,)))
    return out


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _parent(obj: Any, path: Path) -> Any:
    return _get(obj, path[:-1])


def tensor_paths(obj: Any) -> list[Path]:
    """Paths of the maps that look like tensors (have dtype, shape and data)."""
    return [p for p in paths(obj) if isinstance(_get(obj, p), dict) and {"dtype", "shape", "data"} <= set(_get(obj, p))]


def set_random(msg: dict, rng: random.Random) -> None:
    path = rng.choice(paths(msg))
    _parent(msg, path)[path[-1]] = random_value(rng)


def drop_key(msg: dict, rng: random.Random) -> None:
    keyed = [p for p in paths(msg) if isinstance(_parent(msg, p), dict)]
    path = rng.choice(keyed)
    del _parent(msg, path)[path[-1]]


def extra_key(msg: dict, rng: random.Random) -> None:
    target = rng.choice([msg] + [_get(msg, p) for p in tensor_paths(msg)])
    target[rng.choice(("extra", "scale", "eval", "labels", "model", "batch_id"))] = random_value(rng)


def other_type(msg: dict, rng: random.Random) -> None:
    msg["type"] = rng.choice(MESSAGE_TYPES + ("ping", "", "FORWARD"))


def odd_batch_id(msg: dict, rng: random.Random) -> None:
    msg["batch_id"] = rng.choice((INT_MIN, -1, 0, 1, 2, 3, 2**31, 2**63 - 1, UINT_MAX, 1.0, True, "1", None))


# ---- tensors ----------------------------------------------------------------------------------
def _itemsize(t: dict) -> int:
    return {"f32": 4, "f16": 2, "i8": 1, "i8c": 1}.get(t.get("dtype"), 4)


def _scales(t: dict) -> bytes:
    """An i8c tensor's scales as bytes (b"" where there are none, or where a mutation already made them something else)."""
    return bytes(t["scales"]) if isinstance(t.get("scales"), (bytes, bytearray, memoryview)) else b""


def _nonfinite(t: dict, rng: random.Random) -> None:
    data = bytearray(t["data"])
    if len(_scales(t)) >= 4:   # i8c: a scale that is not finite
        scales = bytearray(_scales(t))
        i = rng.randrange(len(scales) // 4) * 4
        scales[i:i + 4] = rng.choice((struct.pack("<f", math.nan), struct.pack("<f", math.inf), struct.pack("<f", 3e38)))
        t["scales"] = bytes(scales)
        return
    if t.get("dtype") not in ("f32", "f16") or len(data) < _itemsize(t):
        t["scale"] = rng.choice((math.inf, math.nan, 1e300))   # i8 * 1e300 overflows float32
        return
    i = rng.randrange(len(data) // _itemsize(t)) * _itemsize(t)
    special = {"f32": (struct.pack("<f", math.nan), struct.pack("<f", math.inf), struct.pack("<f", -math.inf)),
               "f16": (b"\x00\x7e", b"\x00\x7c", b"\x00\xfc")}[t["dtype"]]
    data[i:i + _itemsize(t)] = rng.choice(special)
    t["data"] = bytes(data)


def _huge_finite(t: dict, rng: random.Random) -> None:
    """Values near float32's maximum: valid on the wire, poison for a model (the server must cope)."""
    n = len(t["data"]) // _itemsize(t)
    t.update(dtype="f32", data=struct.pack(f"<{n}f", *([rng.choice((3e38, -3e38))] * n)))
    t.pop("scale", None)
    t.pop("scales", None)


TENSOR_ATTACKS: dict[str, Callable[[dict, random.Random], None]] = {
    "huge_dim": lambda t, r: t["shape"].__setitem__(r.randrange(len(t["shape"])), r.choice(HUGE_DIMS))
    if t["shape"] else t.update(shape=[r.choice(HUGE_DIMS)]),
    "zero_size_huge_shape": lambda t, r: t.update(
        shape=[0] + [r.choice(HUGE_DIMS[:2] + (2**31 - 1,))] * r.randint(1, 7), data=b""),
    "negative_dim": lambda t, r: t.update(shape=[r.choice((-1, -(2**31), INT_MIN))] + list(t["shape"])[1:]),
    "non_int_dim": lambda t, r: t.update(shape=[r.choice((1.0, True, "2", None, [2], b"\x02"))] + list(t["shape"])[1:]),
    "too_many_dims": lambda t, r: t.update(shape=[1] * r.randint(9, 40), data=bytes(_itemsize(t))),
    "shape_not_list": lambda t, r: t.update(shape=random_value(r, 0)),
    "bad_dtype": lambda t, r: t.update(dtype=r.choice(BAD_DTYPES)),
    "other_dtype": lambda t, r: t.update(dtype=r.choice([d for d in ("f32", "f16", "i8", "i8c") if d != t["dtype"]])),
    "length_mismatch": lambda t, r: t.update(data=bytes(t["data"])[:-r.randint(1, 5)] if r.random() < 0.5 and t["data"]
                                             else bytes(t["data"]) + bytes(r.randint(1, 5))),
    "data_not_bin": lambda t, r: t.update(data=r.choice((bytes(t["data"]).hex(), list(bytes(t["data"])[:8]), None))),
    "bad_scale": lambda t, r: t.update(scale=r.choice(BAD_SCALES)),
    "drop_scale": lambda t, r: (t.pop("scale", None) if "scale" in t else t.pop("scales", None) if "scales" in t
                                else t.update(scale=1.0)),
    "bad_scales": lambda t, r: t.update(scales=r.choice((b"", bytes(3), struct.pack("<2f", 0.0, -1.0), [1.0], None,
                                                         _scales(t)[:-4], _scales(t) * 2))),
    "nonfinite": _nonfinite,
    "huge_finite": _huge_finite,
    "tensor_not_a_map": lambda t, r: t.clear(),
}

STRUCTURE_ATTACKS: dict[str, Callable[[dict, random.Random], None]] = {
    "wrong_type_value": set_random, "drop_key": drop_key, "extra_key": extra_key, "other_type": other_type,
    "odd_batch_id": odd_batch_id,
}
BYTE_ATTACKS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "flip_bits": flip_bits, "truncate": truncate, "splice": splice, "trailing": trailing,
}


def attack_tensor(msg: dict, rng: random.Random, kind: str | None = None) -> str:
    """Damage one tensor field of `msg` in place; returns the attack's name ("" if it has no tensor)."""
    found = tensor_paths(msg)
    if not found:
        return ""
    path = rng.choice(found)
    tensor = _get(msg, path)
    tensor["shape"] = list(tensor["shape"]) if isinstance(tensor.get("shape"), list) else [1]
    tensor["data"] = bytes(tensor["data"]) if isinstance(tensor.get("data"), (bytes, bytearray)) else b""
    kind = kind or rng.choice(sorted(TENSOR_ATTACKS))
    TENSOR_ATTACKS[kind](tensor, rng)
    if kind == "tensor_not_a_map":
        _parent(msg, path)[path[-1]] = random_value(rng, 1)
    return kind


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """(attack name, damaged bytes) for a message `data`: bytes, structure or a tensor, at random."""
    family = rng.random()
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception:  # noqa: BLE001 - already broken bytes (an invalid vector): damage them further
        msg = None
    if family < 0.3 or not isinstance(msg, dict) or not msg:
        kind = rng.choice(sorted(BYTE_ATTACKS))
        return kind, BYTE_ATTACKS[kind](data, rng)
    if family < 0.6 or not tensor_paths(msg):
        kind = rng.choice(sorted(STRUCTURE_ATTACKS))
        STRUCTURE_ATTACKS[kind](msg, rng)
    else:
        kind = attack_tensor(msg, rng)
    return kind, pack(msg)
