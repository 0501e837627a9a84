"""What a device batch costs on each backend, side by side in one run: batch 8, VGG-Face conv1 at
224x224 and IResNet conv1 at 112x112, eager PyTorch vs ExecuTorch vs ONNX Runtime, one thread vs
all cores, next to the source paper's Nexus 6P figures; for IResNet-18 also each release transform of
the privacy frontier (bottleneck, dct, dct with its channel subset, FaceMAE's patch mask where it
exists) through the same runtimes, with MACs and wire bytes per image for every row.

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
    python bench/bench_device.py --data ../shared/data/lfw --runs 3 --noise                  # and its noise table
    python bench/bench_device.py --data ../shared/data/lfw --runs 3 --warmup 1 --threads 1 --releases none --merge
        # re-measures the conv1 rows of both models (every backend) into the results above, keeping the other rows
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
from dataclasses import replace
from pathlib import Path

from research.results import write_record

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"vgg_face": 224, "iresnet18": 112}
RELOWER = "executorch-relower"  # the release re-lowered to XNNPACK after each weight change
GEMM = "executorch-xnnpack"  # the im2col programs: XNNPACK with the weights as inputs (splitface/export/gemm_programs.py)
BACKENDS = ("torch", "executorch", "onnxruntime", RELOWER, GEMM)
BUILDS = {"device": "device part only", "full": "whole backbone, split",
          "banded": "device part only, LRN window as the former banded 1x1 conv"}
# Release transforms (the frontier's points, each at its split; spec changes, split), measured for RELEASE_MODEL.
RELEASES = {"none": ({}, "conv1"),
            "bottleneck": ({"release": "bottleneck", "bottleneck_channels": 4, "bottleneck_stride": 2}, "conv1"),
            "dct": ({"release": "dct", "dct_drop": 4}, "layer2"),
            "dct-keep": ({"release": "dct", "dct_drop": 4, "dct_keep": 36}, "layer2"),
            "mask": ({"release": "mask", "mask_patch": 8, "mask_ratio": 0.75}, "conv1")}
RELEASE_MODEL = "iresnet18"
RELEASE_BACKENDS = ("torch", "executorch", "onnxruntime")


def release_spec(model: str, release: str):
    """The model spec and split of a release configuration."""
    from splitface.common.models import resolve_spec

    changes, split = RELEASES[release]
    return replace(resolve_spec(model), **changes), split


def available_releases() -> list[str]:
    """The transforms this checkout has (FaceMAE's `mask` arrived separately)."""
    from splitface.common.transforms import TRANSFORMS

    return [r for r, (changes, _) in RELEASES.items() if changes.get("release", "none") in ("none", *TRANSFORMS)]


def macs_per_image(layer, input_size: int) -> int:
    """Multiply-accumulates of the device part for one image (torch's flop counter: 2 flops per MAC)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(torch.zeros(1, 3, input_size, input_size))
    return counter.get_total_flops() // 2


def wire_bytes_per_image(release) -> dict[str, int]:
    """One image's release as the protocol sends it (the msgpack tensor map), in each encoding."""
    import msgpack

    from splitface.protocol.tensor import encode_tensor

    one = release[:1].detach().numpy()
    return {enc: len(msgpack.packb(encode_tensor(one, enc), use_bin_type=True)) for enc in ("f32", "f16", "i8")}


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
            build: str = "device", release: str = "none") -> dict:
    """One configuration, in this process (the programs were exported and verified into `artifacts` already)."""
    import numpy as np
    import torch

    from splitface.common.data import find_lfw_root, load_lfw
    from splitface.device.trainer import to_input
    from splitface.device.meter import EnergyCounter, latency_stats, peak_rss_bytes
    from splitface.common.models import build_backbone, build_device_part, split_backbone
    from splitface.common.models.lrn import PaperLRN
    from splitface.device.runtimes import load_runtime
    from splitface.export.exporter import EXPORTER
    from splitface.common.transforms import release_mask
    from splitface.device.runtimes.parity import reference

    import_rss = peak_rss_bytes()  # Python, torch and the SDK, before any model, data or runtime library
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    spec, split = release_spec(model, release)
    layer = split_backbone(build_backbone(spec), split)[0] if build == "full" else build_device_part(spec, split)
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
        released = layer(images)
    noise = 0.1 * torch.randn_like(released)
    grad = torch.randn_like(noise)
    mask = release_mask(spec, len(images), tuple(released.shape[1:]), torch.Generator().manual_seed(0))
    if backend == "torch":
        def forward() -> None:
            with torch.no_grad():
                (layer(images) if mask is None else layer(images) * mask) + noise

        def backward() -> None:
            reference(layer, images, noise, grad, weights, mask)
        export_s = None
    else:
        t = time.perf_counter()
        runtime = load_runtime("executorch" if backend == RELOWER else backend, layer, spec.input_size, 8, artifacts,
                               threads=threads, exporter=EXPORTER)
        export_s = time.perf_counter() - t  # loading only: exported before

        def forward() -> None:
            runtime.release(images, noise, weights, mask)

        def backward() -> None:
            runtime.weight_grads(images, noise, grad, weights, mask)
    steps = [("forward_s", forward), ("backward_s", backward)]
    if backend == RELOWER:
        # XNNPACK runs the conv only with constant weights: after every weight change, lower a static-weight
        # release program for the new weights and load it (the "update"), then run it.
        from executorch.extension.pybindings import portable_lib

        from splitface.export.artifacts import export_release_pte
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
            "release": release, "split": split, "released_shape": list(released.shape[1:]),
            "trains": bool(weights), "macs_per_image": macs_per_image(layer, spec.input_size),
            "wire_bytes_per_image": wire_bytes_per_image(released),
            "load_s": latency_stats(load_s, warmup), **{k: latency_stats(v, warmup) for k, v in timings.items()},
            "program_load_s": export_s, "peak_rss_bytes": peak_rss_bytes(), "import_rss_bytes": import_rss,
            "energy_j_per_batch": None if energy.reason else sum(joules[warmup:]) / runs, "energy_note": energy.reason}


