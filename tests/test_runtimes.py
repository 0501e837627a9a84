"""The simulator trains through each backend against a real loopback server, and the
trajectories agree: same noise (keyed by the release), same losses, same final device layer.
The native runner (a C++ process per device) on VGG-Face's conv1 at 64 px, batch 2, a few steps."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from device_sdk.data import load_lfw
from device_sdk.engine import PrivacyEngine
from device_sdk.models import resolve_spec
from device_sdk.optim import TrainConfig
from device_sdk.privacy.mechanisms import NoNoise, PerActivationGaussian
from device_sdk.simulator import SimConfig, simulate
from tests.conftest import TOKENS, serve_in_thread, small_trainer

pytestmark = pytest.mark.slow  # real processes or real-face training: the full tier

MODEL = "iresnet_small"


def train_with(backend: str, lfw, tmp_path, model: str = MODEL, images: int = 64, batch_size: int = 24,
               epochs: int = 2, mechanism=lambda: PerActivationGaussian(10.0, 1e-5)) -> tuple[list[float], dict]:
    data = load_lfw(lfw, min_images=10, max_identities=4)
    data.train = data.train.subset(np.arange(images))
    data.test = data.test.subset(np.arange(8))
    config = SimConfig(url="", spec=resolve_spec(model), num_devices=1, epochs=epochs, batch_size=batch_size,
                       progress=False, train=TrainConfig(lr=0.05), backend=backend, artifacts=tmp_path / "artifacts",
                       privacy=lambda: PrivacyEngine(mechanism=mechanism(), secret=7))
    with serve_in_thread(small_trainer(len(data.class_names), model, lr=0.05), tmp_path / backend) as server:
        config.url = server.url
        results = asyncio.run(simulate(config, data, {"device-0": TOKENS["device-0"]}))
    epochs = results["devices"][0]["epochs"]
    # train losses depend on every release and step; the last test loss on the final device layer and server
    return [e["train_loss"] for e in epochs] + [epochs[-1]["test_loss"]], epochs[-1]


@pytest.fixture(scope="module")
def reference(lfw, tmp_path_factory):
    return train_with("torch", lfw, tmp_path_factory.mktemp("torch"))


@pytest.mark.parametrize("backend", ["executorch", "onnxruntime"])
def test_backend_trains_like_eager_pytorch(backend, reference, lfw, tmp_path):
    want_losses, _ = reference
    losses, last_epoch = train_with(backend, lfw, tmp_path)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-3)
    # 3 batches per epoch of which 1 is warm-up; the meter reports every phase and names the missing energy counter
    cost = last_epoch["cost"]
    assert cost["forward_s"]["n"] == 2 and cost["backward_s"]["mean"] > 0 and cost["server_s"]["mean"] > 0
    assert cost["bytes_sent_per_batch"] > 24 * 16 * 64 * 64 * 4 * 0.3
    assert (cost["energy_j_per_batch"] is None) == (cost["energy_note"] is not None)


def test_native_backend_trains_vgg_face_like_eager_pytorch(lfw, tmp_path, monkeypatch):
    """Six steps of VGG-Face's conv1 (64 px, batch 2) through the C++ runner: without noise its releases and
    weight gradients move the layer as eager PyTorch's do (every loss depends on both). With noise every release
    is drawn in the runner under the engine's key (another sampler than torch's, so the losses are not compared;
    tests/test_native.py holds that noise to its reference) and training runs."""
    from device_sdk.runtimes.native_runtime import NativeRuntime

    small = {"model": "vgg_face_small", "images": 6, "batch_size": 2, "epochs": 2, "mechanism": NoNoise}
    want_losses, _ = train_with("torch", lfw, tmp_path / "torch", **small)
    calls = {"weight_grads": 0, "keyed_release": 0}
    for method in calls:
        def counted(self, *args, _method=getattr(NativeRuntime, method), _name=method, **kw):
            calls[_name] += 1
            return _method(self, *args, **kw)
        monkeypatch.setattr(NativeRuntime, method, counted)
    losses, last_epoch = train_with("native", lfw, tmp_path / "native", **small)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-3)
    # the load's self-check (two weight sets), then every step: none fell back to torch
    assert calls["weight_grads"] == 2 + 6 and calls["keyed_release"] >= 6
    assert last_epoch["cost"]["forward_s"]["mean"] > 0
    noisy, _ = train_with("native", lfw, tmp_path / "noisy", **{**small, "mechanism": lambda: PerActivationGaussian(3.0, 1e-5)})
    assert np.isfinite(noisy).all() and noisy != losses and calls["weight_grads"] == 2 * (2 + 6)
