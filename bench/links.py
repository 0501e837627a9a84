#!/usr/bin/env python
"""The split loop over emulated phone links, side by side per wire encoding.

Run from the repository root:

    .venv/bin/python bench/links.py                     # results/links/{summary.json,table.md}
    .venv/bin/python bench/links.py --links lte --encodings f32 --batches 2 --out /tmp/links   # a quick look

An edge server (the real EdgeServer, in a thread) and a device (the real DeviceClient with its engine) train
IResNet-small at 64 x 64 split at conv1, the main job's model, with every byte between them passing
through `Relay`: a userspace link emulator on 127.0.0.1 that, per direction, paces the bytes at the link's
rate and delivers each chunk half the round-trip time after it has been serialised onto the link. Per batch
it reports: device compute (forward + backward on the device), upload (first to last byte of FORWARD
through the link), server (from FORWARD's last byte delivered to BACKWARD's first byte leaving the server:
decode, the tail's step, encode), download (BACKWARD through the link), the rest (the client's encode and
decode, scheduling), the total and samples/s.

What is emulated, and what is not (docs/links.md): rate and propagation delay per direction, on an otherwise
idle link with unbounded buffering. The relay terminates TCP on both sides, so the endpoints' TCP runs over
loopback and never sees the link's round-trip time: slow start, congestion control, loss and jitter are not
emulated (`tc netem` would do delay, loss and jitter in the kernel, but its module is missing on this
machine: "Specified qdisc kind is unknown"). A rate limit in the kernel (tbf, which works here) would add
nothing while the delay lives in a TCP-terminating relay, so both live in the relay.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from research.results import write_summary

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64 * 1024
# A websocket ping or pong (what the endpoints send unasked) is at most this long as websockets sends it; a
# chunk this small does not start a burst, or a ping in the middle of an upload would count as the download.
CONTROL_FRAME_MAX = 32


@dataclass(frozen=True)
class Link:
    """A phone link: rates in Mbit/s (up = device to server) and the round-trip time in ms."""
    name: str
    up_mbit_s: float
    down_mbit_s: float
    rtt_ms: float

    def __post_init__(self) -> None:
        if min(self.up_mbit_s, self.down_mbit_s) <= 0 or self.rtt_ms < 0:
            raise ValueError(f"link {self.name}: rates must be positive and the RTT not negative")


LINKS = {"lte": Link("LTE", 5, 20, 50), "wifi": Link("Wi-Fi", 40, 100, 10), "5g": Link("5G", 50, 300, 20)}


@dataclass
class Burst:
    """One direction's traffic since the last `Relay.mark()` (perf_counter times)."""
    bytes: int = 0
    first_arrival: float | None = None    # first data chunk read from the sender
    last_delivery: float | None = None    # last byte written to the receiver


@dataclass
class _Direction:
    rate_bytes_s: float
    delay_s: float
    free_at: float = 0.0                  # when the link finishes serialising what it has accepted
    burst: Burst = field(default_factory=Burst)


class Relay:
    """Userspace link emulator: accepts on 127.0.0.1, connects each client to `target`, and per direction
    delivers every chunk at (the time the link has serialised it at its rate) + (half the RTT), in order.
    Runs its own event loop in a thread, so the endpoints' work never delays the pacing."""

    def __init__(self, link: Link, target: tuple[str, int]):
        self.link, self.target = link, target
        self.up = _Direction(link.up_mbit_s * 1e6 / 8, link.rtt_ms / 2e3)
        self.down = _Direction(link.down_mbit_s * 1e6 / 8, link.rtt_ms / 2e3)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> "Relay":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("link relay did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def mark(self) -> None:
        """Start counting a new exchange (call between batches)."""
        self.up.burst, self.down.burst = Burst(), Burst()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer, self.up), self._pipe(up_reader, writer, self.down))
        except asyncio.CancelledError:   # the relay is closing
            writer.close()
            up_writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: _Direction) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, chunk = item
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
                d.burst.last_delivery = time.perf_counter()
            writer.close()

        sender = asyncio.create_task(deliver())
        try:
            while chunk := await reader.read(CHUNK):
                now = time.perf_counter()
                if d.burst.first_arrival is None and len(chunk) > CONTROL_FRAME_MAX:
                    d.burst.first_arrival = now
                d.burst.bytes += len(chunk)
                d.free_at = max(d.free_at, now) + len(chunk) / d.rate_bytes_s
                queue.put_nowait((d.free_at + d.delay_s, chunk))
        except ConnectionError:
            pass
        finally:
            queue.put_nowait(None)
            try:
                await sender
            except ConnectionError:
                pass


