"""A killed device rejoins its server run (issue 28, item 2): its training progress (the committed batch and its
snapshots back to the server's durable_through) is on disk beside its privacy state, atomic and checksummed, so a
restarted device resumes at the server's resume_from with the same data order, and no batch is lost or applied
twice. Real websockets on loopback; the process test kills a real device process with SIGKILL."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.load import random_batches, train_device
from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.device.privacy.state import StateFileError, read_state
from splitface.device.progress import FORMAT, progress_path
from splitface.server.trainer import ServerTrainer
from tests.conftest import ROOT, TOKENS, PausingTrainer, serve_in_thread

# A tiny model without dropout (the server draws nothing at random: two runs of the same batches are the same run)
MODEL = {"family": "vgg_face", "input_size": 32, "width": 4, "fc_width": 32, "dropout": 0.0}
NUM_CLASSES, N = 5, 4
batch = random_batches(N, 32, NUM_CLASSES)


def engine(state_dir: Path | None, head: str = "server") -> DeviceTrainer:
    """A device whose layer trains (so its snapshots matter), with its progress in `state_dir` (None: in memory)."""
    e = DeviceTrainer(resolve_spec(MODEL), "conv1", head, NUM_CLASSES, TrainConfig(lr=0.005, momentum=0.9))
    if state_dir is not None:
        e.open_progress(progress_path(state_dir, "device-0"))
    return e


def trainer() -> ServerTrainer:
    return ServerTrainer(resolve_spec(MODEL), "conv1", NUM_CLASSES, TrainConfig(), device="cpu")


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def server_weights(t: ServerTrainer) -> dict[str, torch.Tensor]:
    """The server's model: its tail and its classifier."""
    return {f"{name}.{k}": v for name, m in (("tail", t.tail), ("classifier", t.classifier))
            for k, v in weights(m).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_progress_is_resumed_whole(tmp_path):
    first = engine(tmp_path)
    path = progress_path(tmp_path, "device-0")
    assert read_state(path, FORMAT, "training state")["committed"] == 0   # written at once
    for b in (1, 2, 3):
        images, labels, ids = batch(b)
        first.forward(images, ("train", b), ids, labels)
        first.commit(b, np.full((N, 4, 32, 32), 1e-3 * b, np.float32))
    first.forget_before(2)   # the server's checkpoint covers batch 2: snapshots 0 and 1 can never be needed
    assert sorted(p.name for p in path.with_suffix("").iterdir()) == ["2.pt", "3.pt"]

    again = engine(tmp_path)
    assert again.committed == 3 and sorted(again.snapshots) == [2, 3]
    assert same(weights(again.layer), weights(first.layer))
    momentum = [{k: v["momentum_buffer"] for k, v in e.optimizer.state_dict()["state"].items()} for e in (first, again)]
    assert same(*momentum) and again.scheduler.state_dict() == first.scheduler.state_dict()
    again.rollback(2)   # the server went back to its checkpoint: durable too
    assert engine(tmp_path).committed == 2
    again.rollback(0)   # a server run with nothing of this device: the initial state, kept for it
    assert same(weights(engine(tmp_path).layer), weights(engine(None).layer))


def test_a_bad_or_foreign_training_state_is_an_error_never_a_fresh_start(tmp_path):
    engine(tmp_path)
    path = progress_path(tmp_path, "device-0")
    snapshot = path.with_suffix("") / "0.pt"
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 1   # one bit flipped on disk
    snapshot.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="snapshot of batch 0 fails its checksum"):
        engine(tmp_path)
    path.write_text(path.read_text().replace('"committed": 0', '"committed": 7'))
    with pytest.raises(StateFileError, match="checksum"):
        engine(tmp_path)
    engine(tmp_path / "other")   # a valid server-head file: a device-head engine refuses it
    with pytest.raises(StateFileError, match="not of this device"):
        engine(tmp_path / "other", head="device")


def _train(url: str, e: DeviceTrainer, total: int) -> None:
    asyncio.run(train_device(DeviceClient(url, "device-0", TOKENS["device-0"], e, N, reconnect_timeout_s=30),
                             batch, total=total))


def _killed_after_backward(url: str, e: DeviceTrainer, batch_id: int) -> None:
    """Train up to `batch_id - 1`, then send `batch_id` and die once its BACKWARD is in, before committing it:
    the connection is aborted (no close frame) and the engine abandoned, as a killed process leaves them."""
    async def run() -> None:
        client = DeviceClient(url, "device-0", TOKENS["device-0"], e, N, reconnect_timeout_s=30)
        await client.connect()
        for b in range(1, batch_id):
            await client.train_batch(b, *batch(b))
        await client.send_batch(await client.prepare_batch(batch_id, *batch(batch_id)))
        client._ws.transport.abort()
    asyncio.run(run())


