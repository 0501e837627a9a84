"""The curious server's recorder keeps exactly what it received, once per batch, and nothing unless asked;
what it receives from a device with --noise discrete is int8 integers of the device's public step."""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from splitface.device.connection import DeviceClient
from splitface.common.data import load_lfw
from splitface.device.trainer import DeviceTrainer, PrivacyEngine, to_input
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.common.accountants.ledger import epsilon_of
from splitface.device.privacy.discrete import DiscreteGaussianMechanism
from splitface.server.recorder import Recorder, load_recordings
from tests.conftest import TOKENS, serve_in_thread, small_trainer

MODEL = "vgg_face_small"


def test_server_records_the_releases_it_received(lfw, tmp_path):
    split = load_lfw(lfw, min_images=10, max_identities=3)
    train = split.train.subset(np.arange(32))
    images, labels = train.load(64, 160), train.labels
    def frozen_engine() -> DeviceTrainer:  # a fixed layer: every release is layer(x)
        return DeviceTrainer(resolve_spec(MODEL), "conv1", "server", 3, TrainConfig(lr=0.05),
                            PrivacyEngine(layer_training="frozen"))

    async def train(url: str, engine: DeviceTrainer, batches: int = 4, size: int = 8, device: str = "device-0") -> list:
        client = DeviceClient(url, device, TOKENS[device], engine, batch_size=size)
        await client.connect()
        results = []
        for b in range(1, batches + 1):
            sl = slice((b - 1) * size, b * size)
            results.append(await client.train_batch(b, images[sl], labels[sl], np.arange(32)[sl]))
        await client.close()
        return results

    engine = frozen_engine()
    # --noise discrete end to end, on the same server: a second device releases int8 integers of its public step
    exact = DiscreteGaussianMechanism(clip_norm=16.0, noise_multiplier=1.0)
    discrete = DeviceTrainer(resolve_spec(MODEL), "conv1", "server", 3, TrainConfig(lr=0.05),
                            PrivacyEngine(exact, layer_training="frozen"))
    with serve_in_thread(small_trainer(3, MODEL), tmp_path / "server", record_max=20) as server:
        asyncio.run(train(server.url, engine))
        trained = asyncio.run(train(server.url, discrete, batches=2, size=4, device="device-1"))
    kept = load_recordings(tmp_path / "server" / "recordings")["device-0"]
    # room for 20 samples: batches 1 and 2 (16), not batch 3 (24 > 20)
    assert list(kept["batch_ids"]) == [1] * 8 + [2] * 8 and list(kept["rows"]) == list(range(8)) * 2
    assert kept["activations"].dtype == np.float16 and list(kept["labels"]) == list(labels[:16])
    with torch.no_grad():
        sent = engine.layer(to_input(images[:16])).numpy()
    np.testing.assert_allclose(kept["activations"].astype(np.float32), sent, atol=1e-3)

    assert all(np.isfinite(r.loss) for r in trained)  # the server trained on the integer releases
    values = 4 * 16 * 64 * 64  # per batch: sent as one byte each (f32 is the negotiated encoding here)
    assert all(values < r.bytes_sent < values + 1024 for r in trained)
    got = load_recordings(tmp_path / "server" / "recordings")["device-1"]["activations"].astype(np.float32)
    steps = got / np.float32(exact.step)  # kept as f16: integers to within f16's 11 bits
    assert got.shape == (8, 16, 64, 64) and np.abs(steps - np.rint(steps)).max() < 0.07
    assert np.abs(np.rint(steps)).max() <= 127 and np.unique(np.rint(steps)).size > 20  # noisy, in int8's range
    assert discrete.privacy.accountant.epsilon_image(0) == epsilon_of(exact.image_event(0), 1e-5)

    with serve_in_thread(small_trainer(3, MODEL), tmp_path / "quiet") as server:
        asyncio.run(train(server.url, frozen_engine()))
    assert not (tmp_path / "quiet" / "recordings").exists()


def test_a_replayed_batch_replaces_itself_and_survives_a_restart(tmp_path):
    rec = Recorder(tmp_path, max_per_device=10)
    rec.record("d", 1, np.ones((4, 2, 2, 2)), np.arange(4))
    rec.record("d", 2, np.ones((4, 2, 2, 2)), None)
    rec.record("d", 2, 2 * np.ones((4, 2, 2, 2)), None)          # replayed after a restart: same batch, once
    rec.record("d", 3, np.ones((4, 2, 2, 2)), None)              # would make 12 > 10: not kept
    rec.record_embedding_grad("d", 2, np.full((4, 5), 0.5))
    rec.flush()
    again = Recorder(tmp_path, max_per_device=10)                 # a restarted server picks up where it was
    assert sorted(again.batches["d"]) == [1, 2]
    data = load_recordings(tmp_path)["d"]
    assert list(data["batch_ids"]) == [1] * 4 + [2] * 4 and (data["activations"][4:] == 2).all()
    assert list(data["labels"]) == [0, 1, 2, 3] + [-1] * 4
    assert np.isnan(data["embedding_grads"][:4]).all() and (data["embedding_grads"][4:] == 0.5).all()
