#!/usr/bin/env python
"""Transport at the wire's speed: 100 MB-class messages through the protocol vs raw sockets.

Run from the repository root:

    .venv/bin/python bench/transport.py                 # results/transport/{summary.json,table.md}
    .venv/bin/python bench/transport.py --rounds 2 --trips 1 --shape 8 16 64 64 --out /tmp/t   # a quick look
    .venv/bin/python bench/transport.py --compare-fastws 3eb6d0c:device_sdk/fastws.py --variants \
        "protocol, + fast connections on both ends (now)" "raw blocking sockets, recv_into" --out /tmp/t
        # the fast connections side by side with another revision's module (git REV:PATH), in the same run

A round trip is what a split-learning batch does: the device sends FORWARD (activations, f32, validated
encode) and the server answers BACKWARD carrying a tensor of the same size. Each variant runs in its own
pair of processes (a client and an echo server on 127.0.0.1, both long-lived), so that process-wide settings
(the allocator's) apply to one variant only; the variants take turns, round after round, so that all see the
same load from other processes on this shared machine. Variants:

- protocol, as before: websocket message in one frame, the old settings (the client's default 32 KiB write
  limit), glibc's default allocator behaviour;
- protocol, fragments only / allocator only: one of the two changes of splitface/net/transport.py;
- protocol, tuned: both, with the codec before the zero-copy one (msgpack.packb, msgpack.unpackb,
  np.isfinite(...).all());
- protocol, zero-copy codec: tuned, and the zero-copy codec (the client sends ClientSession.forward_parts, the
  tensor from its own buffer; decode views the tensor in the received message; the sum-first finite check;
  the echo encodes its reply with messages.encode, one copy), both ends receiving with websockets' recv();
- protocol, + replies as parts: the echo sends its reply as messages.encode_parts' parts, as the edge server
  does with ServerSession.applied_parts;
- protocol, + server's streamed receive: replies as parts, and the echo receives with transport.receive
  instead of recv(): fragments copied into the message's buffer as they arrive, the message placed so that its
  tensor is aligned (decode views it instead of copying it);
- protocol, + client's streamed receive too: the client receives with transport.receive as well (measured
  slower: websockets hands a client its unmasked fragments as bytearrays, which recv_streaming copies once more);
- protocol, + fast connections on both ends (now): both ends on splitface.net.fastws's connections (serve's and
  connect's create_connection), receiving with transport.receive and sending with send_fragments: a binary
  message's frames read into a reused buffer, unmasked in place and copied once into the message's buffer (its
  tensor aligned); frames masked into their own buffer; what the device client and the edge server do now;
- websockets alone: the streamed-receive variant's transport (websockets' own connections), but neither end
  decodes (the echo answers every FORWARD with a BACKWARD it encoded once): what the protocol would cost on
  websockets' connections if its codec and checks were free;
- fast connections alone: the same floor on splitface.net.fastws's connections;
- raw blocking sockets: a length prefix, then sendall / recv_into a buffer reused across trips (no protocol,
  no validation, no allocation): the ceiling.

Every protocol variant does the full work on both ends: ClientSession.forward (msgpack), websockets framing
with the size limits in force (the client accepts at most the protocol's 1 GiB), messages.decode with every
check (schema, dtype/shape/byte count, finite values), the reply encoded and decoded the same way.
The client also times its own phases (encode, send, wait, decode) and the server its own, and each
client process times the codec steps alone on one message (where the copies go).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from research.results import write_summary

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6

class Setting(NamedTuple):
    """What a protocol variant runs with."""
    fragments: bool            # send_fragments and splitface/net/transport.py's websocket options
    allocator: bool            # reuse_large_buffers
    zero_copy: bool            # today's codec (encode_parts, decode's views, the sum-first finite check)
    reply_parts: bool = False  # the echo sends its reply as messages.encode_parts' parts, not joined
    server_receive: bool = False   # the echo receives with transport.receive, not websockets' recv()
    client_receive: bool = False   # the client too
    codec: bool = True             # False: neither end decodes, the echo answers a BACKWARD made in advance
    fast: bool = False             # both ends on splitface.net.fastws's connections (frames straight into their buffers)


# variant -> its setting; None: raw sockets
VARIANTS: dict[str, Setting | None] = {
    "protocol, as before (one frame, default allocator)": Setting(False, False, False),
    "protocol, fragments only": Setting(True, False, False),
    "protocol, allocator only": Setting(False, True, False),
    "protocol, tuned (fragments + allocator)": Setting(True, True, False),
    "protocol, zero-copy codec (tuned + views)": Setting(True, True, True),
    "protocol, + replies as parts": Setting(True, True, True, reply_parts=True),
    "protocol, + server's streamed receive": Setting(True, True, True, True, True),
    "protocol, + client's streamed receive too (not adopted)": Setting(True, True, True, True, True, True),
    "protocol, + fast connections on both ends (now)": Setting(True, True, True, True, True, True, fast=True),
    "websockets alone: streamed receive, without decode or encode (a floor)": Setting(True, True, True, True, True,
                                                                                      codec=False),
    "fast connections alone: now, without decode or encode (a floor)": Setting(True, True, True, True, True, True,
                                                                               codec=False, fast=True),
    "raw blocking sockets, recv_into": None,
}
RAW = list(VARIANTS)[-1]
# --compare-fastws REV:PATH adds these variants: a fast-connection variant (the key) whose processes load the
# connection classes from `git show REV:PATH` instead of splitface.net.fastws; the name ends with " [REV:PATH]".
COMPARED = {"protocol, + fast connections on both ends": "protocol, + fast connections on both ends (now)",
            "fast connections alone, without decode or encode":
                "fast connections alone: now, without decode or encode (a floor)"}


def compared_variants(spec: str) -> list[str]:
    return [f"{name} [{spec}]" for name in COMPARED]


def setting_of(variant: str) -> Setting | None:
    """A variant's setting; a compared one's is its fast-connection variant's."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    return VARIANTS[COMPARED[variant.rsplit(" [", 1)[0]]]


