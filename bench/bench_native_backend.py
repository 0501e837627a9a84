"""What a device pays for the `native` backend per batch, beside what the runner computes.

The backend (splitface/device/runtimes/native_runtime.py) feeds one persistent runner process through files in
/dev/shm; bench_native.py times the runner alone, one process per run. This times the backend on
bench_native.py's layer and inputs (4-row strip programs) and prints per batch, side by side in one run:

- the release as the backend made it before: the engine draws the noise (torch.randn, as
  `PerActivationGaussian.additive_noise`) and the runner reads it from a file (`NativeRuntime.release`);
- the release as the engine makes it now: the runner draws the noise under the release's key
  (`NativeRuntime.keyed_release`), with what of its compute the drawing took;
- the weight gradient.

Wall is the time as the engine sees it (drawing the noise where the engine draws it, writing the inputs, the
request, reading the output back); from the runner's reply, its programs' compute and its whole pass (reading
the inputs and writing the output included).

    python bench/bench_native_backend.py            # VGG-Face conv1, 224 px, batch 8, one thread; --out's text
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import cmake_flags, describe, record
from bench.bench_native import device_layer, inputs
from splitface.device.privacy.fastnoise import fresh_key
from splitface.device.runtimes.native import cache_dir
from splitface.device.runtimes.native_runtime import NativeRuntime
from splitface.export.artifacts import example_inputs, manifest_of
from splitface.export.exporter import EXPORTER

ROOT = Path(__file__).resolve().parents[1]


def timed(call) -> tuple[float, dict]:
    """Wall ms of `call()` and the runner's report it left."""
    t0 = time.perf_counter()
    report = call()
    return (time.perf_counter() - t0) * 1e3, report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg_face")
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--noise-std", type=float, default=0.5, help="the release noise's standard deviation")
    p.add_argument("--artifacts", type=Path, default=None, help="keep the strip programs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_native_backend.txt",
                   help="where the printed table is also written")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    layer = device_layer(args.model, args.input_size)
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="bench-native-backend-"))
    manifest = manifest_of(layer, *example_inputs(layer, args.samples, args.input_size), gemm=True)
    runtime = NativeRuntime(layer, artifacts, manifest, threads=1, exporter=EXPORTER)  # checked against eager PyTorch on load
    t = inputs(layer, args.samples, args.input_size)
    weights = [t["weight"], t["bias"]]
    shape = t["noise"].shape
    generator = torch.Generator().manual_seed(0)

    def engine_noise() -> dict:  # what the engine did before: draw with torch, hand the tensor over in a file
        runtime.release(t["images"], args.noise_std * torch.randn(shape, generator=generator), weights)
        return runtime.last_report

    def keyed() -> dict:  # what it does now: the runner draws under the release's key
        runtime.keyed_release(t["images"], weights, args.noise_std, fresh_key())
        return runtime.last_report

    def grad() -> dict:
        runtime.weight_grads(t["images"], None, t["grad"], weights)
        return runtime.last_report

    calls = {"release, engine draws (torch), file": engine_noise, "release, runner draws under the key": keyed,
             "weight gradient": grad}
    rows: dict[str, list[float]] = {}
    load = os.getloadavg()[0]
    for r in range(args.runs + 1):  # the first is a warm-up
        for name, call in calls.items():
            wall, report = timed(call)
            if r == 0:
                continue
            values = {"wall": wall, "runner pass": report["total_ms"], "runner compute": report["compute_ms"]}
            if call is keyed:
                values["of which drawing"] = report["noise_ms"]
            for part, value in values.items():
                rows.setdefault(f"{name}: {part}", []).append(value)
    runtime.close()
    lines = [f"{args.model} conv1, {args.input_size} px, batch {args.samples}, one thread, noise std "
             f"{args.noise_std:g}, {args.runs} runs after 1 warm-up, the three calls in turn; load {load:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after; ms per batch, mean / min"]
    lines += [f"  {name:60s} {statistics.mean(values):8.1f} / {min(values):8.1f}" for name, values in rows.items()]
    lines.append(f"  machine: {describe({**record(cmake_flags(cache_dir(), 'splitface_native')), 'load_avg': [load]})}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.write_text(text)


if __name__ == "__main__":
    main()
