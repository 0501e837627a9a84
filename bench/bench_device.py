"""What a device batch costs on each backend, side by side in one run: batch 8, VGG-Face conv1 at
224x224 and IResNet conv1 at 112x112, eager PyTorch vs ExecuTorch vs ONNX Runtime, one thread vs
all cores, next to the source paper's Nexus 6P figures.

Each configuration runs in its own process, so peak RSS is that configuration's alone. The device
builds only its own stages (`build_device_part`), as the SDK does; for VGG-Face at one thread each
backend also runs once as before this change, building the whole backbone and splitting it ("full"
build), so the memory the server's tail cost a device is measured side by side. Per
configuration: load (decode + crop + resize 8 LFW images from disk), forward (the release the
device sends, noise added), backward (weight gradient from a server gradient: ExecuTorch's joint
training program, ONNX Runtime's VJP program, eager autograd). Warm-up runs are excluded; mean,
trimmed mean (10% each end), p50 and p99 as the mobile benchmarks report them.

    python bench/bench_device.py --data ../shared/data/lfw   # writes results/bench_device.{txt,json}
    python bench/bench_device.py --data ../shared/data/lfw --runs 3 --warmup 1 --threads 1   # what results/ holds,
    python bench/bench_device.py --data ../shared/data/lfw --runs 3 --lrn-window             # then its LRN table
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

MODELS = {"vgg_face": 224, "iresnet18": 112}
RELOWER = "executorch-relower"  # the release re-lowered to XNNPACK after each weight change
BACKENDS = ("torch", "executorch", "onnxruntime", RELOWER)
BUILDS = {"device": "device part only", "full": "whole backbone, split",
          "banded": "device part only, LRN window as the former banded 1x1 conv"}


def banded_window_sum(lrn, t):
    """The LRN's window sum as it was before the 5-tap form (a C x C banded 1x1 conv): a baseline, eager only."""
    import torch
    import torch.nn.functional as F

    idx = torch.arange(t.shape[1])
    band = ((idx[:, None] - idx[None, :]).abs() <= lrn.size // 2).to(t.dtype)
    return F.conv2d(t, band.reshape(*band.shape, 1, 1))
# The source paper's Nexus 6P measurements (batch of 8 LFW images, VGG-Face conv1 on the phone).
PAPER = {"load_s": "< 0.4", "forward_s": "< 0.6", "backward_s": "< 0.2 per sample (< 1.6 per batch)",
         "peak_rss": "< 500 MB", "energy": "< 3.5 mAh per minute"}


def measure(model: str, backend: str, threads: int, data: str, runs: int, warmup: int, artifacts: Path,
            build: str = "device") -> dict:
    """One configuration, in this process (the programs were exported and verified into `artifacts` already)."""
    import numpy as np
    import torch

    from device_sdk.data import find_lfw_root, load_lfw
    from device_sdk.engine import to_input
    from device_sdk.meter import EnergyCounter, latency_stats, peak_rss_bytes
    from device_sdk.models import build_backbone, build_device_part, resolve_spec, split_backbone
    from device_sdk.models.lrn import PaperLRN
    from device_sdk.runtimes import load_runtime
    from export.verify import reference

    import_rss = peak_rss_bytes()  # Python, torch and the SDK, before any model, data or runtime library
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    spec = resolve_spec(model)
    layer = split_backbone(build_backbone(spec), "conv1")[0] if build == "full" else build_device_part(spec, "conv1")
    if build == "banded":
        PaperLRN.window_sum = banded_window_sum  # this measuring process only
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
        runtime = load_runtime("executorch" if backend == RELOWER else backend, layer, spec.input_size, 8, artifacts,
                               threads=threads)
        export_s = time.perf_counter() - t  # loading only: exported before

        def forward() -> None:
            runtime.release(images, noise, weights)

        def backward() -> None:
            runtime.weight_grads(images, noise, grad, weights)
    steps = [("forward_s", forward), ("backward_s", backward)]
    if backend == RELOWER:
        # XNNPACK runs the conv only with constant weights: after every weight change, lower a static-weight
        # release program for the new weights and load it (the "update"), then run it.
        from executorch.extension.pybindings import portable_lib

        from export.artifacts import export_release_pte
        program = pte = None

        def update() -> None:
            nonlocal program, pte
            pte = export_release_pte(layer, images, noise, True)  # the loaded program reads this buffer: keep it
            program = portable_lib._load_for_executorch_from_buffer(pte)

        def forward() -> None:
            program.forward([images, noise])

        with torch.no_grad():  # verified against eager with changed weights: the update really takes them
            for w in layer.parameters():
                w.mul_(1.01)
            update()
            err = float((program.forward([images, noise])[0] - (layer(images) + noise)).abs().max())
        if err > 1e-4:
            raise SystemExit(f"re-lowered release differs from eager by {err}")
        steps = [("update_s", update), ("forward_s", forward), ("backward_s", backward)]
    energy = EnergyCounter()
    timings: dict[str, list[float]] = {name: [] for name, _ in steps}
    joules = []
    for _ in range(warmup + runs):
        e0 = energy.read_joules()
        for name, fn in steps:
            t = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - t)
        e1 = energy.read_joules()
        joules.append(None if e0 is None else e1 - e0)
    return {"model": model, "input": spec.input_size, "backend": backend, "threads": threads, "build": build,
            "load_s": latency_stats(load_s, warmup), **{k: latency_stats(v, warmup) for k, v in timings.items()},
            "program_load_s": export_s, "peak_rss_bytes": peak_rss_bytes(), "import_rss_bytes": import_rss,
            "energy_j_per_batch": None if energy.reason else sum(joules[warmup:]) / runs, "energy_note": energy.reason}


