"""The native device runner: ExecuTorch's C++ runtime with no Python and no libtorch in the process.

A phone app links libexecutorch, the optimized kernels and the XNNPACK delegate, not PyTorch; the Python
binding (`executorch-xnnpack`) links libtorch, so its process measures PyTorch as much as the device.
`splitface_native.cpp` runs the im2col programs (`splitface-export --gemm`) the way an app would: the
programs memory-mapped, each chunk of the programs' batch streamed in from files and its release streamed
out, the weight gradient summed over chunks. With batch-1 programs a batch of N images never holds more
than one image's activations, which is what brings the device's peak memory down.

Built here with CMake against the executorch wheel's prebuilt runtime (`build`, or `build_cached` into a
per-user cache), or for arm64 with Debian's cross compiler against the same release's aarch64 wheel
(`build(..., arm64=True)`; scripts/setup_arm64.sh unpacks it into `arm64_runtime_dir()`; `launcher` runs that
build under qemu-user), driven by `run_native` (one batch per process: the bench and tests) and `StripServer` (one
process that keeps the strip programs loaded and answers a request per batch: the `native` backend,
`splitface/device/runtimes/native_runtime.py`), and measured by `bench/bench_native.py`. Its fast path is the strip programs (`splitface.export.artifacts.export_strip_ptes`): each image cut into
strips of a few rows so that XNNPACK's passes stay in cache, and the release's noise drawn by the runner
(ChaCha8 + Box-Muller, `gaussian_noise.h`; `reference_normals` is its float64 reference).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent
BINARY = "splitface_native"
JNI_LIBRARY = "libsplitface_jni.so"  # splitface_jni.cpp: the runtime for android_demo's Java device on a host JVM
ARM64_CXX = "aarch64-linux-gnu-g++"  # Debian's g++-aarch64-linux-gnu
# qemu-user, its loader and libraries from Debian's arm64 multiarch root (the arm64 JRE that scripts/setup_arm64.sh
# installs brings them; the JVM needs them there)
ARM64_RUN = ["qemu-aarch64", "-L", "/"]
EM_X86_64, EM_AARCH64 = 62, 183  # the ELF header's e_machine for x86-64 and arm64


def user_cache() -> Path:
    """<XDG cache or ~/.cache>/splitface: the per-user builds and downloads below."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitface"


def executorch_cmake_dir() -> Path:
    """Where the executorch wheel keeps its CMake package (headers and prebuilt libraries beside it)."""
    import executorch

    found = Path(next(iter(executorch.__path__))) / "lib" / "cmake" / "executorch"
    if not (found / "executorch-config.cmake").exists():
        raise RuntimeError(f"the executorch package at {found.parents[2]} ships no C++ runtime (no "
                           f"{found / 'executorch-config.cmake'}): install executorch 1.5.1 from PyPI")
    return found


def arm64_runtime_dir() -> Path:
    """Where scripts/setup_arm64.sh unpacks the aarch64 wheel of the installed executorch release (its prebuilt
    C++ runtime for arm64 Linux; nothing of it is installed): $SPLITFACE_EXECUTORCH_ARM64, else
    `user_cache()`/executorch-<version>-aarch64."""
    from importlib.metadata import version

    if os.environ.get("SPLITFACE_EXECUTORCH_ARM64"):
        return Path(os.environ["SPLITFACE_EXECUTORCH_ARM64"])
    return user_cache() / f"executorch-{version('executorch')}-aarch64"


def arm64_cmake_dir() -> Path:
    """The aarch64 wheel's CMake package, as `executorch_cmake_dir` is the installed wheel's."""
    found = arm64_runtime_dir() / "executorch" / "lib" / "cmake" / "executorch"
    if not (found / "executorch-config.cmake").exists():
        raise RuntimeError(f"no ExecuTorch runtime for arm64 at {arm64_runtime_dir()}: run scripts/setup_arm64.sh, "
                           "which unpacks the installed release's aarch64 wheel there")
    return found


