"""Property-based fuzzing of the tensor codec, message decoding and the sans-I/O server session.

Property: every input gives either a valid message or a ProtocolError with a known code, never
another exception; the session answers everything with a decodable reply and its batch bookkeeping
stays consistent (applied exactly once, in order, retries replayed byte for byte, closed means
closed). Inputs: random msgpack values and bytes, and mutations of the committed vectors
(splitface/protocol/mutate.py, shared with bench/fuzz_server.py). Settings are derandomized so CI is
reproducible; the slow tier runs many more examples of the same properties.
"""
from __future__ import annotations

import random
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitface.protocol import messages as m
from splitface.protocol import mutate
from splitface.protocol.errors import FATAL_CODES, ErrorCode, ProtocolError, RemoteError
from splitface.protocol.server_session import Admit, DeviceRecord, Embed, Evaluate, Reply, ServerSession, Train, TrainTail
from splitface.protocol.tensor import MAX_DIM, MAX_RANK, WIRE_DTYPES, decode_tensor, encode_tensor
from splitface.protocol.vectors import generate as gen

VECTORS = sorted(Path(gen.__file__).parent.glob("*.msgpack"))
VALID = [p.read_bytes() for p in VECTORS if "_invalid_" not in p.name]
ALL = [p.read_bytes() for p in VECTORS]
KNOWN_CODES = set(ErrorCode)

FAST = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(FAST, max_examples=300)

# msgpack values of every family, nested; keys may be str or bin (msgpack allows both).
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
           | st.binary(max_size=40) | st.sampled_from(mutate.MESSAGE_TYPES + ("f32", "f16", "i8")))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=10) | st.binary(max_size=4), inner, max_size=5), max_leaves=20)
shapes = st.lists(st.integers(0, 4) | st.sampled_from(mutate.HUGE_DIMS + (-1, 0, MAX_DIM)) | scalars, max_size=10)


def decode_or_refuse(data: bytes) -> dict | None:
    """The property itself: a valid message, or a ProtocolError with a known code (None)."""
    try:
        message = m.decode(data)
    except ProtocolError as exc:
        assert exc.code in KNOWN_CODES and exc.message
        assert len(exc.message) < 1000, "an error must not echo the peer's bytes back"
        return None
    assert message["type"] in m.SCHEMA
    return message


# ---- tensor codec --------------------------------------------------------------------------------
def check_tensor(obj) -> None:
    try:
        array = decode_tensor(obj)
    except ProtocolError as exc:
        assert exc.code == ErrorCode.BAD_TENSOR
        return
    assert array.dtype == np.float32 and list(array.shape) == obj["shape"]
    assert np.isfinite(array).all()


@FAST
@given(dtype=st.sampled_from(list(WIRE_DTYPES)) | scalars, shape=shapes, data=st.binary(max_size=64) | scalars,
       scale=st.none() | st.floats() | st.integers(-5, 2**64 - 1) | scalars, extra=st.booleans(),
       scales=st.none() | st.binary(max_size=64) | scalars)
def test_codec_answers_any_tensor_map_with_an_array_or_bad_tensor(dtype, shape, data, scale, extra, scales):
    obj = {"dtype": dtype, "shape": shape, "data": data}
    if scale is not None:
        obj["scale"] = scale
    if scales is not None:
        obj["scales"] = scales
    if extra:
        obj["extra"] = 1
    check_tensor(obj)


@FAST
@given(dtype=st.sampled_from(list(WIRE_DTYPES)), shape=st.lists(st.integers(0, 3), max_size=4),
       rng=st.randoms(use_true_random=False), attack=st.sampled_from(sorted(mutate.TENSOR_ATTACKS)))
def test_codec_refuses_each_tensor_attack_or_decodes_cleanly(dtype, shape, rng, attack):
    values = np.asarray(rng.random(), np.float32) * np.ones(shape, np.float32)
    wire = encode_tensor(values, dtype)
    message = {"type": "forward", "t": dict(wire, data=bytes(wire["data"]))}
    mutate.attack_tensor(message, rng, attack)
    check_tensor(message["t"])


