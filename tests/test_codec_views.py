"""The zero-copy codec (messages.encode_parts, messages.decode's views, tensor.all_finite) against msgpack's.

encode_parts must give exactly msgpack.packb's bytes (the vectors and the JVM client depend on them), and
decode with views must accept and refuse exactly what plain msgpack.unpackb did, with the same codes and
messages. The thresholds are lowered here so that small messages take the view paths too.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitface.protocol import messages as m
from splitface.protocol import mutate
from splitface.protocol.errors import ProtocolError
from splitface.protocol.tensor import WIRE_DTYPES, all_finite, encode_tensor
from splitface.protocol.vectors import generate as gen

VECTORS = Path(gen.__file__).resolve().parent
STEMS = sorted(str(p.relative_to(VECTORS).with_suffix("")) for p in VECTORS.rglob("*.msgpack"))
VALID = [s for s in STEMS if "_invalid_" not in s]
ALL_DATA = {s: (VECTORS / f"{s}.msgpack").read_bytes() for s in STEMS}
FUZZ = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _thresholds(bin_min: int, message_min: int):
    """Context: the view paths' thresholds set for one block (hypothesis runs many examples per test call)."""
    class Ctx:
        def __enter__(self):
            self.old = m.VIEW_BIN_MIN, m.VIEW_MESSAGE_MIN, m.ZERO_COPY
            m.VIEW_BIN_MIN, m.VIEW_MESSAGE_MIN, m.ZERO_COPY = bin_min, message_min, True

        def __exit__(self, *exc):
            m.VIEW_BIN_MIN, m.VIEW_MESSAGE_MIN, m.ZERO_COPY = self.old
    return Ctx()


def _plain(fn):
    class Ctx:
        def __enter__(self):
            self.old = m.ZERO_COPY
            m.ZERO_COPY = False

        def __exit__(self, *exc):
            m.ZERO_COPY = self.old
    with Ctx():
        return fn()


# ---- encoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bin_min", [0, 1, 16, 256, 1 << 16])
@pytest.mark.parametrize("stem", VALID)
def test_encode_parts_gives_packb_bytes_for_every_vector(stem, bin_min):
    data = ALL_DATA[stem]
    wire = msgpack.unpackb(data, raw=False)
    with _thresholds(bin_min, 0):
        parts = m.encode_parts(wire)
        assert b"".join(parts) == data and m.encode(wire) == data
    if bin_min <= 16 and any(isinstance(p, memoryview) for p in parts):
        assert len(parts) > 1   # the tensors' bins really went out as views


