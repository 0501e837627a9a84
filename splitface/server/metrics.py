"""Per-device and global training metrics on the server: loss, accuracy, samples/s, bytes, step latency,
errors by code. They are saved in every checkpoint (so a resumed server counts on from its checkpoint, as the
batches do), written to metrics.json, and exposed to Prometheus by `PrometheusCollector`."""
from __future__ import annotations

import bisect
import json
import time
from collections import Counter as Tally
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Upper bounds (seconds) of the step-latency histogram: a tiny model's step on a CPU to a large one's under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Counter:
    samples: int = 0
    batches: int = 0
    labelled: int = 0       # samples whose loss the server knows (server head)
    loss_sum: float = 0.0
    correct: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    compute_s: float = 0.0
    started: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def summary(self) -> dict[str, Any]:
        elapsed = max(self.updated - self.started, 1e-9)
        out = asdict(self)
        out["mean_loss"] = self.loss_sum / self.labelled if self.labelled else None
        out["accuracy"] = self.correct / self.labelled if self.labelled else None
        out["samples_per_s"] = self.samples / elapsed
        out["compute_samples_per_s"] = self.samples / self.compute_s if self.compute_s else None
        return out


class Metrics:
    def __init__(self) -> None:
        self.total = Counter()
        self.devices: dict[str, Counter] = {}
        self.errors: Tally[str] = Tally()           # ERROR replies sent, by code
        self.closes: Tally[str] = Tally()           # connections the server closed or refused, by reason
        self.sessions = 0                           # devices admitted (HELLO accepted), over the run
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # step latencies per bucket, the last one +Inf
        # each device's last reported spent epsilon (FORWARD's claim, SPEC.md section 5.11): the protocol sessions
        # record it here (ServerSession's `epsilon`), so the gauge, metrics.json, the checkpoint and WELCOME agree
        self.epsilon: dict[str, float] = {}

    def state(self) -> dict[str, Any]:
        """Everything counted, for the checkpoint; `from_state` restores it."""
        return {"total": asdict(self.total), "devices": {k: asdict(v) for k, v in self.devices.items()},
                "errors": dict(self.errors), "closes": dict(self.closes), "sessions": self.sessions,
                "latency": list(self.latency), "epsilon": dict(self.epsilon)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Metrics":
        metrics = cls()
        metrics.total = Counter(**state["total"])
        metrics.devices = {k: Counter(**v) for k, v in state["devices"].items()}
        metrics.errors.update(state["errors"])
        metrics.closes.update(state["closes"])
        metrics.sessions = state["sessions"]
        metrics.latency = list(state["latency"])
        metrics.epsilon = dict(state["epsilon"])
        return metrics

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def closed(self, reason: str) -> None:
        self.closes[reason] += 1

    def _counters(self, device_id: str) -> tuple[Counter, Counter]:
        return self.total, self.devices.setdefault(device_id, Counter())

    def batch(self, device_id: str, n: int, seconds: float, loss: float | None = None, n_correct: int | None = None) -> None:
        now = time.time()
        self.latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        for c in self._counters(device_id):
            c.samples += n
            c.batches += 1
            c.compute_s += seconds
            if loss is not None:
                c.labelled += n
                c.loss_sum += loss * n
                c.correct += n_correct or 0
            c.updated = now

    def traffic(self, device_id: str, bytes_in: int = 0, bytes_out: int = 0) -> None:
        for c in self._counters(device_id):
            c.bytes_in += bytes_in
            c.bytes_out += bytes_out

    def snapshot(self) -> dict[str, Any]:
        return {"global": self.total.summary(), "devices": {k: v.summary() for k, v in sorted(self.devices.items())},
                "errors": dict(sorted(self.errors.items())), "closes": dict(sorted(self.closes.items())),
                "sessions": self.sessions, "epsilon": dict(sorted(self.epsilon.items()))}

    def write(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        """metrics.json: the snapshot, and `extra` beside it (the server adds its accelerator's figures)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.snapshot(), **(extra or {})}, indent=2))
        tmp.replace(path)

    def line(self) -> str:
        s = self.total.summary()
        loss = f"{s['mean_loss']:.3f}" if s["mean_loss"] is not None else "-"
        acc = f"{s['accuracy']:.3f}" if s["accuracy"] is not None else "-"
        return (f"batches={s['batches']} samples={s['samples']} loss={loss} acc={acc} "
                f"samples/s={s['samples_per_s']:.1f} in={s['bytes_in'] / 1e6:.1f}MB out={s['bytes_out'] / 1e6:.1f}MB "
                f"devices={len(self.devices)}")


class PrometheusCollector(Collector):
    """Reads `Metrics` at each scrape (so restored counts show after a resume). `open_sessions` gives the
    devices connected now."""

    def __init__(self, metrics: Callable[[], Metrics], open_sessions: Callable[[], int]):
        self.metrics, self.open_sessions = metrics, open_sessions

    def collect(self) -> Iterator[Any]:
        m = self.metrics()
        yield GaugeMetricFamily("splitface_sessions_open", "devices connected now", value=self.open_sessions())
        yield CounterMetricFamily("splitface_sessions", "device sessions admitted (HELLO accepted)", value=m.sessions)
        yield CounterMetricFamily("splitface_batches", "training batches applied", value=m.total.batches)
        yield CounterMetricFamily("splitface_samples", "training samples applied", value=m.total.samples)
        per_device = CounterMetricFamily("splitface_device_batches", "training batches applied per device",
                                         labels=["device"])
        for device, c in sorted(m.devices.items()):
            per_device.add_metric([device], c.batches)
        yield per_device
        traffic = CounterMetricFamily("splitface_bytes", "message bytes of admitted devices", labels=["direction"])
        traffic.add_metric(["in"], m.total.bytes_in)
        traffic.add_metric(["out"], m.total.bytes_out)
        yield traffic
        errors = CounterMetricFamily("splitface_errors", "ERROR replies sent, by code", labels=["code"])
        for code, n in sorted(m.errors.items()):
            errors.add_metric([code], n)
        yield errors
        closes = CounterMetricFamily("splitface_closes", "connections closed or refused by the server, by reason",
                                     labels=["reason"])
        for reason, n in sorted(m.closes.items()):
            closes.add_metric([reason], n)
        yield closes
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], m.latency):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily("splitface_step_seconds", "server compute per training step", buckets=buckets,
                                    sum_value=m.total.compute_s)
        epsilon = GaugeMetricFamily("splitface_spent_epsilon", "privacy budget spent, as reported by the device",
                                    labels=["device"])
        for device, eps in sorted(m.epsilon.items()):
            epsilon.add_metric([device], eps)
        yield epsilon