@pytest.mark.parametrize("tensor", [
    {"dtype": "f32", "shape": [0, 2**62], "data": b""},                      # issue 16: reshape raised
    {"dtype": "f32", "shape": [0, 2**31 - 1, 2**31 - 1], "data": b""},
    {"dtype": "f32", "shape": [2**64 - 1], "data": b""},
    {"dtype": "f32", "shape": [-1, 2], "data": bytes(8)},
    {"dtype": "f32", "shape": [1.0], "data": bytes(4)},
    {"dtype": "f32", "shape": [True], "data": bytes(4)},
    {"dtype": "f32", "shape": [1] * (MAX_RANK + 1), "data": bytes(4)},
    {"dtype": ["f32"], "shape": [1], "data": bytes(4)},                      # unhashable: raised TypeError
    {"dtype": "f64", "shape": [1], "data": bytes(8)},
    {"dtype": "i8", "shape": [2], "data": b"\x01\x02", "scale": 0.0},
    {"dtype": "i8", "shape": [2], "data": b"\x01\x02", "scale": 1e300},       # finite scale, overflows float32
    {"dtype": "f16", "shape": [1], "data": b"\x00\x7e", "scale": 1.0},         # NaN
    {"dtype": "f32", "shape": [2], "data": bytes(4)},
    {"dtype": "f32", "shape": [1], "data": bytes(4), b"bin-key": 1, "other": 2},  # str and bin keys: raised TypeError
])
def test_codec_refuses_known_malformed_tensors(tensor):
    with pytest.raises(ProtocolError) as exc:
        decode_tensor(tensor)
    assert exc.value.code == ErrorCode.BAD_TENSOR


def test_empty_tensor_with_large_but_addressable_dims_decodes():
    assert decode_tensor({"dtype": "f32", "shape": [0, MAX_DIM], "data": b""}).shape == (0, MAX_DIM)


@FAST
@given(values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=32),
       dtype=st.sampled_from(list(WIRE_DTYPES)))
def test_codec_round_trip_within_its_precision(values, dtype):
    x = np.asarray(values, np.float32)
    wire = msgpack.unpackb(m.encode({"type": "embedding_grad", "batch_id": 1, "grad": encode_tensor(x, dtype)}))["grad"]
    y = decode_tensor(wire)
    peak = float(np.abs(x).max())
    tolerance = {"f32": 0.0, "f16": peak * 2**-10, "i8": peak / 127 / 2 * 1.0001,
                 "i8c": peak / 127 / 2 * 1.0001}[dtype]   # a 1-D tensor asked for as i8c goes as i8
    assert np.all(np.abs(y - x) <= tolerance + 1e-45)


@FAST
@given(values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False) | st.sampled_from(
           [1e-44, -5e-45, 3.4028234663852886e+38, -3.4028234663852886e+38, 0.0]), min_size=12, max_size=12),
       shape=st.sampled_from([(2, 2, 3), (1, 3, 2, 2), (3, 4, 1), (1, 1, 12)]), dither=st.booleans())
def test_i8c_round_trip_within_each_groups_precision(values, shape, dither):
    """i8c on tensors it really scales (3 or 4 axes), with subnormal and float32-extreme groups: always a valid
    tensor, every value within half (dithered: one) of its own group's step."""
    x = np.asarray(values, np.float32).reshape(shape)
    wire = msgpack.unpackb(m.encode({"type": "backward", "batch_id": 1, "durable_through": 0,
                                     "grad": encode_tensor(x, "i8c", dither=np.random.default_rng(0) if dither else None)}))
    y = decode_tensor(wire["grad"])
    peaks = np.abs(x).reshape(shape[0], shape[1], -1).max(axis=2).reshape(shape[0], shape[1], *([1] * (len(shape) - 2)))
    bound = peaks / 127 * (1.0 if dither else 0.5) * 1.0001 + 1e-44
    assert y.shape == x.shape and np.all(np.abs(y.astype(np.float64) - x) <= bound)


# ---- message decoding -----------------------------------------------------------------------------
@FAST
@given(value=values)
def test_any_msgpack_value_is_a_message_or_a_known_error(value):
    decode_or_refuse(msgpack.packb(value, use_bin_type=True))


@FAST
@given(data=st.binary(max_size=200))
def test_any_bytes_are_a_message_or_a_known_error(data):
    decode_or_refuse(data)


@FAST
@given(vector=st.sampled_from(ALL), rng=st.randoms(use_true_random=False))
def test_mutated_vectors_are_messages_or_known_errors(vector, rng):
    kind, data = mutate.mutate(vector, rng)
    decode_or_refuse(data)


@SLOW
@pytest.mark.slow
@given(vector=st.sampled_from(ALL), rng=st.randoms(use_true_random=False), value=values)
def test_mutated_vectors_and_values_many(vector, rng, value):
    decode_or_refuse(mutate.mutate(vector, rng)[1])
    decode_or_refuse(msgpack.packb(value, use_bin_type=True))


