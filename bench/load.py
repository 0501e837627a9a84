"""Load: many simulated devices at once against one edge-server process, for a bounded time.

    .venv/bin/python -m bench.load [--devices 32] [--batch-size 16] [--seconds 75] [--out results/reliability/load.json]

Starts `splitface-server serve` on loopback with the tiny configuration (vgg_face_small split at conv1,
20 LFW identities), then runs `--devices` devices in this process, each a real `DeviceClient` and
`DeviceTrainer` on its own share of the real faces (alternately server head and device head). Shares hold
33 and 40 images, so at batch 16 every other device's last batch of an epoch holds one image. Devices train
epoch after epoch until `--seconds` have passed, then finish their batch in flight.

Afterwards the server is stopped (it checkpoints on the way out) and its counters are checked against the
devices' own: `lost` counts batches a device committed that the server does not hold, `double_applied`
batches the server applied more often than the device committed them (from the server's per-device batch
counters and `last_applied`, and its step count against the devices' sum). It records every device-side
error, the per-batch round-trip latency percentiles, the server's RSS every second and the size of each
checkpoint it wrote (every `--checkpoint-every` s, so several under load).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from bench.hostile import rss_mb
from splitface.device.connection import DeviceClient, Rollback, device_faults
from splitface.common.data import load_lfw
from splitface.device.trainer import DeviceTrainer
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.common.options import add_data_root_arg, add_devices_arg, add_training_args
from splitface.sim.simulator import batch_indices, batches_per_epoch
from splitface.server.auth import issue_tokens
from splitface.server.checkpoint import ReplyStore, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LFW = ROOT.parent / "shared" / "data" / "lfw"
MODEL, SPLIT = "vgg_face_small", "conv1"
DATA = {"min_images": 20, "max_identities": 20}
SHARES = (33, 40)  # images per device, alternately: at batch 16, 33 leaves a last batch of one image

Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # images, labels, image ids


class ServerProcess:
    """An edge-server process forked from a server that has imported it already (so a restart takes a
    fraction of a second, not the 5-15 s of importing torch on a busy machine); Popen's calls used here."""

    def __init__(self, process: mp.process.BaseProcess, launched: threading.Thread | None = None):
        self.process, self.launched = process, launched

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise TimeoutError(f"server process {self.pid} still running after {timeout} s")
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.process.kill()


def _forkserver() -> mp.context.BaseContext:
    # torch._dynamo: the first optimizer imports it (5 s on a busy machine), once here instead of in every process
    multiprocessing.forkserver.set_forkserver_preload(["splitface.server.cli", "torch._dynamo"])
    return mp.get_context("forkserver")


def _serve(argv: list[str], log_path: str) -> None:
    """In the forked process: `splitface-server <argv>` with its output appended to `log_path`."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    from splitface.server.cli import main
    main(argv)


def start_server(run_dir: Path, tokens: Path, num_classes: int, *options: str, port: int = 0,
                 model: str = MODEL) -> tuple[ServerProcess, int]:
    """`splitface-server serve` on loopback (its log in <run_dir>/server.log, appended across restarts);
    returns the process and its port once it is listening."""
    return wait_ready(*launch_server(run_dir, tokens, num_classes, *options, port=port, model=model))


def launch_server(run_dir: Path, tokens: Path, num_classes: int, *options: str, port: int = 0,
                  model: str = MODEL) -> tuple[ServerProcess, Path, int]:
    """Start the server without waiting for it (`wait_ready` does): (process, its log, where its output starts)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "server.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    argv = ["serve", "--model", model, "--split", SPLIT, "--num-classes", str(num_classes), "--tokens", str(tokens),
            "--port", str(port), "--run-dir", str(run_dir), "--device", "cpu", "--threads", "1", *options]
    context = _forkserver()
    threading.Thread(target=multiprocessing.forkserver.ensure_running, daemon=True).start()  # imports meanwhile
    process = context.Process(target=_serve, args=(argv, str(log_path)), daemon=False)
    launched = threading.Thread(target=process.start, daemon=True)
    launched.start()
    return ServerProcess(process, launched), log_path, start