def bench_link(link: Link, encoding: str, batch: int, batches: int, warmup: int, num_classes: int) -> dict[str, Any]:
    """`warmup` + `batches` training batches of the split loop through `link` in `encoding` (both directions)."""
    from splitface.device.connection import DeviceClient
    from splitface.device.trainer import DeviceTrainer
    from splitface.common.models import resolve_spec
    from splitface.server.app import EdgeServer, ServerConfig, ServerThread, server_info
    from splitface.server.auth import TokenAuthenticator, hash_token
    from splitface.server.trainer import ServerTrainer
    from splitface.protocol import messages as m

    spec = resolve_spec("iresnet_small")
    trainer = ServerTrainer(spec, "conv1", num_classes, device="cpu")
    info = server_info(trainer, batch, m.DEFAULT_MAX_MESSAGE_BYTES)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (batch, 3, spec.input_size, spec.input_size), dtype=np.uint8)
    labels = rng.integers(0, num_classes, batch, dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="links_") as run_dir, \
            ServerThread(EdgeServer(trainer, info, TokenAuthenticator({"phone": hash_token("secret")}),
                                    ServerConfig(port=0, run_dir=Path(run_dir), checkpoint_every_s=1e9,
                                                 log_every_s=1e9))) as st, \
            Relay(link, ("127.0.0.1", st.server.port)) as relay:
        async def main() -> list[dict[str, float]]:
            engine = DeviceTrainer(spec, "conv1", "server", num_classes)
            client = DeviceClient(f"ws://127.0.0.1:{relay.port}", "phone", "secret", engine, batch,
                                  encodings={"activations": encoding, "gradients": encoding})
            await client.connect()
            rows = []
            for i in range(warmup + batches):
                relay.mark()
                t = time.perf_counter()
                r = await client.train_batch(i + 1, images, labels, np.arange(batch) + i * batch)
                total = time.perf_counter() - t
                up, down = relay.up.burst, relay.down.burst
                if i < warmup:
                    continue
                upload = up.last_delivery - up.first_arrival
                download = down.last_delivery - down.first_arrival
                server = down.first_arrival - up.last_delivery
                rows.append({"device_compute_s": r.device_s, "upload_s": upload, "server_s": server,
                             "download_s": download, "rest_s": total - r.device_s - upload - server - download,
                             "total_s": total, "bytes_up": up.bytes, "bytes_down": down.bytes,
                             "server_reported_s": r.cost.server_s})
            await client.close()
            return rows
        rows = asyncio.run(main())
    mean = {k: statistics.fmean(r[k] for r in rows if r[k] is not None) for k in rows[0]}
    ideal_up = mean["bytes_up"] * 8 / (link.up_mbit_s * 1e6) + link.rtt_ms / 2e3
    return {"link": asdict(link), "encoding": encoding, "batch": batch, "batches": rows, "mean": mean,
            "samples_per_s": batch / mean["total_s"], "ideal_upload_s": ideal_up,
            "ideal_download_s": mean["bytes_down"] * 8 / (link.down_mbit_s * 1e6) + link.rtt_ms / 2e3}


def table(res: dict[str, Any]) -> str:
    a = res["args"]
    L = [f"Split loop (IResNet-small 64x64, split conv1, server head, batch {a['batch_size']}: the real EdgeServer and "
         f"DeviceClient) through a userspace link emulator on 127.0.0.1 (rate and one-way delay per direction; "
         f"TCP's own dynamics over the RTT are not emulated: docs/links.md). Mean of {a['batches']} batches after "
         f"{a['warmup']} warm-up; activations and gradients both in the encoding named. Times in ms per batch. "
         f"Ideal = bytes at the link rate + RTT/2. Load average {res['loadavg_start'][0]:.1f} at the start, "
         f"{res['loadavg_end'][0]:.1f} at the end (2 shared cores).", "",
         "| link (up/down Mbit/s, RTT) | encoding | bytes up | device compute | upload (ideal) | server | "
         "download (ideal) | rest | total | samples/s |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        k, mn = r["link"], r["mean"]
        L.append(f"| {k['name']} ({k['up_mbit_s']:g}/{k['down_mbit_s']:g}, {k['rtt_ms']:g} ms) | {r['encoding']} | "
                 f"{mn['bytes_up'] / 1e6:.2f} MB | {mn['device_compute_s'] * 1e3:.0f} | {mn['upload_s'] * 1e3:.0f} "
                 f"({r['ideal_upload_s'] * 1e3:.0f}) | {mn['server_s'] * 1e3:.0f} | {mn['download_s'] * 1e3:.0f} "
                 f"({r['ideal_download_s'] * 1e3:.0f}) | {mn['rest_s'] * 1e3:.0f} | {mn['total_s'] * 1e3:.0f} | "
                 f"{r['samples_per_s']:.1f} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    from splitface.common.options import add_threads_arg, add_training_args, apply_threads
    from splitface.protocol.tensor import ENCODINGS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    p.add_argument("--encodings", nargs="+", default=["f32", "f16", "i8"], choices=ENCODINGS)
    add_training_args(p, epochs=None, batch_size=16, lr=None)
    p.add_argument("--batches", type=int, default=3, help="timed batches per link and encoding")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-classes", type=int, default=111)
    add_threads_arg(p, 1, help="torch threads (device and server share the process; 0: torch's choice)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "links")
    args = p.parse_args(argv)
    apply_threads(args)
    res: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "loadavg_start": os.getloadavg(), "rows": []}
    for name in args.links:
        for enc in args.encodings:
            print(f"[{time.strftime('%H:%M:%S')}] {LINKS[name].name} {enc}", file=sys.stderr, flush=True)
            res["rows"].append(bench_link(LINKS[name], enc, args.batch_size, args.batches, args.warmup,
                                          args.num_classes))
    res["loadavg_end"] = os.getloadavg()
    write_summary(args.out, res, table(res), newline=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
