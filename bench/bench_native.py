"""The device layer as a phone app runs it: ExecuTorch's C++ runtime, no Python, no libtorch.

VGG-Face conv1 + ReLU + LRN at 224x224, a batch of 8 images, one thread: the im2col programs
(`splitface-export --gemm`, XNNPACK with the weights as inputs) run by `splitface_native`
(device_sdk/runtimes/native), exported for batch 8 (one call per batch) and for batch 1 (eight calls,
streaming one image's inputs in and its release out at a time), side by side with the Python binding
running the batch-8 programs (`executorch-xnnpack`, whose process imports PyTorch) in the same run.
Every native output is checked against eager PyTorch (export/verify.py's tolerances) before its figures
are kept. Peak RSS is the measuring process's whole peak (getrusage), runtime libraries included.

    python bench/bench_native.py   # writes results/bench_native.{json,txt}
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_device import minimal_rss  # noqa: E402  (the Python binding's process, same programs)

from device_sdk.models import build_device_part, resolve_spec  # noqa: E402
from device_sdk.models.lrn import PaperLRN  # noqa: E402
from device_sdk.runtimes.native import build, run_native, write_inputs  # noqa: E402
from export.artifacts import RELEASE_GEMM_PTE, VJP_GEMM_PTE, export_gemm_ptes  # noqa: E402
from export.verify import GRAD_RTOL, RELEASE_ATOL, reference  # noqa: E402

RELEASE_INPUTS = ["images", "noise", "weight", "bias"]
GRAD_INPUTS = ["images", "grad", "weight", "bias"]


def device_layer(model: str, input_size: int) -> torch.nn.Module:
    """The device's conv1 stage, seeded, with the DP clamp of the LRN's input as the device bench exports it."""
    torch.manual_seed(0)
    layer = build_device_part(resolve_spec(model), "conv1").eval()
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0
    return layer


def export_for_batch(layer: torch.nn.Module, batch: int, input_size: int, out: Path) -> Path:
    """release_gemm.pte and vjp_gemm.pte for `batch` images in `out` (kept ones are reused)."""
    if not ((out / RELEASE_GEMM_PTE).exists() and (out / VJP_GEMM_PTE).exists()):
        out.mkdir(parents=True, exist_ok=True)
        images = torch.rand(batch, 3, input_size, input_size)
        with torch.no_grad():
            noise = torch.zeros_like(layer(images))
        release, vjp = export_gemm_ptes(layer, images, noise, None)
        (out / RELEASE_GEMM_PTE).write_bytes(release)
        (out / VJP_GEMM_PTE).write_bytes(vjp)
    return out


def inputs(layer: torch.nn.Module, samples: int, input_size: int) -> dict[str, torch.Tensor]:
    """Images, noise, a server gradient and perturbed weights (read at run time, not baked in)."""
    g = torch.Generator().manual_seed(3)
    images = torch.rand(samples, 3, input_size, input_size, generator=g)
    with torch.no_grad():
        shape = layer(images[:1]).shape[1:]
    weight, bias = (p.detach() + 0.05 * p.detach().abs().mean() * torch.randn(p.shape, generator=g)
                    for p in layer.parameters())
    return {"images": images, "noise": 0.1 * torch.randn((samples, *shape), generator=g),
            "grad": torch.randn((samples, *shape), generator=g), "weight": weight, "bias": bias}


def measure(binary: Path, programs: Path, work: Path, tensors: dict, want: tuple, runs: int, warmup: int) -> dict:
    samples = len(tensors["images"])
    report = run_native(binary, work, samples, (programs / RELEASE_GEMM_PTE, RELEASE_INPUTS),
                        (programs / VJP_GEMM_PTE, GRAD_INPUTS), runs=runs, warmup=warmup)
    want_release, want_grads = want
    release_err = float(np.abs(report.pop("release") - want_release.numpy().ravel()).max())
    grads = report.pop("grads")
    grad_err = max(float(np.abs(a - b.numpy().ravel()).max() / np.abs(b.numpy()).max())
                   for a, b in zip(grads, want_grads, strict=True))
    if release_err > RELEASE_ATOL or grad_err > GRAD_RTOL:
        raise SystemExit(f"native batch-{report['program_batch']} programs disagree with eager PyTorch: release "
                         f"{release_err:.3g} (tolerance {RELEASE_ATOL}), gradient {grad_err:.3g} ({GRAD_RTOL})")
    return {**report, "release_max_abs_err": release_err, "grad_max_rel_err": grad_err}


def binding_times(programs: Path, tensors: dict, runs: int, warmup: int) -> dict:
    """The same batch-N programs warm through the Python binding in this process, one thread: the same-run
    reference for the native rows' times (its memory is the minimal process's, not this one's)."""
    import time

    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(1)
    release = portable_lib._load_for_executorch(str(programs / RELEASE_GEMM_PTE))
    vjp = portable_lib._load_for_executorch(str(programs / VJP_GEMM_PTE))
    weights = [tensors["weight"], tensors["bias"]]
    times: dict[str, list[float]] = {"forward_ms": [], "backward_ms": []}
    for _ in range(warmup + runs):
        t = time.perf_counter()
        release.forward([tensors["images"], tensors["noise"], *weights])
        times["forward_ms"].append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        vjp.forward([tensors["images"], tensors["grad"], *weights])
        times["backward_ms"].append(1e3 * (time.perf_counter() - t))
    return {k: v[warmup:] for k, v in times.items()}


