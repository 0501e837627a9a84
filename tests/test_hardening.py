"""Hardening against hostile devices, over a real loopback websockets server: poisoned batches are
refused without touching the shared model, and pre-authentication limits hold."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, InvalidStatus

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.server.app import Limits
from splitface.server.auth import AuthThrottle
from splitface.server.checkpoint import NonFiniteState, load_checkpoint, save_checkpoint
from splitface.server.trainer import ServerTrainer, StepGuard
from splitface.protocol import messages as m
from splitface.protocol.client_session import ClientSession
from tests.conftest import TOKENS, serve_in_thread

NUM_CLASSES = 5
POISON = 3e38  # finite in float32, so the codec's NaN/inf check lets it through


def _trainer(**guard) -> ServerTrainer:
    return ServerTrainer(resolve_spec("vgg_face_small"), "conv1", NUM_CLASSES, TrainConfig(), device="cpu",
                         guard=StepGuard(**guard))


def _session(trainer: ServerTrainer, device_id: str = "device-1", head: str = "server", token: str | None = None,
             batch_size: int = 8) -> ClientSession:
    return ClientSession(device_id, TOKENS[device_id] if token is None else token, trainer.spec.to_dict(), "conv1",
                         head, batch_size, NUM_CLASSES if head == "server" else None)


def _activations(n: int = 4, value: float | None = None) -> np.ndarray:
    if value is not None:
        return np.full((n, 16, 64, 64), value, np.float32)
    return np.random.default_rng(n).random((n, 16, 64, 64), dtype=np.float32) * 0.5


async def _handshake(url: str, session: ClientSession):
    ws = await connect(url, max_size=64 << 20, compression=None)
    await ws.send(session.hello())
    session.accept_welcome(await ws.recv())
    return ws


async def _ask(ws, data: bytes) -> dict:
    await ws.send(data)
    return m.decode(await ws.recv())


def _snapshot(trainer: ServerTrainer) -> dict[str, torch.Tensor]:
    state = {f"tail.{k}": v.clone() for k, v in trainer.tail.state_dict().items()}
    state.update({f"classifier.{k}": v.clone() for k, v in trainer.classifier.state_dict().items()})
    return state


def _assert_untouched(trainer: ServerTrainer, before: dict[str, torch.Tensor], steps: int) -> None:
    assert trainer.steps == steps
    for k, v in _snapshot(trainer).items():
        assert torch.equal(v, before[k]), k


async def _honest_batches(url: str, trainer: ServerTrainer, device_id: str, batches: range, head: str = "server"):
    client = DeviceClient(url, device_id, TOKENS[device_id], DeviceTrainer(trainer.spec, "conv1", head, NUM_CLASSES),
                          batch_size=8)
    await client.connect()
    losses = []
    for b in batches:
        rng = np.random.default_rng(b)
        result = await client.train_batch(b, rng.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8),
                                          rng.integers(0, NUM_CLASSES, 4), np.arange(4) + 4 * b)
        losses.append(result.loss)
    await client.close()
    return losses


def _assert_checkpoint_finite(path) -> dict:
    checkpoint = load_checkpoint(path)
    tensors = [v for part in ("tail", "classifier") for v in checkpoint["trainer"][part].values()]
    assert tensors and all(torch.isfinite(v.float()).all() for v in tensors)
    return checkpoint


@pytest.mark.parametrize("max_abs_value", [1e6, pytest.param(0.0, marks=pytest.mark.slow)],
                         ids=["range-check", "step-check-only"])
def test_poisoned_forward_is_refused_and_training_goes_on(tmp_path, max_abs_value):
    """The 3e38 batch of issue #16: refused by the range check, or (bound off) by the non-finite loss; the
    model, BN statistics and optimizer are untouched, the session and an honest client keep training."""
    trainer = _trainer(max_abs_value=max_abs_value)
    with serve_in_thread(trainer, tmp_path, max_batch=8) as server:
        before = _snapshot(trainer)

        async def scenario():
            session = _session(trainer)
            ws = await _handshake(server.url, session)
            reply = await _ask(ws, session.forward(1, _activations(value=POISON), [0, 1, 2, 3]))
            assert reply["type"] == m.ERROR and reply["code"] == "bad_tensor" and reply["batch_id"] == 1
            assert "bound" in reply["message"] if max_abs_value else "non-finite" in reply["message"]
            _assert_untouched(trainer, before, 0)
            reply = await _ask(ws, session.forward(1, _activations(), [0, 1, 2, 3]))  # batch 1 is still next
            assert reply["type"] == m.BACKWARD and np.isfinite(reply["loss"])
            await ws.close()
            losses = await _honest_batches(server.url, trainer, "device-0", range(1, 3))
            assert all(np.isfinite(losses))
        asyncio.run(scenario())
    checkpoint = _assert_checkpoint_finite(tmp_path / "checkpoint.pt")
    assert checkpoint["trainer"]["steps"] == 3
    assert {d: r["last_applied"] for d, r in checkpoint["devices"].items()} == {"device-0": 2, "device-1": 1}


@pytest.mark.slow
def test_device_head_poison_releases_the_model(tmp_path):
    """Device head: a poisoned FORWARD and a poisoned EMBEDDING_GRAD are refused, the model lock is released
    at once (an honest device trains next), and the U-turn's BN statistics are rolled back."""
    trainer = _trainer(max_abs_value=0.0)
    with serve_in_thread(trainer, tmp_path, max_batch=8, pending_timeout_s=600) as server:
        before = _snapshot(trainer)

        async def scenario():
            session = _session(trainer, head="device")
            ws = await _handshake(server.url, session)
            reply = await _ask(ws, session.forward(1, _activations(value=POISON)))
            assert reply["type"] == m.ERROR and reply["code"] == "bad_tensor"
            _assert_untouched(trainer, before, 0)
            reply = await _ask(ws, session.forward(1, _activations()))
            assert reply["type"] == m.EMBEDDINGS
            grad = np.full(reply["embeddings"].shape, POISON, np.float32)
            reply = await _ask(ws, session.embedding_grad(1, grad))
            assert reply["type"] == m.ERROR and reply["code"] == "bad_tensor", reply
            _assert_untouched(trainer, before, 0)
            # the lock is free: without the release this would wait for the 600 s U-turn timeout
            await asyncio.wait_for(_honest_batches(server.url, trainer, "device-0", range(1, 3)), 60)
            await ws.close()
        asyncio.run(scenario())
    _assert_checkpoint_finite(tmp_path / "checkpoint.pt")