@settings(max_examples=200, derandomize=True, deadline=None)
@given(encoding=st.sampled_from(list(WIRE_DTYPES)), shape=st.lists(st.integers(0, 70), max_size=4),
       bin_min=st.sampled_from([0, 1, 255, 256, 257, 65535, 65536]), labels=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_encode_parts_gives_packb_bytes_for_random_tensors(encoding, shape, bin_min, labels, seed):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    message: dict[str, Any] = {"type": m.FORWARD, "batch_id": seed, "activations": encode_tensor(a, encoding)}
    if labels:
        message["labels"] = list(range(3))
    with _thresholds(bin_min, 0):
        parts = m.encode_parts(message)
    assert b"".join(parts) == _packb(m.wire_form(message))
    for p in parts:
        if isinstance(p, memoryview):
            assert p.nbytes >= bin_min


def test_encode_parts_gives_packb_bytes_for_named_tensors_and_array_fields():
    rng = np.random.default_rng(3)
    delta = {f"layer{i}.weight": rng.standard_normal((i + 1, 300)).astype(np.float32) for i in range(5)}
    message = {"type": m.UPDATE, "round_id": 2, "delta": delta, "norm": 1.5, "examples": 10, "loss": np.float32(0.25)}
    with _thresholds(64, 0):
        parts = m.encode_parts(message)
    assert b"".join(parts) == _packb(m.wire_form(message))
    assert sum(isinstance(p, memoryview) for p in parts) == 5


def test_large_tensor_is_sent_from_its_own_buffer():
    a = np.random.default_rng(0).random((4, 16, 64, 64), dtype=np.float32)   # 1 MiB
    parts = m.encode_parts({"type": m.FORWARD, "batch_id": 1, "activations": a, "labels": [1, 2, 3, 4]})
    assert [type(p) for p in parts] == [bytes, memoryview, bytes]
    assert np.shares_memory(np.frombuffer(parts[1], np.uint8), a)   # a view, not a copy
    assert b"".join(parts) == _packb(m.wire_form({"type": m.FORWARD, "batch_id": 1, "activations": a,
                                                  "labels": [1, 2, 3, 4]}))


def test_encode_refuses_what_packb_refuses():
    strided = np.zeros((300, 300), np.float32)[:, ::2]
    bad = {"type": m.FORWARD, "batch_id": 1, "activations": {"dtype": "f32", "shape": [1], "data": memoryview(strided)}}
    with _thresholds(0, 0), pytest.raises(BufferError):
        m.encode_parts(bad)
    with pytest.raises(BufferError):
        _packb(m.wire_form(bad))


# ---- decoding ---------------------------------------------------------------------------------
def _normal(value: Any) -> Any:
    """A decoded value with views and bytes alike, arrays as (dtype, shape, bytes): for comparing outcomes."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (bytes, memoryview)):
        return ("bin", bytes(value))
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _outcome(data: bytes) -> Any:
    try:
        return ("ok", _normal(m.decode(data)))
    except ProtocolError as exc:
        return ("refused", exc.code, exc.message, exc.batch_id)


def _same_outcome(data: bytes) -> Any:
    before = _plain(lambda: _outcome(data))
    with _thresholds(1, 0):
        now = _outcome(data)
    assert now == before, data[:80]
    return now


@pytest.mark.parametrize("stem", STEMS)
def test_views_decode_every_vector_as_before(stem):
    outcome = _same_outcome(ALL_DATA[stem])
    assert (outcome[0] == "refused") == ("_invalid_" in stem)


@FUZZ
@given(stem=st.sampled_from(STEMS), rng=st.randoms(use_true_random=False))
def test_views_decode_mutated_vectors_as_before(stem, rng):
    _, data = mutate.mutate(ALL_DATA[stem], rng)
    _same_outcome(data)


@FUZZ
@given(stem=st.sampled_from(VALID), rng=st.randoms(use_true_random=False))
def test_views_decode_tensor_attacks_as_before(stem, rng):
    msg = msgpack.unpackb(ALL_DATA[stem], raw=False)
    if mutate.tensor_paths(msg):
        mutate.attack_tensor(msg, rng)
    _same_outcome(mutate.pack(msg))


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=20) | st.builds(msgpack.ExtType, st.sampled_from([0, 1, 0x5F, 127]), st.binary(max_size=9)),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(["data", "type", "x", "dtype", "shape"]),
                                                             kids, max_size=4), max_leaves=12)


@FUZZ
@given(value=values, mtype=st.sampled_from(list(m.SCHEMA) + ["nope"]),
       key=st.sampled_from(["activations", "data", "x"]))
def test_views_decode_any_msgpack_value_as_before(value, mtype, key):
    _same_outcome(_packb({"type": mtype, key: value, "batch_id": 1}))
    _same_outcome(_packb(value))


@pytest.mark.parametrize("data", [
    _packb({"type": "forward", "batch_id": 1, "activations": {"dtype": "f32", "shape": [2], "data": bytes(8)}}) + b"\0",
    _packb({"type": "forward", "batch_id": 1, "activations": {"dtype": "f32", "shape": [2], "data": bytes(8)}})[:-3],
    _packb({"type": "forward", "batch_id": 1, "activations": {"dtype": "f32", "shape": [2], "data": bytes(8)},
            "labels": msgpack.ExtType(0x5F, b"\0\0\0\0")}),
    _packb({"type": "forward", "batch_id": 1, "activations": {"dtype": "f32", "shape": [2],
                                                              "data": msgpack.ExtType(0x5F, b"\0\0\0\0")}}),
    _packb({"type": "forward", "batch_id": 1, "activations": {"dtype": "f32", "shape": [2], bytes(8): bytes(8)}}),
    _packb({"type": "forward", "batch_id": 1, "activations": {"dtype": "f32", "shape": [2], "data": bytes(8)}})
    .replace(b"\xc4\x08", b"\xc1\x08"),
    b"\x81\xa4data\xc6\xff\xff\xff\xff",
    b"\x83\xa4type\xa7forward\xa8batch_id\x01\xa4data\xd6\xff\x00\x00\x00\x01",        # a timestamp (ext -1)
    b"\x83\xa4type\xa7forward\xa8batch_id\x01\xa4data\xc7\x03\xff\x00\x00\x01",        # a bad timestamp
    b"\x83\xa4type\xa7forward\xa8batch_id\x01\xa4data\xc7\x03\x5f\x00\x00\x01",        # the placeholder's type
    b"\xdf\xff\xff\xff\xff",
])
def test_views_decode_hostile_messages_as_before(data):
    assert _same_outcome(data)[0] == "refused"


def test_large_message_decodes_to_read_only_aligned_views_of_its_bytes():
    a = np.random.default_rng(0).random((4, 16, 64, 64), dtype=np.float32)   # 1 MiB: the view path's size
    viewed = 0
    for batch_id in (1, 200, 300, 70000, 2**33):     # the tensor's offset in the message moves with the id's size
        data = m.encode({"type": m.FORWARD, "batch_id": batch_id, "activations": a, "labels": [1, 2, 3, 4]})
        out = m.decode(data)["activations"]
        assert np.array_equal(out, a) and not out.flags.writeable and out.flags.aligned
        viewed += np.shares_memory(out, np.frombuffer(data, np.uint8))      # aligned: a view; else a copy
        copied = _plain(lambda: m.decode(data))["activations"]
        assert np.array_equal(copied, a) and not np.shares_memory(copied, np.frombuffer(data, np.uint8))
        # a mutable buffer is never viewed: its owner could change the tensor after the checks
        assert not np.shares_memory(m.decode(bytearray(data))["activations"], np.frombuffer(data, np.uint8))
    assert 0 < viewed < 5                              # both ways taken


# ---- the finite check -------------------------------------------------------------------------
@pytest.mark.parametrize("values", [[], [1.0, 2.0], [np.nan], [1.0, np.inf], [-np.inf, 0.0], [np.inf, -np.inf],
                                    [3e38, 3e38, 1.0], [3e38, 3e38, np.nan], [-3e38, -3e38]])
def test_all_finite_agrees_with_isfinite(values):
    a = np.asarray(values, np.float32)
    assert all_finite(a) == bool(np.isfinite(a).all())


@settings(max_examples=200, derandomize=True, deadline=None)
@given(values=st.lists(st.floats(width=32), max_size=64))
def test_all_finite_agrees_with_isfinite_on_any_floats(values):
    a = np.asarray(values, np.float32).reshape(-1, 1) if values else np.zeros((0, 1), np.float32)
    assert all_finite(a) == bool(np.isfinite(a).all())


def test_random_hostile_seeds_match_bench_fuzzer():
    """The seeded fuzzing of bench/fuzz_server.py, replayed on the decoder: same outcome both ways."""
    rng = random.Random(15)
    for _ in range(2000):
        stem = rng.choice(STEMS)
        _, data = mutate.mutate(ALL_DATA[stem], rng)
        _same_outcome(data)