def wait_ready(proc: "ServerProcess", log_path: Path, start: int) -> tuple["ServerProcess", int]:
    """The port once the server has printed READY."""
    proc.launched.join(120)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log_path.exists():
            with open(log_path) as f:
                f.seek(start)
                for line in f:
                    if line.startswith("READY "):
                        return proc, int(line.split()[1])
        if proc.poll() is not None:
            log = log_path.read_text()[-3000:] if log_path.exists() else "(no log)"
            raise RuntimeError(f"server exited ({proc.poll()}): {log}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start in 120 s")


def stop_server(proc: ServerProcess) -> int:
    """SIGINT (the server checkpoints and writes its metrics on the way out); its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    return proc.wait(120)


def random_batches(batch_size: int, size: int, num_classes: int) -> Callable[[int], Batch]:
    """Made-up training batches for tests: batch `id` is always the same images, labels and image ids."""
    def batch(batch_id: int) -> Batch:
        rng = np.random.default_rng(batch_id)
        return (rng.integers(0, 256, (batch_size, 3, size, size), dtype=np.uint8),
                rng.integers(0, num_classes, batch_size), np.arange(batch_size) + batch_size * batch_id)
    return batch


def _device(url: str, device_id: str, token: str, spec: dict, head: str, num_classes: int, batch_size: int,
            total: int, faults: str) -> None:
    """In a forked process: one device training `total` made-up batches, with injected `faults`."""
    engine = DeviceTrainer(resolve_spec(spec), SPLIT, head, num_classes, TrainConfig(lr=0.005))
    client = DeviceClient(url, device_id, token, engine, batch_size, faults=device_faults(faults).get(device_id, []))
    asyncio.run(train_device(client, random_batches(batch_size, engine.spec.input_size, num_classes), total=total))


def start_device(*args: Any) -> ServerProcess:
    """A device process (`_device`'s arguments), forked like the servers; wait() gives its exit status."""
    proc = ServerProcess(_forkserver().Process(target=_device, args=args, daemon=False))
    proc.process.start()
    return proc


async def train_device(client: DeviceClient, next_batch: Callable[[int], Batch], total: int | None = None,
                       until: float | None = None, latencies: list[float] | None = None) -> None:
    """Train batch after batch (ids from 1, `next_batch(id)` always the same batch for an id) until `total` are
    committed or the monotonic time `until` has passed, as a device does: a Rollback (the server resumed from an
    older checkpoint) replays from where the device went back to."""
    engine = client.engine
    while True:
        try:
            await client.connect()
            break
        except Rollback:
            continue
    try:
        while (total is None or engine.committed < total) and (until is None or time.monotonic() < until):
            batch_id = engine.committed + 1
            try:
                result = await client.train_batch(batch_id, *next_batch(batch_id))
            except Rollback:
                continue
            if latencies is not None:
                latencies.append(result.round_trip_s)
    finally:
        await client.close()


class Sampler(threading.Thread):
    """The server's RSS, and the size of each checkpoint it writes (and of the replies beside it), every
    `every` s while the load runs."""

    def __init__(self, pid: int, checkpoint: Path, every: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.checkpoint, self.every = pid, checkpoint, every
        self.replies = ReplyStore(checkpoint.parent / "replies")
        self.rss: list[tuple[float, float]] = []
        self.checkpoints: list[tuple[float, int, int]] = []  # (time, checkpoint bytes, replies' bytes)
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        seen = None
        while not self.stop.is_set():
            t = round(time.monotonic() - self.t0, 1)
            try:
                self.rss.append((t, round(rss_mb(self.pid), 1)))
                stat = self.checkpoint.stat()
                if (stat.st_mtime_ns, stat.st_size) != seen:
                    seen = (stat.st_mtime_ns, stat.st_size)
                    self.checkpoints.append((t, stat.st_size, self.replies.size()))
            except (FileNotFoundError, RuntimeError):
                pass
            self.stop.wait(self.every)


def share_batches(images: np.ndarray, labels: np.ndarray, ids: np.ndarray, batch_size: int, device: int,
                  seed: int = 0) -> Callable[[int], Batch]:
    """Batch `id` of a device's share: the simulator's seeded per-epoch order, so a replayed id is the same batch."""
    def batch(batch_id: int) -> Batch:
        _, idx = batch_indices(len(labels), batch_size, batch_id, seed, device)
        return images[idx], labels[idx], ids[idx]
    return batch


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    q = np.percentile(np.asarray(values), [50, 90, 99])
    return {"p50": round(float(q[0]), 4), "p90": round(float(q[1]), 4), "p99": round(float(q[2]), 4),
            "max": round(max(values), 4), "n": len(values)}


def check_counts(committed: dict[str, int], state: dict[str, Any]) -> dict[str, Any]:
    """Exactly-once from the counters: the server's per-device `last_applied` and applied-batch counts (from its
    checkpoint) against what each device committed, and its step count against their sum. `lost`: batches a
    device committed that the server does not hold; `double_applied`: applications beyond the device's own."""
    applied = {d: r["last_applied"] for d, r in state["devices"].items()}
    counted = {d: c["batches"] for d, c in state["metrics"]["devices"].items()}
    steps, total = state["trainer"]["steps"], sum(committed.values())
    return {"lost": sum(max(0, n - applied.get(d, 0)) for d, n in committed.items()),
            "double_applied": sum(max(0, counted.get(d, 0) - n) for d, n in committed.items()),
            "mismatched_devices": sorted(d for d, n in committed.items()
                                         if applied.get(d, 0) != n or counted.get(d, 0) != n),
            "server_steps": steps, "device_batches": total}


async def run_devices(clients: list[DeviceClient], shares: list[Callable[[int], Batch]],
                      seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    until = time.monotonic() + seconds
    outcomes = await asyncio.gather(*(train_device(c, s, until=until, latencies=latencies)
                                      for c, s in zip(clients, shares)), return_exceptions=True)
    errors = {c.device_id: f"{type(o).__name__}: {o}" for c, o in zip(clients, outcomes) if isinstance(o, BaseException)}
    return {"committed": {c.device_id: c.engine.committed for c in clients},
            "reconnects": sum(c.traffic.reconnects for c in clients), "errors": errors, "latencies": latencies}


def run(devices: int, batch_size: int, seconds: float, checkpoint_every: float, run_dir: Path,
        lfw: Path = LFW, model: str | dict = MODEL) -> dict[str, Any]:
    """The load run; `model`: a preset name or a ModelSpec dict (the test's is smaller still)."""
    torch.set_num_threads(1)
    spec = resolve_spec(model)
    data = load_lfw(lfw, **DATA)
    n_classes = len(data.class_names)
    sizes = [SHARES[i % 2] for i in range(devices)]
    if sum(sizes) > len(data.train):
        raise ValueError(f"{devices} devices need {sum(sizes)} training images; the data has {len(data.train)}")
    heads = ["server" if i % 2 == 0 else "device" for i in range(devices)]
    tokens = issue_tokens(run_dir / "tokens.json", [f"device-{i:02d}" for i in range(devices)])
    launched = launch_server(run_dir, run_dir / "tokens.json", n_classes, "--max-batch", str(batch_size),
                             "--checkpoint-every", str(checkpoint_every),  # starts while the devices get ready
                             model=model if isinstance(model, str) else json.dumps(model))
    order = np.random.default_rng(0).permutation(len(data.train))
    images = data.train.subset(order[:sum(sizes)]).load(spec.input_size)
    labels = np.asarray(data.train.labels)[order[:sum(sizes)]]
    starts = np.cumsum([0, *sizes])
    shares = [share_batches(images[a:b], labels[a:b], np.arange(a, b), batch_size, i)
              for i, (a, b) in enumerate(zip(starts[:-1], starts[1:]))]
    engines = [DeviceTrainer(spec, SPLIT, head, n_classes, TrainConfig(lr=0.005)) for head in heads]
    proc, port = wait_ready(*launched)
    clients = [DeviceClient(f"ws://127.0.0.1:{port}", d, tokens[d], engine, batch_size, reconnect_timeout_s=60)
               for d, engine in zip(sorted(tokens), engines)]
    sampler = Sampler(proc.pid, run_dir / "checkpoint.pt")
    sampler.start()
    started = time.monotonic()
    try:
        result = asyncio.run(run_devices(clients, shares, seconds))
    finally:
        wall = time.monotonic() - started
        status = stop_server(proc)
        sampler.stop.set()
        sampler.join()
    state = load_checkpoint(run_dir / "checkpoint.pt")
    counts = check_counts(result["committed"], state)
    server_errors = sum(state["metrics"]["errors"].values())
    per_epoch = {s: batches_per_epoch(s, batch_size) for s in SHARES}
    return {
        "devices": devices,
        "batch_size": batch_size,
        "heads": {"server": heads.count("server"), "device": heads.count("device")},
        "shares": {str(s): sizes.count(s) for s in SHARES},
        "last_batch_sizes": {str(s): s - (per_epoch[s] - 1) * batch_size for s in SHARES},
        "model": model, "split": SPLIT, "num_classes": n_classes,
        "seconds": round(wall, 1),
        "batches": counts["device_batches"],
        "batches_per_s": round(counts["device_batches"] / wall, 2),
        "batches_per_device": {"min": min(result["committed"].values()), "max": max(result["committed"].values())},
        "errors": len(result["errors"]) + server_errors,
        "device_errors": result["errors"],
        "server_errors": state["metrics"]["errors"],
        "lost": counts["lost"],
        "double_applied": counts["double_applied"],
        "server_steps": counts["server_steps"],
        "mismatched_devices": counts["mismatched_devices"],
        "reconnects": result["reconnects"],
        "server_exit_status": status,
        "round_trip_s": percentiles(result["latencies"]),
        "server_rss_mb": {"max": max((r for _, r in sampler.rss), default=None), "samples": sampler.rss},
        "checkpoint_bytes": {"final": (run_dir / "checkpoint.pt").stat().st_size,
                             "max": max((b for _, b, _ in sampler.checkpoints), default=None),
                             "model_and_optimizer_tensors": _tensor_bytes(state["trainer"]),
                             "replies_final": ReplyStore(run_dir / "replies").size(),
                             "replies_kept_final": sum(r["reply"] is not None for r in state["devices"].values()),
                             "written": [{"t": t, "checkpoint": c, "replies": r} for t, c, r in sampler.checkpoints]},
        "machine": {"cores": os.cpu_count(), "load_avg_1m_end": round(os.getloadavg()[0], 2),
                    "python": platform.python_version()},
    }


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_devices_arg(p, 32)
    add_training_args(p, epochs=None, batch_size=16, lr=None)
    p.add_argument("--seconds", type=float, default=75.0, help="devices start no batch after this")
    p.add_argument("--checkpoint-every", type=float, default=10.0, help="the server's checkpoint interval (s)")
    add_data_root_arg(p, default=LFW, help=f"LFW root (default {LFW})")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "reliability" / "load.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splitface-load-") as tmp:
        result = run(args.devices, args.batch_size, args.seconds, args.checkpoint_every, Path(tmp), args.data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("server_rss_mb", "checkpoint_bytes")}, indent=2))
    print("server RSS max", result["server_rss_mb"]["max"], "MB; checkpoint bytes",
          {k: v for k, v in result["checkpoint_bytes"].items() if k != "written"})


if __name__ == "__main__":
    main()
