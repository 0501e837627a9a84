"""Simulated devices on Ray against local processes: the same split run, side by side, on this machine.

    .venv/bin/python -m bench.ray_sim [--devices 64] [--devices-per-part 8] [--out results/ray_sim]

Each placement trains `--devices` devices for `--epochs` against its own fresh edge server (`splitface-server serve`
on loopback, one torch thread), each device with its own small share of real LFW faces:
- processes: `splitface-device sim --only-devices START:STOP` processes of `--devices-per-part` devices each, one
  torch thread each, as `splitface-research demo --device-processes` runs them, their results merged by `merge_results`;
- ray: one `splitface-device sim --placement ray --devices-per-actor K` that starts a local Ray instance on this
  machine's cores and runs actors of the same K devices (Ray's start-up counts).
The wall time runs from launching the simulator(s) to their exit (loading torch, the data, Ray); `training_span_s`
from the first batch's start to the last batch's end, over all parts on this machine's clock (the parts' own wall_s,
each from its own start, give `devices_wall_s`, their longest). Device time per batch is the devices' own `device_s`
(their layer's forward and backward, the release: wall time, so it grows with the devices computing beside it),
averaged over every batch of every device; `devices_computing_at_once` is their sum over the training span.
The machine's record (CPU, load before and after: it is shared) is stored beside the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.load import start_server, stop_server
from bench.machine import describe, record
from splitface.common.data import load_lfw
from splitface.common.options import add_data_root_arg, add_devices_arg
from splitface.sim.simulator import device_ranges, merge_results
from splitface.server.auth import issue_tokens
from research.results import write_report

ROOT = Path(__file__).resolve().parents[1]
LFW = ROOT.parent / "shared" / "data" / "lfw"
PLACEMENTS = ("processes", "ray")


def sim_argv(args: argparse.Namespace, url: str, tokens: Path, results: Path) -> list[str]:
    """The simulator's options, the same for both placements."""
    return [sys.executable, "-m", "splitface.device_cli", "sim", "--server", url, "--tokens", str(tokens),
            "--data", str(args.data), "--min-images", "10", "--max-identities", str(args.max_identities),
            "--max-images", str(args.max_images),
            "--model", args.model, "--devices", str(args.devices), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--lr", "0.005", "--no-progress", "--results", str(results)]


def run_placement(placement: str, args: argparse.Namespace, run_dir: Path, tokens: Path,
                  num_classes: int) -> dict[str, Any]:
    """One run of every device in `placement` against a fresh server: its row of figures."""
    server, port = start_server(run_dir / "server", tokens, num_classes, "--max-batch", str(args.batch_size),
                                model=args.model)
    parts = device_ranges(args.devices, -(-args.devices // args.devices_per_part))
    url, device_tokens = f"ws://127.0.0.1:{port}", run_dir / "device_tokens.json"
    started = time.time()
    try:
        if placement == "ray":
            procs = [subprocess.Popen([*sim_argv(args, url, device_tokens, run_dir / "results.json"),
                                       "--placement", "ray", "--devices-per-actor", str(args.devices_per_part)],
                                      cwd=ROOT, stdout=open(run_dir / "sim.log", "w"), stderr=subprocess.STDOUT)]
        else:
            procs = [subprocess.Popen([*sim_argv(args, url, device_tokens, run_dir / f"results.part-{k}.json"),
                                       "--threads", "1", "--only-devices", f"{a}:{b}"], cwd=ROOT,
                                      stdout=open(run_dir / f"sim-{k}.log", "w"), stderr=subprocess.STDOUT)
                     for k, (a, b) in enumerate(parts)]
        codes = [proc.wait(args.timeout) for proc in procs]
        wall = time.time() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        stop_server(server)
    if any(codes):
        raise SystemExit(f"{placement}: a simulator failed ({codes}); see {run_dir}")
    if placement == "ray":
        results = json.loads((run_dir / "results.json").read_text())
    else:
        results = merge_results([json.loads((run_dir / f"results.part-{k}.json").read_text())
                                 for k in range(len(parts))], processes=len(parts))
        (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    batches = [b for d in results["devices"] for b in d["batches"]]
    # on this machine's one clock: from the first batch's start (its end less its device and round-trip time) to
    # the last batch's end, whichever part ran it
    span = max(b["finished"] for b in batches) - min(b["finished"] - b["device_s"] - b["round_trip_s"] for b in batches)
    return {"placement": placement, "devices": len(results["devices"]), "parts": len(parts),
            "devices_per_part": args.devices_per_part, "batches": len(batches), "wall_s": wall,
            "devices_wall_s": results["wall_s"], "training_span_s": span,
            "devices_computing_at_once": sum(b["device_s"] for b in batches) / span,
            "device_ms_per_batch": 1e3 * statistics.mean(b["device_s"] for b in batches),
            "device_ms_per_batch_median": 1e3 * statistics.median(b["device_s"] for b in batches),
            "round_trip_ms_per_batch": 1e3 * statistics.mean(b["round_trip_s"] for b in batches),
            "train_loss_last_epoch": results["epochs"][-1]["train_loss"],
            "config": {k: results["config"].get(k) for k in ("placement", "actors", "cpus_per_actor", "nodes",
                                                               "niceness", "processes")}}


def table(report: dict[str, Any]) -> str:
    lines = [f"# {report['devices']} simulated devices: Ray actors against local processes",
             "", f"Machine: {describe(report['machine_before'])} before, load "
             f"{report['machine_after']['load_avg'][0]:.1f} after (shared with other work).",
             f"Model {report['model']}, {report['epochs']} epoch(s), batch {report['batch_size']}, "
             f"{report['train_images']} training images dealt over the devices.", "",
             "| placement | parts | devices each | batches | wall s | training span s | device ms/batch (mean, median) "
             "| devices computing at once | round trip ms/batch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['placement']} | {r['parts']} | {r['devices_per_part']} | {r['batches']} "
                     f"| {r['wall_s']:.1f} | {r['training_span_s']:.1f} | {r['device_ms_per_batch']:.1f}, "
                     f"{r['device_ms_per_batch_median']:.1f} | {r['devices_computing_at_once']:.1f} "
                     f"| {r['round_trip_ms_per_batch']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.ray_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, default=LFW)
    add_devices_arg(p, default=64)
    p.add_argument("--devices-per-part", type=int, default=8,
                   help="devices per simulator process and per Ray actor (1: a process or an actor each; each costs "
                        "a Python process with torch, about 200 MB)")
    p.add_argument("--model", default="iresnet_small")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-identities", type=int, default=70,
                   help="people with 10 images or more (every device needs a test image)")
    p.add_argument("--max-images", type=int, default=16,
                   help="only people with at most this many images (70 such people: 781 train, 82 test images)")
    p.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    p.add_argument("--timeout", type=float, default=1800, help="seconds a placement's run may take")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ray_sim")
    args = p.parse_args(argv)
    data = load_lfw(args.data, min_images=10, max_identities=args.max_identities, max_images=args.max_images)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "devices": args.devices,
                              "model": args.model, "epochs": args.epochs, "batch_size": args.batch_size,
                              "train_images": len(data.train), "machine_before": record(), "rows": []}
    for placement in args.placements:
        run_dir = args.out / "runs" / placement
        run_dir.mkdir(parents=True, exist_ok=True)
        device_ids = [f"device-{i:02d}" for i in range(args.devices)]
        tokens = issue_tokens(run_dir / "server" / "tokens.json", device_ids)
        (run_dir / "device_tokens.json").write_text(json.dumps(tokens))
        report["rows"].append(run_placement(placement, args, run_dir, run_dir / "server" / "tokens.json",
                                            len(data.class_names)))
        print(json.dumps(report["rows"][-1]), flush=True)
    report["machine_after"] = record()
    write_report(args.out / "ray_sim.json", report, args.out / "ray_sim.md", table(report), newline=True)


if __name__ == "__main__":
    main()