def test_checkpoint_refuses_non_finite_state(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"trainer": {"w": torch.ones(3)}})
    with pytest.raises(NonFiniteState, match="/trainer/w"):
        save_checkpoint(path, {"trainer": {"w": torch.tensor([1.0, float("nan")])}})
    assert torch.equal(load_checkpoint(path)["trainer"]["w"], torch.ones(3))  # the last good one is kept


# ---- pre-authentication limits, throttling, rate and lock timeouts -------------------------------------------

def _frame_header(length: int) -> bytes:
    """A masked binary frame's header (client to server) announcing `length` payload bytes."""
    assert length < 1 << 16
    return bytes([0x82, 0x80 | 126]) + length.to_bytes(2, "big") + b"\x00\x00\x00\x00"


async def _close_code(ws, within: float = 10.0) -> int:
    """Wait until the server closes `ws`; its close code."""
    await asyncio.wait_for(ws.wait_closed(), within)
    assert ws.close_code is not None
    return ws.close_code


@pytest.mark.slow
def test_pre_auth_limits(tmp_path):
    """Before HELLO: small messages only, a HELLO deadline that trickled partial frames do not extend, and
    connection caps per address and in total (a full server displacing the largest address's unauthenticated
    connections first); after HELLO the announced message limit applies."""
    trainer = _trainer()
    limits = Limits(pre_auth_max_bytes=4096, hello_timeout_s=1.0, max_connections=3, max_connections_per_address=2)
    with serve_in_thread(trainer, tmp_path, max_batch=8, max_message_bytes=4 << 20, limits=limits) as server:
        async def scenario():
            async with connect(server.url, max_size=None, compression=None) as ws:  # 1 MiB before HELLO
                await ws.send(b"\x00" * (1 << 20))
                assert await _close_code(ws) == 1009
            session = _session(trainer)
            ws = await _handshake(server.url, session)                      # after HELLO: 1 MiB is fine
            assert (await _ask(ws, session.forward(1, _activations(), [0, 1, 2, 3])))["type"] == m.BACKWARD
            await ws.close()

            idle = await connect(server.url, compression=None)
            trickle = await connect(server.url, compression=None)
            trickle.transport.write(_frame_header(2000) + b"\x00" * 10)
            with pytest.raises(InvalidStatus) as third:                     # a third from 127.0.0.1
                await connect(server.url, compression=None)
            assert third.value.response.status_code == 503
            other = await connect(server.url, compression=None, local_addr=("127.0.0.2", 0))  # total: 3
            # full: a newcomer from 127.0.0.3 displaces the oldest unauthenticated connection of the address that
            # holds the most (127.0.0.1, 2), closed 1013; then no address holds more than a newcomer's share
            third = await connect(server.url, compression=None, local_addr=("127.0.0.3", 0))
            assert await _close_code(idle) == 1013
            with pytest.raises(InvalidStatus, match="503") as full:
                await connect(server.url, compression=None, local_addr=("127.0.0.4", 0))
            assert b"server full" in full.value.response.body
            for ws in (other, third):
                await asyncio.sleep(0.2)
                trickle.transport.write(b"\x00")                            # keeps trickling: no extension
            for ws in (trickle, other, third):
                assert await _close_code(ws, 10) == 1008
            for _ in range(50):                                             # the handlers finish just after
                if not server.server.open_by_address:
                    break
                await asyncio.sleep(0.1)
            assert server.server.open_by_address == {}
        asyncio.run(scenario())