def lrn_window(runs: int, threads: int = 1) -> list[dict]:
    """The LRN's window sum alone on a VGG-Face conv1 output (8 x 64 x 224 x 224), in the 5-tap form the device
    runs and as the former banded 64x64 1x1 conv, on each runtime: eager PyTorch, ExecuTorch's portable kernels
    (as in the training program) and ONNX Runtime. Outputs checked equal to eager before timing."""
    import torch
    from executorch.exir import to_edge
    from executorch.extension.pybindings import portable_lib
    import onnxruntime as ort

    from device_sdk.meter import latency_stats
    from device_sdk.models.lrn import PaperLRN

    torch.set_num_threads(threads)
    lrn = PaperLRN(64)

    class Window(torch.nn.Module):
        def __init__(self, banded: bool) -> None:
            super().__init__()
            self.banded = banded

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return banded_window_sum(lrn, t) if self.banded else lrn.window_sum(t)

    x = torch.rand(8, 64, 224, 224)
    out = []
    for banded in (False, True):
        module = Window(banded).eval()
        want = module(x)
        pte = to_edge(torch.export.export(module, (x,))).to_executorch().buffer  # the program reads it: kept alive
        et = portable_lib._load_for_executorch_from_buffer(pte)
        with tempfile.TemporaryDirectory() as tmp:
            torch.onnx.export(module, (x,), dynamo=True, verbose=False).save(f"{tmp}/w.onnx")
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            session = ort.InferenceSession(f"{tmp}/w.onnx", options, providers=["CPUExecutionProvider"])
        feed = {session.get_inputs()[0].name: x.numpy()}
        runners = {"torch": lambda: module(x), "executorch portable": lambda: et.forward([x])[0],
                   "onnxruntime": lambda: torch.from_numpy(session.run(None, feed)[0])}
        for runtime, run in runners.items():
            err = float((run() - want).abs().max())
            if err > 1e-3:
                raise SystemExit(f"LRN window on {runtime} differs from eager by {err}")
            seconds = []
            for _ in range(runs):
                t = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - t)
            out.append({"form": "banded 1x1 conv" if banded else "5-tap slices", "runtime": runtime,
                        "threads": threads, "seconds": latency_stats(seconds)})
    return out


