"""A device's privacy state survives it (issue #16, item 6): the spent epsilon, the budget and the noise
secret are on disk before a release leaves, a restarted device resumes them, and a re-sent release costs
nothing only if it is bit-identical. The process test kills a real device process mid-epoch and restarts it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from PIL import Image

from splitface.device.connection import FAULT_ENV
from splitface.common.faults import FAULT_EXIT
from splitface.device.trainer import DeviceTrainer
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.common.accountants.ledger import epsilon_of
from splitface.device.privacy.budget import BudgetExceeded
from splitface.device.privacy.engine import PrivacyEngine, attempt_key
from splitface.device.privacy.mechanisms import PerImageGaussian
from splitface.device.privacy.state import StateFileError, read_state, state_path, write_state
from splitface.server.trainer import ServerTrainer
from tests.conftest import ROOT, TOKENS, serve_in_thread

MODEL = {"family": "vgg_face", "input_size": 32, "width": 4, "fc_width": 32, "dropout": 0.0}
Z, DELTA = 2.0, 1e-5
RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
IDS, LABELS = [10, 11, 12, 13], [0, 1, 1, 2]


def eps(releases: int) -> float:
    """Per-image epsilon after `releases` releases of GaussianDpEvent(Z), straight from dp_accounting."""
    return epsilon_of(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(Z), releases), DELTA)


def frozen_engine(path: Path, budget: float = float("inf"), **kw) -> DeviceTrainer:
    privacy = PrivacyEngine(PerImageGaussian(1.0, Z), delta=DELTA, budget_epsilon=budget, layer_training="frozen",
                            state_path=path, **kw)
    return DeviceTrainer(resolve_spec(MODEL), "conv1", "server", 3, TrainConfig(), privacy)


def test_state_file_is_written_whole_and_checked(tmp_path):
    path = state_path(tmp_path / "state", "device-0")
    write_state(path, {"secret": "ab", "n": [1, 2]})
    assert read_state(path) == {"secret": "ab", "n": [1, 2]}
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.listdir(path.parent) == [path.name]  # no temp file left
    with pytest.raises(ValueError, match="cannot name a state file"):
        state_path(tmp_path, "../elsewhere")

    text = path.read_text()
    for broken, why in [(text[: len(text) // 2], "corrupt"), (text.replace('"n": [1, 2]', '"n": [1, 3]'), "checksum"),
                        (json.dumps({"format": "other"}), "not a device privacy state"), ("", "corrupt")]:
        path.write_text(broken)
        with pytest.raises(StateFileError, match=why):
            read_state(path)


def test_a_corrupt_state_file_is_an_error_never_a_reset(tmp_path):
    path = tmp_path / "device-0.privacy.json"
    engine = PrivacyEngine(PerImageGaussian(1.0, Z), delta=DELTA, state_path=path)
    engine.release(("train", 1), IDS, LABELS, engine.mechanism.image_event(16),
                   lambda g: {"released": engine.mechanism.privatize(torch.ones(4, 16), g)})
    assert engine.accountant.max_epsilon_image() == pytest.approx(eps(1), rel=1e-6)
    body = json.loads(path.read_text())
    body["state"]["accountant"]["images"][0][2][0][1] = 0  # "this image was never released": the checksum says no
    path.write_text(json.dumps(body))
    with pytest.raises(StateFileError, match="checksum"):
        PrivacyEngine(PerImageGaussian(1.0, Z), delta=DELTA, state_path=path)
    path.write_bytes(path.read_bytes()[:100])  # a torn write cannot happen (os.replace), a damaged disk can
    with pytest.raises(StateFileError, match="corrupt"):
        frozen_engine(path)
    assert path.read_bytes() == json.dumps(body).encode()[:100]  # refused, not overwritten with a fresh state


def test_a_restarted_engine_resumes_its_epsilon_secret_and_budget(tmp_path):
    path = tmp_path / "device-0.privacy.json"
    first = frozen_engine(path, budget=(eps(1) + eps(2)) / 2)  # room for one release of each image
    assert path.exists()  # the secret is on disk before any release
    released = first.forward(IMAGES, ("train", 1), IDS, LABELS)
    assert first.privacy.secret.bit_length() > 128  # drawn from the OS CSPRNG, not a seed

    again = frozen_engine(path, budget=(eps(1) + eps(2)) / 2)
    assert again.privacy.secret == first.privacy.secret
    assert again.privacy.accountant.epsilon_image(10) == pytest.approx(eps(1), rel=1e-6)  # resumed, not 0
    assert np.array_equal(again.forward(IMAGES, ("train", 1), IDS, LABELS), released)  # the re-send: same bits
    assert again.privacy.accountant.epsilon_image(10) == pytest.approx(eps(1), rel=1e-6)  # ... and free
    with pytest.raises(BudgetExceeded):
        again.forward(IMAGES, ("train", 2), IDS, LABELS)
    assert "train:2" not in read_state(path)["accountant"]["releases"]  # refused: nothing recorded or saved
    with pytest.raises(StateFileError, match="another noise secret"):
        frozen_engine(path, secret=12345)
    with pytest.raises(StateFileError, match="delta"):
        PrivacyEngine(PerImageGaussian(1.0, Z), delta=1e-6, state_path=path)


def test_a_re_release_that_differs_gets_fresh_noise_and_is_counted(tmp_path):
    """The same key on different values must not reuse the noise (the difference of the two would be noise-free):
    it becomes a new attempt, with its own noise, and the accountant counts it."""
    engine = PrivacyEngine(PerImageGaussian(1.0, Z), delta=DELTA, state_path=tmp_path / "d.privacy.json")
    event = engine.mechanism.image_event(16)

    def release(signal: torch.Tensor) -> torch.Tensor:
        return engine.release(("train", 1), IDS, LABELS, event,
                              lambda g: {"released": engine.mechanism.privatize(signal, g)})["released"]

    signal = torch.zeros(4, 16)
    first = release(signal)  # all noise: the signal clips to 0
    assert torch.equal(release(signal), first) and engine.accountant.epsilon_image(10) == pytest.approx(eps(1), rel=1e-6)
    changed = release(signal + 1)
    assert not torch.allclose(changed - engine.mechanism.clip(signal + 1), first)  # fresh noise, not the old one
    assert engine.accountant.epsilon_image(10) == pytest.approx(eps(2), rel=1e-6)
    assert engine.attempt(("train", 1)) == 1 and attempt_key(("train", 1), 1) in engine.accountant.state_dict()["releases"]
    resumed = PrivacyEngine(PerImageGaussian(1.0, Z), delta=DELTA, state_path=tmp_path / "d.privacy.json")
    assert resumed.attempt(("train", 1)) == 1
    # without noise there is nothing to reuse: the key stays (a fresh draw would only show other dct_keep channels)
    plain = PrivacyEngine()
    for value in (0.0, 1.0):
        plain.release(("train", 1), IDS, LABELS, event, lambda g: {"released": torch.full((4, 16), value)})
    assert plain.attempt(("train", 1)) == 0


def _image_folder(root: Path) -> None:
    """3 people x 9 photos of noise (the test is about the books, not the faces): 24 train, 3 test images."""
    rng = np.random.default_rng(1)
    for person in range(3):
        (root / f"p{person}").mkdir(parents=True)
        for k in range(9):
            Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(root / f"p{person}" / f"{k}.png")


def _device_process(url: str, tmp_path: Path, budget: float, fault: str = "") -> subprocess.CompletedProcess:
    """`splitface-device sim` for one device: frozen public layer, per-image noise z = 2, 3 epochs of 3 batches."""
    argv = [sys.executable, "-m", "splitface.device_cli", "sim", "--server", url, "--tokens", str(tmp_path / "tokens.json"),
            "--data", str(tmp_path / "faces"), "--image-folder", "--model", json.dumps(MODEL), "--devices", "1",
            "--epochs", "3", "--batch-size", "8", "--mechanism", "per-image", "--noise-multiplier", str(Z),
            "--layer-training", "frozen", "--budget-epsilon", str(budget), "--results",
            str(tmp_path / "run" / "results.json"), "--no-progress", "--threads", "1", "--reconnect-timeout", "30"]
    env = {**os.environ, FAULT_ENV: fault}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_device_process_killed_mid_epoch_resumes_its_budget(tmp_path):
    """The device process exits hard right after sending batch 5 (epoch 2 of 3); restarted, it resumes its spent
    epsilon, re-sends batches 1-5 bit-identically and free, and refuses the third release of any image.
    The restarted device meets a fresh server run, which has nothing of it, so it starts again from its initial
    layer at batch 1 (tests/test_training_state.py has it rejoin the same run); its privacy state carries over."""
    _image_folder(tmp_path / "faces")
    (tmp_path / "tokens.json").write_text(json.dumps({"device-0": TOKENS["device-0"]}))
    budget = (eps(2) + eps(3)) / 2  # two releases of each image, not three
    state_file = tmp_path / "run" / "privacy_state" / "device-0.privacy.json"

    with serve_in_thread(ServerTrainer(resolve_spec(MODEL), "conv1", 3, TrainConfig()), tmp_path / "server-1") as server:
        crashed = _device_process(server.url, tmp_path, budget, fault="device-0=crash-after-forward:5")
    assert crashed.returncode == FAULT_EXIT, crashed.stderr[-2000:]
    before = read_state(state_file)
    assert {f"train:{b}" for b in range(1, 6)} <= set(before["accountant"]["releases"])
    assert "train:6" not in before["accountant"]["releases"]

    with serve_in_thread(ServerTrainer(resolve_spec(MODEL), "conv1", 3, TrainConfig()), tmp_path / "server-2") as server:
        restarted = _device_process(server.url, tmp_path, budget)
        reported = server.server.metrics.epsilon["device-0"]  # the device's last FORWARD's spent_epsilon
        kept = state_file.read_bytes()
        state_file.unlink()  # lost: the device would start again at epsilon 0, but the server's WELCOME says more
        lost = _device_process(server.url, tmp_path, budget)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert lost.returncode == 1 and f"{state_file} says epsilon 0 spent, but the server recorded {reported:.6g}" \
        in lost.stderr, lost.stderr[-2000:]
    assert server.server.records["device-0"].last_applied == 6  # the device that lost its state sent nothing
    state_file.write_bytes(kept)  # restored by the operator
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    device = results["devices"][0]
    after = read_state(state_file)
    assert after["secret"] == before["secret"]
    # batches 1-5 and the first evaluation were re-sent bit-identically: the same attempt and digest, no new cost
    for key, (attempt, digest) in before["attempts"].items():
        assert after["attempts"][key] == [attempt, digest] and attempt == 0
    # resumed, not reset: after epoch 1 of the restarted run, images of batches 4-5 already had two releases
    assert device["epochs"][0]["epsilon_image_max"] == pytest.approx(eps(2), rel=1e-6)
    # and refused past the budget: epoch 3 would release every image a third time
    assert device["stopped"] and "refused" in device["stopped"] and "train:7" in device["stopped"]
    assert len(device["epochs"]) == 2 and device["privacy"]["epsilon_image"]["max"] <= budget
    assert reported == device["privacy"]["epsilon_image"]["max"]  # what went on the wire is the accountant's figure
    assert not any(k.startswith("train:7") for k in after["accountant"]["releases"])
