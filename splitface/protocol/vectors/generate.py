"""Write the wire-protocol test vectors: `python -m splitface.protocol.vectors.generate [--out DIR]`.

Every case is one `NN_name.msgpack` (the exact bytes of the reference encoder) and one
`NN_name.json` (what those bytes mean). The federated round messages (SPEC.md section 15) have
their own numbered set in `federated/`, so that a split-only implementation (the Android core)
can conform to the top-level set alone. Valid cases are produced by the real builders
(ClientSession / ServerSession / messages.encode / encode_tensor) driven through a real
handshake against a toy server, so they are what the Python implementation sends. Invalid
cases are hand-made bytes with {"invalid": true, "error_code": ...}: `messages.decode` must
refuse them with that code. Nothing here is random; running it twice gives the same files.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode, ProtocolError
from splitface.protocol.client_session import CannotResume, ClientSession, FederatedClientSession, Resume
from splitface.protocol.round_board import RoundBoard
from splitface.protocol.server_session import Admit, DeviceRecord, ServerInfo, ServerSession
from splitface.protocol.tensor import decode_tensor

HERE = Path(__file__).resolve().parent
RECONNECT_FILE = Path("reconnect") / "welcome_decisions.json"   # one JSON file of cases, no message bytes

# The toy server every valid vector talks to: tiny shapes on purpose, but the model map carries every
# key of SPEC.md's model table, with the values of the `vgg_face_small` preset (tests/test_spec_keys.py
# pins both to splitface.common.models' ModelSpec; splitface/protocol/ itself does not import the device SDK).
MODEL = {"family": "vgg_face", "input_size": 64, "width": 16, "fc_width": 256, "depth": 50, "embedding_size": 512,
         "dropout": 0.0, "release_pool": 1, "release": "none", "bottleneck_channels": 8, "bottleneck_stride": 1,
         "dct_drop": 1, "dct_keep": 0, "dct_stem_blocks": 0, "mask_ratio": 0.75, "mask_patch": 8}
SPLIT = "conv1"
ACTIVATION_SHAPE = (2, 3)
EMBEDDING_DIM = 4
NUM_CLASSES = 10
MAX_BATCH = 2
MAX_MESSAGE_BYTES = 1 << 20
SESSION_ID = "00112233445566778899aabbccddeeff"
DEVICE_ID = "phone-01"
TOKEN = "s3cret-token"

INFO = ServerInfo(model=MODEL, split=SPLIT, activation_shape=ACTIVATION_SHAPE, embedding_dim=EMBEDDING_DIM,
                  num_classes=NUM_CLASSES, max_batch=MAX_BATCH, max_message_bytes=MAX_MESSAGE_BYTES)

ACTIVATIONS = np.array([[[0.5, -1.25, 3.0], [0.1, 0.0, -2.0]],
                        [[1.0, 2.5, -0.75], [100.0, -0.001, 7.0]]], dtype=np.float32)
ACT_GRAD = np.array([[[0.25, -0.5, 0.125], [1e-3, 0.0, -4.0]],
                     [[2.0, -0.0625, 0.3], [-1.5, 8.0, 0.01]]], dtype=np.float32)
EMBEDDINGS = np.array([[0.5, -0.5, 0.25, 1.0], [-1.0, 0.75, 0.0, 0.2]], dtype=np.float32)
EMBEDDING_GRAD = np.array([[0.01, -0.02, 0.03, -0.04], [0.5, 0.0, -0.25, 0.125]], dtype=np.float32)
LABELS = [3, 7]


# ---- meaning <-> wire ----------------------------------------------------------------------
def tensor_fields(mtype: str) -> set[str]:
    return {f for f, (check, _) in m.SCHEMA.get(mtype, {}).items() if check == m.TENSOR}


def named_tensor_fields(mtype: str) -> set[str]:
    """Fields that map names to tensors (federated weights and updates)."""
    return {f for f, (check, _) in m.SCHEMA.get(mtype, {}).items() if check == m.TENSORS}


def _tensor_meaning(value: dict[str, Any], key: str) -> dict[str, Any]:
    t = {"dtype": value["dtype"], "shape": value["shape"], "data_hex": value["data"].hex(),
         "values": [float(x) for x in decode_tensor(value, field=key).reshape(-1)]}
    if "scale" in value:
        t["scale"] = value["scale"]
    if "scales" in value:
        t["scales_hex"] = bytes(value["scales"]).hex()
    return t


def _tensor_wire(value: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = {"dtype": value["dtype"], "shape": value["shape"], "data": bytes.fromhex(value["data_hex"])}
    if "scale" in value:
        t["scale"] = value["scale"]
    if "scales_hex" in value:
        t["scales"] = bytes.fromhex(value["scales_hex"])
    return t


def meaning_of(data: bytes) -> dict[str, Any]:
    """JSON meaning of a valid message: every field in wire order, tensors spelled out (a packed FORWARD's
    `visible` as `{"grid", "bits_hex"}`)."""
    m.decode(data)  # must be valid
    raw = msgpack.unpackb(data, raw=False)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in tensor_fields(raw["type"]):
            value = _tensor_meaning(value, key)
        elif key in named_tensor_fields(raw["type"]):
            value = {name: _tensor_meaning(t, key) for name, t in value.items()}
        elif key == "visible":
            value = {"grid": value["grid"], "bits_hex": value["bits"].hex()}
        out[key] = value
    return out


def wire_of(meaning: dict[str, Any]) -> dict[str, Any]:
    """The message map a meaning stands for (inverse of meaning_of), ready for messages.encode."""
    out: dict[str, Any] = {}
    for key, value in meaning.items():
        if key in tensor_fields(meaning["type"]):
            value = _tensor_wire(value)
        elif key in named_tensor_fields(meaning["type"]):
            value = {name: _tensor_wire(t) for name, t in value.items()}
        elif key == "visible":
            value = {"grid": value["grid"], "bits": bytes.fromhex(value["bits_hex"])}
        out[key] = value
    return out


# ---- sessions ------------------------------------------------------------------------------
def client(head: str, encodings: dict[str, str] | None = None, token: str = TOKEN) -> ClientSession:
    return ClientSession(DEVICE_ID, token, dict(MODEL), SPLIT, head, MAX_BATCH,
                         NUM_CLASSES if head == "server" else None,
                         dict(encodings or {"activations": "f32", "gradients": "f32"}))


def server(c: ClientSession, last_applied: int = 0, durable: int = 0,
           epsilon: dict[str, float] | None = None) -> ServerSession:
    """A server session that has admitted `c` (records say `last_applied`, checkpoint says `durable`; `epsilon`:
    the devices' last reported spent epsilon)."""
    records = {DEVICE_ID: DeviceRecord(last_applied)}
    s = ServerSession(INFO, lambda d, t: d == DEVICE_ID and t == TOKEN, records, lambda d: durable, epsilon=epsilon)
    s.session_id = SESSION_ID
    action = s.receive(c.hello())
    assert isinstance(action, Admit), action
    return s


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _f32(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


# ---- cases -----------------------------------------------------------------------------------
def valid_cases() -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []
    add = lambda name, data: cases.append((name, data))  # noqa: E731

    server_head = client("server")
    device_head = client("device", {"activations": "f16", "gradients": "f16"})
    add("hello_server_head", server_head.hello())
    add("hello_device_head", device_head.hello())

    add("welcome", server(server_head, last_applied=5, durable=3).welcome())

    refused = ServerSession(INFO, lambda d, t: False, {}, lambda d: 0)
    add("error_unauthorized", refused.receive(client("server", token="wrong").hello()).data)
    s = server(server_head)
    add("error_out_of_order", s.receive(server_head.forward(3, ACTIVATIONS, LABELS)).data)

    add("forward_f32_labels", server_head.forward(1, ACTIVATIONS, LABELS))
    add("forward_f16", device_head.forward(1, ACTIVATIONS))
    add("forward_i8_labels", client("server", {"activations": "i8", "gradients": "f32"}).forward(2, ACTIVATIONS, LABELS))
    add("forward_eval", server_head.forward(1, ACTIVATIONS, LABELS, eval=True))

    add("backward_server_head", server(server_head).applied(1, ACT_GRAD, loss=2.3025850929940455, n_correct=1,
                                                                     server_s=0.125))
    add("backward_device_head", server(device_head, last_applied=6, durable=4).applied(7, ACT_GRAD))

    add("embeddings", server(device_head).embedded(1, EMBEDDINGS, server_s=0.0625))
    add("embeddings_eval", server(client("device")).embedded(4, EMBEDDINGS, eval=True))
    add("embedding_grad", client("device").embedding_grad(1, EMBEDDING_GRAD))
    add("embedding_grad_i8_zero",
        client("device", {"activations": "f32", "gradients": "i8"}).embedding_grad(2, np.zeros((2, 4), np.float32)))
    add("eval_result", server(server_head).eval_result(1, loss=0.6931471805599453, n_correct=2, n=2))
    return cases


def invalid_cases() -> list[tuple[str, bytes, ErrorCode, str]]:
    f32 = {"dtype": "f32", "shape": [1, 2], "data": _f32([1.0, 2.0])}
    return [
        ("invalid_not_msgpack", _pack({"type": "forward", "batch_id": 1})[:-3], ErrorCode.BAD_MESSAGE,
         "truncated msgpack"),
        ("invalid_not_a_map", _pack(["forward", 1]), ErrorCode.BAD_MESSAGE, "an array, not a map"),
        ("invalid_unknown_type", _pack({"type": "ping", "batch_id": 1}), ErrorCode.UNKNOWN_TYPE,
         "type 'ping' is not defined"),
        ("invalid_missing_field", _pack({"type": "forward", "batch_id": 1, "labels": [0]}), ErrorCode.BAD_MESSAGE,
         "forward without activations"),
        ("invalid_wrong_field_type", _pack({"type": "forward", "batch_id": "1", "activations": f32}),
         ErrorCode.BAD_MESSAGE, "batch_id is a string"),
        ("invalid_unexpected_field", _pack({"type": "forward", "batch_id": 1, "activations": f32, "extra": 0}),
         ErrorCode.BAD_MESSAGE, "a field the schema does not define"),
        ("invalid_byte_count", _pack({"type": "forward", "batch_id": 1,
                                      "activations": {"dtype": "f32", "shape": [1, 2], "data": _f32([1.0, 2.0, 3.0])}}),
         ErrorCode.BAD_TENSOR, "12 bytes for shape [1, 2] f32 (8 expected)"),
        ("invalid_bad_dtype", _pack({"type": "forward", "batch_id": 1,
                                     "activations": {"dtype": "f64", "shape": [1], "data": bytes(8)}}),
         ErrorCode.BAD_TENSOR, "dtype f64 is not defined"),
        ("invalid_i8_without_scale", _pack({"type": "forward", "batch_id": 1,
                                            "activations": {"dtype": "i8", "shape": [1, 2], "data": b"\x01\xff"}}),
         ErrorCode.BAD_TENSOR, "i8 tensor without scale"),
        ("invalid_scale_on_f32", _pack({"type": "forward", "batch_id": 1, "activations": dict(f32, scale=1.0)}),
         ErrorCode.BAD_TENSOR, "scale on an f32 tensor"),
        ("invalid_f32_nan", _pack({"type": "forward", "batch_id": 1,
                                   "activations": {"dtype": "f32", "shape": [1, 2], "data": _f32([1.0, math.nan])}}),
         ErrorCode.BAD_TENSOR, "NaN in an f32 tensor"),
        ("invalid_f16_infinity", _pack({"type": "backward", "batch_id": 1, "durable_through": 0, "grad": {
            "dtype": "f16", "shape": [2], "data": bytes.fromhex("003c007c"), "scale": 1.0}}),
         ErrorCode.BAD_TENSOR, "+inf in an f16 tensor (1.0 then +inf, scale 1.0: well-formed but for the infinity)"),
        ("invalid_negative_dimension", _pack({"type": "forward", "batch_id": 1,
                                              "activations": {"dtype": "f32", "shape": [-1, 2], "data": bytes(8)}}),
         ErrorCode.BAD_TENSOR, "a negative dimension"),
        ("invalid_zero_size_huge_shape", _pack({"type": "forward", "batch_id": 1, "activations": {
            "dtype": "f32", "shape": [0, 2**31 - 1, 2**31 - 1], "data": b""}}),
         ErrorCode.BAD_TENSOR, "zero elements and zero bytes, but the non-zero dimensions multiply past 2^31 - 1"),
        ("invalid_i8_scale_bool", _pack({"type": "forward", "batch_id": 1, "activations": {
            "dtype": "i8", "shape": [1, 2], "data": b"\x01\xff", "scale": True}}),
         ErrorCode.BAD_TENSOR,
         "an i8 scale that is a bool: a float field takes a number, never a bool (SPEC.md section 3)"),
    ]


def accepted_cases() -> list[tuple[str, bytes, str, str]]:
    """Non-canonical bytes a decoder must accept: (name, bytes, the valid case whose meaning they have, why)."""
    def with_int_scale(data: bytes) -> bytes:
        raw = msgpack.unpackb(data, raw=False)
        assert raw["grad"]["scale"] == 1.0
        raw["grad"]["scale"] = 1
        return _pack(raw)
    zero = client("device", {"activations": "f32", "gradients": "i8"}).embedding_grad(2, np.zeros((2, 4), np.float32))
    return [("accepted_i8_scale_int", with_int_scale(zero), "embedding_grad_i8_zero",
             "the i8 scale 1.0 written as the int 1, as a JavaScript encoder writes a whole number: a float field "
             "accepts an int (SPEC.md section 3); re-encoded, it is the canonical float64")]


# ---- federated rounds (written to federated/) ---------------------------------------------------
FEDERATED_DEVICE = "client-3"
FED_WEIGHTS = {"conv.weight": np.array([[0.5, -0.25], [1.0, 0.125]], dtype=np.float32),
               "bn.num_batches_tracked": np.array(7.0, dtype=np.float32)}
FED_HEAD = {"weight": np.array([[0.01, -0.02]], dtype=np.float32), "bias": np.zeros(1, np.float32)}
FED_DELTA = {"conv.weight": np.array([[0.003, -0.004], [0.0, 0.0]], dtype=np.float32)}
FED_CONFIG = {"epochs": 2, "batch_size": 8, "lr": 0.01, "head_lr_scale": 10.0, "momentum": 0.0, "weight_decay": 0.0,
              "flip": True}


def federated_board(clip_norm: float | None = 0.05, head: bool = False) -> RoundBoard:
    """A board with round 4 open for FEDERATED_DEVICE (on a clock that stands still: deadline_s is exact)."""
    board = RoundBoard(dict(MODEL), retry_after_s=0.5, max_message_bytes=MAX_MESSAGE_BYTES, clock=lambda: 100.0)
    board.open(4, {FEDERATED_DEVICE: 3735928559}, FED_CONFIG, clip_norm, {"conv.weight": (2, 2)}, FED_WEIGHTS,
               FED_HEAD if head else None, quorum=1, deadline_s=30.0)
    return board


def federated_valid_cases() -> list[tuple[str, bytes]]:
    device = FederatedClientSession(FEDERATED_DEVICE, TOKEN, dict(MODEL))
    board = federated_board()
    update = device.update(4, FED_DELTA, norm=0.005, examples=9, loss=1.25)
    cases = [
        ("hello_federated", device.hello()),
        ("round_start", board.offer(FEDERATED_DEVICE)),
        ("round_start_unclipped", federated_board(clip_norm=None).offer(FEDERATED_DEVICE)),
        ("model_request", device.model_request(4)),
        ("model", board.model_for(FEDERATED_DEVICE, 4)),
        ("model_global_head", federated_board(head=True).model_for(FEDERATED_DEVICE, 4)),
        ("update", update),
        ("update_ack", board.accept(FEDERATED_DEVICE, m.decode(update))),
        ("round_request", device.round_request()),
        ("round_wait", board.offer(FEDERATED_DEVICE)),  # its update is in: nothing more for it this round
    ]
    try:
        board.model_for(FEDERATED_DEVICE, 3)
    except ProtocolError as exc:
        cases.append(("error_round_closed", m.encode(m.error(exc.code, exc.message))))
    return cases


def federated_invalid_cases() -> list[tuple[str, bytes, ErrorCode, str]]:
    delta = {"dtype": "f32", "shape": [2], "data": _f32([0.001, 0.002])}
    hello = {"type": "hello", "protocol_version": 1, "device_id": FEDERATED_DEVICE, "token": TOKEN, "model": MODEL}
    update = {"type": "update", "round_id": 4, "delta": {"w": delta}, "norm": 0.01, "examples": 2, "loss": 0.5}
    return [
        ("invalid_hello_federated_with_split", _pack({**hello, "split": "conv1", "mode": "federated"}),
         ErrorCode.BAD_MESSAGE, "a federated hello carries a split-only field"),
        ("invalid_hello_split_without_head", _pack({**hello, "split": "conv1", "encodings": {}, "batch_size": 2}),
         ErrorCode.BAD_MESSAGE, "a split hello (no mode) without head"),
        ("invalid_update_nan", _pack({**update, "delta": {"w": dict(delta, data=_f32([0.001, math.nan]))}}),
         ErrorCode.BAD_TENSOR, "NaN in an update tensor"),
        ("invalid_update_delta_not_a_map", _pack({**update, "delta": [delta]}), ErrorCode.BAD_MESSAGE,
         "delta is an array, not a map of names to tensors"),
        ("invalid_update_empty_delta", _pack({**update, "delta": {}}), ErrorCode.BAD_MESSAGE, "an empty update"),
        ("invalid_update_norm_nan", _pack({**update, "norm": math.nan}), ErrorCode.BAD_MESSAGE,
         "a non-finite norm"),
        ("invalid_round_start_config_missing_key", _pack({
            "type": "round_start", "round_id": 1, "seed": 1, "config": {k: v for k, v in FED_CONFIG.items() if k != "lr"},
            "deadline_s": 1.0, "max_message_bytes": 1024}), ErrorCode.BAD_MESSAGE, "config without lr"),
        ("invalid_model_request_round_zero", _pack({"type": "model_request", "round_id": 0}), ErrorCode.BAD_MESSAGE,
         "round ids start at 1"),
    ]


# ---- U-shaped split: PrivacyFace's cluster relay (written to clusters/, SPEC.md section 8.1) ---------------
CLUSTERS_OWN = np.array([[0.6, 0.0, -0.8, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=np.float32)
CLUSTERS_OTHER = np.array([[0.0, 0.0, 0.0, -1.0]], dtype=np.float32)
HEAD_OWN = np.array([[0.5, -0.25, 0.0, 1.0], [0.0, 2.0, 0.125, -0.5]], dtype=np.float32)
HEAD_CORRECTED = np.array([[0.5, -0.25, 0.0625, 1.0], [0.0, 2.0, 0.125, -0.4375]], dtype=np.float32)  # as a server
# would answer (the correction itself is the server's, research/federated/fedgc.py: splitface/protocol/ does not run it)


def clusters_valid_cases() -> list[tuple[str, bytes]]:
    from splitface.protocol.clusters import ClusterRelay

    def admitted(relay: ClusterRelay) -> ServerSession:
        s = ServerSession(INFO, lambda d, t: d == DEVICE_ID and t == TOKEN, {}, lambda d: 0, relay=relay)
        assert isinstance(s.receive(device.hello()), Admit)
        return s

    device = client("device")
    relay = ClusterRelay(EMBEDDING_DIM)
    relay.exchange("phone-00", CLUSTERS_OTHER)  # another device released one cluster before
    release = device.clusters(CLUSTERS_OWN)
    empty = device.clusters(np.zeros((0, EMBEDDING_DIM), np.float32))
    return [("clusters_release", release), ("clusters_relayed", admitted(relay).receive(release).data),
            ("clusters_none_released", empty),
            ("clusters_none_relayed", admitted(ClusterRelay(EMBEDDING_DIM)).receive(empty).data),
            ("class_embeddings_upload", device.class_embeddings(HEAD_OWN)),
            ("class_embeddings_corrected", m.encode({"type": m.CLASS_EMBEDDINGS, "class_embeddings": HEAD_CORRECTED}))]


def clusters_invalid_cases() -> list[tuple[str, bytes, ErrorCode, str]]:
    return [
        ("invalid_clusters_missing", _pack({"type": "clusters"}), ErrorCode.BAD_MESSAGE, "clusters without its tensor"),
        ("invalid_clusters_nan", _pack({"type": "clusters", "clusters": {
            "dtype": "f32", "shape": [1, 2], "data": _f32([1.0, math.nan])}}), ErrorCode.BAD_TENSOR, "NaN in a cluster"),
        ("invalid_class_embeddings_wrong_type", _pack({"type": "class_embeddings", "class_embeddings": [[1.0]]}),
         ErrorCode.BAD_TENSOR, "class embeddings as a nested array, not a tensor"),
        ("invalid_clusters_extra_field", _pack({"type": "clusters", "clusters": {
            "dtype": "f32", "shape": [0, 4], "data": b""}, "batch_id": 1}), ErrorCode.BAD_MESSAGE,
         "a field the schema does not define"),
    ]


# ---- spent epsilon (written to epsilon/, SPEC.md section 5.11) --------------------------------------------
SPENT = 1.25          # what the device reports after its release
LAST_REPORTED = 2.5   # the server's figure for it (from an earlier report)


def epsilon_valid_cases() -> list[tuple[str, bytes]]:
    server_head, device_head = client("server"), client("device")
    return [
        ("forward_spent_epsilon", server_head.forward(1, ACTIVATIONS, LABELS, spent_epsilon=SPENT)),
        ("forward_eval_spent_epsilon_device_head", device_head.forward(2, ACTIVATIONS, eval=True, spent_epsilon=SPENT)),
        ("forward_spent_epsilon_zero", server_head.forward(3, ACTIVATIONS, LABELS, spent_epsilon=0.0)),
        ("welcome_spent_epsilon", server(server_head, last_applied=5, durable=3,
                                         epsilon={DEVICE_ID: LAST_REPORTED}).welcome()),
        ("error_epsilon_regressed", server(server_head, last_applied=5, epsilon={DEVICE_ID: LAST_REPORTED}).receive(
            server_head.forward(6, ACTIVATIONS, LABELS, spent_epsilon=SPENT)).data),
    ]


def epsilon_invalid_cases() -> list[tuple[str, bytes, ErrorCode, str]]:
    def forward(spent: Any) -> bytes:
        return _pack({"type": "forward", "batch_id": 1, "activations": {
            "dtype": "f32", "shape": [1, 2, 3], "data": _f32([0.0] * 6)}, "labels": [3], "spent_epsilon": spent})
    return [
        ("invalid_spent_epsilon_negative", forward(-0.5), ErrorCode.BAD_MESSAGE, "spent_epsilon below 0"),
        ("invalid_spent_epsilon_nan", forward(math.nan), ErrorCode.BAD_MESSAGE, "spent_epsilon NaN"),
        ("invalid_spent_epsilon_infinity", forward(math.inf), ErrorCode.BAD_MESSAGE, "spent_epsilon infinite"),
        ("invalid_spent_epsilon_string", forward("1.25"), ErrorCode.BAD_MESSAGE, "spent_epsilon a string"),
        ("invalid_spent_epsilon_bool", forward(True), ErrorCode.BAD_MESSAGE, "spent_epsilon a bool"),
        ("invalid_spent_epsilon_nil", forward(None), ErrorCode.BAD_MESSAGE, "spent_epsilon nil"),
        ("invalid_welcome_spent_epsilon_negative", _pack({
            "type": "welcome", "session_id": SESSION_ID, "resume_from": 1, "durable_through": 0,
            "activation_shape": [2, 3], "embedding_dim": 4, "limits": {"max_message_bytes": 1024, "max_batch": 2},
            "spent_epsilon": -1.0}), ErrorCode.BAD_MESSAGE, "welcome spent_epsilon below 0"),
    ]


def epsilon_accepted_cases() -> list[tuple[str, bytes, str, str]]:
    zero = msgpack.unpackb(client("server").forward(3, ACTIVATIONS, LABELS, spent_epsilon=0.0), raw=False)
    zero["spent_epsilon"] = 0
    return [("accepted_spent_epsilon_int", _pack(zero), "forward_spent_epsilon_zero",
             "spent_epsilon 0.0 written as the int 0, as a JavaScript encoder writes a whole number: a float field "
             "accepts an int (SPEC.md section 3); re-encoded, it is the canonical float64")]


# ---- packed mask releases (written to packed/, SPEC.md section 5.12) ---------------------------------------
# A toy mask release: 2 images of 1 x 6 x 6 in 2 x 2 patches (a 3 x 3 grid: 9 bits, 2 bytes per image, so the
# top 7 bits of each image's second byte are padding). Image 0 shows its diagonal patches 0, 4, 8; image 1 only
# patch 8, the first bit of its second byte. A toy server expects [N, 1, 6, 6].
PACKED_PATCH = 2
PACKED_SHAPE = (1, 6, 6)
PACKED_INFO = replace(INFO, activation_shape=PACKED_SHAPE)


def _packed_release() -> np.ndarray:
    values = np.arange(1, 2 * 36 + 1, dtype=np.float32).reshape(2, *PACKED_SHAPE) / 8
    values[0, 0, 0, 0] = -0.75          # a negative value (i8 and f16 carry its sign)
    grid = np.zeros((2, 3, 3), np.float32)
    grid[0, [0, 1, 2], [0, 1, 2]] = 1
    grid[1, 2, 2] = 1
    return values * grid.repeat(PACKED_PATCH, 1).repeat(PACKED_PATCH, 2)[:, None]


def packed_client(head: str, activations: str = "f32") -> ClientSession:
    return replace(client(head, {"activations": activations, "gradients": "f32"}), pack_patch=PACKED_PATCH)


def packed_valid_cases() -> list[tuple[str, bytes]]:
    release, server_head = _packed_release(), packed_client("server")
    nothing = np.zeros((1, *PACKED_SHAPE), np.float32)
    s = ServerSession(PACKED_INFO, lambda d, t: d == DEVICE_ID and t == TOKEN, {}, lambda d: 0)
    s.session_id = SESSION_ID
    assert isinstance(s.receive(server_head.hello()), Admit)
    larger = np.pad(release, ((0, 0), (0, 0), (0, 2), (0, 2)))   # 8 x 8: a 4 x 4 grid, not the server's 6 x 6
    return [
        ("forward_packed_f32_labels", server_head.forward(1, release, LABELS)),
        ("forward_packed_i8_eval_device_head", packed_client("device", "i8").forward(2, release, eval=True)),
        ("forward_packed_f16_spent_epsilon", packed_client("server", "f16").forward(3, release, LABELS,
                                                                                    spent_epsilon=SPENT)),
        ("forward_packed_nothing_visible", server_head.forward(4, nothing, LABELS[:1])),
        ("error_packed_not_the_servers_shape", s.receive(server_head.forward(1, larger, LABELS)).data),
    ]


def packed_invalid_cases() -> list[tuple[str, bytes, ErrorCode, str]]:
    valid = msgpack.unpackb(packed_client("server").forward(1, _packed_release(), LABELS), raw=False)

    def forward(visible: Any = None, shape: list[int] | None = None, data: bytes | None = None, **extra: Any) -> bytes:
        wire = dict(valid, **extra)
        wire["activations"] = dict(valid["activations"])
        if shape is not None:
            wire["activations"].update(shape=shape, data=data if data is not None else wire["activations"]["data"])
        if visible is not None:
            wire["visible"] = visible
        return _pack(wire)

    bits = valid["visible"]["bits"]
    assert bits == bytes([0b00010001, 0b1, 0, 0b1])   # image 0: patches 0, 4, 8; image 1: patch 8
    return [
        ("invalid_visible_not_a_map", forward(bits), ErrorCode.BAD_MESSAGE, "visible is the bitmask alone"),
        ("invalid_visible_nil", _pack(dict(valid, visible=None)), ErrorCode.BAD_MESSAGE, "visible is nil"),
        ("invalid_visible_extra_key", forward({"grid": [3, 3], "bits": bits, "patch": 2}), ErrorCode.BAD_MESSAGE,
         "a key besides grid and bits"),
        ("invalid_visible_grid_zero", forward({"grid": [3, 0], "bits": bits}), ErrorCode.BAD_MESSAGE,
         "a grid dimension of 0"),
        ("invalid_visible_bits_str", forward({"grid": [3, 3], "bits": bits.hex()}), ErrorCode.BAD_MESSAGE,
         "bits as str, not bin"),
        ("invalid_visible_bits_length", forward({"grid": [3, 3], "bits": bits[:3]}), ErrorCode.BAD_TENSOR,
         "3 bytes: not a multiple of the 2 bytes per image of a 3 x 3 grid"),
        ("invalid_visible_position_past_grid", forward({"grid": [3, 3], "bits": bytes([0b10001, 0b10, 0, 0b1])}),
         ErrorCode.BAD_TENSOR, "image 0 marks patch 9 instead of 8: a position past the grid's 9 (count still 4)"),
        ("invalid_visible_count_mismatch", forward({"grid": [3, 3], "bits": bytes([0b10001, 0b1, 0b1, 0b1])}),
         ErrorCode.BAD_TENSOR, "5 positions for 4 patches"),
        ("invalid_packed_rank", forward(shape=[4, 1, 4]), ErrorCode.BAD_TENSOR, "patches of rank 3, not [T, C, P, P]"),
        ("invalid_packed_not_square", forward(shape=[4, 1, 1, 4]), ErrorCode.BAD_TENSOR, "1 x 4 patches"),
        ("invalid_packed_unpacks_too_large", forward({"grid": [1, 8], "bits": b"\x00\x00"}, shape=[0, 2**20, 32, 32],
                                                     data=b""),
         ErrorCode.BAD_TENSOR, "no patch, but the 2 x 2^20 x 32 x 256 dense tensor is past the tensor bounds"),
    ]


# ---- i8c: int8 with a scale per image and channel (written to channel_scaled/, SPEC.md sections 4, 5.10) -----------
def channel_scaled_valid_cases() -> list[tuple[str, bytes]]:
    both = {"activations": "i8c", "gradients": "i8c"}
    quiet = ACT_GRAD.copy()
    quiet[1, 0] = 0.0                     # an all-zero (image, channel): its scale is 1.0
    quiet[0, 1] = [1e-44, 0.0, -5e-45]    # a subnormal peak: float32(peak / 127) is 0, so 1.0 too, all zeros
    return [
        ("forward_i8c_labels", client("server", both).forward(1, ACTIVATIONS, LABELS)),
        ("backward_i8c", server(client("server", both)).applied(1, ACT_GRAD, loss=2.3025850929940455, n_correct=1)),
        ("backward_i8c_zero_channel", server(client("device", both)).applied(1, quiet)),
        # 2-D tensors in a role negotiated as i8c go as i8 (section 5.10)
        ("embeddings_i8c_role_as_i8", server(client("device", both)).embedded(1, EMBEDDINGS)),
        # a mask release packed (section 5.12): each travelled patch carries its image's scales
        ("forward_packed_i8c_labels", packed_client("server", "i8c").forward(2, _packed_release(), LABELS)),
    ]


def channel_scaled_invalid_cases() -> list[tuple[str, bytes, ErrorCode, str]]:
    q = bytes(range(1, 13))                                       # 12 int8 values: [2, 2, 3]
    scales = _f32([0.5, 0.25, 1.0, 2.0])

    def forward(**tensor: Any) -> bytes:
        t = {"dtype": "i8c", "shape": [2, 2, 3], "data": q, "scales": scales}
        t.update(tensor)
        return _pack({"type": "forward", "batch_id": 1, "activations": {k: v for k, v in t.items() if v is not None},
                      "labels": LABELS})
    return [
        ("invalid_i8c_without_scales", forward(scales=None), ErrorCode.BAD_TENSOR, "i8c tensor without scales"),
        ("invalid_i8c_with_scale", forward(scale=0.5), ErrorCode.BAD_TENSOR, "i8c tensor with a per-tensor scale too"),
        ("invalid_i8c_scales_length", forward(scales=scales[:-4]), ErrorCode.BAD_TENSOR,
         "3 scales for 2 images x 2 channels"),
        ("invalid_i8c_scales_not_bin", forward(scales=[0.5, 0.25, 1.0, 2.0]), ErrorCode.BAD_TENSOR,
         "scales as an array of floats, not bin"),
        ("invalid_i8c_scale_zero", forward(scales=_f32([0.5, 0.0, 1.0, 2.0])), ErrorCode.BAD_TENSOR, "a zero scale"),
        ("invalid_i8c_scale_negative", forward(scales=_f32([0.5, -0.25, 1.0, 2.0])), ErrorCode.BAD_TENSOR,
         "a negative scale"),
        ("invalid_i8c_scale_nan", forward(scales=_f32([0.5, math.nan, 1.0, 2.0])), ErrorCode.BAD_TENSOR, "a NaN scale"),
        ("invalid_i8c_overflow", forward(scales=_f32([0.5, 3e38, 1.0, 2.0])), ErrorCode.BAD_TENSOR,
         "finite scale, infinite product"),
        ("invalid_i8c_rank_2", forward(shape=[2, 6], scales=_f32([0.5, 0.25])), ErrorCode.BAD_TENSOR,
         "i8c of 2 dimensions"),
        ("invalid_scales_on_i8", forward(dtype="i8", scale=0.5), ErrorCode.BAD_TENSOR, "i8 with scales"),
    ]


# ---- reconnect: what a device does after WELCOME (SPEC.md section 10) ---------------------------------
# (name, description, the device's last committed batch, its batch in flight, WELCOME's resume_from, durable_through)
RECONNECT_CASES: list[tuple[str, str, int, int | None, int, int]] = [
    ("resume_fresh", "a new device meets a server with nothing of it", 0, None, 1, 0),
    ("resume", "between batches: the server applied what the device committed", 5, None, 6, 4),
    ("resume_resend_unapplied", "the FORWARD of batch 6 was lost: re-send it, the server applies it", 5, 6, 6, 5),
    ("resume_resend_reply_lost", "batch 6 applied, its BACKWARD lost: re-send it, the server replays its reply",
     5, 6, 7, 5),
    ("resume_resend_reply_lost_checkpointed", "as above, the server's checkpoint covering batch 6 already: the "
     "device still keeps its snapshot of batch 5 until it commits 6", 5, 6, 7, 6),
    ("resume_restarted_replay", "a device restarted from its training state (nothing in flight) whose batch 6 the "
     "server applied before it died: it makes batch 6 again and gets the cached reply", 5, None, 7, 2),
    ("rollback", "the server restarted from its checkpoint of batch 3: the device drops batch 6 in flight, restores "
     "batch 3 and replays from 4", 5, 6, 4, 3),
    ("rollback_between_batches", "the same with nothing in flight", 7, None, 5, 4),
    ("rollback_to_start", "a server run with no checkpoint of this device: back to the initial state", 2, None, 1, 0),
    ("invalid_server_ahead", "the server claims batch 7, which the device never sent (it sent up to 6)",
     5, 6, 8, 5),
    ("invalid_server_ahead_lost_state", "a device that lost its state (restarted at 0) against a server at batch 4",
     0, None, 5, 4),
    ("invalid_durable_ahead", "the checkpoint covers batch 6, but the server says it applied only 5", 5, None, 6, 6),
]


def reconnect_cases() -> dict[str, Any]:
    """The WELCOME decisions (ClientSession.reconcile) of RECONNECT_CASES, each WELCOME built by a real server
    session whose records say `resume_from - 1` and whose checkpoint says `durable_through`."""
    cases = []
    for name, why, committed, in_flight, resume_from, durable in RECONNECT_CASES:
        c = client("server")
        welcome = c.accept_welcome(server(c, resume_from - 1, durable).welcome())
        assert (welcome["resume_from"], welcome["durable_through"]) == (resume_from, durable), name
        try:
            d = c.reconcile(committed, in_flight)
            decision = {"type": "resume" if isinstance(d, Resume) else "rollback", **asdict(d)}
        except CannotResume as exc:
            decision = {"type": "invalid", "reason": exc.reason, "error_code": exc.code.value}
        cases.append({"name": name, "description": why, "device": {"committed": committed, "in_flight": in_flight},
                      "welcome": {"resume_from": resume_from, "durable_through": durable}, "decision": decision})
    return {"description": "What a split device does after WELCOME (SPEC.md section 10): the device's last "
                           "committed batch and the batch whose FORWARD it holds unanswered (null: none), WELCOME's "
                           "fields, and the decision.", "cases": cases}


def build(valid: list[tuple[str, bytes]] | None = None,
          invalid: list[tuple[str, bytes, ErrorCode, str]] | None = None,
          accepted: list[tuple[str, bytes, str, str]] | None = None) -> list[tuple[str, bytes, dict[str, Any]]]:
    """(NN_name, message bytes, JSON meaning) for every case, numbered in order: valid, invalid, then accepted
    (non-canonical bytes that decode to a valid case's meaning; JSON {"accepted", "canonical", "description"})
    (default: the split set)."""
    out: list[tuple[str, bytes, dict[str, Any]]] = []
    valid = valid_cases() if valid is None else valid
    for name, data in valid:
        out.append((name, data, meaning_of(data)))
    for name, data, code, why in invalid_cases() if invalid is None else invalid:
        try:
            m.decode(data)
        except ProtocolError as exc:
            assert exc.code == code, (name, exc)
        else:
            raise AssertionError(f"{name} decoded")
        out.append((name, data, {"invalid": True, "error_code": code.value, "description": why}))
    stems = {name: f"{i:02d}_{name}" for i, (name, _, _) in enumerate(out, start=1)}
    for name, data, canonical, why in accepted_cases() if accepted is None else accepted:
        canonical_data = dict(valid)[canonical]
        assert data != canonical_data and meaning_of(data) == meaning_of(canonical_data), name  # 1 == 1.0
        out.append((name, data, {"accepted": True, "canonical": stems[canonical], "description": why}))
    return [(f"{i:02d}_{name}", data, meaning) for i, (name, data, meaning) in enumerate(out, start=1)]


def render_json(meaning: dict[str, Any]) -> str:
    return json.dumps(meaning, indent=2, allow_nan=False) + "\n"


def generate(out_dir: Path = HERE) -> list[Path]:
    """Every set: the split protocol's in `out_dir`, the federated rounds' in `out_dir/federated`, ..., and the
    WELCOME decisions in `out_dir/reconnect/welcome_decisions.json`."""
    written = []
    for folder, cases in ((out_dir, build()),
                          (out_dir / "federated", build(federated_valid_cases(), federated_invalid_cases(), [])),
                          (out_dir / "clusters", build(clusters_valid_cases(), clusters_invalid_cases(), [])),
                          (out_dir / "epsilon", build(epsilon_valid_cases(), epsilon_invalid_cases(),
                                                      epsilon_accepted_cases())),
                          (out_dir / "packed", build(packed_valid_cases(), packed_invalid_cases(), [])),
                          (out_dir / "channel_scaled", build(channel_scaled_valid_cases(),
                                                             channel_scaled_invalid_cases(), []))):
        folder.mkdir(parents=True, exist_ok=True)
        for stem, data, meaning in cases:
            (folder / f"{stem}.msgpack").write_bytes(data)
            (folder / f"{stem}.json").write_text(render_json(meaning))
            written += [folder / f"{stem}.msgpack", folder / f"{stem}.json"]
    (out_dir / "reconnect").mkdir(parents=True, exist_ok=True)
    (out_dir / RECONNECT_FILE).write_text(render_json(reconnect_cases()))
    return written + [out_dir / RECONNECT_FILE]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: this package)")
    args = parser.parse_args()
    written = generate(args.out)
    print(f"wrote {len(written) // 2} vectors and {len(RECONNECT_CASES)} WELCOME decisions to {args.out}")


if __name__ == "__main__":
    main()