def fastws_module(variant: str) -> Any:
    """The module with the connection classes a fast variant runs: splitface.net.fastws, or for a compared variant
    the module text of its git REV:PATH (loaded under its own name)."""
    if not variant.endswith("]"):
        from splitface.net import fastws
        return fastws
    import subprocess
    import types
    spec = variant.rsplit(" [", 1)[1][:-1]
    source = subprocess.run(["git", "show", spec], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("fastws_compared")
    module.__file__ = f"{spec} (git show)"
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
# Round trips take their batch ids from these in turn, one of each width msgpack gives an int (fixint, uint8,
# uint16, uint32): the tensors then sit at each of the offsets in a message that a training run meets (FORWARD's
# at 70, 71, 72 and 74 bytes, BACKWARD's at 64, 65, 66 and 68), aligned for a view or not.
BATCH_IDS = (100, 200, 40_000, 100_000)


def codec_setting(zero_copy: bool) -> None:
    """This process's codec (once, at its start): today's (encode_parts' views, decode's views, the sum-first finite
    check), or the one before it (msgpack.packb, msgpack.unpackb, np.isfinite(...).all()) for the variants that
    show it. The bytes on the wire are the same."""
    from splitface.protocol import messages as m
    from splitface.protocol import tensor
    global _all_finite_now
    _all_finite_now = _all_finite_now or tensor.all_finite
    m.ZERO_COPY = zero_copy
    tensor.all_finite = _all_finite_now if zero_copy else _all_finite_before


_all_finite_now = None


def _all_finite_before(array: np.ndarray) -> bool:
    return bool(np.isfinite(array).all())


def _with_codec(zero_copy: bool, fn):
    """`fn` run with one codec or the other, whatever this process's own (for the codec table)."""
    from splitface.protocol import messages as m

    def run() -> Any:
        own = m.ZERO_COPY
        codec_setting(zero_copy)
        try:
            return fn()
        finally:
            codec_setting(own)
    return run


def ws_options(side: str, fragmented: bool) -> dict[str, Any]:
    """The settings a variant runs with: splitface/net/transport.py's, or those of the code before it."""
    from splitface.protocol import messages as m
    from splitface.net.transport import CLIENT_WS_OPTIONS, SERVER_WS_OPTIONS
    if fragmented:
        opts = dict(CLIENT_WS_OPTIONS if side == "client" else SERVER_WS_OPTIONS)
    elif side == "client":   # splitface/device/connection.py before: websockets' default write limit
        opts = dict(compression=None, open_timeout=10, ping_interval=30, ping_timeout=120, close_timeout=2, max_queue=4)
    else:                    # splitface/server/app.py before
        opts = dict(compression=None, max_queue=4, write_limit=2 ** 24, ping_interval=30, ping_timeout=120)
    opts["max_size"] = m.DEFAULT_MAX_MESSAGE_BYTES
    return opts


# ---------------------------------------------------------------------------------------
# server side (child process)
# ---------------------------------------------------------------------------------------
def server_main(conn, variant: str) -> None:
    """Echo server of one variant: sends its port, serves until the pipe says stop, then sends its phase times."""
    setting = setting_of(variant)
    phases: dict[str, list[float]] = {"decode": [], "encode": [], "send": []}
    if setting is None:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=raw_echo, args=(listener,), daemon=True).start()
        conn.send(listener.getsockname()[1])
        conn.recv()
        conn.send(phases)
        return
    codec_setting(setting.zero_copy)
    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    from splitface.protocol import messages as m
    from splitface.protocol.tensor import encode_tensor
    from splitface.net.transport import receive, reuse_large_buffers, send_fragments
    if setting.allocator:
        reuse_large_buffers()
    encode = m.encode_parts if setting.reply_parts else m.encode
    canned: list[Any] = []   # without the codec: the reply to every message, made from the first one

    async def echo(ws) -> None:
        while True:
            try:
                data = await (receive(ws) if setting.server_receive else ws.recv())
            except ConnectionClosed:
                return
            t0 = time.perf_counter()
            msg = m.decode(data) if setting.codec or not canned else None
            t1 = time.perf_counter()
            if setting.codec or not canned:
                canned[:] = [encode({"type": m.BACKWARD, "batch_id": msg["batch_id"],
                                     "grad": encode_tensor(msg["activations"], "f32"), "loss": 4.6, "n_correct": 1,
                                     "durable_through": 0})]
            reply = canned[0]
            t2 = time.perf_counter()
            if setting.fragments:
                await send_fragments(ws, reply)
            else:
                await ws.send(reply)
            del reply, msg, data
            phases["decode"].append(t1 - t0)
            phases["encode"].append(t2 - t1)
            phases["send"].append(time.perf_counter() - t2)

    async def main() -> None:
        options = ws_options("server", setting.fragments)
        if setting.fast:
            options["create_connection"] = fastws_module(variant).FastServerConnection
        async with serve(echo, "127.0.0.1", 0, **options) as server:
            conn.send(next(iter(server.sockets)).getsockname()[1])
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)   # "stop"

    asyncio.run(main())
    conn.send(phases)


