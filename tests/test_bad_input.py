"""Bad input against a live server: each gets a clear ERROR (or a clean close), the server
keeps serving a well-behaved device, and no bad batch reaches the model or its checkpoint."""
from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer
from splitface.server.checkpoint import load_checkpoint
from splitface.protocol import messages as m
from splitface.protocol.errors import RemoteError
from splitface.protocol.client_session import ClientSession
from splitface.protocol.tensor import encode_tensor
from tests.conftest import TOKENS, serve_in_thread, small_trainer

NUM_CLASSES = 5
MAX_MESSAGE = 4 << 20


def _client_session(device_id: str = "device-1", token: str | None = None, **kw) -> ClientSession:
    trainer_spec = small_trainer(NUM_CLASSES).spec
    return ClientSession(device_id, TOKENS[device_id] if token is None else token, trainer_spec.to_dict(), "conv1",
                         kw.get("head", "server"), 8, NUM_CLASSES)


def _activations(n: int = 4) -> np.ndarray:
    return np.random.default_rng(0).random((n, 16, 64, 64), dtype=np.float32) * 0.5


async def _raw(url: str, session: ClientSession):
    ws = await connect(url, max_size=None, compression=None)
    await ws.send(session.hello())
    session.accept_welcome(await ws.recv())
    return ws


async def _expect_error(ws, data, code: str) -> dict:
    await ws.send(data)
    reply = m.decode(await ws.recv())
    assert reply["type"] == m.ERROR and reply["code"] == code, reply
    assert reply["message"]
    return reply


async def _good_batch(client: DeviceClient, batch_id: int) -> None:
    rng = np.random.default_rng(batch_id)
    images = rng.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8)
    await client.train_batch(batch_id, images, rng.integers(0, NUM_CLASSES, 4), np.arange(4) + 4 * batch_id)


def _forward(session: ClientSession, batch_id: int, **override) -> bytes:
    message = {"type": m.FORWARD, "batch_id": batch_id, "activations": encode_tensor(_activations()),
               "labels": [0, 1, 2, 3]}
    message.update(override)
    return msgpack.packb(message, use_bin_type=True)


@pytest.fixture()
def server(tmp_path):
    with serve_in_thread(small_trainer(NUM_CLASSES), tmp_path, max_batch=8, max_message_bytes=MAX_MESSAGE) as s:
        yield s