MINIMAL = """
import sys, time
def peak():  # VmHWM: ru_maxrss would carry over the parent's peak across fork and exec
    return [int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
from executorch.extension.pybindings import portable_lib  # imports torch: the binding links libtorch
import torch
out = {"import": peak()}
portable_lib._unsafe_reset_threadpool(1)
artifacts = sys.argv[1]
release = portable_lib._load_for_executorch(artifacts + "/release_gemm.pte")
vjp = portable_lib._load_for_executorch(artifacts + "/vjp_gemm.pte")
out["load"] = peak()
g = torch.Generator().manual_seed(0)
images = torch.rand(8, 3, 224, 224, generator=g)
noise = torch.empty(8, 64, 224, 224).normal_(0, 0.1, generator=g)
weight, bias = 0.1 * torch.randn(64, 3, 3, 3, generator=g), torch.zeros(64)
out["inputs"] = peak()
t = time.perf_counter(); released = release.forward([images, noise, weight, bias])[0]; out["forward_s"] = time.perf_counter() - t
out["forward"] = peak()
t = time.perf_counter(); grads = vjp.forward([images, noise, weight, bias]); out["backward_s"] = time.perf_counter() - t
out["backward"] = peak()
print("RESULT", out)
"""


def minimal_rss(artifacts: Path) -> dict:
    """Peak RSS of a process that runs only ExecuTorch's im2col programs for VGG-Face conv1, batch 8 at 224 px:
    no SDK, no model, no data loader; one process, measured after each step (the release's noise and its
    gradient are the same-sized random tensor)."""
    import ast

    proc = subprocess.run([sys.executable, "-c", MINIMAL, str(artifacts)], capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"minimal ExecuTorch process failed:\n{proc.stderr[-3000:]}")
    return ast.literal_eval(line[0][len("RESULT "):])


