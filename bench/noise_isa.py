"""The native runner's noise generator on each x86 vector path, side by side in one run.

The generator runs ChaCha8 on W lanes at once; its 16-vector state must stay in registers through the rounds
(splitface/device/runtimes/native/chacha_lanes.h). Until this benchmark it used 16 lanes on every path, which fits
AVX-512's 32 zmm registers but needs 32 of AVX2's 16 ymm ones: GCC spilled the state every round, and an AVX2
machine drew the release's noise 6-7x slower than the AVX-512 machine that measured the committed figures. Now
each path has its own width (AVX-512 16, AVX2 8, SSE2 4). This builds the same sources once per path (g++
-march=..., the width forced as each ISA's version picks it, and the old 16 lanes as "before"), plus the shipped
build (function multiversions: what this CPU picks at load time), and times them in turn, rounds interleaved so
that a change of load hits them all:
- in cache: 65,536 values, the minimum of many repetitions (the kernel's own speed, ns per value);
- the release: VGG-Face conv1's output at 224 px, batch 8 (25,690,112 values), the minimum of a few, and of it
  the ChaCha8 keystream alone (the 4 bytes a value that the draw consumes, made in registers at the path's
  width as the draw makes it, folded by XOR instead of turned into normals; the rows of a forced width only);
- for scale, OpenSSL's ChaCha20 and AES-128-CTR (`openssl speed`, its hand-written assembly for this CPU) on
  the same number of bytes (the generator ran ChaCha20 until issue 30's fourth pass; docs/noise.md).
Every path's normals equal the float64 reference (tests/test_native.py checks it); rows this CPU cannot run
are left out and named.

    python -m bench.noise_isa            # from the repository root; writes results/bench_noise_isa.{json,txt}
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench.machine import cpu, describe, record, run_harness
from research.results import write_record
from splitface.device.runtimes.native import ARM64_CXX, launcher

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "splitface" / "device" / "runtimes" / "native"
HARNESS = Path(__file__).with_name("noise_isa.cpp")
CXX = "g++"
FLAGS = ["-O2", "-std=c++17", "-fno-math-errno", "-Wall", "-Wno-psabi"]
KEY = bytes(range(100, 132))
RELEASE_VALUES = 8 * 64 * 224 * 224

# (label, -march, forced lane width or None for the build's own choice, the /proc/cpuinfo flag it needs)
PATHS = [
    ("AVX-512, 16 lanes", "x86-64-v4", 16, "avx512f"),
    ("AVX2, 8 lanes", "x86-64-v3", 8, "avx2"),
    ("AVX2, 16 lanes (before)", "x86-64-v3", 16, "avx2"),
    ("SSE2, 4 lanes", "x86-64", 4, None),
    ("SSE2, 16 lanes (before)", "x86-64", 16, None),
    ("shipped build (multiversions)", None, None, None),
]


KEYSTREAM_BYTES = 4 * 64 * 16  # what the harness dumps after the normals: 4 groups of 16 ChaCha20 blocks (exact)


def build(march: str | None, width: int | None, out: Path, cxx: str = CXX) -> Path:
    """The harness with the runner's noise sources for one path; `march` None: the build's own choice (the
    runner's flags on x86; NEON on arm64)."""
    flags = [*FLAGS, *([f"-march={march}"] if march else []), *([f"-DSPLITFACE_FORCE_LANES={width}"] if width else []),
             *(["-static"] if cxx == ARM64_CXX else [])]   # arm64: static, run under qemu-user (`launcher`)
    subprocess.run([cxx, *flags, f"-I{NATIVE}", str(HARNESS), str(NATIVE / "gaussian_noise.cpp"),
                    str(NATIVE / "chacha20.cpp"), "-o", str(out)], check=True)
    return out


def run(binary: Path, values: int, repetitions: int, dump: Path | None = None) -> dict:
    argv = [*launcher(binary), KEY.hex(), str(values), str(repetitions), *([str(dump)] if dump else [])]
    return json.loads(run_harness(argv))


def openssl_ms(cipher: str, nbytes: int) -> dict | None:
    """OpenSSL's speed for `cipher` on this CPU (16 KiB buffers, one core), as the ms that `nbytes` would take;
    None without an openssl command."""
    try:
        version = subprocess.run(["openssl", "version"], capture_output=True, text=True, check=True).stdout.strip()
        out = subprocess.run(["openssl", "speed", "-seconds", "2", "-bytes", "16384", "-evp", cipher],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    kbytes_per_s = float(out.strip().splitlines()[-1].split()[-1].rstrip("k"))   # "AES-128-CTR  8046174.17k"
    return {"cipher": cipher, "openssl": version, "gb_per_s": round(kbytes_per_s / 1e6, 3),
            "release_ms": round(nbytes / (kbytes_per_s * 1e3) * 1e3, 2)}


def read_dump(path: Path, values: int) -> tuple[np.ndarray, bytes]:
    """(the normals, the keystream bytes) of a harness dump."""
    raw = path.read_bytes()
    if len(raw) != 4 * values + KEYSTREAM_BYTES:
        raise ValueError(f"{path}: {len(raw)} bytes, expected {4 * values + KEYSTREAM_BYTES}")
    return np.frombuffer(raw[:4 * values], dtype=np.float32), raw[4 * values:]


def runnable(isa: list[str]) -> list[tuple[str, str | None, int | None, str | None]]:
    return [p for p in PATHS if p[3] is None or p[3] in isa]


def table(saved: dict) -> str:
    base = saved["rows"][0]
    lines = [f"Native noise generator (ChaCha8 + Box-Muller, float32), one thread, side by side in one run, "
             f"{saved['rounds']} rounds interleaved; minimum over runs. Machine: {describe(saved['machine'])} "
             f"(load {saved['load_after'][0]:.1f} after).", "",
             "| path | -march | lanes | in cache: ns/value | release of 25.7M values: ms | of it, the ChaCha8 "
             "keystream alone: ms | vs the first row |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in saved["rows"]:
        keystream = f"{r['keystream_ms']:.1f} ({r['keystream_ms'] / r['release_ms']:.0%})" if "keystream_ms" in r else "-"
        lines.append(f"| {r['path']} | {r['march'] or 'none (multiversions)'} | {r['lanes'] or 'picked'} | "
                     f"{r['ns_per_value']:.2f} | {r['release_ms']:.1f} | {keystream} | "
                     f"{r['release_ms'] / base['release_ms']:.2f}x |")
    if saved["not_run"]:
        lines += ["", "Not run on this CPU: " + ", ".join(saved["not_run"]) + "."]
    if saved.get("openssl"):
        lines += ["", f"For scale, {saved['openssl'][0]['openssl']} (`openssl speed -evp`, one core, 16 KiB buffers) on "
                  f"the release's {4 * RELEASE_VALUES / 1e6:.0f} MB of keystream: " + "; ".join(
                      f"{o['cipher']} {o['gb_per_s']:.2f} GB/s, {o['release_ms']:.1f} ms" for o in saved["openssl"])
                  + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_noise_isa")
    args = p.parse_args(argv)
    machine = record(FLAGS, CXX)
    paths = runnable(cpu()["isa"])
    work = Path(tempfile.mkdtemp(prefix="bench-noise-isa-"))
    binaries = [build(march, width, work / f"noise-{i}") for i, (_, march, width, _) in enumerate(paths)]
    best: list[dict] = [{"ns_per_value": float("inf"), "release_ms": float("inf"), "keystream_ms": float("inf")}
                        for _ in paths]
    for _ in range(args.rounds):
        for b, binary in zip(best, binaries):
            b["ns_per_value"] = min(b["ns_per_value"], run(binary, 65_536, 300)["ns_per_value"])
            release = run(binary, RELEASE_VALUES, 2)
            b["release_ms"] = min(b["release_ms"], release["ms_min"])
            if release["keystream_ms_min"] >= 0:
                b["keystream_ms"] = min(b["keystream_ms"], release["keystream_ms_min"])
    openssl = [o for c in ("chacha20", "aes-128-ctr") if (o := openssl_ms(c, 4 * RELEASE_VALUES))]
    saved = {"machine": machine, "rounds": args.rounds, "load_after": record()["load_avg"],
             "rows": [{"path": label, "march": march, "lanes": width,
                       **{k: v for k, v in b.items() if v != float("inf")}}
                      for (label, march, width, _), b in zip(paths, best)],
             "not_run": [p[0] for p in PATHS if p not in paths], "openssl": openssl}
    write_record(args.out, saved, table(saved))


if __name__ == "__main__":
    main()
