"""FaceMAE's packed wire form (issue #12; SPEC.md section 5.12): a mask release's FORWARD carries only its
non-zero patches and a per-image bitmask of where they go. The server's session unpacks it to exactly the
dense tensor (every encoding), a split step on it equals the dense one, the device's re-sent release packs to
the same bytes, every malformed packed FORWARD gets a clear ERROR and changes nothing, and over a real
websocket the packed run trains exactly as the dense one with a quarter of the bytes."""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from bench.mask_wire import forward_bytes
from splitface.common.options import load_selection
from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer, PrivacyEngine
from splitface.common.models import PRESETS
from splitface.common.optim import TrainConfig
from splitface.common.transforms.mask import infer_mask
from splitface.server.trainer import ServerTrainer
from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode
from splitface.protocol.mutate import mutate
from splitface.protocol.patches import pack
from splitface.protocol.client_session import ClientSession
from splitface.protocol.server_session import Admit, DeviceRecord, Embed, Evaluate, Reply, ServerInfo, ServerSession, Train
from splitface.protocol.tensor import encode_tensor
from splitface.protocol.vectors import generate as gen
from tests.conftest import TOKENS, serve_in_thread

MASK = replace(PRESETS["iresnet_small"], release="mask")
SHAPE = (3, 64, 64)
ENCODINGS = ("f32", "f16", "i8", "i8c")   # every wire dtype: i8c packs its scales per patch


def _images(n: int, seed: int = 0) -> np.ndarray:
    """uint8 faces stand-ins; image 0 is black on its top-left patch, so a visible patch may be all zeros."""
    images = np.random.default_rng(seed).integers(0, 256, (n, 3, 64, 64), dtype=np.uint8)
    images[0, :, :8, :8] = 0
    return images


def _sessions(head: str = "server", encoding: str = "f32", packed: bool = True,
              epsilon: dict[str, float] | None = None) -> tuple[ClientSession, ServerSession]:
    device = ClientSession(gen.DEVICE_ID, gen.TOKEN, dict(gen.MODEL), gen.SPLIT, head, 8,
                           gen.NUM_CLASSES if head == "server" else None,
                           {"activations": encoding, "gradients": "f32"}, pack_patch=8 if packed else None)
    info = ServerInfo(model=gen.MODEL, split=gen.SPLIT, activation_shape=SHAPE, embedding_dim=gen.EMBEDDING_DIM,
                      num_classes=gen.NUM_CLASSES, max_batch=8, max_message_bytes=1 << 24)
    server = ServerSession(info, lambda d, t: True, {gen.DEVICE_ID: DeviceRecord(0)}, lambda d: 0,
                           epsilon=epsilon if epsilon is not None else {})
    server.receive(device.hello())
    return device, server


def _releases(n: int = 6, batch: int = 1) -> np.ndarray:
    engine = DeviceTrainer(MASK, "conv1", "server", 5)
    return engine.forward(_images(n), ("train", batch), range(n), range(n))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_packed_and_dense_give_the_server_the_same_tensor(encoding):
    released = _releases()
    labels = np.arange(6) % 5
    got = {}
    for packed in (False, True):
        device, server = _sessions(encoding=encoding, packed=packed)
        data = device.forward(1, released, labels)
        got[packed] = (len(data), server.receive(data))
    (dense_bytes, dense), (packed_bytes, packed) = got[False], got[True]
    assert isinstance(dense, Train) and isinstance(packed, Train) and dense.visible is None
    assert packed.activations.dtype == np.float32 and packed.activations.shape == (6, *SHAPE)
    assert np.array_equal(packed.activations.view(np.uint32), dense.activations.view(np.uint32))   # bit for bit
    # the mask handed over is what the server's MAE reads from the zeros; image 0's black visible patch (if drawn)
    # travels as zeros in both forms, so both read it as hidden
    inferred = infer_mask(torch.from_numpy(dense.activations.copy()), 8)[:, 0, ::8, ::8].numpy().astype(bool)
    assert np.array_equal(packed.visible, inferred)
    assert (packed.visible.sum(axis=(1, 2)) <= 16).all() and packed.visible[1:].sum() == 5 * 16
    assert packed_bytes < dense_bytes / 3.5