def table(saved: dict) -> str:
    def ms(v: list[float]) -> str:
        return f"{np.mean(v):.0f} / {min(v):.0f}"

    lines = [f"The device layer through ExecuTorch's C++ runtime (`splitface_native`, no Python, no libtorch), "
             f"{saved['model']} conv1 + ReLU + LRN at {saved['input_size']} px, {saved['samples']} images per "
             f"batch, one thread, on {saved['machine']}. Not a phone: compare the rows with each other. Times in "
             f"ms as mean / min over {saved['runs']} runs after {saved['warmup']} warm-up; 'compute' is the "
             "programs' execute calls alone, 'with I/O' adds streaming each chunk's inputs from files and its "
             "release out (a phone's noise source, server gradient and socket stand in for the files). Every "
             "native output was checked against eager PyTorch first (release max abs error, gradient max "
             "relative error).", "",
             "| process | program batch | calls per batch | RSS after load | peak after release | peak after weight "
             "gradient | release compute | release with I/O | weight gradient compute | weight gradient with I/O | "
             "release err | gradient err |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|"]
    for r in saved["native"]:
        mb = {k: f"{r[k] / 1024:.0f} MB" for k in ("rss_loaded_kb", "peak_forward_kb", "peak_kb")}
        lines.append(f"| native C++ | {r['program_batch']} | {r['samples'] // r['program_batch']} | "
                     f"{mb['rss_loaded_kb']} | {mb['peak_forward_kb']} | {mb['peak_kb']} | "
                     f"{ms(r['forward_compute_ms'])} | {ms(r['forward_total_ms'])} | {ms(r['backward_compute_ms'])} | "
                     f"{ms(r['backward_total_ms'])} | {r['release_max_abs_err']:.1e} | {r['grad_max_rel_err']:.1e} |")
    p = saved["python_binding"]
    w = saved["python_binding_warm"]
    lines.append(f"| Python binding (imports PyTorch) | {saved['samples']} | 1 | {p['load'] / 2**20:.0f} MB | "
                 f"{p['forward'] / 2**20:.0f} MB | {p['backward'] / 2**20:.0f} MB | {ms(w['forward_ms'])} | | "
                 f"{ms(w['backward_ms'])} | | | |")
    lines += ["", "The Python binding's memory is bench_device.py's minimal process (only the binding, its own random "
              "inputs of the same shapes, one call of each program); its times are the same batch-8 programs called "
              "warm from Python in this run, on the native rows' inputs. "
              f"Machine load (1/5/15 min): {' / '.join(f'{x:.1f}' for x in saved['load_before'])} before, "
              f"{' / '.join(f'{x:.1f}' for x in saved['load_after'])} after.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg_face", help="a model whose conv1 the im2col programs cover")
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--samples", type=int, default=8, help="images per device batch")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 1], help="program batch sizes to compare")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--artifacts", type=Path, default=None, help="keep the exported programs here (default: a temp dir)")
    p.add_argument("--build-dir", type=Path, default=ROOT / "build" / "native")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_native")
    args = p.parse_args(argv)
    if any(args.samples % b for b in args.batches):
        p.error(f"every program batch must divide --samples {args.samples}")
    load_before = os.getloadavg()
    binary = build(args.build_dir)
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="bench-native-"))
    layer = device_layer(args.model, args.input_size)
    tensors = inputs(layer, args.samples, args.input_size)
    want = reference(layer, tensors["images"], tensors["noise"], tensors["grad"], [tensors["weight"], tensors["bias"]])
    work = Path(tempfile.mkdtemp(prefix="bench-native-io-"))
    write_inputs(work, {k: v.numpy() for k, v in tensors.items()})
    native = []
    for batch in args.batches:
        programs = export_for_batch(layer, batch, args.input_size, artifacts / f"{args.model}-b{batch}")
        native.append(measure(binary, programs, work, tensors, want, args.runs, args.warmup))
        print(json.dumps({k: v for k, v in native[-1].items()}), flush=True)
    python_binding = minimal_rss(export_for_batch(layer, args.samples, args.input_size,
                                                  artifacts / f"{args.model}-b{args.samples}")) \
        if args.model == "vgg_face" and args.input_size == 224 and args.samples == 8 else None
    warm = binding_times(artifacts / f"{args.model}-b{args.samples}", tensors, args.runs, args.warmup) \
        if python_binding else None
    saved = {"model": args.model, "input_size": args.input_size, "samples": args.samples, "runs": args.runs,
             "warmup": args.warmup, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
             "native": native, "python_binding": python_binding, "python_binding_warm": warm, "load_before": load_before,
             "load_after": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(saved, indent=2))
    text = table(saved) if python_binding else json.dumps(saved, indent=2)
    args.out.with_suffix(".txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
