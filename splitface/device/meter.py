"""What a batch costs the device: time per phase, bytes, peak memory, and energy where the
platform exposes it. Energy is never estimated: without a readable counter it is None with
the reason.

Latency summaries follow the mobile benchmarks (ExecuTorch's benchmark app, LiteRT
`benchmark_model`): warm-up runs excluded, then mean, trimmed mean, p50 and p99.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

RAPL_ROOT = Path("/sys/class/powercap")


def latency_stats(samples: Sequence[float], warmup: int = 0, trim: float = 0.1) -> dict[str, float]:
    """Summary of per-run seconds after dropping the first `warmup`; trimmed mean drops `trim` at each end."""
    x = np.sort(np.asarray(samples[warmup:], dtype=np.float64))
    if len(x) == 0:
        raise ValueError(f"no samples left after {warmup} warm-up runs")
    cut = int(len(x) * trim)
    kept = x[cut:len(x) - cut] if len(x) > 2 * cut else x
    return {"n": int(len(x)), "mean": float(x.mean()), "trimmed_mean": float(kept.mean()),
            "p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
            "min": float(x[0]), "max": float(x[-1])}


def peak_rss_bytes() -> int:
    """This process's peak resident set so far: Linux's VmHWM, the high-water mark of this process's own
    memory. Not ru_maxrss there: Linux carries it over fork and exec, so a process started by a large
    parent reports the parent's peak. Elsewhere ru_maxrss (bytes on macOS)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class EnergyCounter:
    """Cumulative package energy from Linux RAPL, when readable; else `reason` says why not."""

    def __init__(self, root: Path = RAPL_ROOT):
        self.files: list[Path] = []
        self.reason: str | None = None
        zones = sorted(root.glob("intel-rapl:[0-9]*/energy_uj")) if root.is_dir() else []
        if not zones:
            self.reason = f"no RAPL energy counter under {root} (not an Intel/AMD host, or a VM without powercap)"
            return
        try:
            for f in zones:
                int(f.read_text())
            self.files = zones
        except (OSError, ValueError) as exc:
            self.reason = f"RAPL counter not readable: {exc} (reading it usually needs root)"

    @property
    def available(self) -> bool:
        return bool(self.files)

    def read_joules(self) -> float | None:
        if not self.files:
            return None
        return sum(int(f.read_text()) for f in self.files) / 1e6


@dataclass
class BatchCost:
    """One training batch, device side. network_s is the round trip minus the server's own compute."""
    forward_s: float
    backward_s: float
    serialise_s: float
    round_trip_s: float
    server_s: float | None
    bytes_sent: int
    bytes_received: int
    peak_rss_bytes: int
    energy_j: float | None
    load_s: float | None = None

    @property
    def network_s(self) -> float | None:
        return None if self.server_s is None else max(self.round_trip_s - self.server_s, 0.0)

    def to_dict(self) -> dict:
        return {**self.__dict__, "network_s": self.network_s}


def summarize_costs(costs: Sequence[BatchCost], warmup: int = 1, energy_reason: str | None = None) -> dict:
    """Per-field latency stats over batches (warm-up excluded), bytes per batch, peak memory, energy."""
    def stats(get: Callable[[BatchCost], float | None]) -> dict | None:
        values = [get(c) for c in costs]
        if any(v is None for v in values) or len(values) <= warmup:
            return None
        return latency_stats(values, warmup)

    return {
        "batches": len(costs), "warmup_excluded": warmup,
        "forward_s": stats(lambda c: c.forward_s), "backward_s": stats(lambda c: c.backward_s),
        "serialise_s": stats(lambda c: c.serialise_s), "round_trip_s": stats(lambda c: c.round_trip_s),
        "server_s": stats(lambda c: c.server_s), "network_s": stats(lambda c: c.network_s),
        "bytes_sent_per_batch": float(np.mean([c.bytes_sent for c in costs])) if costs else None,
        "bytes_received_per_batch": float(np.mean([c.bytes_received for c in costs])) if costs else None,
        "peak_rss_bytes": max((c.peak_rss_bytes for c in costs), default=None),
        "energy_j_per_batch": stats(lambda c: c.energy_j),
        "energy_note": energy_reason,
    }


class Stopwatch:
    """perf_counter laps: `with watch("forward"): ...` adds to watch.seconds["forward"]."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> "_Lap":
        return _Lap(self, name)


class _Lap:
    def __init__(self, watch: Stopwatch, name: str):
        self.watch, self.name = watch, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.watch.seconds[self.name] = self.watch.seconds.get(self.name, 0.0) + time.perf_counter() - self.start
