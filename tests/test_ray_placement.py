"""`splitface-device sim --placement ray` (slow: Ray's start-up and real device processes): the simulated devices as actors
of a real local Ray instance, against a real edge server on loopback, give the per-batch results of local simulator
processes (`--only-devices`, as `splitface-research demo --device-processes` runs them) for the same seeds.

Both runs are exact, not close: a device's batches are the same images (its share and order are seeded by its
index), its layer starts from the same seeded weights and runs on one torch thread either way (in every compute
thread from its first op: splitface/common/compute.py), and the server in
this process computes with the same thread count for both, so every float operation is the same one. With two
devices the server interleaves their batches by timing, so both sides learn at rate 0 there: every batch's loss
then depends only on its images and the initial weights (the server tail's batch norm normalises by the batch's own
statistics in training). One device learns at the usual rates: its batches reach the server in one order only.
The actors' CPU shares (fast): all of them fit on the cluster at once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitface.sim.cli import main as sim_main
from splitface.device.trainer import initial_layer
from splitface.common.models import ModelSpec
from splitface.sim.ray_placement import cpus_per_actor, ray_session
from splitface.sim.simulator import batches_per_epoch, merge_results
from tests.conftest import ROOT, TOKENS, serve_in_thread, small_trainer

pytest.importorskip("ray", reason="the Ray placement needs the `ray` extra (pip install splitface[ray])")

TINY = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=16, dropout=0.0)
IDENTITIES = 4
# where the devices ran, not what they did
PLACEMENT_KEYS = {"placement", "actors", "cpus_per_actor", "nodes", "niceness", "processes"}


@pytest.fixture(scope="module")
def local_ray():
    with ray_session(None, num_cpus=2, log_to_driver=False):   # the devices at the priority the command gives them
        yield


def sim_argv(lfw: Path, url: str, tokens: Path, results: Path, devices: int, lr: float) -> list[str]:
    """The same simulator run for both placements: tiny IResNet at 16 px, 4 identities of real faces, 2 epochs."""
    return ["--server", url, "--tokens", str(tokens), "--data", str(lfw), "--min-images", "10", "--max-images", "11",
            "--max-identities", str(IDENTITIES), "--model", json.dumps(TINY.to_dict()), "--devices", str(devices),
            "--epochs", "2", "--batch-size", "4", "--lr", str(lr), "--no-progress", "--results", str(results)]


def token_file(tmp_path: Path, devices: int) -> Path:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({d: TOKENS[d] for d in sorted(TOKENS)[:devices]}))
    return path


def on_local_processes(lfw: Path, tmp_path: Path, devices: int, lr: float) -> dict:
    """One `splitface-device sim` process per device (--only-devices k:k+1, one torch thread), at once, against a fresh
    server; their parts merged as splitface-research demo merges them."""
    tokens = token_file(tmp_path, devices)
    with serve_in_thread(small_trainer(IDENTITIES, TINY, lr=lr), tmp_path / "server-local") as server:
        parts = [tmp_path / "local" / f"results.part-{k}.json" for k in range(devices)]
        procs = [subprocess.Popen([sys.executable, "-m", "splitface.device_cli", "sim",
                                   *sim_argv(lfw, server.url, tokens, parts[k], devices, lr), "--threads", "1",
                                   *(["--only-devices", f"{k}:{k + 1}"] if devices > 1 else [])],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for k in range(devices)]
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, out[-3000:]
    loaded = [json.loads(p.read_text()) for p in parts]
    return merge_results(loaded, processes=devices) if devices > 1 else loaded[0]


def on_ray(lfw: Path, tmp_path: Path, devices: int, lr: float) -> dict:
    """`splitface-device sim --placement ray` (its own main, in this process: Ray is this module's local instance), one
    actor per device, against a fresh server."""
    tokens = token_file(tmp_path, devices)
    results = tmp_path / "ray" / "results.json"
    with serve_in_thread(small_trainer(IDENTITIES, TINY, lr=lr), tmp_path / "server-ray") as server:
        sim_main([*sim_argv(lfw, server.url, tokens, results, devices, lr), "--placement", "ray"])
    return json.loads(results.read_text())


def test_every_actor_asks_for_a_share_of_the_cpus_that_lets_all_run_at_once():
    for actors, cpus in [(64, 2), (3, 2), (2, 2), (1, 16), (7, 3)]:
        share = cpus_per_actor(actors, cpus)
        assert 0 < share <= 1 and actors * share <= cpus   # Ray places them all at once, none waits for a CPU
        assert share == 1 or actors * (share + 1e-4) > cpus   # and no smaller than Ray's step makes it
    assert cpus_per_actor(64, 2) == 0.0312 and cpus_per_actor(2, 2) == 1.0


def per_batch(results: dict) -> list[list[tuple]]:
    """What each device's batches gave: (batch id, images, loss, correct), by device."""
    return [[(b["batch_id"], b["n"], b["loss"], b["n_correct"]) for b in d["batches"]] for d in results["devices"]]


def shape(value) -> object:
    """A results.json's keys, nested, without the values (lists by their first element)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


@pytest.mark.slow
def test_two_devices_on_ray_give_the_per_batch_losses_of_local_processes(local_ray, lfw, tmp_path):
    local = on_local_processes(lfw, tmp_path, devices=2, lr=0.0)
    placed = on_ray(lfw, tmp_path, devices=2, lr=0.0)
    assert [d["device_id"] for d in placed["devices"]] == ["device-0", "device-1"]
    assert per_batch(placed) == per_batch(local)
    assert [len(b) for b in per_batch(placed)] == \
        [2 * batches_per_epoch(d["train_samples"], 4) for d in placed["devices"]]   # 2 epochs at batch 4
    assert [[e["train_loss"] for e in d["epochs"]] for d in placed["devices"]] == \
        [[e["train_loss"] for e in d["epochs"]] for d in local["devices"]]
    assert placed["config"]["placement"] == "ray" and placed["config"]["actors"] == 2
    assert placed["config"]["cpus_per_actor"] == 1.0 and placed["config"]["only_devices"] is None
    strip = lambda r: {**r, "config": {k: v for k, v in r["config"].items() if k not in PLACEMENT_KEYS}}
    assert shape(strip(placed)) == shape(strip(local))
    layers = sorted(p.name for p in (tmp_path / "ray" / "device_layers").iterdir())
    assert layers == ["device-0.pt", "device-1.pt"]   # sent back by the actors, written here


@pytest.mark.slow
def test_one_device_learning_on_ray_equals_a_local_process_bit_for_bit(local_ray, lfw, tmp_path):
    local = on_local_processes(lfw, tmp_path, devices=1, lr=0.05)
    placed = on_ray(lfw, tmp_path, devices=1, lr=0.05)
    assert per_batch(placed) == per_batch(local)
    assert placed["devices"][0]["epochs"][-1]["test_loss"] == local["devices"][0]["epochs"][-1]["test_loss"]
    a = torch.load(tmp_path / "ray" / "device_layers" / "device-0.pt")
    b = torch.load(tmp_path / "local" / "device_layers" / "device-0.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = initial_layer(TINY, "conv1", seed=0).state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)   # it did learn
