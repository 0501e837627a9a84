"""Wire protocol: vectors, tensor codec, message validation and the sans-I/O sessions (no sockets)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import msgpack
import numpy as np
import pytest

from splitface.protocol import messages as m
from splitface.protocol.errors import FATAL_CODES, ErrorCode, ProtocolError, RemoteError
from splitface.protocol.client_session import ClientSession
from splitface.protocol.server_session import (Admit, DeviceRecord, Embed, Evaluate, Reply, ServerInfo, ServerSession, Train, TrainTail)
from splitface.protocol.tensor import decode_tensor, encode_tensor, payload_bytes
from splitface.protocol.vectors import generate as gen

VECTORS = Path(gen.__file__).resolve().parent
# the split set at the top, the federated rounds' set in federated/ (SPEC.md section 13)
STEMS = sorted(str(p.relative_to(VECTORS).with_suffix("")) for p in VECTORS.rglob("*.msgpack"))
VALID = [s for s in STEMS if "_invalid_" not in s and "_accepted_" not in s]
INVALID = [s for s in STEMS if "_invalid_" in s]
ACCEPTED = [s for s in STEMS if "_accepted_" in s]   # non-canonical bytes with a valid case's meaning


# ---- vectors ---------------------------------------------------------------------------------
def test_vectors_on_disk_match_the_generator(tmp_path):
    gen.generate(tmp_path)
    fresh = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    on_disk = sorted(str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*") if p.suffix in (".msgpack", ".json"))
    assert fresh == on_disk, "run `python -m splitface.protocol.vectors.generate`"
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (VECTORS / name).read_bytes(), name


def test_vectors_cover_every_message_type():
    assert len(VALID) >= 24 and len(INVALID) >= 14
    types = {json.loads((VECTORS / f"{s}.json").read_text())["type"] for s in VALID}
    assert types == set(m.SCHEMA)


@pytest.mark.parametrize("stem", VALID)
def test_valid_vector_decodes_to_its_meaning_and_reencodes_exactly(stem):
    data = (VECTORS / f"{stem}.msgpack").read_bytes()
    meaning = json.loads((VECTORS / f"{stem}.json").read_text())
    message = m.decode(data)
    assert list(message) == list(meaning)
    tensors = gen.tensor_fields(meaning["type"])
    named = gen.named_tensor_fields(meaning["type"])
    for key, want in meaning.items():
        if key in named:
            raw = msgpack.unpackb(data, raw=False)[key]
            assert list(message[key]) == list(want) == list(raw)
            for name, t in want.items():
                assert raw[name]["data"].hex() == t["data_hex"] and raw[name]["shape"] == t["shape"]
                assert message[key][name].reshape(-1).tolist() == t["values"]
        elif key in tensors:
            raw = msgpack.unpackb(data, raw=False)[key]
            assert raw["dtype"] == want["dtype"] and raw["shape"] == want["shape"]
            assert raw["data"].hex() == want["data_hex"]
            assert raw.get("scale") == want.get("scale")
            assert message[key].dtype == np.float32 and list(message[key].shape) == want["shape"]
            assert message[key].reshape(-1).tolist() == want["values"]
        elif key == "visible":   # a packed FORWARD's positions (SPEC.md section 5.12), bin spelled as hex
            assert message[key] == {"grid": want["grid"], "bits": bytes.fromhex(want["bits_hex"])}
        else:
            assert message[key] == want, key
    assert m.encode(gen.wire_of(meaning)) == data
    assert gen.meaning_of(data) == meaning


@pytest.mark.parametrize("stem", INVALID)
def test_invalid_vector_is_refused_with_its_code(stem):
    data = (VECTORS / f"{stem}.msgpack").read_bytes()
    meaning = json.loads((VECTORS / f"{stem}.json").read_text())
    assert meaning["invalid"] is True
    with pytest.raises(ProtocolError) as exc:
        m.decode(data)
    assert exc.value.code.value == meaning["error_code"]


def test_the_f16_infinity_vector_is_refused_for_its_infinity():
    """Vector 28 once lacked a scale and was refused for that, not for the +inf it names (issue 28): with the
    infinity made finite the same tensor decodes."""
    data = (VECTORS / "28_invalid_f16_infinity.msgpack").read_bytes()
    with pytest.raises(ProtocolError, match="NaN or infinity"):
        m.decode(data)
    finite = msgpack.unpackb(data, raw=False)
    assert finite["grad"]["scale"] == 1.0 and finite["grad"]["data"] == bytes.fromhex("003c007c")
    finite["grad"]["data"] = bytes.fromhex("003c0078")   # +inf -> 32768.0
    assert m.decode(msgpack.packb(finite, use_bin_type=True))["grad"].tolist() == [1.0, 32768.0]


@pytest.mark.parametrize("stem", ACCEPTED)
def test_accepted_vector_decodes_to_its_canonical_meaning(stem):
    """A float field written as an int (a JavaScript encoder's whole number) is accepted, with the meaning of the
    canonical float64 case (SPEC.md section 3)."""
    data = (VECTORS / f"{stem}.msgpack").read_bytes()
    meaning = json.loads((VECTORS / f"{stem}.json").read_text())
    assert meaning["accepted"] is True
    canonical = VECTORS / Path(stem).parent / meaning["canonical"]
    got, want = m.decode(data), m.decode(canonical.with_suffix(".msgpack").read_bytes())
    assert list(got) == list(want)
    for key, value in want.items():
        assert np.array_equal(got[key], value) if isinstance(value, np.ndarray) else got[key] == value, key
    assert gen.meaning_of(data) == json.loads(canonical.with_suffix(".json").read_text())


def test_vectors_name_both_forms_of_a_whole_float():
    assert {"32_accepted_i8_scale_int", "epsilon/13_accepted_spent_epsilon_int"} <= set(ACCEPTED)
    assert "31_invalid_i8_scale_bool" in INVALID


# ---- tensor codec ----------------------------------------------------------------------------
RNG_FREE = np.linspace(-3.0, 2.0, 24, dtype=np.float32).reshape(2, 3, 4)


def _roundtrip(a: np.ndarray, enc: str) -> np.ndarray:
    return m.decode(m.encode({"type": "embedding_grad", "batch_id": 1, "grad": encode_tensor(a, enc)}))["grad"]


def test_f32_round_trip_is_exact_and_zero_copy():
    out = _roundtrip(RNG_FREE, "f32")
    assert out.dtype == np.float32 and np.array_equal(out, RNG_FREE)
    assert not out.flags.owndata and not out.flags.writeable
    wire = encode_tensor(RNG_FREE, "f32")
    wire["data"] = bytes(wire["data"])
    decoded = decode_tensor(wire)
    assert np.shares_memory(decoded, np.frombuffer(wire["data"], np.uint8))


def test_f32_encode_hands_msgpack_a_view():
    wire = encode_tensor(RNG_FREE, "f32")
    assert isinstance(wire["data"], memoryview)
    assert np.shares_memory(np.frombuffer(wire["data"], np.uint8), RNG_FREE)


def test_f16_round_trip_within_1e_3_relative():
    out = _roundtrip(RNG_FREE, "f16")
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, RNG_FREE, rtol=1e-3, atol=0)


def test_i8_round_trip_within_half_a_step():
    wire = encode_tensor(RNG_FREE, "i8")
    assert wire["scale"] == pytest.approx(3.0 / 127)
    out = _roundtrip(RNG_FREE, "i8")
    assert np.abs(out - RNG_FREE).max() <= wire["scale"] / 2 + 1e-6


def test_i8_stochastic_rounding_is_unbiased_and_within_one_step():
    """Dithered i8: every value decodes to one of the two steps around it, and the mean over many encodings
    is the value itself, where nearest rounding keeps its error (here: values under half a step become 0)."""
    values = np.array([3.0, -3.0, 0.01, -0.01, 0.5 * 3 / 127, 1.0, 0.0], np.float32)
    rng = np.random.default_rng(7)
    draws = np.stack([decode_tensor(encode_tensor(values, "i8", dither=rng)) for _ in range(4000)])
    step = 3.0 / 127
    assert np.all(np.abs(draws - values) < step * (1 + 1e-5))
    assert draws[:, 0].min() == draws[:, 0].max() == pytest.approx(3.0)       # the peak is exact
    assert np.all(draws[:, -1] == 0)                                            # and so is zero
    np.testing.assert_allclose(draws.mean(0), values, atol=4 * step / 2 / np.sqrt(4000))
    assert decode_tensor(encode_tensor(values, "i8"))[2] == 0                # nearest: 0.01 is lost, always


def test_i8c_scales_each_image_and_channel():
    """i8c: every (image, channel) within half of its own step, however small its values against the others';
    i8's one scale rounds the small channels to zero. Empty groups, all-zero groups and 2-D tensors too."""
    x = np.random.default_rng(3).standard_normal((3, 4, 5, 5)).astype(np.float32)
    x *= np.array([1e-4, 1.0, 1e3, 1e-2], np.float32)[None, :, None, None]
    x[2, 1] = 0.0
    wire = encode_tensor(x, "i8c")
    assert wire["dtype"] == "i8c" and "scale" not in wire and len(wire["scales"]) == 3 * 4 * 4
    out = decode_tensor(wire)
    steps = np.frombuffer(wire["scales"], "<f4").reshape(3, 4, 1, 1)
    assert np.all(np.abs(out - x) <= steps / 2 * (1 + 1e-6))
    assert steps[2, 1] == 1.0 and np.all(out[2, 1] == 0)
    assert np.all(decode_tensor(encode_tensor(x, "i8"))[:, 0] == 0)    # i8: channel 0 is all zero
    assert np.abs(out[:, 0]).max() > 0
    emb = x[:, :, 0, 0]
    flat = encode_tensor(emb, "i8c")
    assert flat["dtype"] == "i8" and flat == encode_tensor(emb, "i8")  # fewer than 3 axes: i8
    for shape in [(0, 4, 5), (3, 0, 5), (3, 4, 0)]:
        assert decode_tensor(encode_tensor(np.zeros(shape, np.float32), "i8c")).shape == shape
    draws = np.stack([decode_tensor(encode_tensor(x, "i8c", dither=np.random.default_rng(k))) for k in range(300)])
    assert np.all(np.abs(draws.mean(0) - x) <= steps * 0.2)          # unbiased: 300 draws, 6.9 s.d. of the mean


@pytest.mark.parametrize("encoding", ["i8", "i8c"])
def test_i8_peak_at_float32_max_decodes_finite(encoding):
    """127 steps of float32(max / 127) round above float32's largest value: the encoder takes the float32 below
    (found by hypothesis in test_fuzz_protocol; the receiver refused such a tensor as infinite)."""
    x = np.array([[[np.finfo(np.float32).max, -1e38]]], np.float32)
    out = decode_tensor(encode_tensor(x, encoding))
    assert np.all(np.isfinite(out)) and np.all(np.abs(out - x) <= x.max() / 127 / 2 * 1.0001)


@pytest.mark.parametrize("encoding", ["f32", "f16", "i8", "i8c"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3), (0, 3, 2)])
def test_payload_bytes_are_what_the_encoder_writes(encoding, shape):
    wire = encode_tensor(np.ones(shape, np.float32), encoding)
    assert payload_bytes(shape, encoding) == len(wire["data"]) + len(wire.get("scales", b""))


