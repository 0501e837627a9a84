"""The curious server's recorder keeps exactly what it received, once per batch, and nothing unless asked."""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from device_sdk.client import DeviceClient
from device_sdk.data import load_lfw
from device_sdk.engine import DeviceEngine, PrivacyEngine, to_input
from device_sdk.models import resolve_spec
from device_sdk.optim import TrainConfig
from edge_server.recorder import Recorder, load_recordings
from tests.conftest import TOKENS, serve_in_thread, small_trainer

MODEL = "vgg_face_small"


def test_server_records_the_releases_it_received(lfw, tmp_path):
    split = load_lfw(lfw, min_images=10, max_identities=3)
    train = split.train.subset(np.arange(32))
    images, labels = train.load(64, 160), train.labels
    def frozen_engine() -> DeviceEngine:  # a fixed layer: every release is layer(x)
        return DeviceEngine(resolve_spec(MODEL), "conv1", "server", 3, TrainConfig(lr=0.05),
                            PrivacyEngine(layer_training="frozen"))

    async def train_four_batches(url: str, engine: DeviceEngine) -> None:
        client = DeviceClient(url, "device-0", TOKENS["device-0"], engine, batch_size=8)
        await client.connect()
        for b in range(1, 5):
            sl = slice((b - 1) * 8, b * 8)
            await client.train_batch(b, images[sl], labels[sl], np.arange(32)[sl])
        await client.close()

    engine = frozen_engine()
    with serve_in_thread(small_trainer(3, MODEL), tmp_path / "server", record_max=20) as server:
        asyncio.run(train_four_batches(server.url, engine))
    kept = load_recordings(tmp_path / "server" / "recordings")["device-0"]
    # room for 20 samples: batches 1 and 2 (16), not batch 3 (24 > 20)
    assert list(kept["batch_ids"]) == [1] * 8 + [2] * 8 and list(kept["rows"]) == list(range(8)) * 2
    assert kept["activations"].dtype == np.float16 and list(kept["labels"]) == list(labels[:16])
    with torch.no_grad():
        sent = engine.layer(to_input(images[:16])).numpy()
    np.testing.assert_allclose(kept["activations"].astype(np.float32), sent, atol=1e-3)

    with serve_in_thread(small_trainer(3, MODEL), tmp_path / "quiet") as server:
        asyncio.run(train_four_batches(server.url, frozen_engine()))
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