def minimal_table(r: dict) -> str:
    mb = {k: f"{r[k] / 2**20:.0f} MB" for k in ("import", "load", "inputs", "forward", "backward")}
    return ("Peak RSS of a process that runs only ExecuTorch (its Python binding, which imports PyTorch: it links "
            "libtorch) with the im2col programs, VGG-Face conv1, batch 8 at 224 px, one thread; peak so far after "
            "each step; one call of each program, so its time includes XNNPACK's set-up (the main table's rows are "
            "warm):\n\n| after imports | programs loaded | inputs made (images, noise/gradient, weights) | "
            "release | weight gradient | release s (first call) | weight gradient s (first call) |\n|---:|---:|---:|---:|---:|---:|---:|\n"
            f"| {mb['import']} | {mb['load']} | {mb['inputs']} | {mb['forward']} | {mb['backward']} | "
            f"{r['forward_s']:.2f} | {r['backward_s']:.2f} |\n")


def lrn_window(runs: int, threads: int = 1) -> list[dict]:
    """The LRN's window sum alone on a VGG-Face conv1 output (8 x 64 x 224 x 224), in the 5-tap form the device
    runs and as the former banded 64x64 1x1 conv, on each runtime: eager PyTorch, ExecuTorch's portable kernels
    (as in the training program) and ONNX Runtime. Outputs checked equal to eager before timing."""
    import torch
    from executorch.exir import to_edge
    from executorch.extension.pybindings import portable_lib
    import onnxruntime as ort

    from splitface.device.meter import latency_stats
    from splitface.common.models.lrn import PaperLRN

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


NOISE_VALUES = 8 * 64 * 112 * 112  # one IResNet-18 conv1 release of a batch of 8
NOISE_SIGMA2 = 400  # the exact sampler's variance in quantisation steps (sigma = 20 steps)


def noise_speed(runs: int, threads: list[int]) -> list[dict]:
    """Drawing one release's noise (8 x 64 x 112 x 112 values) three ways, each checked for its variance
    first: torch.randn on a seeded Mersenne Twister generator (today's source), ChaCha20 keyed from the OS
    CSPRNG with Box-Muller in float32 (the fast option), and the exact option's discrete Gaussian sampled in
    integers (CKS20). The exact sampler is numpy and single-threaded: it runs at one thread only."""
    import numpy as np
    import torch

    from splitface.device.meter import latency_stats
    from splitface.device.privacy.discrete import DiscreteGaussian
    from splitface.device.privacy.fastnoise import NoiseStream, fresh_key, gaussian

    n = NOISE_VALUES
    generator = torch.Generator().manual_seed(int.from_bytes(fresh_key()[:8], "little"))
    samplers = {
        "torch.randn (Mersenne Twister, float32)": (lambda: torch.randn(n, generator=generator), 1.0),
        "ChaCha20 + Box-Muller (fast, float32)": (lambda: gaussian((n,), NoiseStream(fresh_key())), 1.0),
        "ChaCha20 + discrete Gaussian (exact, int64)":
            (lambda: torch.from_numpy(DiscreteGaussian(NOISE_SIGMA2).sample(n, NoiseStream(fresh_key()))),
             DiscreteGaussian(NOISE_SIGMA2).variance())}
    out = []
    for t in threads:
        torch.set_num_threads(t)
        for name, (draw, variance) in samplers.items():
            if "discrete" in name and t > 1:
                continue
            sample = draw()
            got = float(sample[:1_000_000].to(torch.float64).var())
            if abs(got - variance) > 0.02 * variance:
                raise SystemExit(f"{name}: variance {got}, expected {variance}")
            del sample
            seconds = []
            for _ in range(runs):
                start = time.perf_counter()
                draw()
                seconds.append(time.perf_counter() - start)
            out.append({"sampler": name, "threads": t, "values": n, "seconds": latency_stats(seconds)})
            print(f"{name}, {t} threads: {np.mean(seconds) * 1e3:.0f} ms", flush=True)
    return out