def test_stochastic_rounding_is_for_peak_scaled_i8_only():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="not for f16"):
        encode_tensor(RNG_FREE, "f16", dither=rng)
    with pytest.raises(ValueError, match="fixed scale"):
        encode_tensor(np.array([0.5, 1.0], np.float32), "i8", scale=0.5, dither=rng)


def test_i8_all_zero_has_scale_one():
    wire = encode_tensor(np.zeros((2, 2), np.float32), "i8")
    assert wire["scale"] == 1.0 and bytes(wire["data"]) == bytes(4)
    assert np.array_equal(decode_tensor(wire), np.zeros((2, 2)))


def test_empty_and_scalar_tensors():
    assert decode_tensor(encode_tensor(np.zeros((0, 3), np.float32))).shape == (0, 3)
    assert decode_tensor(encode_tensor(np.float32(2.5))).tolist() == 2.5


def test_encode_rejects_unknown_encoding():
    with pytest.raises(ValueError):
        encode_tensor(RNG_FREE, "f64")


def _bad(obj):
    with pytest.raises(ProtocolError) as exc:
        decode_tensor(obj)
    assert exc.value.code == ErrorCode.BAD_TENSOR
    return exc.value


def test_tensor_refusals():
    good = {"dtype": "f32", "shape": [2], "data": np.array([1, 2], "<f4").tobytes()}
    _bad(dict(good, data=good["data"] + b"\0"))               # byte count mismatch
    _bad(dict(good, data=good["data"][:-1]))
    _bad(dict(good, dtype="f64"))                              # bad dtype
    _bad(dict(good, dtype=None))
    _bad(dict(good, shape=[-2]))                               # bad shapes
    _bad(dict(good, shape=[2.0]))
    _bad(dict(good, shape=[True, 2]))
    _bad(dict(good, shape=(2,)))
    _bad(dict(good, shape=[1] * 9))
    _bad(dict(good, data="text"))                              # data must be bin
    _bad(dict(good, extra=1))
    _bad(dict(good, scale=1.0))                                # scale only for i8
    _bad([1, 2])
    i8 = {"dtype": "i8", "shape": [2], "data": b"\x01\x7f"}
    for scale in (None, 0.0, -1.0, math.inf, math.nan, True, "1"):
        _bad(i8 if scale is None else dict(i8, scale=scale))
    _bad(dict(i8, scale=1e39))                                 # dequantizes to inf in float32
    _bad(dict(good, data=np.array([1, math.nan], "<f4").tobytes()))
    _bad(dict(good, data=np.array([math.inf, 1], "<f4").tobytes()))
    _bad({"dtype": "f16", "shape": [1], "data": np.array([math.nan], "<f2").tobytes()})
    assert decode_tensor(dict(i8, scale=2)).tolist() == [2.0, 254.0]  # an int scale is a number too