def raw_echo(listener: socket.socket) -> None:
    """The raw-socket floor's server: each trip a 16-byte header (bytes in, bytes out), the bytes in read into a
    reused buffer, a reply of the asked length sent back."""
    while True:
        s, _ = listener.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf, reply = bytearray(0), b""
        try:
            while True:
                head = bytearray(16)
                if not recv_into(s, memoryview(head)):
                    break
                n_in, n_out = struct.unpack("<QQ", head)
                if len(buf) < n_in:
                    buf = bytearray(n_in)
                if not recv_into(s, memoryview(buf)[:n_in]):
                    break
                if len(reply) != n_out:
                    reply = bytes(n_out)
                s.sendall(reply)
        finally:
            s.close()


def recv_into(s: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `s`; False if the peer closed first."""
    got = 0
    while got < len(view):
        k = s.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


# ---------------------------------------------------------------------------------------
# client side (child process)
# ---------------------------------------------------------------------------------------
def client_main(conn, variant: str, port: int, shape: tuple[int, ...]) -> None:
    """Client of one variant: on ("trips", k) runs k round trips and answers their times and phases;
    on "codec" times the codec steps alone; on "stop" ends."""
    setting = setting_of(variant)
    rng = np.random.default_rng(1)
    activations = rng.random(shape, dtype=np.float32)
    labels = rng.integers(0, 1000, shape[0])
    if setting is None:
        sizes = _protocol_sizes(activations, labels)
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, buf = bytes(sizes[0]), bytearray(sizes[1])
        while (cmd := conn.recv()) != "stop":
            if cmd == "codec":
                conn.send([])
                continue
            times = []
            for _ in range(cmd[1]):
                t = time.perf_counter()
                s.sendall(struct.pack("<QQ", *sizes))
                s.sendall(payload)
                if not recv_into(s, memoryview(buf)):
                    raise ConnectionError("raw echo closed")
                times.append(time.perf_counter() - t)
            conn.send({"times": times, "phases": {}, "message_bytes": list(sizes)})
        s.close()
        return
    codec_setting(setting.zero_copy)
    from splitface.net.transport import reuse_large_buffers
    if setting.allocator:
        reuse_large_buffers()
    asyncio.run(_client_loop(conn, port, setting, activations, labels,
                             fastws_module(variant).FastClientConnection if setting.fast else None))


def _protocol_sizes(activations: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """Sizes of the protocol's FORWARD and BACKWARD for these tensors: the raw variant moves as many bytes."""
    from splitface.protocol import messages as m
    from splitface.protocol.tensor import encode_tensor
    forward = m.encode({"type": m.FORWARD, "batch_id": 1, "activations": encode_tensor(activations, "f32"),
                        "labels": [int(x) for x in labels]})
    backward = m.encode({"type": m.BACKWARD, "batch_id": 1, "grad": encode_tensor(activations, "f32"), "loss": 4.6,
                         "n_correct": 1, "durable_through": 0})
    return len(forward), len(backward)


async def _client_loop(conn, port: int, setting: Setting, activations: np.ndarray, labels: np.ndarray,
                       fast_client: Any = None) -> None:
    from websockets.asyncio.client import connect

    from splitface.protocol import messages as m
    from splitface.protocol.client_session import ClientSession
    from splitface.protocol.messages import message_size
    from splitface.net.transport import receive, send_fragments
    session = ClientSession("bench-device", "bench-token", {}, "conv1", "server", len(activations), 1000,
                            {"activations": "f32", "gradients": "f32"})
    trip = 0
    options = ws_options("client", setting.fragments)
    if fast_client is not None:
        options["create_connection"] = fast_client
    async with connect(f"ws://127.0.0.1:{port}", **options) as ws:
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, conn.recv)) != "stop":
            if cmd == "codec":
                conn.send(codec_steps(activations, labels))
                continue
            times, phases = [], {"encode": [], "send": [], "wait": [], "decode": []}
            sizes = [0, 0]
            for _ in range(cmd[1]):
                batch_id = BATCH_IDS[trip % len(BATCH_IDS)]
                trip += 1
                t0 = time.perf_counter()
                # the device client's path: the FORWARD's parts, its activations sent from their own buffer
                data = session.forward_parts(batch_id, activations, labels) if setting.zero_copy else \
                    session.forward(batch_id, activations, labels)
                t1 = time.perf_counter()
                if setting.fragments:
                    await send_fragments(ws, data)
                else:
                    await ws.send(data)
                t2 = time.perf_counter()
                reply = await (receive(ws) if setting.client_receive else ws.recv())
                t3 = time.perf_counter()
                grad = session.receive(reply, {m.BACKWARD}, batch_id)["grad"] if setting.codec else activations
                t4 = time.perf_counter()
                if grad.shape != activations.shape:
                    raise AssertionError(f"echo returned {grad.shape}, sent {activations.shape}")
                sizes = [message_size(data), len(reply)]
                del data, reply, grad
                times.append(t4 - t0)
                for k, a, b in (("encode", t0, t1), ("send", t1, t2), ("wait", t2, t3), ("decode", t3, t4)):
                    phases[k].append(b - a)
            conn.send({"times": times, "phases": phases, "message_bytes": sizes})


