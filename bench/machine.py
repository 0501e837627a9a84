"""What a benchmark figure was measured on: the CPU (model, the vector extensions that decide which code runs),
the compiler and the load. Every native benchmark stores `record()` beside its figures, so that a figure from
another machine can be told apart from a regression (docs/device.md: the noise generator differs per vector path)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import splitface

# the flags that choose a code path in the native runner, XNNPACK or oneDNN (x86: /proc/cpuinfo names; arm64: asimd)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "asimd", "asimdhp", "sve")


def cpu() -> dict:
    """Model name, the x86 family / model / stepping (the name alone is generic on some VMs: "Intel(R) Xeon(R)
    Processor" covers several generations) and the ISA flags that the kernel reports (the first processor's)."""
    model, flags, ident = platform.processor() or platform.machine(), set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key in ("cpu family", "model", "stepping") and key not in ident:
                ident[key] = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    out = {"model": model, "arch": platform.machine(), "cores": os.cpu_count(),
           "isa": [f for f in ISA_FLAGS if f in flags]}
    if len(ident) == 3:
        out["id"] = f"family {ident['cpu family']} model {ident['model']} stepping {ident['stepping']}"
    return out


def run_harness(argv: list[str], **run) -> str:
    """A benchmark harness's stdout; a harness that fails raises with its own stderr (which check=True with
    captured output would drop). `run`: subprocess.run's other options (cwd, env)."""
    done = subprocess.run(argv, capture_output=True, text=True, **run)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def compiler(cxx: str = "c++") -> str:
    """The C++ compiler's first version line (what built the native code), or why there is none."""
    if shutil.which(cxx) is None:
        return f"{cxx}: not found"
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def cmake_flags(build_dir: Path, target: str) -> str:
    """The flags CMake compiled `target` with (its flags.make: the common CXX_FLAGS and each file's own)."""
    flags = Path(build_dir) / "CMakeFiles" / f"{target}.dir" / "flags.make"
    if not flags.exists():
        return f"unknown ({flags} not found)"
    out = []
    for line in flags.read_text().splitlines():
        if line.startswith("CXX_FLAGS"):
            out.append(line.partition("=")[2].strip())
        elif line.startswith("# Custom options:"):  # "...dir/<file>.o_OPTIONS = a;b"
            name, _, opts = line.partition(":")[2].partition("=")
            out.append(f"{Path(name.strip()).name.removesuffix('.o_OPTIONS')}: {opts.strip().replace(';', ' ')}")
    return "; ".join(out)


def revision() -> str:
    """The checkout's commit, with "+dirty" when tracked files differ from it: which code the figures measured."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit, status = (subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout
                          for cmd in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit.strip() + ("+dirty" if status.strip() else "")


def record(build_flags: str | list[str] | None = None, cxx: str = "c++") -> dict:
    """The record a benchmark stores with its figures; call it again at the end for the load after. OpenMP's wait
    policy, as this process's torch read it, decides whether its idle threads spin (splitface/__init__.py)."""
    return {"cpu": cpu(), "compiler": compiler(cxx), "build_flags": build_flags, "load_avg": list(os.getloadavg()),
            "platform": platform.platform(), "revision": revision(),
            "omp_wait_policy": splitface.OPENMP_WAIT_POLICY or "libgomp's default (spins)"}


def describe(rec: dict) -> str:
    """One line for a table's header."""
    c = rec["cpu"]
    flags = f"; build flags {rec['build_flags']}" if rec.get("build_flags") else ""
    rev = rec.get("revision")  # records before it was kept have none
    at = f"; code at {rev[:7]}{'+dirty' if rev.endswith('+dirty') else ''}" if rev and rev[0] != "u" else ""
    ident = f", {c['id']}" if c.get("id") else ""  # records before it was kept have none
    return (f"{c['model']} ({c['arch']}{ident}, {c['cores']} cores; "
            f"{' '.join(c['isa']) or 'no listed vector extensions'}); "
            f"{rec['compiler']}{flags}; load {rec['load_avg'][0]:.1f}{at}")