def build(build_dir: Path, arm64: bool = False, source: Path = SOURCE) -> Path:
    """Configure and build the runner in `build_dir` (CMake rebuilds only what changed); the binary's path.
    `arm64`: cross-built with Debian's aarch64 compiler against `arm64_cmake_dir()`; `launcher` runs it.
    `source`: another copy of this folder (an earlier revision's, bench/native_revisions.py)."""
    compiler = ARM64_CXX if arm64 else "c++"
    missing = [tool for tool in ("cmake", compiler) if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"building the native runner needs {' and '.join(missing)} on PATH "
                           f"(Debian: apt-get install cmake {'g++-aarch64-linux-gnu' if arm64 else 'g++'})")
    build_dir.mkdir(parents=True, exist_ok=True)
    target = ([f"-Dexecutorch_DIR={arm64_cmake_dir()}", "-DCMAKE_SYSTEM_NAME=Linux",
               "-DCMAKE_SYSTEM_PROCESSOR=aarch64", f"-DCMAKE_CXX_COMPILER={ARM64_CXX}"] if arm64
              else [f"-Dexecutorch_DIR={executorch_cmake_dir()}"])
    steps = [["cmake", "-S", str(source), "-B", str(build_dir), *target, "-DCMAKE_BUILD_TYPE=Release"],
             ["cmake", "--build", str(build_dir)]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(step[:2])} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return build_dir / BINARY


def elf_machine(binary: Path) -> int | None:
    """The ELF header's e_machine (EM_X86_64, EM_AARCH64, ...); None for a file that is not ELF (a script)."""
    with open(binary, "rb") as elf:
        header = elf.read(20)
    return int.from_bytes(header[18:20], "little") if header[:4] == b"\x7fELF" and len(header) == 20 else None


def launcher(binary: Path) -> list[str]:
    """The command that starts `binary`: itself, or under qemu-user when it was built for arm64 and this
    machine is not one (the arm64 build's tests run the same calls as the host build's)."""
    if elf_machine(binary) != EM_AARCH64 or os.uname().machine in ("aarch64", "arm64"):
        return [str(binary)]
    if shutil.which(ARM64_RUN[0]) is None:
        raise RuntimeError(f"{binary} is arm64 code: running it here needs {ARM64_RUN[0]} (scripts/setup_arm64.sh; "
                           "Debian: apt-get install qemu-user)")
    return [*ARM64_RUN, str(binary)]


def cache_dir(arm64: bool = False) -> Path:
    """Where `build_cached` builds: $SPLITFACE_NATIVE_BUILD, else <XDG cache or ~/.cache>/splitface/native-<h>
    with h from this checkout's source path (CMake refuses a build directory configured for other sources);
    the arm64 build in its arm64/ subfolder."""
    if os.environ.get("SPLITFACE_NATIVE_BUILD"):
        where = Path(os.environ["SPLITFACE_NATIVE_BUILD"])
    else:
        where = user_cache() / f"native-{hashlib.sha256(str(SOURCE).encode()).hexdigest()[:12]}"
    return where / "arm64" if arm64 else where


def build_cached(arm64: bool = False) -> Path:
    """The runner built (or brought up to date) in `cache_dir()`, under a file lock so that processes starting
    devices at once (the simulator, pytest's workers) build it once, not over each other."""
    where = cache_dir(arm64)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build(where, arm64)


def jni_library(arm64: bool = False) -> Path:
    """libsplitface_jni, built with the runner (`build_cached`): ExecuTorch's C++ runtime for the Android demo's
    Java device on this host (android_demo/core's `NativeProgram`), or on an arm64 JVM. CMake builds it where it
    finds a JDK's jni.h."""
    library = build_cached(arm64).parent / JNI_LIBRARY
    if not library.exists():
        raise RuntimeError(f"no {JNI_LIBRARY} was built: CMake found no jni.h (set JAVA_HOME to a JDK, or "
                           "apt-get install openjdk-17-jdk-headless)")
    return library