def codec_steps(activations: np.ndarray, labels: np.ndarray, reps: int = 3) -> list[dict[str, Any]]:
    """Each step of a message's way alone, best of `reps`, in this process's allocator setting."""
    import msgpack
    from websockets.frames import Frame, Opcode

    from splitface.protocol import messages as m
    from splitface.protocol.tensor import encode_tensor
    from splitface.net.transport import fragments
    msg = {"type": m.FORWARD, "batch_id": 1, "activations": encode_tensor(activations, "f32"),
           "labels": [int(x) for x in labels]}
    data = msgpack.packb(m.wire_form(msg), use_bin_type=True)
    keep = bytearray(len(data))
    ops = {
        "copy into a reused buffer (memcpy)": lambda: memoryview(keep).__setitem__(slice(None), data),
        "copy into a new buffer (bytearray(data))": lambda: bytearray(data),
        "messages.encode before (msgpack.packb)": _with_codec(False, lambda: m.encode(msg)),
        "messages.encode_parts (views, no copy)": _with_codec(True, lambda: m.encode_parts(msg)),
        "messages.encode now (encode_parts joined: one copy)": _with_codec(True, lambda: m.encode(msg)),
        "msgpack.unpackb alone": lambda: msgpack.unpackb(data),
        "np.isfinite(...).all() alone": lambda: np.isfinite(activations).all(),
        "tensor.all_finite alone (sum first)": lambda: _all_finite_now(activations),
        "messages.decode before (unpackb + checks + frombuffer + isfinite)": _with_codec(False, lambda: m.decode(data)),
        "messages.decode now (views + checks + all_finite)": _with_codec(True, lambda: m.decode(data)),
        "websocket client frame, one (mask + serialize)": lambda: Frame(Opcode.BINARY, data).serialize(mask=True),
        "websocket client frames, 1 MiB fragments": lambda: [Frame(Opcode.BINARY, f).serialize(mask=True)
                                                               for f in fragments(data)],
        "reassemble fragments (b''.join)": lambda: b"".join(bytes(f) for f in fragments(data)),
    }
    rows = []
    for name, fn in ops.items():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            r = fn()
            times.append(time.perf_counter() - t)
            del r
        rows.append({"op": name, "bytes": len(data), "best_s": min(times), "gb_s": len(data) / min(times) / 1e9})
    return rows


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
class Pair:
    """A variant's server and client processes."""

    def __init__(self, ctx, variant: str, shape: tuple[int, ...]):
        self.variant = variant
        self.server_pipe, child = ctx.Pipe()
        self.server = ctx.Process(target=server_main, args=(child, variant), daemon=True)
        self.server.start()
        port = self.server_pipe.recv()
        self.client_pipe, child = ctx.Pipe()
        self.client = ctx.Process(target=client_main, args=(child, variant, port, shape), daemon=True)
        self.client.start()

    def ask(self, cmd: Any) -> Any:
        self.client_pipe.send(cmd)
        return self.client_pipe.recv()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) both processes have used so far: unlike wall time, other processes' load
        hardly moves it. NaN where /proc is not there."""
        return _cpu_s(self.client.pid) + _cpu_s(self.server.pid)

    def stop(self) -> dict[str, list[float]]:
        phases: dict[str, list[float]] = {}
        try:
            self.client_pipe.send("stop")
            self.client.join(30)
            self.server_pipe.send("stop")
            phases = self.server_pipe.recv() if self.server_pipe.poll(30) else {}
        finally:
            for p in (self.client, self.server):
                p.join(10)
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        return phases


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


def run(shape: tuple[int, ...], rounds: int, trips: int, warmup: int, variants: list[str]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    pairs = []
    try:
        for v in variants:
            pairs.append(Pair(ctx, v, shape))
        for pair in pairs:
            pair.ask(("trips", warmup))
        got: dict[str, dict[str, Any]] = {v: {"times": [], "phases": {}, "message_bytes": None, "cpu_s": 0.0}
                                          for v in variants}
        for r in range(rounds):
            for pair in pairs:
                cpu = pair.cpu_s()
                out = pair.ask(("trips", trips))
                g = got[pair.variant]
                g["cpu_s"] += pair.cpu_s() - cpu
                g["times"] += out["times"]
                g["message_bytes"] = out["message_bytes"]
                for k, v in out["phases"].items():
                    g["phases"].setdefault(k, []).extend(v)
            print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}/{rounds}: " + ", ".join(
                f"{v.split(',')[0] if v == RAW else v.split(', ', 1)[1]} {statistics.median(got[v]['times']) * 1e3:.0f} ms"
                for v in variants), file=sys.stderr, flush=True)
        codec = {p.variant: p.ask("codec") for p in pairs if setting_of(p.variant) is not None}
    finally:
        server_phases = {p.variant: p.stop() for p in pairs}
    payload = 2 * math.prod(shape) * 4
    rows = []
    for v in variants:
        times = got[v]["times"]
        p50 = statistics.median(times)
        rows.append({"variant": v, "trips": len(times), "p50_s": p50, "mean_s": statistics.fmean(times),
                     "min_s": min(times), "max_s": max(times), "times_s": [round(t, 5) for t in times],
                     "message_bytes": got[v]["message_bytes"], "payload_mb_s": payload / p50 / MB,
                     "cpu_s_per_trip": got[v]["cpu_s"] / len(times),
                     "client_phases_p50_s": {k: statistics.median(x) for k, x in got[v]["phases"].items()},
                     "server_phases_p50_s": {k: statistics.median(x) for k, x in server_phases[v].items() if x}})
    raw = next((r for r in rows if r["variant"] == RAW), None)
    for r in rows:
        r["vs_raw_sockets"] = r["payload_mb_s"] / raw["payload_mb_s"] if raw else None
    return {"rows": rows, "codec": codec}


def table(res: dict[str, Any]) -> str:
    a = res["args"]
    shape = " x ".join(map(str, a["shape"]))
    L = [f"Round trips of a FORWARD of f32 activations {shape} ({math.prod(a['shape']) * 4 / MB:.1f} MB) answered by "
         f"a BACKWARD of the same size, on 127.0.0.1; {a['rounds']} rounds x {a['trips']} trips per variant, "
         f"variants interleaved, after {a['warmup']} warm-up trip(s). Payload MB/s counts the tensor bytes both ways. "
         f"{res['machine']}. Other processes' load during the run: load average "
         f"{res['loadavg_start'][0]:.1f} at the start, {res['loadavg_end'][0]:.1f} at the end.", "",
         "CPU ms/trip: user + system time of the variant's client and server processes together, divided by its "
         "trips (other processes' load moves it far less than the wall time).", "",
         "| variant | trips | p50 ms/trip | min ms | CPU ms/trip | payload MB/s (p50) | vs raw sockets |",
         "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        L.append(f"| {r['variant']} | {r['trips']} | {r['p50_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f} | "
                 f"{r.get('cpu_s_per_trip', math.nan) * 1e3:.0f} | {r['payload_mb_s']:,.0f} | {_ratio(r['vs_raw_sockets'])} |")
    L += ["", "Where a round trip goes (p50 ms; client: encode = ClientSession.forward (forward_parts with the "
          "zero-copy codec, as the device client), send = until websockets "
          "has handed the message to the transport, wait = until the reply is assembled, decode = validated "
          "ClientSession.receive; server: the echo's decode, encode and send):", "",
          "| variant | client encode | send | wait | decode | server decode | encode | send |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        c, s = r["client_phases_p50_s"], r["server_phases_p50_s"]
        if not c:
            continue
        L.append(f"| {r['variant']} | " + " | ".join(f"{c[k] * 1e3:.0f}" for k in ("encode", "send", "wait", "decode"))
                 + " | " + " | ".join(f"{s[k] * 1e3:.0f}" if k in s else "-" for k in ("decode", "encode", "send")) + " |")
    variants = list(res["codec"])
    L += ["", "One message's steps alone (best of 3, ms), in a process with each allocator setting:", "",
          "| step | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    ops = [row["op"] for row in res["codec"][variants[0]]]
    for i, op in enumerate(ops):
        L.append(f"| {op} | " + " | ".join(f"{res['codec'][v][i]['best_s'] * 1e3:.0f}" for v in variants) + " |")
    return "\n".join(L) + "\n"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs="+", default=[8, 64, 224, 224],
                   help="activation shape (default: VGG-Face conv1, batch 8: 102.8 MB)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--trips", type=int, default=2, help="timed round trips per variant per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    p.add_argument("--compare-fastws", metavar="REV:PATH",
                   help="also run the fast-connection variants on this git revision's module (git show REV:PATH), "
                        "side by side with the working tree's")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "transport")
    args = p.parse_args(argv)
    if args.compare_fastws:
        args.variants = [*args.variants, *compared_variants(args.compare_fastws)]
    import platform
    import websockets
    res: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, websockets "
                                      f"{websockets.__version__}, {platform.libc_ver()[0]} {platform.libc_ver()[1]}",
                           "loadavg_start": os.getloadavg()}
    res.update(run(tuple(args.shape), args.rounds, args.trips, args.warmup, args.variants))
    res["loadavg_end"] = os.getloadavg()
    write_summary(args.out, res, table(res), newline=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
