"""The device layer as a phone app runs it: ExecuTorch's C++ runtime, no Python, no libtorch.

VGG-Face conv1 + ReLU + LRN at 224x224, a batch of 8 images, one thread: the im2col programs
(`splitface-export --gemm`, XNNPACK with the weights as inputs) run by `splitface_native`
(splitface/device/runtimes/native), side by side in one run:
- exported for batch 8 (one call per batch) and for batch 1 (eight calls, streaming one image's inputs in
  and its release out at a time), the noise read from a file as before, and the batch-1 programs with the
  noise drawn by the runner into their noise input;
- the strip programs (`export_strip_ptes`: a few rows of one image per call, so that every intermediate
  stays in cache; the release program ends at the LRN's input and the runner applies the LRN), the noise
  drawn by the runner into each strip's rows (ChaCha8 + Box-Muller under a fresh OS-CSPRNG key per
  release), for each of `--strip-rows`;
- the Python binding running the batch-8 programs (`executorch-xnnpack`, whose process imports PyTorch).
Every native configuration is checked against eager PyTorch first (splitface/export/verify.py's tolerances); where
the runner draws the noise, the check runs once under a known key (`--noise-key`), whose normals
`reference_normals` recomputes in float64, and the timed runs draw fresh keys. Peak RSS is the runner's
own high-water mark (VmHWM), runtime libraries included. The rows take turns over `--rounds` rounds, so
that a change of the shared machine's load hits them all. `--profile` adds where each program's time goes:
its runs recorded with ETDump, time per operator kind (XNNPACK's operators inside its delegate call).

    python bench/bench_native.py --profile   # writes results/bench_native.{json,txt}
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.machine import cmake_flags, describe, record
from bench.bench_device import minimal_rss  # the Python binding's process, same programs
from splitface.common.models import build_device_part, resolve_spec
from splitface.common.models.lrn import PaperLRN
from splitface.device.runtimes.native import build, etdump_ops, reference_normals, run_native, write_inputs
from splitface.device.runtimes.manifest import RELEASE_GEMM_PTE, RELEASE_STRIP_PTE, VJP_GEMM_PTE, VJP_STRIP_PTE
from splitface.export.artifacts import export_gemm_ptes, write_strip_ptes
from splitface.device.runtimes.parity import GRAD_RTOL, RELEASE_ATOL, reference
from research.results import write_record

ROOT = Path(__file__).resolve().parents[1]

RELEASE_INPUTS = ["images", "noise", "weight", "bias"]
STRIP_RELEASE_INPUTS = ["images", "weight", "bias"]
GRAD_INPUTS = ["images", "grad", "weight", "bias"]
NOISE_STD = 0.1  # the drawn noise's standard deviation (the file's noise is 0.1 N(0, 1) too)


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


def export_for_strips(layer: torch.nn.Module, rows: int, input_size: int, out: Path) -> Path:
    """release_strip.pte and vjp_strip.pte for strips of `rows` rows in `out` (kept ones are reused)."""
    write_strip_ptes(layer, rows, input_size, out)
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


def errors(report: dict, want_release: torch.Tensor, want_grads: list[torch.Tensor]) -> tuple[float, float]:
    """The runner's release (max abs) and gradient (max relative) errors against eager PyTorch; exits past
    splitface/export/verify.py's tolerances."""
    release_err = float(np.abs(report["release"] - want_release.numpy().ravel()).max())
    grad_err = max(float(np.abs(a - b.numpy().ravel()).max() / np.abs(b.numpy()).max())
                   for a, b in zip(report["grads"], want_grads, strict=True))
    if release_err > RELEASE_ATOL or grad_err > GRAD_RTOL:
        raise SystemExit(f"native programs ({report['program_batch']}, strips of {report['strip_rows']}) disagree "
                         f"with eager PyTorch: release {release_err:.3g} (tolerance {RELEASE_ATOL}), gradient "
                         f"{grad_err:.3g} ({GRAD_RTOL})")
    return release_err, grad_err


TIMES = ("forward_compute_ms", "forward_noise_ms", "forward_total_ms", "backward_compute_ms", "backward_total_ms")


