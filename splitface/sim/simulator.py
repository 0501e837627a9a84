"""N simulated devices, each with its own share of the data, training against one edge server.

Each device draws its batches from a seeded per-epoch permutation of its share, so batch id
k always means the same images: a batch replayed after a server restart is the same batch.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from splitface.device.connection import DeviceClient, Rollback
from splitface.common.data import DataSplit, FaceSet, partition
from splitface.device.trainer import DeviceTrainer
from splitface.device.meter import summarize_costs
from splitface.common.models import ModelSpec
from splitface.common.optim import TrainConfig
from splitface.device.privacy.budget import BudgetExceeded
from splitface.device.privacy.engine import PrivacyEngine
from splitface.device.privacy.state import state_path
from splitface.device.progress import progress_path
from splitface.device.runtimes import load_runtime
from splitface.export.exporter import EXPORTER

log = logging.getLogger("splitface.simulator")


@dataclass
class SimConfig:
    url: str
    spec: ModelSpec
    split: str = "conv1"
    head: str = "server"
    num_devices: int = 2
    epochs: int = 3
    batch_size: int = 64
    partition: str = "iid"
    crop: int = 160
    encodings: dict[str, str] = field(default_factory=lambda: {"activations": "f32", "gradients": "f32"})
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    results: Path | None = None
    progress: bool = True
    reconnect_timeout_s: float = 120.0
    ca_file: Path | None = None            # CA certificates trusted for a wss:// server (host names checked)
    insecure: bool = False                 # allow plain ws:// to a host off loopback (tokens then travel in clear)
    privacy: Callable[[], PrivacyEngine] = PrivacyEngine   # one per device: each has its own secret
    state_dir: Path | None = None          # each device's durable privacy state (None: kept in memory only)
    device_weights: Path | None = None
    backend: str = "torch"                 # splitface.device.runtimes.BACKENDS (torch, executorch, native, ...)
    artifacts: Path | None = None          # exported programs for the backend (exported here if empty)
    pipeline: bool = False                 # make batch n+1's release while batch n is at the server
    data: dict[str, Any] = field(default_factory=dict)  # how the data was selected: lets an audit find each batch's images
    # run only devices [start, stop) of the num_devices here (each keeps its index, share and seeds): the others run
    # in other processes (splitface-research demo --device-processes); None: all of them
    only_devices: tuple[int, int] | None = None

    def devices_here(self) -> range:
        if self.only_devices is None:
            return range(self.num_devices)
        start, stop = self.only_devices
        if not 0 <= start < stop <= self.num_devices:
            raise ValueError(f"only_devices {start}:{stop} is not a non-empty range of the {self.num_devices} devices")
        return range(start, stop)


class DeviceData:
    """A device's share, decoded once into memory, with stable image ids for the accountant."""

    def __init__(self, train: FaceSet, test: FaceSet, size: int, crop: int, ids: dict[str, int]):
        self.train_images, self.train_labels = train.load(size, crop), train.labels
        self.test_images, self.test_labels = test.load(size, crop), test.labels
        self.train_ids = np.array([ids[str(p)] for p in train.paths], dtype=np.int64)
        self.test_ids = np.array([ids[str(p)] for p in test.paths], dtype=np.int64)


