"""Differential privacy through the real processes: noisy releases train, the accountant reports,
and the budget guard stops a device before it sends a release past its budget."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from splitface.common.accountants.ledger import PrivacyAccountant
from splitface.device.privacy.mechanisms import PerImageGaussian
from splitface.device.privacy.planner import release_schedule
from splitface.server.checkpoint import load_checkpoint
from tests.test_integration import DATA, MODEL, _setup, _start_server, _stop

pytestmark = pytest.mark.slow  # real processes or real-face training: the full tier

RELEASE_NUMEL = 16 * 64 * 64  # what one image releases: IResNet-small's conv1 (16 channels at 64x64)


def _simulate(port: int, lfw: Path, run_dir: Path, tokens: Path, *extra: str, data: list[str] = DATA) -> dict:
    cmd = [sys.executable, "-m", "splitface.device_cli", "sim", "--server", f"ws://127.0.0.1:{port}", "--tokens", str(tokens),
           "--data", str(lfw), *data, "--model", MODEL, "--devices", "2", "--batch-size", "32", "--lr", "0.05",
           "--results", str(run_dir / "results.json"), "--threads", "1", "--no-progress", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "results.json").read_text()) | {"stdout": proc.stdout}


def test_per_activation_noise_trains_and_is_accounted(tmp_path, lfw):
    tokens = _setup(tmp_path)
    server, port = _start_server(tmp_path)
    try:
        results = _simulate(port, lfw, tmp_path, tokens, "--epochs", "2", "--mechanism", "per-activation",
                            "--epsilon", "10", "--layer-training", "plain")
    finally:
        _stop(server)
    epochs = results["epochs"]
    assert len(epochs) == 2 and epochs[1]["train_loss"] < epochs[0]["train_loss"]
    # The accountant's figure: each image (train and test) released once per epoch, each release the
    # per-activation mechanism's per-image event over the 16x64x64 conv1 tensor.
    once, twice = release_schedule(10.0, 1e-5, RELEASE_NUMEL, 2)
    assert [e["epsilon_image_max"] for e in epochs] == pytest.approx([once, twice], rel=1e-6)
    assert twice > 1000   # the per-image view of the paper's per-activation epsilon = 10 is far weaker
    for device in results["devices"]:
        privacy = device["privacy"]
        assert privacy["mechanism"]["name"] == "per_activation" and privacy["mechanism"]["epsilon_per_activation"] == 10
        assert privacy["guarantee_void"]  # the layer trained without DP: the figures are flagged, not trusted
        # exactly once per epoch, every image: one release per batch, and the same epsilon for all images
        train, test = device["train_samples"], device["test_samples"]
        assert privacy["images"] == train + test
        assert privacy["releases"] == 2 * (math.ceil(train / 32) + math.ceil(test / 32))
        assert privacy["epsilon_image"]["min"] == privacy["epsilon_image"]["max"] == pytest.approx(twice, rel=1e-6)
    assert "treat the guarantee as void" in results["stdout"]


def _epsilon_after(releases: int, noise_multiplier: float) -> float:
    accountant = PrivacyAccountant(1e-5)
    for i in range(releases):
        accountant.record(f"r{i}", [0], [0], PerImageGaussian(5.0, noise_multiplier).image_event(1))
    return accountant.epsilon_image(0)


def test_budget_guard_stops_the_device_before_it_overspends(tmp_path, lfw):
    """Per-image noise with a budget that covers two releases of an image but not three: each device
    trains two epochs, stops at the first batch of epoch 3, and the server never receives that batch.
    Nothing here depends on learning, so it runs on 3 people (2 batches per device and epoch)."""
    two, three = _epsilon_after(2, 20.0), _epsilon_after(3, 20.0)
    budget = (two + three) / 2
    tokens = _setup(tmp_path)
    server, port = _start_server(tmp_path, num_classes=3)
    try:
        results = _simulate(port, lfw, tmp_path, tokens, "--epochs", "4", "--mechanism", "per-image",
                            "--noise-multiplier", "20", "--clip-norm", "5", "--layer-training", "frozen",
                            "--budget-epsilon", str(budget), data=["--min-images", "20", "--max-identities", "3"])
    finally:
        _stop(server)
    final = load_checkpoint(tmp_path / "checkpoint.pt")
    for device in results["devices"]:
        assert device["stopped"] and "budget" in device["stopped"]
        assert len(device["epochs"]) == 2
        assert device["privacy"]["epsilon_image"]["min"] == device["privacy"]["epsilon_image"]["max"] == \
            pytest.approx(two, rel=1e-6)   # every image released twice, none a third time
        assert not device["privacy"]["guarantee_void"]
        # the refused release is not on the books: two epochs' releases, train and evaluation
        train, test = device["train_samples"], device["test_samples"]
        assert device["privacy"]["releases"] == 2 * (math.ceil(train / 32) + math.ceil(test / 32))
        applied = final["devices"][device["device_id"]]["last_applied"]
        assert applied == sum(e["batches"] for e in device["epochs"])  # nothing past the budget was sent
    # epoch by epoch, the accountant's figure for one and two releases of every image (train and test)
    epsilons = [e["epsilon_image_max"] for e in results["epochs"]]
    assert epsilons == pytest.approx([_epsilon_after(1, 20.0), two], rel=1e-6)