def programs_of(config: dict) -> tuple[tuple[Path, list[str]], tuple[Path, list[str]], dict]:
    """The release and gradient programs of a configuration with their inputs, and run_native's options."""
    programs, strips = config["programs"], config["strips"]
    release = (programs / (RELEASE_STRIP_PTE if strips else RELEASE_GEMM_PTE),
               STRIP_RELEASE_INPUTS if strips else RELEASE_INPUTS)
    grad = (programs / (VJP_STRIP_PTE if strips else VJP_GEMM_PTE), GRAD_INPUTS)
    return release, grad, {"strips": strips, "noise_std": NOISE_STD if config["draw"] else None}


def retime(binary: Path, work: Path, samples: int, config: dict, result: dict, runs: int, warmup: int) -> None:
    """Another round of a configuration's timed runs (a fresh process), appended to `result`'s times."""
    release, grad, run = programs_of(config)
    report = run_native(binary, work, samples, release, grad, runs=runs, warmup=warmup, **run)
    for key in TIMES:
        result[key] += report[key]


def measure(binary: Path, work: Path, layer: torch.nn.Module, tensors: dict, want: tuple, config: dict,
            runs: int, warmup: int, normals: Callable[[bytes, int], np.ndarray] = reference_normals) -> dict:
    """One configuration: checked against eager PyTorch, then timed. config: programs (a folder), strips,
    draw (whether the runner draws the noise). `normals`: the float64 reference of what the runner draws under
    a key (another revision's runner may draw other normals: bench/native_revisions.py)."""
    samples = len(tensors["images"])
    draw = config["draw"]
    release, grad, run = programs_of(config)
    if draw:  # the check: a known key, whose normals eager PyTorch gets as its noise
        key = os.urandom(32)
        (work / "check.key").write_bytes(key)
        noise = NOISE_STD * torch.from_numpy(normals(key, tensors["noise"].numel())).float()
        want = reference(layer, tensors["images"], noise.reshape(tensors["noise"].shape), tensors["grad"],
                         [tensors["weight"], tensors["bias"]])
        release_err, grad_err = errors(run_native(binary, work, samples, release, grad, runs=1, warmup=0,
                                                  noise_key=work / "check.key", **run), *want)
    report = run_native(binary, work, samples, release, grad, runs=runs, warmup=warmup, **run)
    if not draw:
        release_err, grad_err = errors(report, *want)
    del report["release"], report["grads"]
    return {**report, "label": config["label"], "noise": "drawn" if draw else "read",
            "release_max_abs_err": release_err, "grad_max_rel_err": grad_err}


def profile(binary: Path, work: Path, samples: int, config: dict, runs: int) -> dict:
    """Where a configuration's time goes: its runs recorded with ETDump (`--etdump`), each operator's ms per batch
    (XNNPACK's operators inside the delegate call, which the call's own row includes). Recording adds a little
    time per event, so these rows are for the split, the main table for the totals."""
    release, grad, run = programs_of(config)
    prefix = work / f"profile-{config['label'].replace(' ', '-')}"
    run_native(binary, work, samples, release, grad, runs=runs, warmup=0, etdump=prefix, **run)
    return {"label": config["label"], "runs": runs,
            "release": etdump_ops(prefix.with_suffix(".release.etdp"), runs),
            "grad": etdump_ops(prefix.with_suffix(".grad.etdp"), runs)}