def test_failed_authentication_is_throttled_and_logged_without_token(tmp_path, caplog):
    trainer = _trainer()
    limits = Limits(auth_free_per_device=2, auth_free_per_address=100, auth_lockout_s=60, auth_lockout_max_s=60)
    caplog.set_level("WARNING", logger="splitface.auth")
    with serve_in_thread(trainer, tmp_path, max_batch=8, limits=limits) as server:
        async def hello(session: ClientSession) -> dict:
            async with connect(server.url, compression=None) as ws:
                return await _ask(ws, session.hello())

        async def scenario():
            for _ in range(2):
                reply = await hello(_session(trainer, token="guess-secret-123"))
                assert reply["code"] == "unauthorized" and "wrong token" in reply["message"]
            reply = await hello(_session(trainer))                          # the right token, but locked out
            assert reply["code"] == "unauthorized" and "try again in 60 s" in reply["message"]
            assert (await hello(_session(trainer, "device-0")))["type"] == m.WELCOME  # others are not
        asyncio.run(scenario())
    assert caplog.text.count("authentication failed for device 'device-1' from 127.0.0.1") == 2
    assert "device 'device-1' locked out for 60 s" in caplog.text and "guess-secret-123" not in caplog.text


def test_auth_throttle_backs_off_per_device_and_address():
    now = [0.0]
    throttle = AuthThrottle(free_per_device=2, free_per_address=3, base_s=1.0, max_s=4.0, capacity=4,
                            clock=lambda: now[0])
    throttle.failed("a", "d1")
    assert throttle.locked_for("a", "d1") == 0
    throttle.failed("a", "d1")
    assert throttle.locked_for("a", "d1") == 1.0 and throttle.locked_for("b", "d1") == 1.0  # the device id
    assert throttle.locked_for("a", "d2") == 0                                              # not the address yet
    now[0] = 1.0
    assert throttle.failed("a", "d1") == (3, {"device": 2.0, "address": 1.0})  # 3rd: both keys locked
    assert throttle.locked_for("b", "d1") == 2.0 and throttle.locked_for("a", "d2") == 1.0
    for _ in range(5):
        throttle.failed("b", "d1")
    assert throttle.locked_for("c", "d1") == 4.0                 # capped at max_s
    throttle.succeeded("d1")
    assert throttle.locked_for("c", "d1") == 0
    now[0] = 100.0                                               # forgotten after 10 x max_s
    assert throttle.locked_for("b", "x") == 0
    for i in range(10):
        throttle.failed("e", f"made-up-{i}")
    assert len(throttle._keys) == 4                              # bounded memory


