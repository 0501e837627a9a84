"""The native device runner: ExecuTorch's C++ runtime with no Python and no libtorch in the process.

A phone app links libexecutorch, the optimized kernels and the XNNPACK delegate, not PyTorch; the Python
binding (`executorch-xnnpack`) links libtorch, so its process measures PyTorch as much as the device.
`splitface_native.cpp` runs the im2col programs (`splitface-export --gemm`) the way an app would: the
programs memory-mapped, each chunk of the programs' batch streamed in from files and its release streamed
out, the weight gradient summed over chunks. With batch-1 programs a batch of N images never holds more
than one image's activations, which is what brings the device's peak memory down.

Built here with CMake against the executorch wheel's prebuilt runtime (`build`), driven by
`run_native`, and measured by `bench/bench_device.py --native`; the simulator's devices still run the
Python runtimes.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent
BINARY = "splitface_native"


def executorch_cmake_dir() -> Path:
    """Where the executorch wheel keeps its CMake package (headers and prebuilt libraries beside it)."""
    import executorch

    found = Path(next(iter(executorch.__path__))) / "lib" / "cmake" / "executorch"
    if not (found / "executorch-config.cmake").exists():
        raise RuntimeError(f"the executorch package at {found.parents[2]} ships no C++ runtime (no "
                           f"{found / 'executorch-config.cmake'}): install executorch 1.5.1 from PyPI")
    return found


def build(build_dir: Path) -> Path:
    """Configure and build the runner in `build_dir` (CMake rebuilds only what changed); the binary's path."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"building the native runner needs {' and '.join(missing)} on PATH "
                           "(Debian: apt-get install cmake g++)")
    build_dir.mkdir(parents=True, exist_ok=True)
    steps = [["cmake", "-S", str(SOURCE), "-B", str(build_dir), f"-Dexecutorch_DIR={executorch_cmake_dir()}",
              "-DCMAKE_BUILD_TYPE=Release"],
             ["cmake", "--build", str(build_dir)]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(step[:2])} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return build_dir / BINARY


def write_inputs(workdir: Path, inputs: dict[str, np.ndarray]) -> None:
    """Each input as workdir/<name>.f32 (float32, C order), the runner's input files."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, array in inputs.items():
        np.ascontiguousarray(array, dtype=np.float32).tofile(workdir / f"{name}.f32")


def run_native(binary: Path, workdir: Path, samples: int, release: tuple[Path, list[str]],
               grad: tuple[Path, list[str]] | None = None, runs: int = 3, warmup: int = 1,
               threads: str = "1") -> dict:
    """Run the release (and gradient) program over `samples` samples whose inputs `write_inputs` put in
    `workdir`; returns the runner's report (times in ms, RSS in kB) with "release" (the last run's, as
    float32 in the release program's per-sample shape) and "grads" (the summed gradient outputs)."""
    cmd = [str(binary), "--dir", str(workdir), "--samples", str(samples), "--runs", str(runs),
           "--warmup", str(warmup), "--threads", threads, "--release", f"{release[0]}:{','.join(release[1])}"]
    if grad is not None:
        cmd += ["--grad", f"{grad[0]}:{','.join(grad[1])}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BINARY} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    report = json.loads(proc.stdout)
    report["release"] = np.fromfile(workdir / "release.f32", dtype=np.float32)
    report["grads"] = [np.fromfile(workdir / f"grad_{i}.f32", dtype=np.float32)
                       for i in range(report["grad_outputs"])]
    return report
