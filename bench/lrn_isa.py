"""The native runner's LRN and its backward on each x86 vector path, built alone, for the tests.

`lrn.cpp`'s loops are multiversioned like the noise's (isa_versions.h: AVX-512, AVX2, the baseline, picked at
load time; NEON on arm64), and a machine runs only the version its CPU picks. This builds the small harness
`lrn_isa.cpp` against `lrn.cpp` once per path, as bench/noise_isa.py builds the noise's (g++ -march=..., the
width forced as each ISA's version picks it, plus the shipped build's multiversions), with the options CMake
gives lrn.cpp (read from the runner's CMakeLists.txt: without -ffp-contract=off the AVX2 and AVX-512 versions
would fuse multiplies into adds, which the baseline cannot), and runs each on the same strip:
tests/test_native.py holds every path to the others bit for bit and to PaperLRN and `conv_grad`.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from bench.machine import run_harness
from splitface.device.runtimes.native import ARM64_CXX, launcher

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "splitface" / "device" / "runtimes" / "native"
HARNESS = Path(__file__).with_name("lrn_isa.cpp")
CXX = "g++"

# (label, -march, forced lane width or None for the build's own choice, the /proc/cpuinfo flag it needs), as
# bench/noise_isa.py's paths less its "before" rows (the LRN's loops take no width: the compiler vectorises them
# for the version's target)
PATHS = [
    ("AVX-512, 16 lanes", "x86-64-v4", 16, "avx512f"),
    ("AVX2, 8 lanes", "x86-64-v3", 8, "avx2"),
    ("SSE2, 4 lanes", "x86-64", 4, None),
    ("shipped build (multiversions)", None, None, None),
]


def compile_options() -> list[str]:
    """The options CMake compiles lrn.cpp with (its set_source_files_properties in CMakeLists.txt), after the
    target's own (-O2 -Wall; Release adds -DNDEBUG), as CMake orders them."""
    text = (NATIVE / "CMakeLists.txt").read_text()
    pattern = r'set_source_files_properties\(([^)]*?)\s+PROPERTIES\s+COMPILE_OPTIONS\s+"([^"]*)"'
    for names, options in re.findall(pattern, text):
        if "lrn.cpp" in names.split():
            return ["-O2", "-Wall", "-DNDEBUG", "-std=gnu++17", *options.split(";")]
    raise RuntimeError(f"{NATIVE / 'CMakeLists.txt'} gives lrn.cpp no COMPILE_OPTIONS")


def runnable(isa: list[str]) -> list[tuple[str, str | None, int | None, str | None]]:
    return [p for p in PATHS if p[3] is None or p[3] in isa]


def build(march: str | None, width: int | None, out: Path, cxx: str = CXX) -> Path:
    """The harness with the runner's lrn.cpp for one path; `march` None: the build's own choice (the runner's
    multiversions on x86; NEON on arm64)."""
    flags = [*compile_options(), *([f"-march={march}"] if march else []),
             *([f"-DSPLITFACE_FORCE_LANES={width}"] if width else []),
             *(["-static"] if cxx == ARM64_CXX else [])]   # arm64: static, run under qemu-user (`launcher`)
    subprocess.run([cxx, *flags, f"-I{NATIVE}", str(HARNESS), str(NATIVE / "lrn.cpp"), "-o", str(out)], check=True)
    return out


def run(binary: Path, x: np.ndarray, a: np.ndarray, g: np.ndarray, constants: dict[str, int | float],
        work: Path) -> tuple[np.ndarray, np.ndarray]:
    """(Lrn::forward(a), Lrn::backward(x, a, g)) from the harness, for (O, ...) float32 arrays of one shape and
    the release program's constants (`gemm_programs.strip_constants`); both in that shape."""
    work.mkdir(parents=True, exist_ok=True)
    inputs, outputs = work / "in.f32", work / "out.f32"
    np.concatenate([np.ascontiguousarray(t, dtype=np.float32).ravel() for t in (x, a, g)]).tofile(inputs)
    O = x.shape[0]
    run_harness([*launcher(binary), str(inputs), str(outputs), str(O), str(x.size // O),
                 str(constants["lrn_size"]), repr(float(constants["lrn_alpha"])),
                 repr(float(constants["lrn_gamma"])), repr(float(constants["lrn_input_max"]))])
    out = np.fromfile(outputs, dtype=np.float32)
    if out.size != 2 * x.size:
        raise RuntimeError(f"{binary} wrote {out.size} floats, expected {2 * x.size}")
    return out[:x.size].reshape(x.shape), out[x.size:].reshape(x.shape)
