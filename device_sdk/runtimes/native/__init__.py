"""The native device runner: ExecuTorch's C++ runtime with no Python and no libtorch in the process.

A phone app links libexecutorch, the optimized kernels and the XNNPACK delegate, not PyTorch; the Python
binding (`executorch-xnnpack`) links libtorch, so its process measures PyTorch as much as the device.
`splitface_native.cpp` runs the im2col programs (`splitface-export --gemm`) the way an app would: the
programs memory-mapped, each chunk of the programs' batch streamed in from files and its release streamed
out, the weight gradient summed over chunks. With batch-1 programs a batch of N images never holds more
than one image's activations, which is what brings the device's peak memory down.

Built here with CMake against the executorch wheel's prebuilt runtime (`build`), driven by
`run_native`, and measured by `bench/bench_native.py`; the simulator's devices still run the Python
runtimes. Its fast path is the strip programs (`export.artifacts.export_strip_ptes`): each image cut into
strips of a few rows so that XNNPACK's passes stay in cache, and the release's noise drawn by the runner
(ChaCha20 + Box-Muller, `gaussian_noise.h`; `reference_normals` is its float64 reference).
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


def reference_normals(key: bytes, n: int) -> np.ndarray:
    """The first `n` normals the runner draws under `key` (gaussian_noise.h's mapping), in float64 from
    `fastnoise.NoiseStream`'s ChaCha20 keystream: what the tests hold the native generator to."""
    from device_sdk.privacy.fastnoise import NoiseStream

    groups = -(-n // 256)
    words = NoiseStream(key).words32(256 * groups).reshape(groups, 16, 16)  # (group, block = lane, word)
    u = ((words[:, :, 0::2] >> 8) + 1) / 2.0**24
    theta = 2 * np.pi * (words[:, :, 1::2] >> 8) / 2.0**24
    radius = np.sqrt(-2 * np.log(u))
    z = np.empty((groups, 16, 16))
    z[:, :, 0::2], z[:, :, 1::2] = radius * np.cos(theta), radius * np.sin(theta)
    return z.transpose(0, 2, 1).reshape(-1)[:n]  # value 16 word + lane of each group


def write_inputs(workdir: Path, inputs: dict[str, np.ndarray]) -> None:
    """Each input as workdir/<name>.f32 (float32, C order), the runner's input files."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, array in inputs.items():
        np.ascontiguousarray(array, dtype=np.float32).tofile(workdir / f"{name}.f32")


def run_native(binary: Path, workdir: Path, samples: int, release: tuple[Path, list[str]],
               grad: tuple[Path, list[str]] | None = None, runs: int = 3, warmup: int = 1,
               threads: str = "1", strips: bool = False, noise_std: float | None = None,
               noise_key: Path | None = None, etdump: Path | None = None) -> dict:
    """Run the release (and gradient) program over `samples` samples whose inputs `write_inputs` put in
    `workdir`; returns the runner's report (times in ms, RSS in kB) with "release" (the last run's, as
    float32 in the release program's per-sample shape) and "grads" (the summed gradient outputs).

    `strips`: the programs are strip programs (`export_strip_ptes`), run strip by strip over each image.
    `noise_std`: the runner draws the release's noise, N(0, noise_std^2) from ChaCha20 under a fresh key
    from the OS CSPRNG per release, or under the 32 bytes in `noise_key` (tests only). `etdump`: a path
    prefix; every run is recorded with ExecuTorch's ETDump into <prefix>.release.etdp and .grad.etdp."""
    cmd = [str(binary), "--dir", str(workdir), "--samples", str(samples), "--runs", str(runs),
           "--warmup", str(warmup), "--threads", threads, "--release", f"{release[0]}:{','.join(release[1])}"]
    if grad is not None:
        cmd += ["--grad", f"{grad[0]}:{','.join(grad[1])}"]
    if strips:
        cmd.append("--strips")
    if noise_std is not None:
        cmd += ["--noise-std", repr(float(noise_std))]
    if noise_key is not None:
        cmd += ["--noise-key", str(noise_key)]
    if etdump is not None:
        cmd += ["--etdump", str(etdump)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BINARY} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    report = json.loads(proc.stdout)
    report["release"] = np.fromfile(workdir / "release.f32", dtype=np.float32)
    report["grads"] = [np.fromfile(workdir / f"grad_{i}.f32", dtype=np.float32)
                       for i in range(report["grad_outputs"])]
    return report


def etdump_ops(path: Path, runs: int) -> list[tuple[str, float]]:
    """(operator, ms per run) in program order from an ETDump of `runs` runs: every event the devtools
    Inspector finds (XNNPACK's operators inside its delegate call, the portable kernels, the delegate call and
    Method::execute themselves), its time summed over the run's calls."""
    from executorch.devtools import Inspector

    return [(event.name, sum(event.perf_data.raw) / runs)  # one event per operator, all its calls
            for block in Inspector(etdump_path=str(path)).event_blocks if block.name == "Execute"
            for event in block.events if event.perf_data is not None]