# ---- message decoding ------------------------------------------------------------------------
def test_oversize_message_is_too_large_and_fatal():
    data = m.encode({"type": "error", "code": "x", "message": "y" * 100})
    with pytest.raises(ProtocolError) as exc:
        m.decode(data, max_size=len(data) - 1)
    assert exc.value.code == ErrorCode.TOO_LARGE and exc.value.fatal
    assert m.decode(data, max_size=len(data))["message"] == "y" * 100


def test_text_input_is_bad_message():
    with pytest.raises(ProtocolError) as exc:
        m.decode('{"type": "hello"}')
    assert exc.value.code == ErrorCode.BAD_MESSAGE


def test_decode_errors_carry_the_batch_id():
    data = msgpack.packb({"type": "forward", "batch_id": 9, "activations": {"dtype": "f32", "shape": [1], "data": b""}})
    with pytest.raises(ProtocolError) as exc:
        m.decode(data)
    assert exc.value.code == ErrorCode.BAD_TENSOR and exc.value.batch_id == 9


def test_trailing_bytes_and_optional_nil_are_refused():
    data = m.encode({"type": "error", "code": "x", "message": "y"})
    for bad in (data + b"\xc0", msgpack.packb({"type": "error", "code": "x", "message": "y", "batch_id": None})):
        with pytest.raises(ProtocolError) as exc:
            m.decode(bad)
        assert exc.value.code == ErrorCode.BAD_MESSAGE


