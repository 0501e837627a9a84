#!/usr/bin/env python
"""Pipelined devices against lock-step ones, side by side in one run.

Lock-step, a device makes batch n's release, sends it, waits for the gradient, applies it, and only then
makes batch n+1's. Pipelined (`--pipeline`), it makes batch n+1's release while batch n is at the server, so
its device compute overlaps the server's and the network's, and that release uses weights one step stale
(the gradient is taken at them, `splitface/device/trainer.py`). Each pair of runs is the main job
(`splitface-research demo`: an edge server and simulated devices in their own processes on loopback) with the same
data, seed and release, once each way; reduced size (IResNet-small at 64 px).

    python bench/pipeline.py --data ../shared/data/lfw       # results/pipeline/{summary.json,table.md}

Resumable: a finished run is read back (`research.demo.run_recorded`). Throughput is the server's
samples per second of training (its metrics) and the run's wall time; accuracy is the last epoch's test
accuracy on the held-out images of the same people.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from research.demo import run_recorded
from research.results import write_summary

ROOT = Path(__file__).resolve().parents[1]

LOAD_FILE = "load.json"

CONV1 = ["--release", "none", "--split", "conv1"]
MAIN_JOB = ["--release", "dct", "--split", "layer2", "--dct-drop", "4", "--mechanism", "per-image",
            "--clip-norm", "12", "--noise-multiplier", "0.01", "--frequency-gamma", "2"]
# name -> (release arguments, devices, one thread per process). The paper's trainable conv1 layer and the main
# job's default release (run.sh; its device part has no weights, so nothing is stale and only the overlap
# changes), both as the main job runs them: --devices devices and the server in processes that share both
# cores. Then one device whose process and the server's each get one thread (OMP_NUM_THREADS=1), so that the
# phone's compute and the server's can overlap on separate cores, as they would on separate machines.
CONFIGS = {
    "conv1": (CONV1, None, False),
    "main-job-release": (MAIN_JOB, None, False),
    "conv1-one-device-one-core-each": (CONV1, 1, True),
}


def row(name: str, seed: int, mode: str, results: dict, metrics: dict) -> dict:
    last = results["epochs"][-1]
    per_device = [d["epochs"][-1] for d in results["devices"]]  # the last epoch of each device
    return {"config": name, "devices": len(results["devices"]), "seed": seed, "mode": mode, "test_acc": last["test_acc"], "train_loss": last["train_loss"],
            "wall_s": last["wall_s"], "server_samples_per_s": metrics["global"]["samples_per_s"],
            "device_s_per_batch": sum(e["device_s_per_batch"] for e in per_device) / len(per_device),
            "round_trip_s_per_batch": sum(e["round_trip_s_per_batch"] for e in per_device) / len(per_device),
            "samples": metrics["global"]["samples"]}


def load_recorder(run_dir: Path):
    """Called by run_recorded around a run it trains: keeps the machine's 1-minute load before and after, so
    that a table regenerated later from finished runs still says what else was running then."""
    before = os.getloadavg()[0]
    return lambda: (run_dir / LOAD_FILE).write_text(json.dumps({"before": before, "after": os.getloadavg()[0]}))


def load_text(load: dict | None) -> str:
    return "not recorded" if load is None else f"{load['before']:.1f} -> {load['after']:.1f}"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"Lock-step against pipelined devices: the main job (`splitface-research demo`), IResNet-small at 64 px, "
             f"{args.epochs} epochs, per-device batch {args.batch_size}, reduced LFW "
             f"(people with >= {args.min_images} images); each pair with the same data, seed and release, one "
             f"after the other. Load: the machine's 1-minute load average before and after each run (runs "
             f"made before it was recorded say so). Reduced size: compare within a pair.", "",
             "| configuration | devices | seed | mode | server samples/s | wall s | speed-up | device s/batch | round trip s/batch | "
             "test acc | change | load |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        base = next(b for b in rows if (b["config"], b["seed"], b["mode"]) == (r["config"], r["seed"], "lock-step"))
        lines.append(f"| {r['config']} | {r['devices']} | {r['seed']} | {r['mode']} | {r['server_samples_per_s']:.1f} | "
                     f"{r['wall_s']:.0f} | {base['wall_s'] / r['wall_s']:.2f}x | {r['device_s_per_batch']:.3f} | "
                     f"{r['round_trip_s_per_batch']:.3f} | {r['test_acc']:.3f} | "
                     f"{r['test_acc'] - base['test_acc']:+.3f} | "
                     f"{load_text(r['load'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--min-images", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "pipeline")
    args = p.parse_args(argv)
    rows = []
    for name in args.configs:
        for seed in args.seeds:
            for mode in ("lock-step", "pipelined"):
                run_dir = args.out / "runs" / f"{name}-seed{seed}-{mode}"
                release, devices, one_thread = CONFIGS[name]
                demo_args = ["--data", args.data, "--min-images", str(args.min_images), "--epochs", str(args.epochs),
                             "--devices", str(devices or args.devices), "--batch-size", str(args.batch_size),
                             "--seed", str(seed), *release, *(["--pipeline"] if mode == "pipelined" else [])]
                os.environ.pop("OMP_NUM_THREADS", None)
                if one_thread:  # inherited by the server and the simulator: torch's thread count in each
                    os.environ["OMP_NUM_THREADS"] = "1"
                results = run_recorded(run_dir, demo_args + (["--threads", "1"] if one_thread else []),
                                       on_trained=load_recorder(run_dir))
                metrics = json.loads((run_dir / "server" / "metrics.json").read_text())
                load = run_dir / LOAD_FILE
                rows.append(row(name, seed, mode, results, metrics)
                            | {"load": json.loads(load.read_text()) if load.exists() else None})
                print(json.dumps(rows[-1]), flush=True)
    write_summary(args.out, {"rows": rows, "args": vars(args)}, table(rows, args), default=str)


if __name__ == "__main__":
    main()
