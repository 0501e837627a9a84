"""Hardening against hostile devices, over a real loopback websockets server: poisoned batches are
refused without touching the shared model, and pre-authentication limits hold."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from websockets.asyncio.client import connect

from device_sdk.client import DeviceClient
from device_sdk.engine import DeviceEngine
from device_sdk.models import resolve_spec
from device_sdk.optim import TrainConfig
from edge_server.checkpoint import NonFiniteState, load_checkpoint, save_checkpoint
from edge_server.trainer import ServerTrainer, StepGuard
from protocol import messages as m
from protocol.session import ClientSession
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
    client = DeviceClient(url, device_id, TOKENS[device_id], DeviceEngine(trainer.spec, "conv1", head, NUM_CLASSES),
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


@pytest.mark.parametrize("max_abs_value", [1e6, 0.0], ids=["range-check", "step-check-only"])
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