def test_numpy_scalars_encode_as_plain_numbers():
    data = m.encode({"type": "eval_result", "batch_id": np.int64(1), "loss": np.float32(0.5),
                     "n_correct": np.int32(2), "n": 2})
    assert data == m.encode({"type": "eval_result", "batch_id": 1, "loss": 0.5, "n_correct": 2, "n": 2})
    assert b"\xcb" in data  # float64


def test_fatal_codes():
    assert FATAL_CODES == {ErrorCode.UNAUTHORIZED, ErrorCode.VERSION_MISMATCH, ErrorCode.MODEL_MISMATCH,
                           ErrorCode.UNSUPPORTED, ErrorCode.TOO_LARGE}


# ---- ServerSession -----------------------------------------------------------------------------
MODEL = {"family": "toy", "width": 2}
INFO = ServerInfo(model=MODEL, split="conv1", activation_shape=(2, 3), embedding_dim=4, num_classes=5, max_batch=4,
                  max_message_bytes=1 << 16)
ACTS = np.arange(12, dtype=np.float32).reshape(2, 2, 3) / 10
GRAD = np.full((2, 2, 3), 0.5, np.float32)


def make_client(head="server", **kw) -> ClientSession:
    args = dict(device_id="dev", token="tok", model=dict(MODEL), split="conv1", head=head, batch_size=2,
                num_classes=5 if head == "server" else None)
    args.update(kw)
    return ClientSession(**args)


def make_server(records=None, durable=0, **kw) -> ServerSession:
    return ServerSession(INFO, lambda d, t: (d, t) == ("dev", "tok"), {} if records is None else records,
                         lambda d: durable, **kw)


def connect(head="server", records=None, durable=0, gradient_rounding="nearest",
            **kw) -> tuple[ClientSession, ServerSession]:
    c, s = make_client(head, **kw), make_server(records, durable, gradient_rounding=gradient_rounding)
    action = s.receive(c.hello())
    assert isinstance(action, Admit) and action.device_id == "dev"
    c.accept_welcome(s.welcome())
    return c, s


def refused(reply, code: ErrorCode, close: bool, batch_id=None) -> dict:
    assert isinstance(reply, Reply) and reply.close is close
    message = m.decode(reply.data)
    assert message["type"] == "error" and message["code"] == code.value
    assert message.get("batch_id") == batch_id
    return message


def test_handshake_welcome():
    c, s = connect(durable=0)
    assert c.welcome == {"type": "welcome", "session_id": s.session_id, "resume_from": 1, "durable_through": 0,
                         "activation_shape": [2, 3], "embedding_dim": 4,
                         "limits": {"max_message_bytes": 1 << 16, "max_batch": 4}}
    assert c.max_message_bytes == 1 << 16 and s.head == "server" and not s.closed


