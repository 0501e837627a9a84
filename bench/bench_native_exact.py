"""What the exact noise option costs in the native runner, beside the float option, on one release.

VGG-Face conv1 at 224 px, a batch of 8 (25.7M values), 4-row strip programs, one thread: the runner's release
with the float noise drawn (`--noise-std`, ChaCha8 + Box-Muller; ChaCha20 before issue 30's fourth pass) and with
the exact discrete Gaussian (`--noise-discrete`: clip and quantise each image, CKS20 samples in integer
arithmetic, int8 out), in one run.
The mechanism is `DiscreteGaussianMechanism(clip_norm=10, noise_multiplier=0.16)`: B = 127 steps, sigma about
20 steps, docs/device.md's figure for numpy's sampler. Prints the runner's release compute and its noise part.
`--baseline BINARY` also times the exact option with another build of the runner (an older commit's), in the
same run, for a before/after at the same load.

    python bench/bench_native_exact.py [--baseline path/to/old/splitface_native]   # -> results/bench_native_exact.*
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.bench_native import NOISE_STD, STRIP_RELEASE_INPUTS, device_layer, inputs
from bench.machine import cmake_flags, describe, record
from splitface.device.privacy.discrete import DiscreteGaussianMechanism
from splitface.device.runtimes.native import build_cached, run_native, write_inputs
from splitface.export.artifacts import write_strip_ptes
from research.results import write_record

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another build of the runner, timed on the exact option too")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_native_exact",
                   help="writes OUT.json (figures and the machine's record) and OUT.txt")
    args = p.parse_args(argv)
    layer = device_layer("vgg_face", args.input_size)
    work = Path(tempfile.mkdtemp(prefix="bench-native-exact-"))
    release, _ = write_strip_ptes(layer, 4, args.input_size, work / "programs")
    t = inputs(layer, args.samples, args.input_size)
    write_inputs(work, {"images": t["images"].numpy(), "weight": t["weight"].numpy(), "bias": t["bias"].numpy()})
    info = DiscreteGaussianMechanism(clip_norm=10.0, noise_multiplier=0.16).describe()
    binary = build_cached()
    machine = record(cmake_flags(binary.parent, "splitface_native"))
    exact = {"exact": (info["sigma2_steps"], info["step"], info["bound_steps"])}
    cases = [("float, drawn", binary, {"noise_std": NOISE_STD}), ("exact discrete", binary, exact)]
    if args.baseline:
        cases.append(("exact, baseline", args.baseline, exact))
    rows = []
    for label, runner, options in cases:
        report = run_native(runner, work, args.samples, (release, STRIP_RELEASE_INPUTS), runs=args.runs, warmup=1,
                            strips=True, **options)
        rows.append({"case": label, "runner": f"{runner.parent.name}/{runner.name}",   # the build, not the home dir
                     "release_compute_ms": report["forward_compute_ms"],
                     "noise_ms": report["forward_noise_ms"]})
    saved = {"input_size": args.input_size, "samples": args.samples, "runs": args.runs, "warmup": 1,
             "exact": {"sigma2_steps": info["sigma2_steps"], "bound_steps": info["bound_steps"]},
             "record": machine, "load_after": record()["load_avg"], "rows": rows}
    write_record(args.out, saved, table(saved))


def table(saved: dict) -> str:
    exact = saved["exact"]
    lines = [f"vgg_face conv1, {saved['input_size']} px, batch {saved['samples']}, one thread, 4-row strips, "
             f"{saved['runs']} runs after {saved['warmup']} warm-up; exact option: sigma^2 = {exact['sigma2_steps']} "
             f"steps^2, B = {exact['bound_steps']}", f"on {describe(saved['record'])}"]
    for row in saved["rows"]:
        compute, noise = row["release_compute_ms"], row["noise_ms"]
        baseline = f" ({row['runner']})" if row["case"].endswith("baseline") else ""
        lines.append(f"  {row['case']:16s} release compute {statistics.mean(compute):8.1f} / {min(compute):8.1f} ms, "
                     f"of it noise {statistics.mean(noise):8.1f} / {min(noise):8.1f} ms (mean / min){baseline}")
    lines.append(f"load {saved['record']['load_avg'][0]:.1f} before, {saved['load_after'][0]:.1f} after")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