def noise_table(rows: list[dict]) -> str:
    lines = [f"Noise for one release of {rows[0]['values']:,} values (IResNet-18 conv1 at 112 px, batch 8), "
             "ms as mean / min over "
             f"the timed calls after one call checked for its variance; exact sampler at sigma^2 = {NOISE_SIGMA2} "
             "quantisation steps; the CPU is shared, so compare within a column:", "",
             "| sampler | guarantee | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}"
                                                    for t in dict.fromkeys(r["threads"] for r in rows)) + " |",
             "|---|---|" + "---|" * len(set(r["threads"] for r in rows))]
    guarantee = {"torch": "float sampler; Mersenne Twister, not a CSPRNG",
                 "Box-Muller": "float sampler (low bits leak)",
                 "discrete": "exact on the integers"}
    for sampler in dict.fromkeys(r["sampler"] for r in rows):
        g = next(v for k, v in guarantee.items() if k in sampler)
        cells = {r["threads"]: r["seconds"] for r in rows if r["sampler"] == sampler}
        lines.append(f"| {sampler} | {g} | " + " | ".join(
            f"{cells[t]['mean'] * 1e3:.0f} / {cells[t]['min'] * 1e3:.0f}" if t in cells else "not run (single-threaded)"
            for t in dict.fromkeys(r["threads"] for r in rows)) + " |")
    return "\n".join(lines) + "\n"


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
    wire = r["wire_bytes_per_image"]
    release = r["release"] if r["release"] == "none" else f"{r['release']} ({json.dumps(RELEASES[r['release']][0])})"
    return (f"| {r['model']} {r['input']}px | {release} at {r['split']} | {r['backend']} | {r['threads']} | "
            f"{BUILDS[r['build']]} | {r['macs_per_image'] / 1e6:.1f} | {wire['f32']:,} / {wire['i8']:,} | "
            f"{ms(r['load_s'])} | {update} | {ms(r['forward_s'])} | "
            f"{ms(r['backward_s']) if r['trains'] else 'nothing trains'} | {r['peak_rss_bytes'] / 2**20:.0f} MB | "
            f"{r['import_rss_bytes'] / 2**20:.0f} MB | {energy} |")