@pytest.mark.parametrize("change, code", [
    ({"token": "nope"}, ErrorCode.UNAUTHORIZED),
    ({"device_id": "other"}, ErrorCode.UNAUTHORIZED),
    ({"model": {"family": "toy", "width": 3}}, ErrorCode.MODEL_MISMATCH),
    ({"split": "layer1"}, ErrorCode.MODEL_MISMATCH),
    ({"head": "middle"}, ErrorCode.UNSUPPORTED),
    ({"batch_size": 5}, ErrorCode.MODEL_MISMATCH),
    ({"num_classes": 6}, ErrorCode.MODEL_MISMATCH),
    ({"num_classes": None}, ErrorCode.MODEL_MISMATCH),
    ({"encodings": {"activations": "f64", "gradients": "f32"}}, ErrorCode.UNSUPPORTED),
    ({"encodings": {"activations": "f32", "gradients": "bf16"}}, ErrorCode.UNSUPPORTED),
])
def test_handshake_refusals_are_fatal(change, code):
    s = make_server()
    reply = s.receive(make_client(**change).hello())
    refused(reply, code, close=True)
    assert s.closed and s.device_id is None
    refused(s.receive(make_client().hello()), ErrorCode.BAD_STATE, close=True)  # nothing after close


def test_wrong_version_is_fatal():
    hello = msgpack.unpackb(make_client().hello())
    hello["protocol_version"] = 2
    s = make_server()
    refused(s.receive(m.encode(hello)), ErrorCode.VERSION_MISMATCH, close=True)
    assert s.closed


def test_version_is_checked_before_token():
    hello = msgpack.unpackb(make_client(token="wrong").hello())
    hello["protocol_version"] = 2
    refused(make_server().receive(m.encode(hello)), ErrorCode.VERSION_MISMATCH, close=True)


def test_device_head_needs_no_num_classes():
    _, s = connect("device")
    assert s.head == "device"
    _, s = connect("device", num_classes=99)   # SPEC.md section 5.1: sent anyway, it is ignored
    assert s.head == "device"


def test_server_head_without_num_classes_is_a_model_mismatch():
    """SPEC.md sections 5.1 and 6: a server-head HELLO without num_classes decodes, and the handshake refuses it."""
    s = make_server()
    error = refused(s.receive(make_client(num_classes=None).hello()), ErrorCode.MODEL_MISMATCH, close=True)
    assert error["message"] == "server head needs num_classes 5 in HELLO, device sent none"


def test_message_before_hello_closes():
    s = make_server()
    refused(s.receive(make_client().forward(1, ACTS, [0, 1])), ErrorCode.BAD_STATE, close=True)
    assert s.closed


def test_garbage_before_hello_closes():
    s = make_server()
    refused(s.receive(b"\xc1"), ErrorCode.BAD_MESSAGE, close=True)
    assert s.closed


def test_oversize_after_handshake_is_fatal():
    _, s = connect()
    refused(s.receive(b"\0" * ((1 << 16) + 1)), ErrorCode.TOO_LARGE, close=True)
    assert s.closed


def test_server_head_train_and_retry():
    c, s = connect()
    action = s.receive(c.forward(1, ACTS, [0, 4]))
    assert isinstance(action, Train) and action.batch_id == 1
    assert np.array_equal(action.activations, ACTS) and action.labels.tolist() == [0, 4]
    reply = s.applied(1, GRAD, loss=1.5, n_correct=1)
    backward = c.receive(reply, {"backward"}, 1)
    assert backward["loss"] == 1.5 and backward["n_correct"] == 1 and backward["durable_through"] == 0
    assert list(backward) == ["type", "batch_id", "grad", "loss", "n_correct", "durable_through"]
    retry = s.receive(c.forward(1, ACTS, [0, 4]))
    assert isinstance(retry, Reply) and not retry.close and retry.data == reply
    assert s.record.last_applied == 1
    assert isinstance(s.receive(c.forward(2, ACTS, [1, 2])), Train)


def test_server_head_retry_replays_the_reply_parts():
    c, s = connect()
    s.receive(c.forward(1, ACTS, [0, 4]))
    parts = s.applied_parts(1, GRAD, loss=1.5, n_correct=1)   # as the edge server sends it
    assert b"".join(parts) == connect()[1].applied(1, GRAD, loss=1.5, n_correct=1)   # the same bytes as applied's
    retry = s.receive(c.forward(1, ACTS, [0, 4]))
    assert isinstance(retry, Reply) and retry.data is parts
    assert isinstance(s.receive(c.forward(2, ACTS, [0, 4])), Train) and s.record.last_reply is None


def test_a_retry_replays_the_dithered_gradient_it_first_sent():
    """Stochastic rounding draws once per reply: a retry re-sends those very bytes, not a new draw."""
    c, s = connect(gradient_rounding="stochastic", encodings={"activations": "i8c", "gradients": "i8c"})
    s.receive(c.forward(1, ACTS, [0, 4]))
    grad = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 2, 3) / 3
    parts = s.applied_parts(1, grad, loss=1.5, n_correct=1)
    retry = s.receive(c.forward(1, ACTS, [0, 4]))
    assert isinstance(retry, Reply) and b"".join(retry.data) == b"".join(parts)