def test_a_resent_release_packs_to_the_same_bytes_and_eval_and_device_head_unpack_too():
    engine = DeviceTrainer(MASK, "conv1", "device", 5)
    images = _images(4)
    device, server = _sessions(head="device")
    first = device.forward(1, engine.forward(images, ("train", 1), range(4), range(4)))
    assert device.forward(1, engine.forward(images, ("train", 1), range(4), range(4))) == first   # a re-sent batch
    embed = server.receive(first)
    assert isinstance(embed, Embed) and embed.visible is not None and embed.activations.shape == (4, *SHAPE)
    device, server = _sessions(head="server")
    evaluate = server.receive(device.forward(7, engine.evaluate_release(images, ("eval", 7), range(4), range(4)),
                                             np.zeros(4, dtype=np.int64), eval=True))
    assert isinstance(evaluate, Evaluate) and evaluate.visible.shape == (4, 8, 8)


def test_a_split_step_on_the_packed_form_equals_the_dense_one():
    released, labels = _releases(4), np.array([0, 1, 2, 3])
    results = []
    for packed in (False, True):
        device, server = _sessions(packed=packed)
        action = server.receive(device.forward(1, released, labels))
        trainer = ServerTrainer(MASK, "conv1", 5, TrainConfig(lr=0.05, seed=0))
        grad, loss, correct = trainer.train_server_head(action.activations, action.labels)
        results.append((grad, loss, correct, trainer.tail.state_dict()))
    (g0, l0, c0, s0), (g1, l1, c1, s1) = results
    assert np.array_equal(g0, g1) and l0 == l1 and c0 == c1
    assert all(torch.equal(v, s1[k]) for k, v in s0.items())


def _packed_wire(encoding: str = "f32") -> dict:
    device, _ = _sessions(encoding=encoding)
    return msgpack.unpackb(device.forward(1, _releases(3), [0, 1, 2]), raw=False)


def _set(path: str, value):
    def mutate(wire: dict) -> None:
        *parents, leaf = path.split(".")
        target = wire
        for p in parents:
            target = target[p]
        if value is KeyError:
            del target[leaf]
        else:
            target[leaf] = value(target[leaf]) if callable(value) else value
    return mutate


def _flip_padding(wire: dict) -> None:
    """A 3 x 3 grid (9 bits in 2 bytes per image): set bit 9, a position past the grid."""
    device = ClientSession(gen.DEVICE_ID, gen.TOKEN, dict(gen.MODEL), gen.SPLIT, "server", 8, gen.NUM_CLASSES,
                           pack_patch=8)
    small = msgpack.unpackb(device.forward(1, _releases(3)[:, :, :24, :24], [0, 1, 2]), raw=False)
    bits = bytearray(small["visible"]["bits"])
    bits[1] |= 0x02
    wire.update(small, visible={"grid": [3, 3], "bits": bytes(bits)})


def _duplicate_via_count(wire: dict) -> None:
    """The nearest a bitmask comes to a duplicate position: one more patch than marked positions."""
    t = wire["activations"]
    one = len(t["data"]) // t["shape"][0]
    t["data"] = t["data"] + t["data"][:one]
    t["shape"][0] += 1