def batches_per_epoch(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


def batch_indices(n: int, batch_size: int, batch_id: int, seed: int, device: int) -> tuple[int, np.ndarray]:
    """(epoch, indices) of training batch `batch_id` (1-based, counted across epochs)."""
    per_epoch = batches_per_epoch(n, batch_size)
    epoch, j = divmod(batch_id - 1, per_epoch)
    order = np.random.default_rng([seed, device, epoch]).permutation(n)
    return epoch, order[j * batch_size:(j + 1) * batch_size]


def prepares_ahead(pipeline: bool, batch_id: int, total: int, per_epoch: int) -> bool:
    """Whether batch n+1's release is made while batch n is at the server: pipelined, not after the last batch,
    and not across an epoch's end. There the epoch's evaluation releases come first; they can raise the device's
    spent epsilon, and a training FORWARD made before them would carry the lower figure, which the server
    refuses as epsilon_regressed (SPEC 5.11)."""
    return pipeline and batch_id < total and batch_id % per_epoch != 0


class SimulatedDevice:
    def __init__(self, index: int, device_id: str, token: str, data: DeviceData, num_classes: int, config: SimConfig):
        self.index, self.data, self.config = index, data, config
        total = batches_per_epoch(len(data.train_labels), config.batch_size) * config.epochs
        decay_steps = config.train.decay_steps if config.train.decay_steps > 0 else total
        # Every device starts from the same initial layer (as if all downloaded one published model);
        # only their data, and so their updates, differ.
        train_cfg = TrainConfig(**{**asdict(config.train), "decay_steps": decay_steps})
        privacy = config.privacy()
        if config.state_dir is not None:  # resume what this device spent, and its noise secret
            privacy.open_state(state_path(config.state_dir, device_id))
        engine = DeviceTrainer(config.spec, config.split, config.head, num_classes, train_cfg, privacy,
                              config.device_weights, pipeline=config.pipeline)
        if config.state_dir is not None:  # resume the batch it had committed: it rejoins the server's run there
            engine.open_progress(progress_path(config.state_dir, device_id))
        if config.backend != "torch":
            if config.artifacts is None:
                raise ValueError(f"the {config.backend} backend needs SimConfig.artifacts (a directory)")
            engine.attach_runtime(load_runtime(config.backend, engine.layer, config.spec.input_size, config.batch_size,
                                               config.artifacts, real_images=data.train_images[:config.batch_size],
                                               exporter=EXPORTER))
        self.client = DeviceClient(config.url, device_id, token, engine, config.batch_size, config.encodings,
                                   config.reconnect_timeout_s, ca_file=config.ca_file, insecure=config.insecure)
        self.batches: dict[int, Any] = {}      # batch id -> BatchResult (replays overwrite)
        self.finished: dict[int, float] = {}   # batch id -> wall time its gradient was applied here
        self.epochs: dict[int, dict[str, Any]] = {}
        self.stopped: str | None = None
        self.resumed_at = engine.committed   # > 0: restarted, it resumed its training state there

    async def run(self) -> dict[str, Any]:
        cfg, data = self.config, self.data
        n = len(data.train_labels)
        per_epoch = batches_per_epoch(n, cfg.batch_size)
        total = per_epoch * cfg.epochs
        engine = self.client.engine
        bar = tqdm(total=total, desc=self.client.device_id, position=self.index, leave=True,
                   disable=not cfg.progress, dynamic_ncols=True)
        started = time.time()
        while True:
            try:
                await self.client.connect()
                break
            except Rollback:
                continue
        def prepare(batch_id: int):
            _, idx = batch_indices(n, cfg.batch_size, batch_id, cfg.seed, self.index)
            return self.client.prepare_batch(batch_id, data.train_images[idx], data.train_labels[idx],
                                             data.train_ids[idx])

        prepared = None  # pipelined: the next batch's release, made while the previous batch was at the server
        try:
            while engine.committed < total:
                batch_id = engine.committed + 1
                epoch = (batch_id - 1) // per_epoch
                try:
                    if prepared is None or prepared.batch_id != batch_id:
                        prepared = await prepare(batch_id)
                    at_server = asyncio.ensure_future(self.client.send_batch(prepared))
                    upcoming, spent = None, None
                    if prepares_ahead(cfg.pipeline, batch_id, total, per_epoch):
                        try:  # while this batch is away; its commit waits until this release is made
                            upcoming = await prepare(batch_id + 1)
                        except BudgetExceeded as exc:
                            spent = exc  # this batch still finishes; nothing more is sent
                        except BaseException:
                            at_server.cancel()  # nobody would collect its outcome
                            raise
                    result = await self.client.commit_batch(prepared, await at_server)
                    prepared = upcoming
                    self.batches[batch_id] = result
                    self.finished[batch_id] = time.time()
                    bar.n = engine.committed
                    bar.set_postfix(epoch=epoch + 1, loss=f"{result.loss:.3f}")
                    if batch_id % per_epoch == 0:
                        self.epochs[epoch] = await self._epoch_summary(epoch, per_epoch, started)
                        bar.write(f"{self.client.device_id} epoch {epoch + 1}: " + _fmt(self.epochs[epoch]))
                    if spent is not None:
                        raise spent
                except Rollback as rb:
                    prepared = None  # made from weights the rollback discarded
                    engine.drop_uncommitted()
                    bar.write(f"{self.client.device_id}: {rb}")
                    self.batches = {k: v for k, v in self.batches.items() if k <= rb.batch_id}
                    self.finished = {k: v for k, v in self.finished.items() if k <= rb.batch_id}
                    bar.n = engine.committed
                except BudgetExceeded as exc:
                    self.stopped = str(exc)
                    bar.write(f"{self.client.device_id}: stopped, privacy budget spent: {exc}")
                    break
        finally:
            bar.close()
            await self.client.close()
        return {"device_id": self.client.device_id, "train_samples": n, "test_samples": len(data.test_labels),
                "reconnects": self.client.traffic.reconnects, "stopped": self.stopped, "committed": engine.committed,
                "resumed_at": self.resumed_at,
                "privacy": engine.privacy_report(), "epochs": [self.epochs[e] for e in sorted(self.epochs)],
                "batches": [{"batch_id": k, "n": r.n, "loss": r.loss, "n_correct": r.n_correct,
                             "device_s": r.device_s, "round_trip_s": r.round_trip_s, "finished": self.finished[k]}
                            for k, r in sorted(self.batches.items())]}

    async def _epoch_summary(self, epoch: int, per_epoch: int, started: float) -> dict[str, Any]:
        """The epoch's figures over its batches that this process committed (a device restarted mid-epoch
        resumed from its training state: the batches before the restart are not in its results)."""
        ids = range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1)
        rs = [self.batches[k] for k in ids if k in self.batches]
        n = sum(r.n for r in rs)
        test_loss, test_acc = await self.evaluate(epoch)
        privacy = self.client.engine.privacy.accountant.report()
        return {
            "epoch": epoch + 1,
            "train_loss": sum(r.loss * r.n for r in rs) / n,
            "train_acc": sum(r.n_correct for r in rs) / n,
            "test_loss": test_loss,
            "test_acc": test_acc,
            "batches": len(rs),
            "samples": n,
            "bytes_sent": sum(r.bytes_sent for r in rs),
            "bytes_received": sum(r.bytes_received for r in rs),
            "device_s_per_batch": sum(r.device_s for r in rs) / len(rs),
            "round_trip_s_per_batch": sum(r.round_trip_s for r in rs) / len(rs),
            "wall_s": time.time() - started,
            "cost": summarize_costs([r.cost for r in rs], warmup=1, energy_reason=self.client.energy.reason),
            "epsilon_image_max": privacy["epsilon_image"]["max"],
            "epsilon_identity_max": privacy["epsilon_identity"]["max"],
        }

    async def evaluate(self, epoch: int) -> tuple[float, float]:
        data, bs = self.data, self.config.batch_size
        loss_sum, correct = 0.0, 0
        for i in range(0, len(data.test_labels), bs):
            sl = slice(i, i + bs)
            loss, n_correct = await self.client.evaluate_batch(data.test_images[sl], data.test_labels[sl],
                                                               data.test_ids[sl], ("eval", epoch, i // bs))
            loss_sum, correct = loss_sum + loss, correct + n_correct
        n = max(len(data.test_labels), 1)
        return loss_sum / n, correct / n

def _fmt(e: dict[str, Any]) -> str:
    return (f"train loss {e['train_loss']:.3f} acc {e['train_acc']:.3f} | test loss {e['test_loss']:.3f} "
            f"acc {e['test_acc']:.3f} | up {e['bytes_sent'] / 1e6:.1f} MB down {e['bytes_received'] / 1e6:.1f} MB | "
            f"device {e['device_s_per_batch'] * 1e3:.0f} ms/batch")


def summarize(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-epoch totals over devices, accuracies weighted by samples."""
    out = []
    for epoch in range(min(len(d["epochs"]) for d in devices)):
        rows = [d["epochs"][epoch] for d in devices]
        tests = [d["test_samples"] for d in devices]
        n = sum(r["samples"] for r in rows)
        out.append({
            "epoch": epoch + 1,
            "train_loss": sum(r["train_loss"] * r["samples"] for r in rows) / n,
            "train_acc": sum(r["train_acc"] * r["samples"] for r in rows) / n,
            "test_loss": sum(r["test_loss"] * t for r, t in zip(rows, tests)) / sum(tests),
            "test_acc": sum(r["test_acc"] * t for r, t in zip(rows, tests)) / sum(tests),
            "bytes_sent": sum(r["bytes_sent"] for r in rows),
            "bytes_received": sum(r["bytes_received"] for r in rows),
            "device_s_per_batch": sum(r["device_s_per_batch"] for r in rows) / len(rows),
            "wall_s": max(r["wall_s"] for r in rows),
            "epsilon_image_max": max(r["epsilon_image_max"] for r in rows),
            "epsilon_identity_max": max(r["epsilon_identity_max"] for r in rows),
        })
    return out


async def run_simulation(config: SimConfig, data: DataSplit,
                         tokens: dict[str, str]) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """Run this process's devices to the end: (the results, each device's final layer by device id). Writes
    nothing, so that a caller elsewhere (a Ray actor on another node) can send both back to the experimenter."""
    device_ids = sorted(tokens)[:config.num_devices]
    if len(device_ids) < config.num_devices:
        raise ValueError(f"{config.num_devices} devices but tokens for only {len(device_ids)}")
    here = config.devices_here()
    ids = {str(p): i for i, p in enumerate([*data.train.paths, *data.test.paths])}
    shares = {}
    for i in here:
        train = partition(data.train, config.num_devices, i, config.partition, config.seed)
        test = partition(data.test, config.num_devices, i, config.partition, config.seed)
        shares[i] = await asyncio.to_thread(DeviceData, train, test, config.spec.input_size, config.crop, ids)
    devices = [SimulatedDevice(i, device_ids[i], tokens[device_ids[i]], shares[i], len(data.class_names), config)
               for i in here]
    started = time.time()
    per_device = await asyncio.gather(*(d.run() for d in devices))
    results = {
        "config": {"url": config.url, "model": config.spec.to_dict(), "split": config.split, "head": config.head,
                   "num_devices": config.num_devices, "epochs": config.epochs, "batch_size": config.batch_size,
                   "partition": config.partition, "encodings": config.encodings, "train": asdict(config.train),
                   "backend": config.backend,
                   "num_classes": len(data.class_names), "train_images": len(data.train),
                   "test_images": len(data.test), "seed": config.seed,
                   "device_weights": str(config.device_weights) if config.device_weights else None,
                   "crop": config.crop, "data": config.data,
                   "state_dir": str(config.state_dir) if config.state_dir else None,
                   "only_devices": list(config.only_devices) if config.only_devices else None},
        "wall_s": time.time() - started,
        "epochs": summarize(list(per_device)),
        "devices": list(per_device),
    }
    return results, {d.client.device_id: d.client.engine.layer.state_dict() for d in devices}


async def simulate(config: SimConfig, data: DataSplit, tokens: dict[str, str]) -> dict[str, Any]:
    """Run every device to the end; write and return the results."""
    results, layers = await run_simulation(config, data, tokens)
    write_results(config.results, results, layers)
    return results


def write_results(path: Path | None, results: dict[str, Any], layers: dict[str, dict[str, torch.Tensor]]) -> None:
    """results.json at `path` and each device's final layer beside it, `device_layers/<device id>.pt`, so that the
    run can be evaluated afterwards (research.evaluation). They are written on the experimenter's machine;
    nothing here goes to the server. None: nothing is written."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    folder = path.parent / "device_layers"
    folder.mkdir(parents=True, exist_ok=True)
    for device_id, state in layers.items():
        torch.save(state, folder / f"{device_id}.pt")


def device_ranges(devices: int, parts: int) -> list[tuple[int, int]]:
    """The devices [start, stop) each of `parts` simulator processes or Ray actors runs: contiguous, sizes
    differing by at most one."""
    bounds = [k * devices // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def merge_results(parts: list[dict[str, Any]], **placement: Any) -> dict[str, Any]:
    """One results.json from the parts' own (each ran some of the devices: `only_devices`): every device, the
    per-epoch totals over all of them. `placement` (e.g. processes=4, or placement="ray", actors=64) is recorded
    in its config; the devices' own figures are the same whichever ran them."""
    devices = [d for part in parts for d in part["devices"]]
    return {"config": {**parts[0]["config"], "only_devices": None, **placement},
            "wall_s": max(part["wall_s"] for part in parts), "epochs": summarize(devices), "devices": devices}