def test_out_of_order_keeps_the_session_open():
    c, s = connect()
    assert isinstance(s.receive(c.forward(1, ACTS, [0, 1])), Train)
    s.applied(1, GRAD, 0.1, 2)
    refused(s.receive(c.forward(3, ACTS, [0, 1])), ErrorCode.OUT_OF_ORDER, close=False, batch_id=3)
    with pytest.raises(RemoteError) as exc:
        c.receive(s.receive(c.forward(0, ACTS, [0, 1])).data, {"backward"}, 0)
    assert exc.value.code == "out_of_order" and exc.value.batch_id == 0
    assert not s.closed
    assert isinstance(s.receive(c.forward(2, ACTS, [0, 1])), Train)


def test_first_batch_must_be_one():
    c, s = connect()
    refused(s.receive(c.forward(2, ACTS, [0, 1])), ErrorCode.OUT_OF_ORDER, close=False, batch_id=2)
    zero = refused(s.receive(c.forward(0, ACTS, [0, 1])), ErrorCode.OUT_OF_ORDER, close=False, batch_id=0)
    # SPEC.md section 10: a new device has nothing to retry, so the message offers no "retry of 0"
    assert zero["message"] == ("expected batch 1 (training batch ids start at 1: this device has no batch applied "
                               "yet), got 0")
    assert isinstance(s.receive(c.forward(1, ACTS, [0, 1])), Train)
    s.applied(1, GRAD, loss=1.0, n_correct=0)
    assert refused(s.receive(c.forward(3, ACTS, [0, 1])), ErrorCode.OUT_OF_ORDER, close=False,
                   batch_id=3)["message"] == "expected batch 2 (or a retry of 1), got 3"


def test_eval_batches_are_not_sequenced():
    c, s = connect()
    for eval_id in (7, 1, 7):
        action = s.receive(c.forward(eval_id, ACTS, [0, 1], eval=True))
        assert isinstance(action, Evaluate) and action.batch_id == eval_id
    result = c.receive(s.eval_result(7, 0.25, 1, 2), {"eval_result"}, 7)
    assert result == {"type": "eval_result", "batch_id": 7, "loss": 0.25, "n_correct": 1, "n": 2}
    assert s.record.last_applied == 0
    assert isinstance(s.receive(c.forward(1, ACTS, [0, 1])), Train)


@pytest.mark.parametrize("labels, acts", [
    (None, ACTS),                                       # server head needs labels
    ([0], ACTS),                                        # one label for two samples
    ([0, 5], ACTS),                                     # out of range
    ([-1, 0], ACTS),
])
def test_server_head_label_refusals(labels, acts):
    c, s = connect()
    data = m.encode({"type": "forward", "batch_id": 1, "activations": acts, **({} if labels is None else {"labels": labels})})
    refused(s.receive(data), ErrorCode.BAD_MESSAGE, close=False, batch_id=1)
    assert s.record.last_applied == 0 and not s.closed


@pytest.mark.parametrize("acts", [np.zeros((2, 3, 2), np.float32), np.zeros((2, 6), np.float32),
                                  np.zeros((0, 2, 3), np.float32), np.zeros((5, 2, 3), np.float32)])
def test_activation_shape_refusals(acts):
    c, s = connect()
    data = m.encode({"type": "forward", "batch_id": 1, "activations": acts, "labels": [0] * len(acts)})
    refused(s.receive(data), ErrorCode.BAD_TENSOR, close=False, batch_id=1)


def test_device_may_not_send_server_messages():
    c, s = connect()
    refused(s.receive(s.eval_result(1, 0.0, 0, 1)), ErrorCode.BAD_STATE, close=False, batch_id=1)
    refused(s.receive(c.hello()), ErrorCode.BAD_STATE, close=False)
    refused(s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32))), ErrorCode.BAD_STATE, close=False, batch_id=1)


def test_device_head_flow():
    c, s = connect("device")
    refused(s.receive(m.encode({"type": "forward", "batch_id": 1, "activations": ACTS, "labels": [0, 1]})),
            ErrorCode.BAD_MESSAGE, close=False, batch_id=1)
    with pytest.raises(ValueError):
        c.forward(1, ACTS, [0, 1])
    refused(s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32))), ErrorCode.BAD_STATE, close=False, batch_id=1)
    action = s.receive(c.forward(1, ACTS))
    assert isinstance(action, Embed) and action.batch_id == 1 and not action.eval
    emb = c.receive(s.embedded(1, np.ones((2, 4), np.float32)), {"embeddings"}, 1)
    assert emb["eval"] is False
    refused(s.receive(c.embedding_grad(1, np.zeros((2, 5), np.float32))), ErrorCode.BAD_TENSOR, close=False, batch_id=1)
    refused(s.receive(c.embedding_grad(2, np.zeros((2, 4), np.float32))), ErrorCode.OUT_OF_ORDER, close=False,
            batch_id=2)
    tail = s.receive(c.embedding_grad(1, np.full((2, 4), 0.25, np.float32)))
    assert isinstance(tail, TrainTail) and tail.batch_id == 1 and tail.grad.shape == (2, 4)
    reply = s.applied(1, GRAD)
    backward = c.receive(reply, {"backward"}, 1)
    assert "loss" not in backward and "n_correct" not in backward
    # retries of the last batch, by either message, get the cached BACKWARD
    assert s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32))).data == reply
    assert s.receive(c.forward(1, ACTS)).data == reply
    # the next gradient needs its forward first
    refused(s.receive(c.embedding_grad(2, np.zeros((2, 4), np.float32))), ErrorCode.BAD_STATE, close=False, batch_id=2)


