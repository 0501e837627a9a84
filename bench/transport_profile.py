#!/usr/bin/env python
"""Where a protocol round trip's CPU time goes, per process: cProfile of bench/transport.py's round trip.

    .venv/bin/python bench/transport_profile.py                   # results/transport/profile.md
    .venv/bin/python bench/transport_profile.py --trips 4 --out /tmp/p.md

Two variants, each in its own client and echo-server processes, one after the other: websockets' own connections
(the server receives with transport.receive, the client with recv(): what the edge server and the device client did
before splitface/net/fastws.py) and splitface.net.fastws's connections on both ends (what they do now). Each process runs
the profiler over every trip but the first and reports the functions with the most time of their own (tottime),
in ms per round trip: the C functions that move the bytes (socket send / recv / recv_into, BytesIO.write,
bytes.join, ndarray.copy, apply_mask) show up by name, websockets' StreamReader copies as the time of its
feed_data (`bytearray +=`) and read_exact (the frame's slice). cProfile's own overhead makes every trip slower than
in bench/transport.py; the wall times here are only for comparing the two variants with each other.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"websockets' connections (before)": False, "splitface.net.fastws's connections (now)": True}


def _top(prof: cProfile.Profile, trips: int, n: int) -> list[tuple[str, float, int]]:
    stats = pstats.Stats(prof).stats   # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    rows = []
    for (file, line, name), (_, calls, tottime, _, _) in stats.items():
        where = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}({name})"
        rows.append((where, tottime * 1e3 / trips, calls // trips))
    return sorted(rows, key=lambda r: -r[1])[:n]


def server_main(conn, fast: bool, top: int) -> None:
    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    from splitface.protocol import messages as m
    from splitface.net import transport as t
    from splitface.protocol.tensor import encode_tensor
    t.reuse_large_buffers()
    prof = cProfile.Profile()
    trips = [0]

    async def echo(ws) -> None:
        while True:
            if trips[0] == 1:
                prof.enable()
            try:
                data = await t.receive(ws)
            except ConnectionClosed:
                prof.disable()
                return
            msg = m.decode(data)
            await t.send_fragments(ws, m.encode_parts({"type": m.BACKWARD, "batch_id": msg["batch_id"],
                                                       "grad": encode_tensor(msg["activations"], "f32"),
                                                       "loss": 4.6, "n_correct": 1, "durable_through": 0}))
            del msg, data
            trips[0] += 1

    async def main() -> None:
        options = dict(t.SERVER_WS_OPTIONS, max_size=m.DEFAULT_MAX_MESSAGE_BYTES)
        if fast:
            from splitface.net.fastws import FastServerConnection
            options["create_connection"] = FastServerConnection
        async with serve(echo, "127.0.0.1", 0, **options) as server:
            conn.send(next(iter(server.sockets)).getsockname()[1])
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(main())
    conn.send(_top(prof, max(trips[0] - 1, 1), top))


def client_main(port: int, fast: bool, trips: int, shape: tuple[int, ...], top: int):
    from websockets.asyncio.client import connect

    from splitface.protocol import messages as m
    from splitface.net import transport as t
    from splitface.protocol.client_session import ClientSession
    t.reuse_large_buffers()
    rng = np.random.default_rng(1)
    activations, labels = rng.random(shape, dtype=np.float32), rng.integers(0, 1000, shape[0])
    session = ClientSession("d", "t", {}, "conv1", "server", shape[0], 1000, {"activations": "f32", "gradients": "f32"})
    prof = cProfile.Profile()

    async def run() -> list[float]:
        options = dict(t.CLIENT_WS_OPTIONS, max_size=m.DEFAULT_MAX_MESSAGE_BYTES)
        if fast:
            from splitface.net.fastws import FastClientConnection
            options["create_connection"] = FastClientConnection
        times = []
        async with connect(f"ws://127.0.0.1:{port}", **options) as ws:
            for i in range(trips + 1):
                if i == 1:
                    prof.enable()
                start = time.perf_counter()
                batch_id = (100, 200, 40_000, 100_000)[i % 4]
                await t.send_fragments(ws, session.forward_parts(batch_id, activations, labels))
                reply = await (t.receive(ws) if fast else ws.recv())
                session.receive(reply, {m.BACKWARD}, batch_id)
                del reply
                times.append(time.perf_counter() - start)
            prof.disable()
        return times[1:]

    times = asyncio.run(run())
    return times, _top(prof, trips, top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trips", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--shape", type=int, nargs="+", default=[8, 64, 224, 224])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "transport" / "profile.md")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    load_start = os.getloadavg()
    lines = []
    for name, fast in VARIANTS.items():
        parent, child = ctx.Pipe()
        server = ctx.Process(target=server_main, args=(child, fast, args.top), daemon=True)
        server.start()
        times, client_top = client_main(parent.recv(), fast, args.trips, tuple(args.shape), args.top)
        parent.send("stop")
        server_top = parent.recv()
        server.join(10)
        lines += [f"## {name}: {statistics.median(times) * 1e3:.0f} ms per round trip (p50 of {len(times)}, profiled)",
                  "", "| client: function | ms/trip | calls/trip | server: function | ms/trip | calls/trip |",
                  "|---|---:|---:|---|---:|---:|"]
        for (cf, cms, cn), (sf, sms, sn) in zip(client_top, server_top):
            lines.append(f"| `{cf}` | {cms:.1f} | {cn} | `{sf}` | {sms:.1f} | {sn} |")
        lines.append("")
    head = [f"cProfile of a round trip (FORWARD of f32 {' x '.join(map(str, args.shape))}, "
            f"{np.prod(args.shape) * 4 / 1e6:.1f} MB, answered by a BACKWARD of the same size), {args.trips} trips per "
            f"variant after one unprofiled; time of each function's own (tottime), per trip. Load average "
            f"{load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.", ""]
    text = "\n".join(head + lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