def lrn_table(rows: list[dict]) -> str:
    lines = ["LRN window sum alone (8 x 64 x 224 x 224, one thread), ms as mean / min over the timed calls, "
             "after one call that checks the output against eager PyTorch; the CPU is shared:", "", "| runtime | 5-tap slices | former banded 1x1 conv |",
             "|---|---|---|"]
    for runtime in dict.fromkeys(r["runtime"] for r in rows):
        cells = {r["form"]: r["seconds"] for r in rows if r["runtime"] == runtime}
        lines.append(f"| {runtime} | " + " | ".join(f"{cells[f]['mean'] * 1e3:.0f} / {cells[f]['min'] * 1e3:.0f}"
                                                      for f in ("5-tap slices", "banded 1x1 conv")) + " |")
    return "\n".join(lines) + "\n"


def row(r: dict) -> str:
    def ms(stats: dict) -> str:
        return f"{stats['mean'] * 1e3:.0f} / {stats['trimmed_mean'] * 1e3:.0f} / {stats['p50'] * 1e3:.0f} / {stats['p99'] * 1e3:.0f}"
    energy = "unavailable" if r["energy_j_per_batch"] is None else f"{r['energy_j_per_batch']:.2f} J"
    update = ms(r["update_s"]) if "update_s" in r else "none (weights are inputs)"
    return (f"| {r['model']} {r['input']}px | {r['backend']} | {r['threads']} | {BUILDS[r['build']]} | {ms(r['load_s'])} | "
            f"{update} | {ms(r['forward_s'])} | "
            f"{ms(r['backward_s'])} | {r['peak_rss_bytes'] / 2**20:.0f} MB | {r['import_rss_bytes'] / 2**20:.0f} MB | "
            f"{energy} |")