@pytest.mark.slow
def test_rate_limit_and_lock_timeout_from_acquisition(tmp_path):
    """A session sending faster than --message-rate is held back; a device-head U-turn loses the model
    --pending-timeout after it took it, however many eval messages it sends meanwhile (issue #16: 40 s
    against a 5 s timeout)."""
    trainer = _trainer()
    limits = Limits(message_rate=10.0, message_burst=2)
    with serve_in_thread(trainer, tmp_path, max_batch=8, pending_timeout_s=1.5, limits=limits) as server:
        async def scenario():
            session = _session(trainer, head="device")
            ws = await _handshake(server.url, session)
            start = time.monotonic()
            for i in range(12):                                          # pipelined: 2 at once, then 10/s
                await ws.send(session.forward(100 + i, _activations(1), eval=True))
            for i in range(12):
                assert m.decode(await ws.recv())["batch_id"] == 100 + i
            assert time.monotonic() - start >= 0.9                       # (12 - 2) / 10 s at least

            assert (await _ask(ws, session.forward(1, _activations())))["type"] == m.EMBEDDINGS  # takes the lock
            answered = 0
            with pytest.raises(ConnectionClosed) as closed:
                for i in range(40):                                      # 8 s of evals, one per 0.2 s
                    await _ask(ws, session.forward(200 + i, _activations(1), eval=True))
                    answered += 1
                    await asyncio.sleep(0.2)
            assert closed.value.rcvd.code == 4001 and answered < 40
        asyncio.run(scenario())
        assert server.server.records["device-1"].last_applied == 0


def test_client_refuses_oversized_server_messages():
    """The device client bounds what it accepts: a (hostile) server's 2 MiB reply to HELLO closes with 1009."""
    seen: list[int | None] = []

    async def scenario():
        async def huge(ws):
            await ws.recv()
            await ws.send(b"\x00" * (2 << 20))
            await ws.wait_closed()
            seen.append(ws.close_code)
        async with serve(huge, "127.0.0.1", 0) as fake:
            port = next(iter(fake.sockets)).getsockname()[1]
            trainer_spec = resolve_spec("vgg_face_small")
            client = DeviceClient(f"ws://127.0.0.1:{port}", "device-0", "t",
                                  DeviceTrainer(trainer_spec, "conv1", "server", NUM_CLASSES), batch_size=8,
                                  reconnect_timeout_s=0.1, max_message_bytes=1 << 20)
            with pytest.raises(ConnectionError):
                await client.connect()
    asyncio.run(scenario())
    assert seen and seen[0] == 1009


def test_limits_are_options_declared_once():
    """Every Limits and StepGuard field is a serve option with the field's default, parsed back into the type."""
    import argparse
    import dataclasses

    from splitface.server.cli import add_dataclass_options, from_args
    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, Limits, "limits")
    add_dataclass_options(parser, StepGuard, "guard")
    assert from_args(Limits, parser.parse_args([])) == Limits()
    args = parser.parse_args(["--max-connections-per-address", "7", "--hello-timeout-s", "2.5", "--max-abs-value", "0"])
    assert from_args(Limits, args) == dataclasses.replace(Limits(), max_connections_per_address=7, hello_timeout_s=2.5)
    assert from_args(StepGuard, args) == StepGuard(max_abs_value=0.0)