def test_device_head_eval_does_not_touch_pending():
    c, s = connect("device")
    assert isinstance(s.receive(c.forward(1, ACTS)), Embed)
    action = s.receive(c.forward(9, ACTS, eval=True))
    assert isinstance(action, Embed) and action.eval
    assert c.receive(s.embedded(9, np.ones((2, 4), np.float32), eval=True), {"embeddings"}, 9)["eval"] is True
    assert isinstance(s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32))), TrainTail)


def test_close_drops_pending_and_a_new_session_resumes():
    records: dict[str, DeviceRecord] = {}
    c, s = connect("device", records)
    assert isinstance(s.receive(c.forward(1, ACTS)), Embed)
    s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32)))
    s.applied(1, GRAD)
    assert isinstance(s.receive(c.forward(2, ACTS)), Embed)
    s.close()
    assert s.closed and s._pending is None
    refused(s.receive(c.embedding_grad(2, np.zeros((2, 4), np.float32))), ErrorCode.BAD_STATE, close=True)

    c2, s2 = connect("device", records, durable=1)
    assert c2.welcome["resume_from"] == 2 and c2.welcome["durable_through"] == 1
    assert s2.session_id != s.session_id
    refused(s2.receive(c2.embedding_grad(2, np.zeros((2, 4), np.float32))), ErrorCode.BAD_STATE, close=False,
            batch_id=2)
    assert isinstance(s2.receive(c2.forward(2, ACTS)), Embed)
    assert isinstance(s2.receive(c2.embedding_grad(2, np.zeros((2, 4), np.float32))), TrainTail)


def test_a_refused_embedding_grad_leaves_the_batch_pending():
    """SPEC.md section 8: a message refused by the session's checks changes nothing, so the batch stays pending;
    a refused step (server_error, or the server's bad_tensor of its range checks: `failed`) drops it."""
    c, s = connect("device")
    assert isinstance(s.receive(c.forward(1, ACTS)), Embed)
    refused(s.receive(c.embedding_grad(1, np.zeros((3, 4), np.float32))), ErrorCode.BAD_TENSOR, close=False, batch_id=1)
    refused(s.receive(c.forward(2, ACTS)), ErrorCode.OUT_OF_ORDER, close=False, batch_id=2)
    assert isinstance(s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32))), TrainTail)


def test_server_failure_forgets_pending():
    c, s = connect("device")
    s.receive(c.forward(1, ACTS))
    with pytest.raises(RemoteError) as exc:
        c.receive(s.failed(1, "boom"), {"embeddings"}, 1)
    assert exc.value.code == "server_error" and exc.value.batch_id == 1
    refused(s.receive(c.embedding_grad(1, np.zeros((2, 4), np.float32))), ErrorCode.BAD_STATE, close=False, batch_id=1)
    assert isinstance(s.receive(c.forward(1, ACTS)), Embed)


def test_resume_after_restart_from_a_checkpoint():
    # a restarted server whose checkpoint covers batch 3 answers resume_from = durable_through + 1
    records = {"dev": DeviceRecord(3, b"cached")}
    c, s = connect("server", records, durable=3)
    assert c.welcome["resume_from"] == 4 and c.welcome["durable_through"] == 3
    assert s.receive(c.forward(3, ACTS, [0, 1])).data == b"cached"
    assert isinstance(s.receive(c.forward(4, ACTS, [0, 1])), Train)


def test_gradient_encoding_follows_hello():
    c, s = connect(encodings={"activations": "i8", "gradients": "f16"})
    raw = msgpack.unpackb(c.forward(1, ACTS, [0, 1]))
    assert raw["activations"]["dtype"] == "i8" and "scale" in raw["activations"]
    action = s.receive(c.forward(1, ACTS, [0, 1]))
    assert np.abs(action.activations - ACTS).max() <= ACTS.max() / 127 / 2 + 1e-6
    assert msgpack.unpackb(s.applied(1, GRAD))["grad"]["dtype"] == "f16"


