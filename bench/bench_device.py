"""What a device batch costs on each backend, side by side in one run: batch 8, VGG-Face conv1 at
224x224 and IResNet conv1 at 112x112, eager PyTorch vs ExecuTorch vs ONNX Runtime, one thread vs
all cores, next to the source paper's Nexus 6P figures.

Each configuration runs in its own process, so peak RSS is that configuration's alone. Per
configuration: load (decode + crop + resize 8 LFW images from disk), forward (the release the
device sends, noise added), backward (weight gradient from a server gradient: ExecuTorch's joint
training program, ONNX Runtime's VJP program, eager autograd). Warm-up runs are excluded; mean,
trimmed mean (10% each end), p50 and p99 as the mobile benchmarks report them.

    python bench/bench_device.py --data ../shared/data/lfw   # writes results/bench_device.{txt,json}
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"vgg_face": 224, "iresnet18": 112}
BACKENDS = ("torch", "executorch", "onnxruntime")
# The source paper's Nexus 6P measurements (batch of 8 LFW images, VGG-Face conv1 on the phone).
PAPER = {"load_s": "< 0.4", "forward_s": "< 0.6", "backward_s": "< 0.2 per sample (< 1.6 per batch)",
         "peak_rss": "< 500 MB", "energy": "< 3.5 mAh per minute"}


def measure(model: str, backend: str, threads: int, data: str, runs: int, warmup: int, artifacts: Path) -> dict:
    """One configuration, in this process (the programs were exported and verified into `artifacts` already)."""
    import numpy as np
    import torch

    from device_sdk.data import find_lfw_root, load_lfw
    from device_sdk.engine import to_input
    from device_sdk.meter import EnergyCounter, latency_stats, peak_rss_bytes
    from device_sdk.models import build_backbone, resolve_spec, split_backbone
    from device_sdk.models.lrn import PaperLRN
    from device_sdk.runtimes import load_runtime
    from export.verify import reference

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    spec = resolve_spec(model)
    layer, _ = split_backbone(build_backbone(spec), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0  # as the per-activation mechanism runs it
    faces = load_lfw(find_lfw_root(data), min_images=10).train
    batches = [faces.subset(np.arange(8 * i, 8 * i + 8)) for i in range(warmup + runs)]
    load_s, images = [], None
    for b in batches:
        t = time.perf_counter()
        images = to_input(b.load(spec.input_size, 160))
        load_s.append(time.perf_counter() - t)
    weights = [p.detach() for p in layer.parameters()]
    with torch.no_grad():
        noise = 0.1 * torch.randn_like(layer(images))
    grad = torch.randn_like(noise)
    if backend == "torch":
        def forward() -> None:
            with torch.no_grad():
                layer(images) + noise

        def backward() -> None:
            reference(layer, images, noise, grad, weights)
        export_s = None
    else:
        t = time.perf_counter()
        runtime = load_runtime(backend, layer, spec.input_size, 8, artifacts, threads=threads)
        export_s = time.perf_counter() - t  # loading only: exported before

        def forward() -> None:
            runtime.release(images, noise, weights)

        def backward() -> None:
            runtime.weight_grads(images, noise, grad, weights)
    energy = EnergyCounter()
    timings: dict[str, list[float]] = {"forward_s": [], "backward_s": []}
    joules = []
    for _ in range(warmup + runs):
        e0 = energy.read_joules()
        for name, fn in (("forward_s", forward), ("backward_s", backward)):
            t = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - t)
        e1 = energy.read_joules()
        joules.append(None if e0 is None else e1 - e0)
    return {"model": model, "input": spec.input_size, "backend": backend, "threads": threads,
            "load_s": latency_stats(load_s, warmup), **{k: latency_stats(v, warmup) for k, v in timings.items()},
            "program_load_s": export_s, "peak_rss_bytes": peak_rss_bytes(),
            "energy_j_per_batch": None if energy.reason else sum(joules[warmup:]) / runs, "energy_note": energy.reason}


def row(r: dict) -> str:
    def ms(stats: dict) -> str:
        return f"{stats['mean'] * 1e3:.0f} / {stats['trimmed_mean'] * 1e3:.0f} / {stats['p50'] * 1e3:.0f} / {stats['p99'] * 1e3:.0f}"
    energy = "unavailable" if r["energy_j_per_batch"] is None else f"{r['energy_j_per_batch']:.2f} J"
    return (f"| {r['model']} {r['input']}px | {r['backend']} | {r['threads']} | {ms(r['load_s'])} | {ms(r['forward_s'])} | "
            f"{ms(r['backward_s'])} | {r['peak_rss_bytes'] / 2**20:.0f} MB | {energy} |")


def table(results: list[dict], machine: str) -> str:
    lines = [f"Device-layer cost per batch of 8, measured on {machine}. Not a phone: compare backends and thread "
             "counts with each other; the paper's Nexus 6P figures are for orientation only.",
             "", "Times in ms as mean / trimmed mean / p50 / p99, warm-up excluded. Forward = the release "
             "(conv1 + ReLU + LRN + noise); backward = the weight gradient from the server's gradient.", "",
             "| model | backend | threads | load 8 images | forward | backward | peak RSS | energy |",
             "|---|---|---:|---|---|---|---:|---|"]
    lines += [row(r) for r in results]
    lines += [f"| **paper, Nexus 6P** (VGG-Face) | | | {PAPER['load_s']} s | {PAPER['forward_s']} s | "
              f"{PAPER['backward_s']} s | {PAPER['peak_rss']} | {PAPER['energy']} |", ""]
    lines += ["Peak RSS is the whole measuring process's peak, PyTorch's import included (the programs were "
              "exported and verified in another process first).",
              "ExecuTorch's forward takes the weights as inputs (the layer trains), so its conv runs on the portable "
              "kernel, not XNNPACK (XNNPACK delegates only convs with constant weights; `--static-weights` export "
              "for a frozen layer); its training program runs on portable kernels only.", ""]
    notes = {r["energy_note"] for r in results if r["energy_note"]}
    lines += [f"Energy: {n}." for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_device")
    p.add_argument("--one", help=argparse.SUPPRESS)  # model,backend,threads,artifacts: one configuration, print JSON
    args = p.parse_args(argv)
    if args.one:
        model, backend, threads, artifacts = args.one.split(",")
        print("RESULT " + json.dumps(measure(model, backend, int(threads), args.data, args.runs, args.warmup,
                                             Path(artifacts))))
        return
    cores = os.cpu_count() or 1
    results = []
    for model in args.models:
        artifacts = Path(tempfile.mkdtemp(prefix=f"bench-{model}-"))
        print(f"exporting and verifying {model} into {artifacts} ...", flush=True)
        export = subprocess.run([sys.executable, "-m", "export", "--model", model, "--batch-size", "8", "--dp-clamp",
                                 "--out", str(artifacts)], capture_output=True, text=True, cwd=ROOT)
        if export.returncode != 0:
            raise SystemExit(f"export of {model} failed:\n{export.stdout[-2000:]}{export.stderr[-3000:]}")
        for backend in args.backends:
            for threads in sorted({1, cores}):
                cmd = [sys.executable, __file__, "--data", args.data, "--runs", str(args.runs), "--warmup",
                       str(args.warmup), "--one", f"{model},{backend},{threads},{artifacts}"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    raise SystemExit(f"{model} {backend} {threads} threads failed:\n{proc.stderr[-3000:]}")
                results.append(json.loads(line[0][len("RESULT "):]))
                print(row(results[-1]), flush=True)
    machine = f"{platform.processor() or platform.machine()}, {cores} cores, {platform.system()} (shared CI-class VM)"
    text = table(results, machine)
    print(text)
    args.out.with_suffix(".txt").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "paper_nexus_6p": PAPER,
                                                          "results": results}, indent=2))


if __name__ == "__main__":
    main()