def test_bad_inputs_are_refused_and_others_keep_training(server, tmp_path):
    url = server.url

    async def scenario():
        good = DeviceClient(url, "device-0", TOKENS["device-0"],
                            DeviceTrainer(server.trainer.spec, "conv1", "server", NUM_CLASSES), batch_size=8)
        await good.connect()
        await _good_batch(good, 1)

        # Handshake failures: an ERROR, then the server closes.
        for session, code in [(_client_session(token="wrong"), "unauthorized"),
                              (_client_session(device_id="device-2", token=""), "unauthorized")]:
            async with connect(url, compression=None) as ws:
                await ws.send(session.hello())
                reply = m.decode(await ws.recv())
                assert reply["code"] == code
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
        async with connect(url, compression=None) as ws:     # no hello at all: a forward first (a small one:
            # a large frame before HELLO is closed by the pre-authentication size limit, tests/test_hardening.py)
            await ws.send(_forward(_client_session(), 1, activations=encode_tensor(np.zeros((1, 4), np.float32))))
            assert m.decode(await ws.recv())["code"] == "bad_state"
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        async with connect(url, compression=None) as ws:     # a hello without a token field
            hello = msgpack.unpackb(_client_session().hello())
            del hello["token"]
            await ws.send(msgpack.packb(hello))
            assert m.decode(await ws.recv())["code"] == "bad_message"

        # In-session errors: an ERROR reply, the session stays usable.
        session = _client_session()
        ws = await _raw(url, session)
        await _expect_error(ws, b"\xc1\x00garbage", "bad_message")
        await _expect_error(ws, msgpack.packb({"type": "teleport", "batch_id": 1}), "unknown_type")
        bad_dtype = encode_tensor(_activations())
        bad_dtype["dtype"] = "f64"
        await _expect_error(ws, _forward(session, 1, activations=bad_dtype), "bad_tensor")
        short = encode_tensor(_activations())
        short["data"] = bytes(short["data"])[:-4]
        await _expect_error(ws, _forward(session, 1, activations=short), "bad_tensor")
        wrong_shape = encode_tensor(np.zeros((4, 16, 32, 32), np.float32))
        await _expect_error(ws, _forward(session, 1, activations=wrong_shape), "bad_tensor")
        nan = _activations()
        nan[0, 0, 0, 0] = np.nan
        await _expect_error(ws, _forward(session, 1, activations=encode_tensor(nan)), "bad_tensor")
        await _expect_error(ws, _forward(session, 1, labels=[0, 1, 2, 99]), "bad_message")
        await _expect_error(ws, _forward(session, 3), "out_of_order")
        await _expect_error(ws, _forward(session, 0), "out_of_order")
        await _expect_error(ws, msgpack.packb({"type": m.EMBEDDING_GRAD, "batch_id": 1,
                                              "grad": encode_tensor(np.zeros((4, 256), np.float32))}), "bad_state")
        await ws.send(_forward(session, 1))                  # after all that, batch 1 is still next
        assert m.decode(await ws.recv())["type"] == m.BACKWARD
        await ws.send("a text frame")
        assert m.decode(await ws.recv())["code"] == "bad_message"

        # Oversize: the websocket layer closes with 1009 (message too big).
        await ws.send(b"\x00" * (MAX_MESSAGE + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

        # A client refuses to send what the server would refuse.
        engine = DeviceTrainer(server.trainer.spec, "conv1", "server", NUM_CLASSES)
        big = DeviceClient(url, "device-2", TOKENS["device-2"], engine, batch_size=8)
        await big.connect()
        with pytest.raises(Exception, match="exceeds the server's limit"):
            big.session.forward(1, np.zeros((8, 16, 64, 128), np.float32))
        await big.close()

        # The good device never noticed.
        await _good_batch(good, 2)
        with pytest.raises(RemoteError, match="out_of_order"):
            await _good_batch(good, 5)
        await _good_batch(good, 3)
        await good.close()

    asyncio.run(scenario())
    steps_before = server.trainer.steps
    state = {k: v.clone() for k, v in server.trainer.tail.state_dict().items()}
    server.__exit__()  # stop: checkpoint on shutdown

    assert steps_before == 4  # device-0's batches 1..3 and device-1's one good batch; nothing else was applied
    checkpoint = load_checkpoint(tmp_path / "checkpoint.pt")
    assert checkpoint["trainer"]["steps"] == 4
    assert {d: r["last_applied"] for d, r in checkpoint["devices"].items()} == {"device-0": 3, "device-1": 1,
                                                                              "device-2": 0}
    for k, v in checkpoint["trainer"]["tail"].items():
        assert torch.equal(v, state[k])
        assert torch.isfinite(v.float()).all()


def test_device_head_u_turn_allows_eval_and_times_out(tmp_path):
    """An eval batch inside a device's own U-turn is answered (no deadlock on the model lock); a
    device that never sends its embedding gradient is cut off and the others go on."""
    with serve_in_thread(small_trainer(NUM_CLASSES), tmp_path, max_batch=8, pending_timeout_s=3.0) as server:
        async def scenario():
            session = _client_session("device-1", head="device")
            ws = await _raw(server.url, session)
            await ws.send(session.forward(1, _activations()))
            assert m.decode(await ws.recv())["type"] == m.EMBEDDINGS
            await ws.send(session.forward(7, _activations(), eval=True))
            reply = m.decode(await ws.recv())
            assert reply["type"] == m.EMBEDDINGS and reply["eval"]
            await ws.send(session.embedding_grad(1, np.ones((4, reply["embeddings"].shape[1]), np.float32)))
            assert m.decode(await ws.recv())["type"] == m.BACKWARD

            await ws.send(session.forward(2, _activations()))         # then goes silent, holding the model
            assert m.decode(await ws.recv())["type"] == m.EMBEDDINGS
            good = DeviceClient(server.url, "device-0", TOKENS["device-0"],
                                DeviceTrainer(server.trainer.spec, "conv1", "server", NUM_CLASSES), batch_size=8)
            await good.connect()
            await asyncio.wait_for(_good_batch(good, 1), timeout=30)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 4001
            await good.close()
            assert server.server.records["device-1"].last_applied == 1  # batch 2 was dropped, not applied
        asyncio.run(scenario())