def table(results: list[dict], machine: str) -> str:
    lines = [f"Device-layer cost per batch of 8, measured on {machine}. Not a phone: compare backends and thread "
             "counts with each other; the paper's Nexus 6P figures are for orientation only.",
             "", "Times in ms as mean / trimmed mean / p50 / p99, warm-up excluded. Forward = the release "
             "(conv1 + ReLU + LRN, then the release transform if any, times its mask if any, plus the noise given as "
             "an "
             "input); backward = the weight gradient from the server's gradient. MMAC: multiply-accumulates of the "
             "device part per image (torch's flop counter). Wire: one image's release as the protocol's tensor map, in "
             "bytes, f32 / i8.", "",
             "| model | release | backend | threads | build | MMAC/image | wire bytes/image (f32 / i8) | load 8 images "
             "| weight update | forward | backward | peak RSS | of which imports | energy |",
             "|---|---|---|---:|---|---:|---:|---|---|---|---|---:|---:|---|"]
    lines += [row(r) for r in results]
    lines += [f"| **paper, Nexus 6P** (VGG-Face) | | | | | | | {PAPER['load_s']} s | | {PAPER['forward_s']} s | "
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
              "with changed weights before timing.",
              f"Release transforms ({RELEASE_MODEL} only, the frontier's points at their splits): every program was "
              "exported and verified against eager PyTorch first (`python -m export`); the dct device part has no "
              "weights (nothing trains); dct-keep and mask pass their per-image mask to the release program as an "
              "input. The wire bytes are the dense tensor's: a mask's zeros cost as much as values.",
              f"{GEMM}: ExecuTorch with conv1 + ReLU + LRN written as im2col (the k x k shifted slices of the padded "
              "image) times the weight matrix, a bmm of two run-time tensors, which XNNPACK runs, so the whole release "
              "runs in XNNPACK with the weights as inputs (no update cost); its backward is the closed-form weight "
              "gradient (im2col^T times the gradient through LRN and ReLU) as a second XNNPACK program, not a "
              "training program (splitface/export/gemm_programs.py, `splitface-export --gemm`); verified against eager PyTorch "
              "with perturbed weights like every artifact.", ""]
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
    p.add_argument("--releases", nargs="+", default=None, choices=list(RELEASES),
                   help=f"release transforms measured for {RELEASE_MODEL} (default: every one this checkout has)")
    p.add_argument("--lrn-window", action="store_true",
                   help="only time the LRN window sum per runtime (5-tap vs banded) and add it to the results in --out")
    p.add_argument("--noise", action="store_true",
                   help="only time the noise samplers (torch.randn, fast, exact) and add them to the results in --out")
    p.add_argument("--minimal-rss", action="store_true",
                   help="only the peak RSS of a process running nothing but ExecuTorch's im2col programs for VGG-Face "
                        "(exported into --artifacts/vgg_face-none unless kept there), added to the results in --out")
    p.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS),
                   help="which builds to measure where a configuration has several (VGG-Face at one thread)")
    p.add_argument("--merge", action="store_true",
                   help="put the measured rows into the results in --out, replacing rows of the same configuration "
                        "and keeping the others (the text says which rows each run measured)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # model,backend,threads,artifacts,build: one configuration
    args = p.parse_args(argv)
    if args.one:
        model, backend, threads, artifacts, build, release = args.one.split(",")
        print("RESULT " + json.dumps(measure(model, backend, int(threads), args.data, args.runs, args.warmup,
                                             Path(artifacts), build, release)))
        return
    if args.lrn_window or args.noise or args.minimal_rss:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        # each section keeps the load it was measured under; the main table's own load lines stay as they were
        saved.setdefault("section_load", {})
        before = os.getloadavg()
        if args.minimal_rss:
            saved["minimal_rss"] = minimal_rss(export_programs("vgg_face", "none", args.artifacts))
        if args.lrn_window:
            saved["lrn_window"] = lrn_window(args.runs)
        if args.noise:
            saved["noise"] = noise_speed(args.runs, sorted(set(args.threads or {1, os.cpu_count() or 1})))
        for section in ("minimal_rss", "lrn_window", "noise"):
            if getattr(args, section):
                saved["section_load"][section] = [before, os.getloadavg()]
        write_record(args.out, saved, full_text(saved))
        return
    cores = os.cpu_count() or 1
    results = []
    load_before = os.getloadavg()
    earlier = json.loads(args.out.with_suffix(".json").read_text()) if args.merge else None
    for model in args.models:
        releases = [r for r in (args.releases or available_releases()) if model == RELEASE_MODEL or r == "none"]
        for release in releases:
            artifacts = export_programs(model, release, args.artifacts)
            backends = [b for b in args.backends if release == "none" or b in RELEASE_BACKENDS]
            for backend in backends:
                for threads in [1] if backend == RELOWER else sorted(set(args.threads or {1, cores})):
                    builds = ["device"]
                    if model == "vgg_face" and threads == 1 and backend in ("torch", "executorch"):
                        builds += ["full", "banded"] if backend == "torch" else ["full"]
                    for build in [b for b in builds if b in args.builds]:
                        cmd = [sys.executable, __file__, "--data", args.data, "--runs", str(args.runs), "--warmup",
                               str(args.warmup), "--one", f"{model},{backend},{threads},{artifacts},{build},{release}"]
                        proc = subprocess.run(cmd, capture_output=True, text=True)
                        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                        if proc.returncode != 0 or not line:
                            raise SystemExit(f"{model} {release} {backend} {threads} threads {build} failed:\n"
                                             f"{proc.stderr[-3000:]}")
                        results.append(json.loads(line[0][len("RESULT "):]))
                        print(row(results[-1]), flush=True)
                        # after every row: a later failure keeps what was measured
                        write(args.out, results, cores, load_before, earlier)
    print(full_text(json.loads(args.out.with_suffix(".json").read_text())))


def export_programs(model: str, release: str, keep: Path | None) -> Path:
    """Export and verify the configuration's programs in another process (its memory stays out of the rows),
    or reuse verified ones kept from an earlier run."""
    artifacts = (keep / f"{model}-{release}") if keep else Path(tempfile.mkdtemp(prefix=f"bench-{model}-{release}-"))
    kept = (artifacts / "manifest.json").read_text() if (artifacts / "manifest.json").exists() else ""
    if "checks" in kept and ('"gemm_refusal": "not exported' not in kept):  # verified, with the im2col programs
        print(f"reusing the verified programs in {artifacts}", flush=True)
        return artifacts
    print(f"exporting and verifying {model} ({release}) into {artifacts} ...", flush=True)
    spec, split = release_spec(model, release)
    described = model if release == "none" else json.dumps(spec.to_dict())
    export = subprocess.run([sys.executable, "-m", "splitface.export.cli", "--model", described, "--split", split,
                             "--batch-size", "8", "--dp-clamp", "--gemm", "--out", str(artifacts)],
                            capture_output=True, text=True, cwd=ROOT)
    if export.returncode != 0:
        raise SystemExit(f"export of {model} ({release}) failed:\n{export.stdout[-2000:]}{export.stderr[-3000:]}")
    return artifacts


def machine_name(cores: int) -> str:
    return f"{platform.processor() or platform.machine()}, {cores} cores, {platform.system()} (shared CI-class VM)"


def section_load(saved: dict, section: str) -> str:
    """The load a section was measured under, where its run recorded it (earlier runs did not)."""
    load = saved.get("section_load", {}).get(section)
    if not load:
        return ""
    return (f"\nLoad while this table was measured: {' / '.join(f'{x:.1f}' for x in load[0])} before, "
            f"{' / '.join(f'{x:.1f}' for x in load[1])} after.\n")


def full_text(saved: dict) -> str:
    """The results file's text: the main table, then the LRN and noise tables when measured."""
    text = table(saved["results"], saved["machine"])
    load = saved.get("load_before")
    if load:
        text += (f"\nMachine load (1/5/15-minute averages on {os.cpu_count()} cores; other jobs ran at the same "
                 f"time): {' / '.join(f'{x:.1f}' for x in load)} when the rows started, "
                 f"{' / '.join(f'{x:.1f}' for x in saved['load_after'])} after the last.\n")
    for m in saved.get("merged", []):
        text += (f"\nRe-measured in a later run ({m['command']}), replacing the earlier rows of the same "
                 f"configuration: {'; '.join(m['rows'])}. Load {' / '.join(f'{x:.1f}' for x in m['load_before'])} "
                 f"when they started, {' / '.join(f'{x:.1f}' for x in m['load_after'])} after the last; compare "
                 "ratios only within one run.\n")
    if "lrn_window" in saved:
        text += "\n" + lrn_table(saved["lrn_window"]) + section_load(saved, "lrn_window")
    if "noise" in saved:
        text += "\n" + noise_table(saved["noise"]) + section_load(saved, "noise")
    if "minimal_rss" in saved:
        text += "\n" + minimal_table(saved["minimal_rss"]) + section_load(saved, "minimal_rss")
    return text


def config_key(r: dict) -> tuple:
    return r["model"], r["release"], r["backend"], r["threads"], r["build"]


def row_label(r: dict) -> str:
    return f"{r['model']} {r['release']} {r['backend']} {r['threads']} thread(s) {BUILDS[r['build']]}"


def write(out: Path, results: list[dict], cores: int, load_before: tuple[float, ...], earlier: dict | None) -> None:
    """The results files; with `earlier` (--merge), its rows with these rows put in place of the same configuration's."""
    saved = {"machine": machine_name(cores), "paper_nexus_6p": PAPER, "results": results,
             "load_before": load_before, "load_after": os.getloadavg()}
    if earlier is not None:
        new = {config_key(r): r for r in results}
        rows = [new.pop(config_key(r), r) for r in earlier["results"]]
        for r in new.values():  # a configuration the earlier run lacks: after its model's and release's last row
            at = max((i + 1 for i, e in enumerate(rows) if (e["model"], e["release"]) == (r["model"], r["release"])),
                     default=len(rows))
            rows.insert(at, r)
        merged = [m for m in earlier.get("merged", []) if not set(m["rows"]) <= {row_label(r) for r in results}]
        saved = {**earlier, "results": rows,
                 "merged": merged + [{"command": "python bench/bench_device.py " + " ".join(sys.argv[1:]),
                                      "rows": [row_label(r) for r in results], "load_before": load_before,
                                      "load_after": os.getloadavg()}]}
    write_record(out, saved, full_text(saved), echo=False)


if __name__ == "__main__":
    main()
