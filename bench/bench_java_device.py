"""The Android demo's Java device layer: the plain-Java reference against ExecuTorch's C++ runtime through
JNI, on the batch im2col programs (`GemmLayerTrainer` over `NativeProgram`) and on the strip programs
(`StripLayerTrainer`, the native runner's strip layer), side by side in one run.

The demo's core (android_demo/core) is what the app runs; on this host it runs in a JVM, each trainer in its own
JVM process (`Cli bench`), so that each peak RSS is that trainer's. Both compute the release (conv1 + ReLU + LRN,
the DP clamp) and the weight gradient for the same images, weights and server gradient; tests/test_android_core.py
holds the JNI path to eager PyTorch. Not a phone: the JVM is HotSpot on x86, not ART on ARM.

    python bench/bench_java_device.py           # VGG-Face conv1, 224 px, batch 8, one thread; --out's text
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import msgpack
import torch

from bench.bench_native import device_layer, export_for_batch, inputs
from bench.machine import cmake_flags, describe, record
from splitface.device.runtimes.native import jni_library
from splitface.device.runtimes.manifest import RELEASE_GEMM_PTE, VJP_GEMM_PTE
from splitface.export.artifacts import write_strip_ptes
from splitface.export.java_layer import java_layer_job

ROOT = Path(__file__).resolve().parents[1]

TRAINERS = {"reference": "plain Java (DeviceLayer: loops, its own backward)",
            "gemm": "ExecuTorch via JNI, the batch im2col programs (XNNPACK)",
            "strips": "ExecuTorch via JNI, the strip programs (4 rows, XNNPACK)"}
STRIP_ROWS = 4  # the native backend's (splitface/device/runtimes/native_runtime.py)


def java_classes(out: Path) -> list[str]:
    """The core built by android_demo/jvm_test.sh into `out`; the command line that runs its Cli."""
    build = subprocess.run([str(ROOT / "android_demo" / "jvm_test.sh"), "--build-only"], capture_output=True,
                           text=True, env={**os.environ, "JVM_BUILD_DIR": str(out)})
    if build.returncode != 0:
        raise SystemExit(f"building android_demo/core failed:\n{build.stdout}{build.stderr}")
    return ["java", "-cp", f"{out / 'main'}:/usr/share/java/msgpack-core.jar", "org.splitface.core.Cli"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg_face")
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, choices=(0, 1), default=1,
                   help="1: ExecuTorch on the calling thread; 0: its pool, one thread per core (the Java reference has one)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_java_device.txt",
                   help="where the printed table is also written")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-java-device-"))
    layer = device_layer(args.model, args.input_size)
    t = inputs(layer, args.samples, args.input_size)
    with torch.no_grad():  # the weights the programs and the Java layer both get
        for param, value in zip(layer.parameters(), (t["weight"], t["bias"]), strict=True):
            param.copy_(value)
    gemm = export_for_batch(layer, args.samples, args.input_size, work / "gemm")
    strips = write_strip_ptes(layer, STRIP_ROWS, args.input_size, work / "strips")
    library = str(jni_library())
    extras = {"job only": {"warmup": 0, "runs": 0},  # a JVM that reads the job and runs nothing: the baseline
              "reference": {},
              "gemm": {"programs": {"library": library, "kind": "gemm", "release": str(gemm / RELEASE_GEMM_PTE),
                                    "vjp": str(gemm / VJP_GEMM_PTE)}},
              "strips": {"programs": {"library": library, "kind": "strips", "release": str(strips[0]),
                                      "vjp": str(strips[1])}}}
    pixels = (255 * t["images"]).round().to(torch.uint8).numpy()
    job = {**java_layer_job(layer), "images": pixels.tobytes(), "shape": list(pixels.shape),
           "grad": t["grad"].numpy().astype("<f4").tobytes(), "warmup": args.warmup, "runs": args.runs,
           "threads": args.threads}
    java = java_classes(work / "jvm")
    jvm = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0]
    machine = record(cmake_flags(Path(library).parent, "splitface_jni"))
    reports = {}
    for trainer, extra in extras.items():
        path = work / "job.msgpack"
        path.write_bytes(msgpack.packb({**job, **extra}))
        run = subprocess.run([*java, "bench", str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"Cli bench {trainer} failed:\n{run.stderr[-3000:]}")
        reports[trainer] = json.loads(run.stdout.strip().splitlines()[-1])
    baseline = reports.pop("job only")["peak_kb"] / 1024
    after = os.getloadavg()
    threads = "one thread" if args.threads == 1 else "ExecuTorch's pool (one thread per core)"
    lines = [f"{args.model} conv1 + ReLU + LRN, {args.input_size} px, batch {args.samples}, {threads}; each trainer "
             f"in its own JVM ({jvm}), {args.runs} runs after {args.warmup} warm-up; ms per batch, mean / min. "
             f"Machine (the build flags libsplitface_jni's): {describe(machine)}; load {after[0]:.1f} after.",
             "",
             "| trainer | release | weight gradient | per sample | JVM peak RSS |",
             "|---|---:|---:|---:|---:|"]
    for trainer, what in TRAINERS.items():
        r = reports[trainer]
        fwd, grad = r["forward_ms"], r["grad_ms"]
        lines.append(f"| {what} | {statistics.mean(fwd):.0f} / {min(fwd):.0f} | {statistics.mean(grad):.0f} / "
                     f"{min(grad):.0f} | {statistics.mean(grad) / args.samples:.1f} | {r['peak_kb'] / 1024:.0f} MB |")
    lines += ["", f"JVM peak RSS is the whole process's high-water mark (VmHWM): a JVM that only reads the job (its "
                  f"images and server gradient, as msgpack bytes and as float arrays) peaks at {baseline:.0f} MB; the rest "
                  f"is the trainer's arrays (the release returned, the gradient) and the garbage collector's headroom. "
                  f"The native strip layer itself holds one strip's buffers (docs/device.md)."]
    mean = {name: (statistics.mean(r["forward_ms"]), statistics.mean(r["grad_ms"])) for name, r in reports.items()}
    lines.append("")
    for name in ("gemm", "strips"):
        lines.append(f"{name} against the plain-Java layer: release {mean['reference'][0] / mean[name][0]:.1f}x, weight "
                     f"gradient {mean['reference'][1] / mean[name][1]:.1f}x faster (this run's means).")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.write_text(text)


if __name__ == "__main__":
    main()