def table(results: list[dict], machine: str) -> str:
    lines = [f"Device-layer cost per batch of 8, measured on {machine}. Not a phone: compare backends and thread "
             "counts with each other; the paper's Nexus 6P figures are for orientation only.",
             "", "Times in ms as mean / trimmed mean / p50 / p99, warm-up excluded. Forward = the release "
             "(conv1 + ReLU + LRN + noise); backward = the weight gradient from the server's gradient.", "",
             "| model | backend | threads | build | load 8 images | weight update | forward | backward | peak RSS "
             "| of which imports | energy |",
             "|---|---|---:|---|---|---|---|---|---:|---:|---|"]
    lines += [row(r) for r in results]
    lines += [f"| **paper, Nexus 6P** (VGG-Face) | | | | {PAPER['load_s']} s | | {PAPER['forward_s']} s | "
              f"{PAPER['backward_s']} s | {PAPER['peak_rss']} | | {PAPER['energy']} |", ""]
    lines += ["Peak RSS is the whole measuring process's peak, PyTorch's import included (the programs were "
              "exported and verified in another process first); 'of which imports' is the peak right after importing "
              "Python, PyTorch and the SDK, before any model, data or runtime library (ExecuTorch's and ONNX "
              "Runtime's libraries load later and count in the peak). Build: what the process constructed, the device's "
              "stages only (as the SDK does) or the whole backbone split afterwards (as it did before).",
              "The CPU is shared with other jobs, so timings drift between rows: the torch rows of the device part "
              "and of the whole backbone run the same computation, and their difference is that drift. Compare only "
              "large ratios; peak RSS does not depend on the load.",
              "The LRN is the paper's 5-tap window sum (shifted channel slices) in every backend; the 'banded' row "
              "runs eager PyTorch with the window as the former 64x64 banded 1x1 conv, for comparison in the same run.",
              "ExecuTorch's forward takes the weights as inputs (the layer trains), so its conv runs on the portable "
              "kernel, not XNNPACK (XNNPACK delegates only convs with constant weights; `--static-weights` export "
              "for a frozen layer); its training program runs on portable kernels only.",
              f"{RELOWER}: after every weight change the release is lowered again to XNNPACK with the new weights as "
              "constants and loaded ('weight update': torch.export + lowering + serialising + loading, on this host; "
              "a phone has no exporter, so this measures what re-lowering would cost, not a path a phone can take), "
              "then run; its backward is the same training program as executorch's. Verified against eager PyTorch "
              "with changed weights before timing.", ""]
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
    p.add_argument("--threads", nargs="+", default=None, type=int,
                   help="thread counts to measure (default: 1 and all cores)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="keep the exported programs in DIR/<model> and reuse verified ones (default: a fresh export)")
    p.add_argument("--lrn-window", action="store_true",
                   help="only time the LRN window sum per runtime (5-tap vs banded) and add it to the results in --out")
    p.add_argument("--one", help=argparse.SUPPRESS)  # model,backend,threads,artifacts,build: one configuration
    args = p.parse_args(argv)
    if args.one:
        model, backend, threads, artifacts, build = args.one.split(",")
        print("RESULT " + json.dumps(measure(model, backend, int(threads), args.data, args.runs, args.warmup,
                                             Path(artifacts), build)))
        return
    if args.lrn_window:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        saved["lrn_window"] = lrn_window(args.runs)
        text = table(saved["results"], saved["machine"]) + "\n" + lrn_table(saved["lrn_window"])
        print(text)
        args.out.with_suffix(".txt").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(saved, indent=2))
        return
    cores = os.cpu_count() or 1
    results = []
    for model in args.models:
        artifacts = (args.artifacts / model) if args.artifacts else Path(tempfile.mkdtemp(prefix=f"bench-{model}-"))
        if (artifacts / "manifest.json").exists() and "checks" in (artifacts / "manifest.json").read_text():
            print(f"reusing the verified programs in {artifacts}", flush=True)
            export = None
        else:
            print(f"exporting and verifying {model} into {artifacts} ...", flush=True)
            export = subprocess.run([sys.executable, "-m", "export", "--model", model, "--batch-size", "8", "--dp-clamp",
                                     "--out", str(artifacts)], capture_output=True, text=True, cwd=ROOT)
        if export is not None and export.returncode != 0:
            raise SystemExit(f"export of {model} failed:\n{export.stdout[-2000:]}{export.stderr[-3000:]}")
        for backend in args.backends:
            for threads in [1] if backend == RELOWER else sorted(set(args.threads or {1, cores})):
                builds = ["device"]
                if model == "vgg_face" and threads == 1 and backend in ("torch", "executorch"):
                    builds += ["full", "banded"] if backend == "torch" else ["full"]
                for build in builds:
                    cmd = [sys.executable, __file__, "--data", args.data, "--runs", str(args.runs), "--warmup",
                           str(args.warmup), "--one", f"{model},{backend},{threads},{artifacts},{build}"]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if proc.returncode != 0 or not line:
                        raise SystemExit(f"{model} {backend} {threads} threads {build} failed:\n{proc.stderr[-3000:]}")
                    results.append(json.loads(line[0][len("RESULT "):]))
                    print(row(results[-1]), flush=True)
                    write(args.out, results, cores)  # after every row: a later failure keeps what was measured
    print(table(results, machine_name(cores)))


def machine_name(cores: int) -> str:
    return f"{platform.processor() or platform.machine()}, {cores} cores, {platform.system()} (shared CI-class VM)"


def write(out: Path, results: list[dict], cores: int) -> None:
    out.with_suffix(".txt").write_text(table(results, machine_name(cores)))
    out.with_suffix(".json").write_text(json.dumps({"machine": machine_name(cores), "paper_nexus_6p": PAPER,
                                                    "results": results}, indent=2))


if __name__ == "__main__":
    main()
