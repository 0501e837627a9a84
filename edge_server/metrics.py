"""Per-device and global training metrics on the server: loss, accuracy, samples/s, bytes."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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

    def _counters(self, device_id: str) -> tuple[Counter, Counter]:
        return self.total, self.devices.setdefault(device_id, Counter())

    def batch(self, device_id: str, n: int, seconds: float, loss: float | None = None, n_correct: int | None = None) -> None:
        now = time.time()
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
        return {"global": self.total.summary(), "devices": {k: v.summary() for k, v in sorted(self.devices.items())}}

    def write(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=2))
        tmp.replace(path)

    def line(self) -> str:
        s = self.total.summary()
        loss = f"{s['mean_loss']:.3f}" if s["mean_loss"] is not None else "-"
        acc = f"{s['accuracy']:.3f}" if s["accuracy"] is not None else "-"
        return (f"batches={s['batches']} samples={s['samples']} loss={loss} acc={acc} "
                f"samples/s={s['samples_per_s']:.1f} in={s['bytes_in'] / 1e6:.1f}MB out={s['bytes_out'] / 1e6:.1f}MB "
                f"devices={len(self.devices)}")