MALFORMED = {
    # structure of `visible`: bad_message
    "visible not a map": (_set("visible", b"\x01"), ErrorCode.BAD_MESSAGE),
    "visible nil": (_set("visible", None), ErrorCode.BAD_MESSAGE),
    "visible without bits": (_set("visible.bits", KeyError), ErrorCode.BAD_MESSAGE),
    "visible with an extra key": (_set("visible.count", 16), ErrorCode.BAD_MESSAGE),
    "grid of one dimension": (_set("visible.grid", [64]), ErrorCode.BAD_MESSAGE),
    "grid of zero": (_set("visible.grid", [0, 8]), ErrorCode.BAD_MESSAGE),
    "grid of bools": (_set("visible.grid", [True, True]), ErrorCode.BAD_MESSAGE),
    "grid past 2^31-1": (_set("visible.grid", [2**31, 1]), ErrorCode.BAD_MESSAGE),
    "bits as str": (_set("visible.bits", "ff"), ErrorCode.BAD_MESSAGE),
    # positions against patches: bad_tensor
    "bits empty": (_set("visible.bits", b""), ErrorCode.BAD_TENSOR),
    "bits one byte short": (_set("visible.bits", lambda b: b[:-1]), ErrorCode.BAD_TENSOR),
    "bits of another grid": (_set("visible.grid", [8, 9]), ErrorCode.BAD_TENSOR),
    "position past the grid": (_flip_padding, ErrorCode.BAD_TENSOR),
    "one position more than patches": (_set("visible.bits", lambda b: bytes([b[0] | 0xff]) + b[1:]),
                                       ErrorCode.BAD_TENSOR),
    "one patch more than positions": (_duplicate_via_count, ErrorCode.BAD_TENSOR),
    "patches of rank 3": (_set("activations.shape", lambda s: [s[0], s[1], s[2] * s[3]]), ErrorCode.BAD_TENSOR),
    "patches not square": (_set("activations.shape", lambda s: [s[0], s[1], s[2] * 2, s[3] // 2]),
                           ErrorCode.BAD_TENSOR),
    "hostile grid": (_set("visible.grid", [2**31 - 1, 2**31 - 1]), ErrorCode.BAD_TENSOR),
    # one patch of 3 x 8 x 8 on a 4096 x 4096 grid: 2^24 bits, unpacking to 3 x 2^30 values, past the bounds
    "hostile unpacked size": (_set("visible", {"grid": [2**12, 2**12], "bits": b"\x01" + bytes(2**21 - 1)}),
                              ErrorCode.BAD_TENSOR),
    # within the bounds (3.2 GB dense) but not the server's shape: refused before anything is allocated
    "large unpacked size": (_set("visible", {"grid": [2**11, 2**11], "bits": b"\x01" + bytes(2**19 - 1)}),
                            ErrorCode.BAD_TENSOR),
    # well-formed, but not the server's activation shape (session level): bad_tensor, nothing allocated
    "patch of another size": (_set("visible.grid", [16, 4]), ErrorCode.BAD_TENSOR),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_packed_forward_is_refused_and_changes_nothing(case):
    mutate, code = MALFORMED[case]
    epsilon = {gen.DEVICE_ID: 1.0}
    device, server = _sessions(epsilon=epsilon)
    wire = _packed_wire()
    wire["spent_epsilon"] = 2.0
    if case.endswith("unpacked size"):   # a single patch
        wire["activations"].update(shape=[1, 3, 8, 8], data=wire["activations"]["data"][:3 * 64 * 4])
    mutate(wire)
    reply = server.receive(msgpack.packb(wire, use_bin_type=True))
    assert isinstance(reply, Reply) and not reply.close
    error = m.decode(reply.data)
    assert (error["code"], error["batch_id"]) == (code.value, 1), error
    assert "visible" in error["message"] or "activations" in error["message"] or "shape" in error["message"]
    assert server.record.last_applied == 0 and epsilon == {gen.DEVICE_ID: 1.0}   # nothing applied or recorded
    assert isinstance(server.receive(device.forward(1, _releases(3), [0, 1, 2])), Train)   # the session goes on


def test_the_sender_refuses_a_shape_its_patches_do_not_tile():
    with pytest.raises(ValueError, match="multiples of the patch size"):
        pack(encode_tensor(np.zeros((1, 3, 20, 20), np.float32)), 8)


def test_over_a_websocket_the_packed_run_trains_exactly_as_the_dense_one(tmp_path):
    """Two fresh servers, the same device twice: packed and dense FORWARDs give the same losses and server
    weights; the packed one sends a bit over a quarter of the dense bytes."""
    rng = np.random.default_rng(0)
    batches = [(_images(6, seed=i), rng.integers(0, 5, 6)) for i in range(2)]
    out = {}
    for packed in (True, False):
        config = TrainConfig(lr=0.05, seed=0)
        trainer = ServerTrainer(MASK, "conv1", 5, config)
        engine = DeviceTrainer(MASK, "conv1", "server", 5, config, PrivacyEngine(secret=1))   # the same masks twice
        with serve_in_thread(trainer, tmp_path / str(packed)) as server:
            async def run():
                client = DeviceClient(server.url, "device-0", TOKENS["device-0"], engine, batch_size=8)
                assert client.session.pack_patch == 8
                if not packed:
                    client.session.pack_patch = None   # an old device: the dense form
                await client.connect()
                results = [await client.train_batch(i + 1, images, labels, np.arange(6) + 10 * i)
                           for i, (images, labels) in enumerate(batches)]
                await client.close()
                return results
            results = asyncio.run(run())
        out[packed] = ([(r.loss, r.n_correct) for r in results], sum(r.bytes_sent for r in results),
                       trainer.tail.state_dict())
    (losses1, sent1, state1), (losses0, sent0, state0) = out[True], out[False]
    assert losses1 == losses0
    assert all(torch.equal(v, state0[k]) for k, v in state1.items())
    assert sent0 / 4 < sent1 < sent0 / 3.5


PACKED_VECTORS = sorted((Path(gen.__file__).parent / "packed").glob("*.msgpack"))


def _packed_server(last_applied: int = 0) -> ServerSession:
    server = ServerSession(gen.PACKED_INFO, lambda d, t: True, {gen.DEVICE_ID: DeviceRecord(last_applied)}, lambda d: 0)
    assert isinstance(server.receive(gen.packed_client("server").hello()), Admit)
    return server


def test_the_packed_vectors_unpack_to_the_dense_release():
    dense = gen._packed_release()
    train = _packed_server().receive((PACKED_VECTORS[0]).read_bytes())
    assert isinstance(train, Train) and np.array_equal(train.activations, dense)
    assert train.visible.tolist() == [[[True, False, False], [False, True, False], [False, False, True]],
                                      [[False, False, False], [False, False, False], [False, False, True]]]
    nothing = _packed_server(last_applied=3).receive(PACKED_VECTORS[3].read_bytes())   # batch 4
    assert isinstance(nothing, Train) and nothing.activations.shape == (1, 1, 6, 6) and not nothing.activations.any()


def test_mutated_packed_vectors_are_messages_or_known_errors():
    """splitface.protocol.mutate's hostile variants (bit flips, truncation, wrong types, huge shapes, ...) of the packed
    vectors: the server session answers each with an action or an ERROR, never another failure."""
    rng = random.Random(0)
    vectors = [p.read_bytes() for p in PACKED_VECTORS if "_invalid_" not in p.name and "error_" not in p.name]
    for _ in range(400):
        _, data = mutate(rng.choice(vectors), rng)
        action = _packed_server().receive(data)
        if isinstance(action, Reply):
            assert m.decode(action.data)["type"] == m.ERROR


def test_the_wire_bench_counts_what_a_run_counts_and_the_packed_form_a_quarter(tmp_path, lfw):
    """bench/mask_wire.py on a small run configuration: dense f32 is 3 x 64 x 64 floats a image plus the FORWARD's
    share of headers and labels; packed, 16 patches of 3 x 8 x 8 floats plus an 8-byte bitmask."""
    config = {"model": MASK.to_dict(), "split": "conv1", "head": "server", "num_devices": 2, "batch_size": 16,
              "partition": "iid", "num_classes": 3, "seed": 0, "crop": 160, "train_images": None,
              "data": {"image_folder": False, "min_images": 10, "max_identities": 3, "max_images": None,
                       "people": "devtrain", "seed": 0}}
    config["train_images"] = len(load_selection(lfw, config["data"]).train.labels)
    (tmp_path / "results.json").write_text(json.dumps({"config": config}))
    figures = forward_bytes(tmp_path, lfw)
    assert 49152 < figures["f32"]["dense"] < 49152 + 40
    assert 16 * 768 - 768 < figures["f32"]["packed"] < 16 * 768 + 8 + 40   # a black visible patch costs nothing
    assert figures["i8"]["packed"] < figures["f16"]["packed"] < figures["f32"]["packed"]