# ---- the sans-I/O server session ------------------------------------------------------------------
class Shell:
    """Plays the server shell around ServerSession (what splitface/server/app.py does, minus the model)
    and checks the session's invariants after every message."""

    def __init__(self, fail_some: bool):
        self.records: dict[str, DeviceRecord] = {}
        self.fail_some = fail_some
        self.session = self.connect()
        self.applied: list[int] = []

    def connect(self) -> ServerSession:
        return ServerSession(gen.INFO, lambda d, t: d == gen.DEVICE_ID and t == gen.TOKEN, self.records, lambda d: 0)

    def reconnect(self) -> None:
        self.session.close()
        self.session = self.connect()

    def send(self, data: bytes, rng: random.Random) -> dict:
        s = self.session
        was_admitted, was_closed = s.device_id is not None, s.closed
        before = self.records.get(gen.DEVICE_ID, DeviceRecord()).last_applied
        action = s.receive(data)
        if isinstance(action, Reply):
            reply = m.decode(action.data)
            if reply["type"] == m.ERROR:
                assert reply["code"] in {c.value for c in KNOWN_CODES}
                # closes exactly when: not yet admitted, already closed, or a fatal code (SPEC.md section 12)
                assert action.close == (not was_admitted or was_closed or ErrorCode(reply["code"]) in FATAL_CODES)
                assert s.closed == action.close or was_closed
            else:  # a replayed BACKWARD: the cached bytes of the last applied batch
                assert reply["type"] == m.BACKWARD and action.data == self.records[gen.DEVICE_ID].last_reply
                assert reply["batch_id"] == before
        else:
            assert was_admitted and not was_closed or isinstance(action, Admit)
            if isinstance(action, (Train, Embed, TrainTail)) and not getattr(action, "eval", False):
                assert self.records[gen.DEVICE_ID].last_reply is None, "the next batch forgets the last reply"
            reply = m.decode(self.perform(action, rng))
        after = self.records.get(gen.DEVICE_ID, DeviceRecord()).last_applied
        assert after in (before, before + 1)
        if after == before + 1:
            self.applied.append(after)
        assert self.applied == list(range(1, len(self.applied) + 1)), "every batch applied once, in order"
        assert s._pending is None or s._pending[0] == after + 1
        return reply

    def perform(self, action, rng: random.Random) -> bytes:
        s = self.session
        if isinstance(action, Admit):
            assert action.device_id == gen.DEVICE_ID
            return s.welcome()
        record = s.record
        if self.fail_some and rng.random() < 0.1:  # the shell's compute failed: server_error, nothing applied
            return s.failed(action.batch_id, "injected failure")
        if isinstance(action, Train):
            assert action.batch_id == record.last_applied + 1 and s.head == "server"
            assert np.isfinite(action.activations).all() and len(action.labels) == len(action.activations)
            return s.applied(action.batch_id, np.zeros_like(action.activations), 1.0, 0)
        if isinstance(action, Evaluate):
            return s.eval_result(action.batch_id, 1.0, 0, len(action.labels))
        if isinstance(action, Embed):
            assert s.head == "device"
            n = len(action.activations)
            if not action.eval:
                assert action.batch_id == record.last_applied + 1 and s._pending == (action.batch_id, n)
                self.n_pending = n
            return s.embedded(action.batch_id, np.zeros((n, gen.EMBEDDING_DIM), np.float32), action.eval)
        assert isinstance(action, TrainTail) and s.head == "device"
        assert action.batch_id == record.last_applied + 1 and action.grad.shape == (self.n_pending, gen.EMBEDDING_DIM)
        return s.applied(action.batch_id, np.zeros((self.n_pending, *gen.ACTIVATION_SHAPE), np.float32))


def honest(step: tuple, head: str) -> bytes:
    """A well-formed message of the kind the step names (ids and sizes may still be wrong)."""
    kind, batch_id, n, enc, flag = step
    client = gen.client(head, {"activations": enc, "gradients": enc})
    x = np.full((n, *gen.ACTIVATION_SHAPE), 0.5, np.float32)
    if kind == "hello":
        return gen.client(head, token=gen.TOKEN if flag else "wrong").hello()
    if kind == "forward":
        labels = [1] * n if head == "server" else None
        return client.forward(batch_id, x, labels, eval=flag)
    return client.embedding_grad(batch_id, np.full((n, gen.EMBEDDING_DIM), 0.1, np.float32))


# (kind, batch id relative to the next one to apply, N, encoding, flag: eval / right token)
# "batch" is an honest training batch (forward, and in device head its gradient) at the given id.
# "reconnect" opens a new connection and says HELLO, "fresh" opens one and says nothing yet.
steps = st.lists(st.tuples(st.sampled_from(["batch", "forward", "grad", "mutant", "batch", "forward", "hello",
                                            "reconnect", "fresh"]),
                           st.sampled_from([0, 0, 0, 0, -1, 1, -2, 2**62]), st.sampled_from([2, 1, 2, 2, 0, 3]),
                           st.sampled_from(list(WIRE_DTYPES)), st.sampled_from([False, False, False, True])),
                 min_size=4, max_size=30)