def device_weights(e: DeviceTrainer) -> dict[str, torch.Tensor]:
    """The device's layer and, with the device head, its classifier."""
    head = weights(e.classifier) if e.classifier is not None else {}
    return {**{f"layer.{k}": v for k, v in weights(e.layer).items()}, **{f"head.{k}": v for k, v in head.items()}}


@pytest.mark.parametrize("head", ["server", "device"])
def test_a_restarted_device_rejoins_its_run_exactly_once(tmp_path, head):
    """The device dies with batch 4's BACKWARD received but not committed (the server applied it). A device
    without training state cannot rejoin (it would start at batch 1 against a server at 4); one that kept it
    resumes at batch 3, re-sends batch 4 (answered from the server's cache, not applied again; with the device
    head, the head gradient it computed before sending EMBEDDING_GRAD was kept on disk for this) and finishes:
    the server applied 6 batches, each once, and both sides end exactly where an uninterrupted run ends."""
    total = 6
    with serve_in_thread(trainer(), tmp_path / "plain", max_batch=N) as server:
        _train(server.url, plain := engine(None, head), total)
        want_server, want_device = server_weights(server.trainer), device_weights(plain)

    with serve_in_thread(trainer(), tmp_path / "killed", max_batch=N) as server:
        _killed_after_backward(server.url, engine(tmp_path / "state", head), 4)
        with pytest.raises(RuntimeError, match=r"applied batch 4, device only 0: .*no --state-dir"):
            _train(server.url, engine(None, head), total)
        restarted = engine(tmp_path / "state", head)
        assert restarted.committed == 3
        _train(server.url, restarted, total)
        applied = server.server.records["device-0"].last_applied
        counted, steps = server.server.metrics.devices["device-0"].batches, server.trainer.steps
        got_server = server_weights(server.trainer)
    assert applied == counted == steps == total
    assert same(got_server, want_server) and same(device_weights(restarted), want_device)


def _sim(url: str, tmp_path: Path, run: str) -> subprocess.Popen:
    """`splitface-device sim` for one device: its layer trains (plain), no noise, 3 epochs of 3 batches of 8; its
    privacy and training state in <run>/privacy_state."""
    argv = [sys.executable, "-m", "splitface.device_cli", "sim", "--server", url, "--tokens", str(tmp_path / "tokens.json"),
            "--data", str(tmp_path / "faces"), "--image-folder", "--model", json.dumps(MODEL), "--devices", "1",
            "--epochs", "3", "--batch-size", "8", "--results", str(tmp_path / run / "results.json"), "--no-progress",
            "--threads", "1", "--reconnect-timeout", "30"]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_device_process_killed_mid_epoch_rejoins_the_same_run(tmp_path):
    """SIGKILL hits the device process while the server holds batch 5 (epoch 2 of 3) applied and its BACKWARD
    unsent. Restarted against the same server run, the device resumes its committed batch 4 from its training
    state, re-sends batch 5 (the server answers from its cache) and finishes with the same data order: the server
    applied 9 batches, each once, and the server's model and the device's layer equal an uninterrupted run's."""
    from tests.test_privacy_state import _image_folder
    _image_folder(tmp_path / "faces")
    (tmp_path / "tokens.json").write_text(json.dumps({"device-0": TOKENS["device-0"]}))
    plain = PausingTrainer(resolve_spec(MODEL), 3, None)
    with serve_in_thread(plain, tmp_path / "server-plain", max_batch=8) as server:
        _finish(_sim(server.url, tmp_path, "plain"))
        want = server_weights(server.trainer)

    pausing = PausingTrainer(resolve_spec(MODEL), 3, 5)
    with serve_in_thread(pausing, tmp_path / "server", max_batch=8) as server:
        proc = _sim(server.url, tmp_path, "killed")
        assert pausing.reached.wait(240), "the device never reached batch 5"
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        pausing.go.set()
        state = read_state(progress_path(tmp_path / "killed" / "privacy_state", "device-0"), FORMAT, "training state")
        assert state["committed"] == 4
        _finish(_sim(server.url, tmp_path, "killed"))
        applied = server.server.records["device-0"].last_applied
        counted, steps = server.server.metrics.devices["device-0"].batches, server.trainer.steps
        got = server_weights(server.trainer)
    assert applied == counted == steps == 9
    assert same(got, want)
    layers = [torch.load(tmp_path / run / "device_layers" / "device-0.pt") for run in ("plain", "killed")]
    assert same(*layers)
    device = json.loads((tmp_path / "killed" / "results.json").read_text())["devices"][0]
    assert device["resumed_at"] == 4 and device["committed"] == 9
    assert [b["batch_id"] for b in device["batches"]] == [5, 6, 7, 8, 9]