def test_stochastic_gradient_rounding_dithers_i8_backward_only():
    """`gradient_rounding="stochastic"`: an i8 BACKWARD's values are the two steps around the gradient, at random
    (two encodings of one gradient differ); f16 gradients and i8 activations are unaffected."""
    grad = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3) * np.float32(0.3)
    c, s = connect(gradient_rounding="stochastic", encodings={"activations": "i8", "gradients": "i8"})
    sent = [m.decode(s.applied(1, grad))["grad"] for _ in range(40)]
    step = 0.3 / 127
    assert all(np.abs(g - grad).max() < step * (1 + 1e-5) for g in sent)
    assert len({g.tobytes() for g in sent}) > 1
    assert bytes(msgpack.unpackb(c.forward(2, ACTS, [0, 1]))["activations"]["data"]) == \
        bytes(encode_tensor(ACTS, "i8")["data"])
    _, s16 = connect(gradient_rounding="stochastic", encodings={"activations": "f32", "gradients": "f16"})
    assert msgpack.unpackb(s16.applied(1, grad))["grad"] == msgpack.unpackb(m.encode(
        {"type": "backward", "batch_id": 1, "grad": encode_tensor(grad, "f16")}))["grad"]
    with pytest.raises(ValueError, match="gradient_rounding"):
        make_server(gradient_rounding="up")


def test_missing_encoding_roles_default_to_f32():
    c, s = connect(encodings={})
    assert s.grad_encoding == "f32"


# ---- ClientSession -----------------------------------------------------------------------------
def test_client_receive_raises_remote_error():
    c = make_client()
    with pytest.raises(RemoteError) as exc:
        c.receive(m.encode(m.error(ErrorCode.SERVER_ERROR, "boom", 4)), {"backward"}, 4)
    assert (exc.value.code, exc.value.message, exc.value.batch_id) == ("server_error", "boom", 4)
    with pytest.raises(RemoteError):
        c.accept_welcome(make_server().receive(make_client(token="bad").hello()).data)


def test_client_receive_checks_type_and_batch():
    c, s = connect()
    s.receive(c.forward(1, ACTS, [0, 1]))
    reply = s.applied(1, GRAD)
    with pytest.raises(ProtocolError) as exc:
        c.receive(reply, {"embeddings"})
    assert exc.value.code == ErrorCode.BAD_STATE
    with pytest.raises(ProtocolError) as exc:
        c.receive(reply, {"backward"}, 2)
    assert exc.value.code == ErrorCode.OUT_OF_ORDER


def test_client_refuses_too_large_before_sending():
    c, _ = connect()
    assert c.max_message_bytes == 1 << 16
    big = np.zeros((4, 2, 3), np.float32)
    c.welcome["limits"]["max_message_bytes"] = 100
    with pytest.raises(ProtocolError) as exc:
        c.forward(1, big, [0] * 4)
    assert exc.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError):
        c.embedding_grad(1, np.zeros((4, 40), np.float32))
    assert len(c.forward(1, np.zeros((1, 2, 3), np.float32), [0])) <= 100


def test_client_hello_layout():
    hello = msgpack.unpackb(make_client().hello())
    assert list(hello) == ["type", "protocol_version", "device_id", "token", "model", "split", "head", "encodings",
                           "batch_size", "num_classes"]
    assert "num_classes" not in msgpack.unpackb(make_client("device").hello())


def test_f16_keeps_gradient_sized_values():
    """conv1 activation gradients are ~1e-8: the f16 scale keeps them (unscaled f16 flushes half to zero)."""
    grads = np.random.default_rng(1).normal(0, 3e-8, 10_000).astype(np.float32)
    wire = encode_tensor(grads, "f16")
    assert math.log2(wire["scale"]).is_integer()
    assert np.abs(grads).max() / wire["scale"] < 2 ** 15
    out = decode_tensor(wire)
    assert np.count_nonzero(out) == np.count_nonzero(grads)
    assert np.allclose(out, grads, rtol=1e-3, atol=np.abs(grads).max() * 2 ** -11)
    assert np.count_nonzero(grads.astype(np.float16)) < 0.9 * grads.size  # what an unscaled cast would lose


def test_f16_near_the_float32_limit_decodes_finite():
    """A peak within half an f16 step of float32's largest value rounded up to infinity once (found by
    the hypothesis fuzz); the encoder clamps it so the receiver never sees a value it must refuse."""
    x = np.array([3.401992901712019e38, -3.4028235e38, 1.0], np.float32)
    y = decode_tensor(encode_tensor(x, "f16"))
    assert np.isfinite(y).all() and np.allclose(y[:2], x[:2], rtol=1e-3)