NOISE_ROUNDS = 8  # ChaCha8: the runner's float noise (gaussian_noise.h's kNoiseRounds; docs/noise.md says why)


def reference_normals(key: bytes, n: int) -> np.ndarray:
    """The first `n` normals the runner draws under `key` (gaussian_noise.h's mapping), in float64 from
    `fastnoise.chacha_words`'s ChaCha8 keystream: what the tests hold the native generator to."""
    from splitface.device.privacy.fastnoise import chacha_words

    groups = -(-n // 256)
    words = chacha_words(key, 0, 16 * groups, NOISE_ROUNDS).astype(np.uint64)
    words = words.reshape(groups, 16, 16)  # (group, block = lane, word)
    u = ((words[:, :, 0::2] >> 8) + 1) / 2.0**24
    theta = 2 * np.pi * (words[:, :, 1::2] >> 8) / 2.0**24
    radius = np.sqrt(-2 * np.log(u))
    z = np.empty((groups, 16, 16))
    z[:, :, 0::2], z[:, :, 1::2] = radius * np.cos(theta), radius * np.sin(theta)
    return z.transpose(0, 2, 1).reshape(-1)[:n]  # value 16 word + lane of each group


def write_inputs(workdir: Path, inputs: dict[str, np.ndarray]) -> None:
    """Each input as workdir/<name>.f32 (float32, C order), the runner's input files. A file is rewritten in
    place and cut to its new size, not truncated first, so that a file in /dev/shm keeps its pages from one
    request to the next instead of freeing and zeroing them again (100 MB for a batch's gradient)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, array in inputs.items():
        data = np.ascontiguousarray(array, dtype=np.float32)
        fd = os.open(workdir / f"{name}.f32", os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.truncate(data.nbytes)
            f.write(memoryview(data).cast("B"))


def run_native(binary: Path, workdir: Path, samples: int, release: tuple[Path, list[str]],
               grad: tuple[Path, list[str]] | None = None, runs: int = 3, warmup: int = 1,
               threads: str = "1", strips: bool = False, noise_std: float | None = None,
               noise_key: Path | None = None, etdump: Path | None = None,
               exact: tuple[str, float, int] | None = None) -> dict:
    """Run the release (and gradient) program over `samples` samples whose inputs `write_inputs` put in
    `workdir`; returns the runner's report (times in ms, RSS in kB) with "release" (the last run's, as
    float32 in the release program's per-sample shape) and "grads" (the summed gradient outputs).

    `strips`: the programs are strip programs (`export_strip_ptes`), run strip by strip over each image.
    `noise_std`: the runner draws the release's noise, N(0, noise_std^2) from ChaCha8 under a fresh key
    from the OS CSPRNG per release, or under the 32 bytes in `noise_key` (tests only). `exact`: the discrete
    Gaussian option instead, (sigma^2 in steps^2 as "P/Q", step, clip norm in steps) as
    `DiscreteGaussianMechanism.describe` gives them; "release" is then the int8 integers. `etdump`: a path
    prefix; every run is recorded with ExecuTorch's ETDump into <prefix>.release.etdp and .grad.etdp."""
    cmd = [*launcher(binary), "--dir", str(workdir), "--samples", str(samples), "--runs", str(runs),
           "--warmup", str(warmup), "--threads", threads, "--release", f"{release[0]}:{','.join(release[1])}"]
    if grad is not None:
        cmd += ["--grad", f"{grad[0]}:{','.join(grad[1])}"]
    if strips:
        cmd.append("--strips")
    if noise_std is not None:
        cmd += ["--noise-std", repr(float(noise_std))]
    if exact is not None:
        cmd += ["--noise-discrete", str(exact[0]), "--quant-step", repr(float(exact[1])), "--clip-steps", str(exact[2])]
    if noise_key is not None:
        cmd += ["--noise-key", str(noise_key)]
    if etdump is not None:
        cmd += ["--etdump", str(etdump)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BINARY} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    report = json.loads(proc.stdout)
    report["release"] = (np.fromfile(workdir / "release.i8", dtype=np.int8) if exact is not None
                         else np.fromfile(workdir / "release.f32", dtype=np.float32))
    report["grads"] = [np.fromfile(workdir / f"grad_{i}.f32", dtype=np.float32)
                       for i in range(report["grad_outputs"])]
    return report


def _scratch() -> Path:
    """A private directory for a runner's input and output files, in memory (/dev/shm) where there is one."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="splitface-native-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def _stop(proc: subprocess.Popen, scratch: Path) -> None:
    """End a runner (closing its input ends its request loop) and remove its files, whatever state the runner is
    in: one that died leaves a broken pipe (and an unflushed request) behind, which must not keep its files."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except OSError:   # BrokenPipeError: the runner had already exited
        pass
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        shutil.rmtree(scratch, ignore_errors=True)


class StripServer:
    """One runner process (`splitface_native --serve --strips`) that keeps the strip programs loaded: each
    call writes the request's inputs into its scratch directory (in /dev/shm where there is one), sends one
    line, and reads the runner's one-line JSON answer and its output files. No process per batch, no program
    loaded twice. The release's noise is read from the file the caller wrote (`--noise-in`), never drawn.
    `weights`: the input names of the programs' weights, after the images (and the gradient).

    `noise_std`: the runner draws each release's noise instead, N(0, noise_std^2) per value from ChaCha8 +
    Box-Muller under the key the caller gives with the request (`keyed_release`; a key file in the scratch
    directory, removed by the runner once read); 0 adds none. `exact`: the exact option instead, (sigma^2 in
    steps^2 as "P/Q", step, clip norm in steps) as `run_native` takes it: each release (`exact_release`) is
    clipped, quantised and noised by the runner under the request's key, and comes back as int8. A runner that
    draws never takes a key of its own here, so a replay under the same key repeats its noise."""

    def __init__(self, binary: Path, release_pte: Path, vjp_pte: Path, weights: list[str], threads: str = "1",
                 exact: tuple[str, float, int] | None = None, noise_std: float | None = None):
        if exact is not None and noise_std is not None:
            raise ValueError("a runner draws float noise (noise_std) or exact noise (exact), not both")
        if noise_std is not None and not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        self.scratch = _scratch()
        self._stderr = self.scratch / "stderr.txt"
        self.exact, self.noise_std = exact, noise_std
        names = ",".join(weights)
        key = ["--noise-key", str(self.scratch / "key")]
        if exact is not None:
            noise = ["--noise-discrete", str(exact[0]), "--quant-step", repr(float(exact[1])), "--clip-steps",
                     str(exact[2]), *key]
        elif noise_std is None:
            noise = ["--noise-in", "noise"]
        else:
            noise = ["--noise-std", repr(float(noise_std)), *key] if noise_std > 0 else []
        options = ["--serve", "--strips", "--dir", str(self.scratch), "--threads", threads, *noise,
                   "--release", f"{release_pte}:images,{names}", "--grad", f"{vjp_pte}:images,grad,{names}"]
        try:
            cmd = [*launcher(binary), *options]
            with open(self._stderr, "wb") as err:
                self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _stop, self._proc, self.scratch)
        self._lock = threading.Lock()   # one scratch directory and one pipe: one request at a time

    def request(self, op: str, samples: int, inputs: dict[str, np.ndarray]) -> dict:
        """Write `inputs`, ask for `op` ("release" or "grad") over `samples` samples; the runner's report.
        A runner that stopped (bad input, a crash) raises with what it wrote to stderr."""
        with self._lock:
            return self._request(op, samples, inputs)

    def _request(self, op: str, samples: int, inputs: dict[str, np.ndarray]) -> dict:
        write_inputs(self.scratch, inputs)
        try:
            self._proc.stdin.write(f"{op} {samples}\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self._proc.wait()
            why = self._stderr.read_text().strip()[-3000:] if self._stderr.exists() else ""
            raise RuntimeError(f"{BINARY} --serve stopped ({code}): {why}")
        return json.loads(line)

    def release(self, inputs: dict[str, np.ndarray], samples: int) -> tuple[np.ndarray, dict]:
        """The release of `samples` images plus the noise in `inputs` (float32, flat) and the report."""
        with self._lock:   # the output file is the next request's too
            report = self._request("release", samples, inputs)
            return np.fromfile(self.scratch / "release.f32", dtype=np.float32), report

    def exact_release(self, inputs: dict[str, np.ndarray], samples: int, key: bytes) -> tuple[np.ndarray, dict]:
        """The exact option's int8 release of `samples` images (flat) under the 32-byte `key`, and the report:
        the same inputs and key give the same integers."""
        if self.exact is None:
            raise RuntimeError("this runner adds the caller's noise; start it with exact=... for the exact option")
        return self._keyed("release.i8", np.int8, inputs, samples, key)

    def keyed_release(self, inputs: dict[str, np.ndarray], samples: int, key: bytes) -> tuple[np.ndarray, dict]:
        """The release of `samples` images (flat, float32) with the noise the runner draws under the 32-byte
        `key` (none when noise_std is 0), and the report: the same inputs and key give the same release."""
        if self.noise_std is None:
            raise RuntimeError("this runner adds the caller's noise or the exact option's; start it with noise_std=...")
        return self._keyed("release.f32", np.float32, inputs, samples, key)

    def _keyed(self, output: str, dtype: type, inputs: dict[str, np.ndarray], samples: int,
               key: bytes) -> tuple[np.ndarray, dict]:
        if len(key) != 32:
            raise ValueError(f"a release's key is 32 bytes, got {len(key)}")
        with self._lock:
            if self.exact is not None or self.noise_std:  # a runner that draws consumes the request's key
                fd = os.open(self.scratch / "key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(key)
            report = self._request("release", samples, inputs)
            return np.fromfile(self.scratch / output, dtype=dtype), report

    def grads(self, inputs: dict[str, np.ndarray], samples: int, outputs: int) -> tuple[list[np.ndarray], dict]:
        """The gradient program's `outputs` outputs summed over strips and samples (flat), and the report."""
        with self._lock:
            report = self._request("grad", samples, inputs)
            return [np.fromfile(self.scratch / f"grad_{i}.f32", dtype=np.float32) for i in range(outputs)], report

    def close(self) -> None:
        self._finalizer()


def draw_integers(binary: Path, workdir: Path, key: Path, n: int, sigma2: str | None = None,
                  bound: int | None = None, reads: bool = False) -> np.ndarray:
    """The runner's first `n` integers under `key`: discrete Gaussian samples of `sigma2` ("P/Q"), uniform
    integers below `bound`, as its exact option draws them, or (`reads`) its stream's first n reads cycling
    through bit, word64, word32, byte, byte (as uint64) (the test hooks --draw-discrete, --draw-uniform,
    --draw-reads)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher(binary), "--dir", str(workdir), "--noise-key", str(key)]
    if sigma2 is not None:
        cmd += ["--noise-discrete", sigma2, "--draw-discrete", str(n)]
        name, dtype = "discrete.i64", np.int64
    elif reads:
        cmd += ["--draw-reads", str(n)]
        name, dtype = "reads.u64", np.uint64
    else:
        cmd += ["--draw-uniform", f"{bound},{n}"]
        name, dtype = "uniform.i64", np.int64
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BINARY} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return np.fromfile(workdir / name, dtype=dtype)


def etdump_ops(path: Path, runs: int) -> list[tuple[str, float]]:
    """(operator, ms per run) in program order from an ETDump of `runs` runs: every event the devtools
    Inspector finds (XNNPACK's operators inside its delegate call, the portable kernels, the delegate call and
    Method::execute themselves), its time summed over the run's calls."""
    from executorch.devtools import Inspector

    return [(event.name, sum(event.perf_data.raw) / runs)  # one event per operator, all its calls
            for block in Inspector(etdump_path=str(path)).event_blocks if block.name == "Execute"
            for event in block.events if event.perf_data is not None]
