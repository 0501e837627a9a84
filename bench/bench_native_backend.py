"""What a device pays for the `native` backend per batch, beside what the runner computes.

The backend (device_sdk/runtimes/native_runtime.py) feeds one persistent runner process through files in
/dev/shm, the engine's noise among them; bench_native.py times the runner alone, one process per run, with
its own drawn noise. This times the backend on bench_native.py's layer and inputs (4-row strip programs) and
prints per batch, for the release and the weight gradient: the wall time as the engine sees it (writing the
inputs, the request, reading the output back) and, from the runner's reply, its programs' compute and its
whole pass (reading the inputs and writing the output included).

    python bench/bench_native_backend.py            # VGG-Face conv1, 224 px, batch 8, one thread; --out's text
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_native import device_layer, inputs  # noqa: E402
from device_sdk.runtimes.native_runtime import NativeRuntime  # noqa: E402
from export.artifacts import example_inputs, manifest_of  # noqa: E402


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
    p.add_argument("--artifacts", type=Path, default=None, help="keep the strip programs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_native_backend.txt",
                   help="where the printed table is also written")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    layer = device_layer(args.model, args.input_size)
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="bench-native-backend-"))
    manifest = manifest_of(layer, *example_inputs(layer, args.samples, args.input_size), gemm=True)
    runtime = NativeRuntime(layer, artifacts, manifest, threads=1)  # checked against eager PyTorch on load
    t = inputs(layer, args.samples, args.input_size)
    weights = [t["weight"], t["bias"]]
    rows = {"release wall": [], "release runner compute": [], "release runner pass": [],
            "grad wall": [], "grad runner compute": [], "grad runner pass": []}
    load = os.getloadavg()[0]
    for r in range(args.runs + 1):  # the first is a warm-up
        release_ms, release = timed(lambda: (runtime.release(t["images"], t["noise"], weights), runtime.last_report)[1])
        grad_ms, grad = timed(lambda: (runtime.weight_grads(t["images"], t["noise"], t["grad"], weights),
                                       runtime.last_report)[1])
        if r == 0:
            continue
        for op, wall, report in (("release", release_ms, release), ("grad", grad_ms, grad)):
            rows[f"{op} wall"].append(wall)
            rows[f"{op} runner compute"].append(report["compute_ms"])
            rows[f"{op} runner pass"].append(report["total_ms"])
    runtime.close()
    lines = [f"{args.model} conv1, {args.input_size} px, batch {args.samples}, one thread, {args.runs} runs after 1 "
             f"warm-up; load {load:.1f} before, {os.getloadavg()[0]:.1f} after; ms per batch, mean / min"]
    lines += [f"  {name:24s} {statistics.mean(values):8.1f} / {min(values):8.1f}" for name, values in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.write_text(text)


if __name__ == "__main__":
    main()