def run_session(head: str, script: list[tuple], rng: random.Random, fail_some: bool) -> Shell:
    shell = Shell(fail_some)
    shell.send(honest(("hello", 0, 1, "f32", True), head), rng)   # most scripts start admitted
    for step in script:
        if step[0] in ("reconnect", "fresh"):
            shell.reconnect()
            if step[0] == "reconnect":
                shell.send(honest(("hello", 0, 1, "f32", True), head), rng)
            continue
        next_id = shell.records.get(gen.DEVICE_ID, DeviceRecord()).last_applied + 1
        step = (step[0], max(next_id + step[1], 0), *step[2:])
        if step[0] == "batch":
            shell.send(honest(("forward", step[1], max(step[2], 1), step[3], False), head), rng)
            if head == "device":
                shell.send(honest(("grad", step[1], max(step[2], 1), step[3], False), head), rng)
            continue
        if step[0] == "mutant":
            data = mutate.mutate(honest(("forward", step[1], max(step[2], 1), step[3], False), head), rng)[1]
        else:
            data = honest(step, head)
        shell.send(data, rng)
    return shell


@FAST
@given(head=st.sampled_from(["server", "device"]), script=steps, rng=st.randoms(use_true_random=False),
       fail_some=st.booleans())
def test_session_state_stays_consistent(head, script, rng, fail_some):
    shell = run_session(head, script, rng, fail_some)
    event(f"batches applied: {min(len(shell.applied), 3)}{'+' if len(shell.applied) >= 3 else ''}")


@SLOW
@pytest.mark.slow
@given(head=st.sampled_from(["server", "device"]), script=steps, rng=st.randoms(use_true_random=False),
       fail_some=st.booleans())
def test_session_state_stays_consistent_many(head, script, rng, fail_some):
    run_session(head, script, rng, fail_some)


def test_session_fuzz_reaches_training_duplicates_and_out_of_order():
    """The generator is not vacuous: an honest script applies batches, replays and refuses."""
    rng = random.Random(0)
    # ids relative to the next batch: 0 = next, -1 = a retry of the last, 1 = one too far
    script = [("forward", 0, 2, "f32", False), ("forward", -1, 2, "f32", False), ("forward", 1, 2, "f32", False),
              ("forward", 0, 1, "i8", True), ("forward", 0, 1, "f16", False)]
    shell = run_session("server", script, rng, False)
    assert shell.applied == [1, 2]
    device = run_session("device", [("forward", 0, 2, "f16", False), ("grad", 1, 2, "f32", False),
                                    ("grad", 0, 2, "f32", False), ("grad", -1, 2, "f32", False),
                                    ("reconnect", 0, 0, "f32", False), ("forward", -1, 2, "f32", False)], rng, False)
    assert device.applied == [1]
    codes = []
    s = device.session
    for data in (honest(("forward", 5, 1, "f32", False), "device"), honest(("grad", 2, 1, "f32", False), "device")):
        codes.append(m.decode(s.receive(data).data).get("code"))
    assert codes == ["out_of_order", "bad_state"]


# ---- the sans-I/O client session ------------------------------------------------------------------
SERVER_VECTORS = [p.read_bytes() for p in VECTORS
                  if any(t in p.name for t in ("welcome", "error_", "backward", "embeddings", "eval_result"))]


def client_receives(data: bytes) -> None:
    """A device takes any server bytes as a message, a RemoteError (an ERROR) or a ProtocolError; after a
    WELCOME it knows its limits."""
    client = gen.client("server")
    try:
        message = client.receive(data, set(m.SCHEMA))
        if message["type"] == m.WELCOME:
            client.accept_welcome(data)
            assert client.max_message_bytes > 0
    except RemoteError as exc:
        assert isinstance(exc.code, str)
    except ProtocolError as exc:
        assert exc.code in KNOWN_CODES


@FAST
@given(vector=st.sampled_from(SERVER_VECTORS), rng=st.randoms(use_true_random=False))
def test_client_session_takes_any_server_bytes(vector, rng):
    client_receives(mutate.mutate(vector, rng)[1])


@pytest.mark.parametrize("limits", [{}, {"max_message_bytes": "big", "max_batch": 2}, {"max_message_bytes": 0},
                                    {"max_message_bytes": 1 << 20, "max_batch": -1}])
def test_client_refuses_a_welcome_without_usable_limits(limits):
    welcome = msgpack.unpackb((gen.HERE / "03_welcome.msgpack").read_bytes())
    welcome["limits"] = limits
    with pytest.raises(ProtocolError) as exc:
        gen.client("server").accept_welcome(mutate.pack(welcome))
    assert exc.value.code == ErrorCode.BAD_MESSAGE
