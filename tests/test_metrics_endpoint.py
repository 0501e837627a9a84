"""Server metrics: restored from the checkpoint on resume (issue #16: 127 of 200 batches counted after a
kill -9), and scraped from the Prometheus endpoint over HTTP; with them the device's reported spent epsilon
(SPEC.md section 5.11), which the resumed server hands back in WELCOME and guards against going down."""
from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitface.device.connection import DeviceClient, Rollback
from splitface.device.trainer import DeviceTrainer
from splitface.device.privacy.engine import PrivacyEngine
from splitface.device.privacy.mechanisms import PerImageGaussian
from splitface.device.privacy.state import LostPrivacyState, spent_epsilon
from splitface.protocol import messages as m
from splitface.protocol.errors import RemoteError
from tests.conftest import TOKENS, serve_in_thread, small_trainer

NUM_CLASSES = 5


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _batch(batch_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same 4 images (ids 0-3) with new pixels each batch: every batch is one more release of each."""
    rng = np.random.default_rng(batch_id)
    return rng.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8), np.arange(4), np.arange(4)  # image i: person i


async def _train(client: DeviceClient, batch_id: int) -> None:
    await client.train_batch(batch_id, *_batch(batch_id))


def _private_client(url: str, trainer, state_file) -> DeviceClient:
    """A device with a formal mechanism (per-image Gaussian, frozen public layer) and a durable state file."""
    privacy = PrivacyEngine(PerImageGaussian(1.0, 2.0), layer_training="frozen", state_path=state_file)
    return DeviceClient(url, "device-0", TOKENS["device-0"],
                        DeviceTrainer(trainer.spec, "conv1", "server", NUM_CLASSES, privacy=privacy), batch_size=8)


@pytest.mark.slow
def test_metrics_survive_a_crash_and_are_scraped(tmp_path):
    """Server A applies batches 1-5 and checkpoints after 3; it 'crashes' (B starts from that checkpoint, as
    after a kill -9). B's metrics count 3, then 5 once the device has replayed 4 and 5: the count equals the
    batches applied, never those lost with the crash. The device reports its spent epsilon: B resumes the figure
    of A's checkpoint (and hands it back in WELCOME), then shows the device's own once it has replayed; a lower
    claim is refused, and a device that lost its state file cannot start."""
    first, second = tmp_path / "a", tmp_path / "b"
    second.mkdir()
    client = None
    with serve_in_thread(small_trainer(NUM_CLASSES), first, max_batch=8, checkpoint_every_s=1e9) as a:
        async def until_crash() -> DeviceClient:
            c = _private_client(a.url, a.trainer, tmp_path / "state" / "device-0.privacy.json")
            await c.connect()
            for b in (1, 2, 3):
                await _train(c, b)
            with pytest.raises(RemoteError, match="out_of_order"):
                await _train(c, 9)
            await c.close()
            return c
        client = asyncio.run(until_crash())
        asyncio.run_coroutine_threadsafe(a.server.checkpoint(), a._loop).result(60)
        shutil.copy(first / "checkpoint.pt", second / "checkpoint.pt")
        checkpointed = a.server.metrics.epsilon["device-0"]  # the claim of batch 3 (batch 9's was refused)
        assert 0 < checkpointed < spent_epsilon(client.engine.privacy.guard)

        async def after_checkpoint() -> None:
            await client.reconnect()
            for b in (4, 5):
                await _train(client, b)
            await client.close()
        asyncio.run(after_checkpoint())

    with serve_in_thread(small_trainer(NUM_CLASSES), second, max_batch=8, metrics_port=0) as b:
        port = b.server.metrics_port
        resumed = _scrape(port)
        assert resumed[("splitface_batches_total", ())] == 3
        assert resumed[("splitface_device_batches_total", (("device", "device-0"),))] == 3
        assert resumed[("splitface_errors_total", (("code", "out_of_order"),))] == 1
        assert resumed[("splitface_step_seconds_count", ())] == 3
        assert resumed[("splitface_spent_epsilon", (("device", "device-0"),))] == checkpointed

        async def replay() -> float:
            client.url = b.url
            with pytest.raises(Rollback):
                await client.reconnect()
            for batch in (4, 5):
                await _train(client, batch)
            spent = spent_epsilon(client.engine.privacy.guard)
            activations = np.zeros((4, *client.session.welcome["activation_shape"]), np.float32)
            lower = client.session.forward(6, activations, _batch(6)[1], spent_epsilon=spent / 2)
            with pytest.raises(RemoteError, match="epsilon_regressed"):
                await client.request(lower, {m.BACKWARD}, 6)
            await client.close()
            return spent
        spent = asyncio.run(replay())
        assert b.server.records["device-0"].last_applied == 5  # the lower claim's batch was not applied

        async def lost_state() -> None:
            fresh = _private_client(b.url, b.trainer, tmp_path / "new-state" / "device-0.privacy.json")
            with pytest.raises(LostPrivacyState, match=rf"new-state/device-0\.privacy\.json says epsilon 0 spent, "
                                                       rf"but the server recorded {spent:.6g}"):
                await fresh.connect()
        asyncio.run(lost_state())
        now = _scrape(port)
        assert now[("splitface_batches_total", ())] == 5 == b.server.records["device-0"].last_applied
        assert now[("splitface_samples_total", ())] == 20
        assert now[("splitface_step_seconds_count", ())] == 5
        assert now[("splitface_step_seconds_bucket", (("le", "+Inf"),))] == 5
        assert now[("splitface_sessions_total", ())] == 3   # A's before its checkpoint, B's, and the one that stopped
        assert now[("splitface_bytes_total", (("direction", "in"),))] > 5 * 4 * 16 * 64 * 64 * 4
        assert now[("splitface_spent_epsilon", (("device", "device-0"),))] == spent  # re-sent releases: free
        assert now[("splitface_errors_total", (("code", "epsilon_regressed"),))] == 1
        assert ("splitface_sessions_open", ()) in now
    summary = json.loads((second / "metrics.json").read_text())
    assert summary["global"]["batches"] == 5 and summary["errors"] == {"epsilon_regressed": 1, "out_of_order": 1}
    assert summary["epsilon"] == {"device-0": spent}


def test_metrics_state_round_trips_into_the_exposition():
    from prometheus_client import CollectorRegistry, generate_latest

    from splitface.server.metrics import Metrics, PrometheusCollector
    metrics = Metrics()
    for seconds in (0.003, 0.003, 7.0, 60.0):
        metrics.batch("d1", 4, seconds, loss=1.0, n_correct=1)
    metrics.error("bad_tensor")
    metrics.closed("hello_timeout")
    restored = Metrics.from_state(json.loads(json.dumps(metrics.state())))  # as a checkpoint would keep it
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(lambda: restored, lambda: 0))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("splitface_step_seconds_bucket", (("le", "0.005"),))] == 2
    assert samples[("splitface_step_seconds_bucket", (("le", "10.0"),))] == 3
    assert samples[("splitface_step_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("splitface_step_seconds_sum", ())] == pytest.approx(67.006)
    assert samples[("splitface_errors_total", (("code", "bad_tensor"),))] == 1
    assert samples[("splitface_closes_total", (("reason", "hello_timeout"),))] == 1
    assert samples[("splitface_device_batches_total", (("device", "d1"),))] == 4