def profile_table(profiles: list[dict]) -> str:
    """Each profiled program's operators grouped by kind (XNNPACK numbers its operators: "Slice (ND, X32) #19"),
    ms per batch and share of Method::execute; the portable kernels (ExecuTorch's, outside XNNPACK) together."""
    lines = ["Where the time goes (`--profile`: each program's runs recorded with ETDump, ms per batch of 8 summed "
             "over its calls and over the operators of a kind, mean of the recorded runs, which ran after the main "
             "table's and, with the recording's own cost, need not add up to its times; the JSON keeps every "
             "operator):", ""]
    for prof in profiles:
        for program in ("release", "grad"):
            kinds: dict[str, list[float]] = {}
            total = 0.0
            for name, ms in prof[program]:
                if name == "Method::execute":
                    total += ms
                elif name == "OPERATOR_CALL" or name.startswith("native_call_"):
                    kinds.setdefault("portable kernels (outside XNNPACK)", []).append(ms / 2)  # both rows time one call
                elif name != "DELEGATE_CALL":
                    kinds.setdefault(name.split(" #")[0], []).append(ms)
            rows = sorted(((sum(v), len(v), k) for k, v in kinds.items()), reverse=True)
            note = (", over both passes: the weight gradient runs it again for the conv's output"
                    if program == "release" and prof["label"].startswith("strips") else "")
            lines += [f"{prof['label']}, {'release' if program == 'release' else 'weight gradient'} program "
                      f"(Method::execute {total:.0f} ms per batch{note}):", "",
                      "| operator | operators | ms per batch | share |", "|---|---:|---:|---:|"]
            lines += [f"| {k} | {n} | {ms:.1f} | {ms / total:.0%} |" for ms, n, k in rows if ms >= 0.5]
            rest = total - sum(ms for ms, _, _ in rows)
            lines += [f"| rest: per-call cost of the runtime and the delegate outside any operator | | {rest:.1f} | "
                      f"{rest / total:.0%} |", ""]
    return "\n".join(lines)


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
        return f"{np.mean(v):.0f} / {min(v):.0f}" if v else ""

    n = saved["samples"]
    lines = [f"The device layer through ExecuTorch's C++ runtime (`splitface_native`, no Python, no libtorch), "
             f"{saved['model']} conv1 + ReLU + LRN at {saved['input_size']} px, {n} images per batch, one "
             f"thread, on {describe(saved['record']) if 'record' in saved else saved['machine']}. Not a phone: compare the rows with each other. Times in ms as mean / "
             f"min over {saved['rounds']} rounds of {saved['runs']} runs, each round a fresh process per row after "
             f"{saved['warmup']} warm-up run, the rows taking turns (so a change of the machine's load hits them "
             "all); 'compute' is the programs' execute "
             "calls plus what the runner does between them in memory (cutting strips, the strips' LRN, drawing and adding the noise), "
             "'with I/O' adds streaming each image's inputs from files and its release out (a phone's camera, "
             "server gradient and socket stand in for the files). Noise 'read': the release program adds noise "
             "read from a file, not drawn (last session's rows); 'drawn': the runner draws N(0, "
             f"{NOISE_STD}^2) per value (ChaCha8 + Box-Muller, a fresh key from the OS CSPRNG per release), the "
             "issue's forward goal. Every native configuration was checked against eager PyTorch first (release "
             "max abs error, gradient max relative error).", "",
             "| process | programs | calls per batch | noise | RSS after load | peak after release | peak after "
             "weight gradient | release compute | of it drawing noise | release with I/O | weight gradient compute "
             "| per sample | weight gradient with I/O | release err | gradient err |",
             "|---|---|---:|---|---:|---:|---:|---|---|---|---|---:|---|---:|---:|"]
    for r in saved["native"]:
        mb = {k: f"{r[k] / 1024:.0f} MB" for k in ("rss_loaded_kb", "peak_forward_kb", "peak_kb")}
        calls = n // r["program_batch"] if not r["strip_rows"] else n * saved["input_size"] // r["strip_rows"]
        lines.append(f"| native C++ | {r['label']} | {calls} | {r['noise']} | {mb['rss_loaded_kb']} | "
                     f"{mb['peak_forward_kb']} | {mb['peak_kb']} | {ms(r['forward_compute_ms'])} | "
                     f"{ms(r['forward_noise_ms']) if r['noise'] == 'drawn' else ''} | {ms(r['forward_total_ms'])} | "
                     f"{ms(r['backward_compute_ms'])} | {np.mean(r['backward_compute_ms']) / n:.1f} | "
                     f"{ms(r['backward_total_ms'])} | {r['release_max_abs_err']:.1e} | {r['grad_max_rel_err']:.1e} |")
    p, w = saved["python_binding"], saved["python_binding_warm"]
    if p and w:
        lines.append(f"| Python binding (imports PyTorch) | batch {n} | 1 | read | {p['load'] / 2**20:.0f} MB | "
                     f"{p['forward'] / 2**20:.0f} MB | {p['backward'] / 2**20:.0f} MB | {ms(w['forward_ms'])} | | | "
                     f"{ms(w['backward_ms'])} | {np.mean(w['backward_ms']) / n:.1f} | | | |")
        lines += ["", "The Python binding's memory is bench_device.py's minimal process (only the binding, its own "
                  "random inputs of the same shapes, one call of each program); its times are the same batch-8 "
                  "programs called warm from Python in this run, on the native rows' inputs."]
    lines += ["", f"Machine load (1/5/15 min): {' / '.join(f'{x:.1f}' for x in saved['load_before'])} before, "
              f"{' / '.join(f'{x:.1f}' for x in saved['load_after'])} after.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg_face", help="a model whose conv1 the im2col programs cover")
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--samples", type=int, default=8, help="images per device batch")
    p.add_argument("--batches", type=int, nargs="*", default=[8, 1], help="per-image program batch sizes to compare")
    p.add_argument("--strip-rows", type=int, nargs="*", default=[8, 4, 2], help="strip heights to compare")
    p.add_argument("--no-binding", action="store_true", help="skip the Python binding's rows")
    p.add_argument("--profile", action="store_true",
                   help="also record the per-image (batch 1) and strip programs with ETDump: time per operator")
    p.add_argument("--runs", type=int, default=3, help="timed runs per configuration and round")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds over all configurations (each a fresh process per configuration)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--artifacts", type=Path, default=None, help="keep the exported programs here (default: a temp dir)")
    p.add_argument("--build-dir", type=Path, default=ROOT / "build" / "native")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_native")
    args = p.parse_args(argv)
    if any(args.samples % b for b in args.batches) or any(args.input_size % r for r in args.strip_rows):
        p.error(f"every program batch must divide --samples {args.samples}, every strip height --input-size")
    load_before = os.getloadavg()
    binary = build(args.build_dir)
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="bench-native-"))
    if args.artifacts is None:
        atexit.register(shutil.rmtree, artifacts, ignore_errors=True)
    layer = device_layer(args.model, args.input_size)
    tensors = inputs(layer, args.samples, args.input_size)
    want = reference(layer, tensors["images"], tensors["noise"], tensors["grad"], [tensors["weight"], tensors["bias"]])
    work = Path(tempfile.mkdtemp(prefix="bench-native-io-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # 300 MB of inputs and releases
    write_inputs(work, {k: v.numpy() for k, v in tensors.items()})
    configs = [{"label": f"batch {b}", "programs": export_for_batch(layer, b, args.input_size,
                                                                     artifacts / f"{args.model}-b{b}"),
                "strips": False, "draw": False} for b in args.batches]
    if 1 in args.batches:
        configs.append({**configs[args.batches.index(1)], "draw": True})
    configs += [{"label": f"strips of {r} rows", "programs": export_for_strips(layer, r, args.input_size,
                                                                              artifacts / f"{args.model}-s{r}"),
                 "strips": True, "draw": True} for r in args.strip_rows]
    native = []
    for config in configs:
        native.append(measure(binary, work, layer, tensors, want, config, args.runs, args.warmup))
        print(json.dumps(native[-1]), flush=True)
    for _ in range(args.rounds - 1):  # the configurations in turn again, so that a change of load hits them all
        for config, result in zip(configs, native, strict=True):
            retime(binary, work, args.samples, config, result, args.runs, args.warmup)
    profiles, profiled = [], set()
    for config in configs if args.profile else []:
        if (config["strips"] or config["label"] == "batch 1") and config["programs"] not in profiled:
            profiled.add(config["programs"])  # batch 1 once: noise read and drawn share its programs
            profiles.append(profile(binary, work, args.samples, config, args.runs))
    binding = not args.no_binding and args.model == "vgg_face" and args.input_size == 224 and args.samples == 8
    b8 = export_for_batch(layer, args.samples, args.input_size, artifacts / f"{args.model}-b{args.samples}") \
        if binding else None
    python_binding = minimal_rss(b8) if binding else None
    warm = binding_times(b8, tensors, args.runs, args.warmup) if binding else None
    saved = {"model": args.model, "input_size": args.input_size, "samples": args.samples, "runs": args.runs,
             "warmup": args.warmup, "rounds": args.rounds, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
             "record": {**record(cmake_flags(args.build_dir, "splitface_native")), "load_avg": list(load_before)},
             "noise_std": NOISE_STD, "native": native, "profiles": profiles, "python_binding": python_binding, "python_binding_warm": warm,
             "load_before": load_before, "load_after": os.getloadavg()}
    write_record(args.out, saved, table(saved) + ("\n" + profile_table(profiles) if profiles else ""))


if __name__ == "__main__":
    main()
