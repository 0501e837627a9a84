"""The native runner's strip release and weight gradient at several git revisions, side by side in one run.

A change to the runner's hot path (the noise, the strips) is measured against the revision before it on one
machine, with the rounds interleaved so that a change of the machine's load hits every revision alike: figures
from two runs on a shared machine differ by more than such a change (docs/device.md). Each revision's native
sources (`git archive`) are built with CMake as the runner is, and its strip programs are exported by its own
`splitface` package (what a strip program computes may change with the runner: since the LRN moved into the
runner, the release program stops at the LRN's input). Every build is checked against eager PyTorch on the
noise that it draws under a known key (as its own revision's reference computes that noise), then each strip
height's release with drawn noise is timed: the release's compute, the part of it drawing and adding the noise,
and the rest (the conv, ReLU and LRN); and the weight gradient of the same batch.

    python -m bench.native_revisions --revisions 649b726 HEAD   # writes results/bench_native_revisions.{json,txt}
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.bench_native import ROOT, device_layer, inputs, measure, retime
from bench.machine import cmake_flags, describe, record, run_harness
from research.results import write_record
from splitface.device.runtimes.native import build, write_inputs
from splitface.device.runtimes.parity import reference

NATIVE = "splitface/device/runtimes/native"
# Run with a revision's `splitface` first on sys.path: its strip programs for (model, size, rows, out), the layer
# built as bench_native.device_layer builds it (the programs take the weights as inputs: only shapes matter).
EXPORT = """
import sys, torch
from pathlib import Path
from splitface.common.models import build_device_part, resolve_spec
from splitface.common.models.lrn import PaperLRN
from splitface.export.artifacts import write_strip_ptes
model, size, rows, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
torch.manual_seed(0)
layer = build_device_part(resolve_spec(model), "conv1").eval()
for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
    lrn.input_max = 1.0
write_strip_ptes(layer, rows, size, out)
"""
# Run the same way: the revision's own float64 reference of the normals its runner draws under a key (the float
# noise's cipher changed at issue 30's fourth pass: ChaCha20, then ChaCha8), saved as .npy.
NORMALS = """
import sys, numpy as np
from splitface.device.runtimes.native import reference_normals
np.save(sys.argv[3], reference_normals(bytes.fromhex(sys.argv[1]), int(sys.argv[2])))
"""


def build_revision(revision: str, work: Path) -> tuple[str, Path, Path]:
    """The revision's full commit id, its runner (built from its own native sources) and its source tree."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    source = work / f"src-{commit[:12]}"
    source.mkdir()
    archive = subprocess.run(["git", "archive", commit, "splitface"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    return commit, build(work / f"build-{commit[:12]}", source=source / NATIVE), source


def export_revision(source: Path, model: str, size: int, rows: int, out: Path) -> Path:
    """The strip programs that the revision in `source` exports, in `out`."""
    run_harness([sys.executable, "-c", EXPORT, model, str(size), str(rows), str(out)], cwd=source,
                env={**os.environ, "PYTHONPATH": str(source)})  # -c puts the cwd first
    return out


def revision_normals(source: Path, work: Path) -> Callable[[bytes, int], np.ndarray]:
    """`reference_normals` as the revision in `source` defines it."""
    def normals(key: bytes, n: int) -> np.ndarray:
        out = work / f"normals-{source.name}.npy"
        run_harness([sys.executable, "-c", NORMALS, key.hex(), str(n), str(out)], cwd=source,
                    env={**os.environ, "PYTHONPATH": str(source)})
        return np.load(out)
    return normals


def table(saved: dict) -> str:
    lines = [f"The strip runner's release with drawn noise at each revision, {saved['model']} conv1 at "
             f"{saved['input_size']} px, {saved['samples']} images per batch, one thread, side by side in one run: "
             f"{saved['rounds']} rounds of {saved['runs']} runs, each a fresh process after {saved['warmup']} warm-up "
             "run, the revisions taking turns. ms per batch as mean / min; 'conv' is the release's compute less the "
             "drawing; the weight gradient is the batch's (all its samples). "
             f"Machine (the build flags are the last revision's build's): {describe(saved['record'])} "
             f"(load {saved['load_after'][0]:.1f} after). Not a phone: "
             "compare the rows with each other.", "",
             "| strips | revision | release compute | of it drawing noise | conv (the rest) | drawing / conv | release err "
             "| weight gradient compute | gradient err |",
             "|---|---|---|---|---|---:|---:|---|---:|"]
    for r in saved["rows"]:
        compute, noise = np.array(r["forward_compute_ms"]), np.array(r["forward_noise_ms"])
        conv, grad = compute - noise, np.array(r["backward_compute_ms"])
        name = r["commit"][:7] if r["commit"].startswith(r["revision"]) else f"{r['revision']} ({r['commit'][:7]})"
        lines.append(f"| {r['label']} | {name} | {compute.mean():.0f} / {compute.min():.0f} | "
                     f"{noise.mean():.0f} / {noise.min():.0f} | {conv.mean():.0f} / {conv.min():.0f} | "
                     f"{noise.mean() / conv.mean():.2f} | {r['release_max_abs_err']:.1e} | "
                     f"{grad.mean():.0f} / {grad.min():.0f} | {r['grad_max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revisions", nargs="+", default=["HEAD~1", "HEAD"], help="git revisions, oldest first")
    p.add_argument("--model", default="vgg_face")
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--strip-rows", type=int, nargs="+", default=[4, 8, 2])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_native_revisions")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-native-revisions-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    builds = [(revision, *build_revision(revision, work)) for revision in args.revisions]
    machine = record(cmake_flags(builds[-1][2].parent, "splitface_native"))
    layer = device_layer(args.model, args.input_size)
    tensors = inputs(layer, args.samples, args.input_size)
    want = reference(layer, tensors["images"], tensors["noise"], tensors["grad"], [tensors["weight"], tensors["bias"]])
    write_inputs(work, {k: v.numpy() for k, v in tensors.items()})
    rows = []
    for r in args.strip_rows:
        for revision, commit, binary, source in builds:
            programs = export_revision(source, args.model, args.input_size, r, work / f"{commit[:12]}-s{r}")
            config = {"label": f"{r} rows", "strips": True, "draw": True, "programs": programs}
            rows.append({**measure(binary, work, layer, tensors, want, config, args.runs, args.warmup,
                                   normals=revision_normals(source, work)),
                         "revision": revision, "commit": commit, "binary": binary, "config": config})
    for _ in range(args.rounds - 1):
        for row in rows:
            retime(row["binary"], work, args.samples, row["config"], row, args.runs, args.warmup)
    for row in rows:
        del row["binary"], row["config"]
    saved = {"model": args.model, "input_size": args.input_size, "samples": args.samples, "runs": args.runs,
             "rounds": args.rounds, "warmup": args.warmup, "record": machine, "rows": rows,
             "load_after": record()["load_avg"]}
    write_record(args.out, saved, table(saved))


if __name__ == "__main__":
    main()
