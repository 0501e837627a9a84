#!/usr/bin/env python
"""Split-learning benchmark: training throughput, bytes on the wire, protocol vs raw TCP.

Run from the repository root:

    .venv/bin/python bench/bench_split.py            # defaults: vgg_face_small, batch 64
    .venv/bin/python bench/bench_split.py --help

It is a benchmark, not a test: it prints a markdown report, saves it to
results/bench_split.txt and writes the numbers plus a machine description to JSON.

1. Training throughput (samples/s), all in this one process and on this machine:
   unsplit model; split loop without network (DeviceTrainer -> numpy -> ServerTrainer ->
   DeviceTrainer.commit); split loop through the real protocol over a loopback websocket
   (EdgeServer in a background thread, DeviceClient.train_batch), f32 and f16.
2. Bytes on the wire per sample for f32 / f16 / i8: measured with the real encoders for
   the benchmark model, analytic (activation_shape x itemsize + measured overhead) for
   the full-size vgg_face and iresnet50 presets (those models are never built).
3. Protocol tensor throughput vs raw TCP: FORWARD/BACKWARD-sized round trips between this
   process and an echo server in a child process (websockets + msgpack protocol,
   websockets moving pre-encoded bytes, asyncio TCP streams, blocking sockets), plus
   msgpack encode / decode of one full-size message alone.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from splitface.protocol import messages as m
from splitface.protocol.client_session import ClientSession
from splitface.protocol.server_session import DeviceRecord, ServerInfo, ServerSession
from splitface.protocol.tensor import WIRE_DTYPES, decode_tensor, encode_tensor, payload_bytes
from research.results import write_report
from bench.transport import raw_echo, recv_into

ROOT = Path(__file__).resolve().parents[1]

# The project's websocket options (splitface/server/app.py serve(...), splitface/device/connection.py connect(...)).
SERVER_WS_OPTIONS = dict(compression=None, max_queue=4, write_limit=2 ** 24, ping_interval=30, ping_timeout=120)
CLIENT_WS_OPTIONS = dict(max_size=None, compression=None, open_timeout=10, ping_interval=30, ping_timeout=120,
                         close_timeout=2, max_queue=4)
SPLIT = "conv1"
DEVICE_ID, TOKEN = "bench-device", "bench-token"
MB = 1e6


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import torch
    import websockets
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = round(int(line.split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": cpu, "cpu_count": os.cpu_count(), "usable_cores": usable, "memory_gib": mem_gb,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__, "msgpack": ".".join(map(str, msgpack.version)), "websockets": websockets.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
    }


class OtherLoad:
    """CPU used by other processes while a block runs, in cores: /proc/stat busy time minus our own.

    The machine may be shared; a high value means the timings of that block are inflated.
    """

    def __enter__(self) -> "OtherLoad":
        self.cores = None
        self._t, self._busy, self._own = time.perf_counter(), self._machine_busy(), self._own_cpu()
        return self

    def __exit__(self, *exc) -> None:
        busy = self._machine_busy()
        if busy is not None and self._busy is not None:
            wall = time.perf_counter() - self._t
            self.cores = max(0.0, ((busy - self._busy) - (self._own_cpu() - self._own)) / wall)

    @staticmethod
    def _machine_busy() -> float | None:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def code_version() -> dict[str, Any]:
    import subprocess
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty) if commit else None}


def stats(times: list[float], batch: int | None = None) -> dict[str, Any]:
    out = {"n": len(times), "mean_s": statistics.fmean(times), "p50_s": statistics.median(times),
           "min_s": min(times), "max_s": max(times), "times_s": [round(t, 6) for t in times]}
    if batch:
        out["samples_per_s"] = batch / out["mean_s"]
    return out


def random_batches(spec, batch: int, num_classes: int, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (batch, 3, spec.input_size, spec.input_size)
    return [(rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, num_classes, batch, dtype=np.int64))
            for _ in range(count)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# 1. training throughput
# ---------------------------------------------------------------------------------------
def bench_unsplit(spec, num_classes, batches, warmup, steps) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from splitface.device.trainer import to_input
    from splitface.common.models import build_backbone, build_classifier
    from splitface.common.optim import exponential_decay, make_sgd
    torch.manual_seed(0)
    backbone, classifier = build_backbone(spec), build_classifier(spec, num_classes)
    opt = make_sgd(list(backbone.parameters()) + list(classifier.parameters()), 0.01, 0.9)
    sched = exponential_decay(opt)
    backbone.train()
    classifier.train()
    times = []
    for i in range(warmup + steps):
        images, labels = batches[i % len(batches)]
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(classifier(backbone(to_input(images))), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        sched.step()
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return stats(times, len(batches[0][1]))


def bench_inprocess(spec, num_classes, batches, warmup, steps) -> dict[str, Any]:
    from splitface.device.trainer import DeviceTrainer
    from splitface.server.trainer import ServerTrainer
    engine = DeviceTrainer(spec, SPLIT, "server", num_classes)
    trainer = ServerTrainer(spec, SPLIT, num_classes, device="cpu")
    times, parts = [], {"device_forward": [], "server_step": [], "device_commit": []}
    for i in range(warmup + steps):
        images, labels = batches[i % len(batches)]
        t0 = time.perf_counter()
        activations = engine.forward(images, ("train", i + 1), _ids(i, batches), labels)
        t1 = time.perf_counter()
        grad, _loss, _ = trainer.train_server_head(activations, labels)
        t2 = time.perf_counter()
        engine.commit(i + 1, grad)
        t3 = time.perf_counter()
        if i >= warmup:
            times.append(t3 - t0)
            parts["device_forward"].append(t1 - t0)
            parts["server_step"].append(t2 - t1)
            parts["device_commit"].append(t3 - t2)
    out = stats(times, len(batches[0][1]))
    out["parts_mean_s"] = {k: statistics.fmean(v) for k, v in parts.items()}
    # How the last gradient fares in f16: conv1 activation gradients are tiny (mean loss over the batch).
    g = np.abs(grad)
    out["activation_grad"] = {"abs_median": float(np.median(g)), "abs_max": float(g.max()),
                              "f16_subnormal_fraction": float(((g > 0) & (g < 2.0 ** -14)).mean()),
                              "f16_zero_fraction": float((grad.astype(np.float16) == 0).mean()),
                              "f16_codec_zero_fraction": float(
                                  ((decode_tensor(encode_tensor(grad, "f16")) == 0) & (grad != 0)).mean()),
                              "f32_zero_fraction": float((grad == 0).mean())}
    return out


def _ids(step: int, batches: list) -> np.ndarray:
    """Stable image ids for the accountant: batch k always holds the same images."""
    size = len(batches[0][1])
    return np.arange(size) + (step % len(batches)) * size


def serve_in_thread(trainer, max_batch: int, run_dir: Path):
    from splitface.server.app import EdgeServer, ServerConfig, ServerThread, server_info
    from splitface.server.auth import TokenAuthenticator, hash_token
    info = server_info(trainer, max_batch, m.DEFAULT_MAX_MESSAGE_BYTES)
    return ServerThread(EdgeServer(trainer, info, TokenAuthenticator({DEVICE_ID: hash_token(TOKEN)}),
                                   ServerConfig(port=0, run_dir=run_dir, checkpoint_every_s=1e9, log_every_s=1e9)))


def bench_websocket(spec, num_classes, batches, warmup, steps, encoding: str) -> dict[str, Any]:
    from splitface.device.connection import DeviceClient
    from splitface.device.trainer import DeviceTrainer
    from splitface.server.trainer import ServerTrainer
    batch = len(batches[0][1])
    trainer = ServerTrainer(spec, SPLIT, num_classes, device="cpu")
    with tempfile.TemporaryDirectory(prefix="bench_split_") as run_dir, serve_in_thread(trainer, batch, Path(run_dir)) as st:
        async def client_main() -> dict[str, Any]:
            engine = DeviceTrainer(spec, SPLIT, "server", num_classes)
            client = DeviceClient(st.url, DEVICE_ID, TOKEN, engine, batch,
                                  encodings={"activations": encoding, "gradients": encoding})
            await client.connect()
            times, device_s, rtt_s, sent, received = [], [], [], [], []
            compute0 = 0.0
            for i in range(warmup + steps):
                if i == warmup:
                    compute0 = st.server.metrics.total.compute_s
                images, labels = batches[i % len(batches)]
                t = time.perf_counter()
                r = await client.train_batch(i + 1, images, labels, _ids(i, batches))
                if i >= warmup:
                    times.append(time.perf_counter() - t)
                    device_s.append(r.device_s)
                    rtt_s.append(r.round_trip_s)
                    sent.append(r.bytes_sent)
                    received.append(r.bytes_received)
            server_compute = (st.server.metrics.total.compute_s - compute0) / steps
            await client.close()
            out = stats(times, batch)
            out["parts_mean_s"] = {
                "device (forward+commit)": statistics.fmean(device_s),
                "round trip (send..reply)": statistics.fmean(rtt_s),
                "  of which server compute+encode": server_compute,
                "  of which transfer + server decode": statistics.fmean(rtt_s) - server_compute,
                "client encode/decode + rest": out["mean_s"] - statistics.fmean(device_s) - statistics.fmean(rtt_s),
            }
            out["forward_bytes"] = sent[0]
            out["backward_bytes"] = received[0]
            return out
        return asyncio.run(client_main())


# ---------------------------------------------------------------------------------------
# 2. bytes on the wire
# ---------------------------------------------------------------------------------------
def _sessions(spec, act_shape, batch, num_classes, encoding) -> tuple[ClientSession, ServerSession]:
    """A client and a server session that have really shaken hands (no model is built)."""
    info = ServerInfo(model=spec.to_dict(), split=SPLIT, activation_shape=tuple(act_shape),
                      embedding_dim=spec.embedding_dim, num_classes=num_classes, max_batch=batch)
    client = ClientSession(DEVICE_ID, TOKEN, spec.to_dict(), SPLIT, "server", batch, num_classes,
                           {"activations": encoding, "gradients": encoding})
    records: dict[str, DeviceRecord] = {}
    server = ServerSession(info, lambda d, t: True, records, lambda d: 0)
    server.receive(client.hello())
    client.accept_welcome(server.welcome())
    return client, server


def message_sizes(spec, act_shape, batch, num_classes, encoding, seed: int = 0) -> tuple[int, int]:
    """Real FORWARD and BACKWARD sizes for one batch (ClientSession.forward, ServerSession.applied)."""
    rng = np.random.default_rng(seed)
    client, server = _sessions(spec, act_shape, batch, num_classes, encoding)
    activations = rng.random((batch, *act_shape), dtype=np.float32)
    labels = rng.integers(0, num_classes, batch)
    forward = client.forward(1, activations, labels)
    grad = (rng.standard_normal((batch, *act_shape), dtype=np.float32) * 1e-3)
    backward = server.applied(1, grad, loss=4.6, n_correct=1)
    return len(forward), len(backward)


def bench_bytes(bench_spec_name: str, batch: int, num_classes: int, full_presets: list[str],
                measured_in_loop: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    from splitface.common.models import activation_shape, resolve_spec
    rows = []
    small = resolve_spec(bench_spec_name)
    small_shape = activation_shape(small, SPLIT)
    overhead = {}
    for enc in WIRE_DTYPES:
        fwd, bwd = message_sizes(small, small_shape, batch, num_classes, enc)
        payload = payload_bytes((batch, *small_shape), enc)
        overhead[enc] = (fwd - payload, bwd - payload)
        row = {"model": bench_spec_name, "activation_shape": list(small_shape), "encoding": enc, "batch": batch,
               "forward_bytes": fwd, "backward_bytes": bwd, "forward_overhead_bytes": fwd - payload,
               "backward_overhead_bytes": bwd - payload, "source": "measured"}
        if enc in measured_in_loop:
            row["websocket_loop_bytes"] = list(measured_in_loop[enc])
        rows.append(row)
    for name in full_presets:
        spec = resolve_spec(name)
        shape = activation_shape(spec, SPLIT)          # meta device: nothing full-size is built
        for enc in WIRE_DTYPES:
            payload = payload_bytes((batch, *shape), enc)
            rows.append({"model": name, "activation_shape": list(shape), "encoding": enc, "batch": batch,
                         "forward_bytes": payload + overhead[enc][0], "backward_bytes": payload + overhead[enc][1],
                         "forward_overhead_bytes": overhead[enc][0], "backward_overhead_bytes": overhead[enc][1],
                         "source": "analytic"})
    # One check of the analytic formula at full size with the real encoder, on a batch of 1.
    vgg = resolve_spec(full_presets[0])
    shape = activation_shape(vgg, SPLIT)
    o1 = message_sizes(small, small_shape, 1, num_classes, "f32")
    p1s = math.prod(small_shape) * 4
    predicted = (math.prod(shape) * 4 + o1[0] - p1s, math.prod(shape) * 4 + o1[1] - p1s)
    real = message_sizes(vgg, shape, 1, num_classes, "f32")
    for r in rows:
        r["per_sample_forward"] = r["forward_bytes"] / batch
        r["per_sample_backward"] = r["backward_bytes"] / batch
    rows.append({"check": f"{full_presets[0]} f32 batch 1: analytic vs real encoder",
                 "predicted": list(predicted), "real": list(real)})
    return rows


# ---------------------------------------------------------------------------------------
# 3. protocol vs raw TCP: echo servers in a child process
# ---------------------------------------------------------------------------------------
def _echo_child(conn) -> None:
    """Child process: a protocol echo (websockets + decode + BACKWARD encode), a bytes-only
    websocket echo, an asyncio TCP echo and a blocking-socket echo, all on 127.0.0.1."""
    from websockets.asyncio.server import serve

    async def ws_protocol(ws) -> None:
        async for data in ws:
            msg = m.decode(data, max_size=m.DEFAULT_MAX_MESSAGE_BYTES)
            act = msg["activations"]
            reply = m.encode({"type": m.BACKWARD, "batch_id": msg["batch_id"], "grad": encode_tensor(act, "f32"),
                              "loss": 4.6, "n_correct": 1, "durable_through": 0})
            await ws.send(reply)

    async def ws_bytes(ws) -> None:
        reply = b""
        async for data in ws:
            n = struct.unpack_from("<Q", data, 0)[0]
            if len(reply) != n:
                reply = bytes(n)
            await ws.send(reply)

    async def tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = b""
        try:
            while True:
                n_in, n_out = struct.unpack("<QQ", await reader.readexactly(16))
                await reader.readexactly(n_in)
                if len(reply) != n_out:
                    reply = bytes(n_out)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        opts = dict(SERVER_WS_OPTIONS, max_size=m.DEFAULT_MAX_MESSAGE_BYTES)
        async with serve(ws_protocol, "127.0.0.1", 0, **opts) as s1, serve(ws_bytes, "127.0.0.1", 0, **opts) as s2:
            tcp = await asyncio.start_server(tcp_echo, "127.0.0.1", 0)
            listener = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=raw_echo, args=(listener,), daemon=True).start()
            ports = {"ws_protocol": next(iter(s1.sockets)).getsockname()[1],
                     "ws_bytes": next(iter(s2.sockets)).getsockname()[1],
                     "tcp_asyncio": tcp.sockets[0].getsockname()[1], "tcp_socket": listener.getsockname()[1]}
            conn.send(ports)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)   # wait for "stop"
            tcp.close()

    asyncio.run(main())


async def _rt_ws_protocol(port, activations, labels, trips) -> list[float]:
    from websockets.asyncio.client import connect
    session = ClientSession(DEVICE_ID, TOKEN, {}, SPLIT, "server", len(activations), 1000,
                            {"activations": "f32", "gradients": "f32"})
    times = []
    async with connect(f"ws://127.0.0.1:{port}", **CLIENT_WS_OPTIONS) as ws:
        for i in range(trips):
            t = time.perf_counter()
            await ws.send(session.forward(i + 1, activations, labels))
            reply = session.receive(await ws.recv(), {m.BACKWARD}, i + 1)
            assert reply["grad"].shape == activations.shape
            times.append(time.perf_counter() - t)
            del reply
    return times


async def _rt_ws_bytes(port, n_out, n_back, trips) -> list[float]:
    from websockets.asyncio.client import connect
    payload = bytearray(n_out)
    struct.pack_into("<Q", payload, 0, n_back)
    payload = bytes(payload)
    times = []
    async with connect(f"ws://127.0.0.1:{port}", **CLIENT_WS_OPTIONS) as ws:
        for _ in range(trips):
            t = time.perf_counter()
            await ws.send(payload)
            reply = await ws.recv()
            assert len(reply) == n_back
            times.append(time.perf_counter() - t)
    return times


async def _rt_tcp_asyncio(port, n_out, n_back, trips) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2 ** 24)
    payload = bytes(n_out)
    times = []
    for _ in range(trips):
        t = time.perf_counter()
        writer.write(struct.pack("<QQ", n_out, n_back))
        writer.write(payload)
        await writer.drain()
        reply = await reader.readexactly(n_back)
        assert len(reply) == n_back
        times.append(time.perf_counter() - t)
    writer.close()
    await writer.wait_closed()
    return times


def _rt_tcp_socket(port, n_out, n_back, trips) -> list[float]:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(n_out)
    buf = bytearray(n_back)
    times = []
    for _ in range(trips):
        t = time.perf_counter()
        s.sendall(struct.pack("<QQ", n_out, n_back))
        s.sendall(payload)
        assert recv_into(s, memoryview(buf))
        times.append(time.perf_counter() - t)
    s.close()
    return times


def bench_transport(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_child, args=(child,), daemon=True)
    proc.start()
    try:
        ports = parent.recv()
        rows = []
        for case in cases:
            shape, trips, warm = case["shape"], case["trips"], case["warmup"]
            rng = np.random.default_rng(1)
            activations = rng.random(shape, dtype=np.float32)
            labels = rng.integers(0, 1000, shape[0])
            session = ClientSession(DEVICE_ID, TOKEN, {}, SPLIT, "server", shape[0], 1000)
            n_out = len(session.forward(1, activations, labels))
            n_back = len(m.encode({"type": m.BACKWARD, "batch_id": 1, "grad": encode_tensor(activations, "f32"),
                                   "loss": 4.6, "n_correct": 1, "durable_through": 0}))
            payload = activations.nbytes
            runs: dict[str, Callable[[int], list[float]]] = {
                "websocket + protocol (msgpack encode/decode)":
                    lambda k: asyncio.run(_rt_ws_protocol(ports["ws_protocol"], activations, labels, k)),
                "websocket, pre-encoded bytes":
                    lambda k: asyncio.run(_rt_ws_bytes(ports["ws_bytes"], n_out, n_back, k)),
                "asyncio TCP streams, length prefix":
                    lambda k: asyncio.run(_rt_tcp_asyncio(ports["tcp_asyncio"], n_out, n_back, k)),
                "blocking sockets, recv_into":
                    lambda k: _rt_tcp_socket(ports["tcp_socket"], n_out, n_back, k),
            }
            for transport, run in runs.items():
                log(f"  {case['name']}: {transport}")
                times = run(warm + trips)[warm:]
                st = stats(times)
                st.update({"case": case["name"], "shape": list(shape), "transport": transport, "trips": trips,
                           "message_bytes": [n_out, n_back], "payload_bytes_per_trip": 2 * payload,
                           "payload_mb_s": 2 * payload / st["mean_s"] / MB,
                           "wire_mb_s": (n_out + n_back) / st["mean_s"] / MB, "round_trips_s": 1 / st["mean_s"]})
                rows.append(st)
            mine = [r for r in rows if r["case"] == case["name"]]
            tcp = next(r for r in mine if r["transport"].startswith("asyncio TCP"))
            sock = next(r for r in mine if r["transport"].startswith("blocking sockets"))
            for r in mine:
                r["vs_asyncio_tcp"] = r["payload_mb_s"] / tcp["payload_mb_s"]
                r["vs_blocking_sockets"] = r["payload_mb_s"] / sock["payload_mb_s"]
            activations = None   # free this case's array before the next one is drawn
        return rows
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def bench_codec(shape, reps: int) -> list[dict[str, Any]]:
    """Where the copies cost, for one full-size FORWARD: each step alone, median of `reps`."""
    rng = np.random.default_rng(2)
    activations = rng.random(shape, dtype=np.float32)
    labels = [int(x) for x in rng.integers(0, 1000, shape[0])]
    tiny = activations * np.float32(1e-7)
    wire = encode_tensor(activations, "f32")
    msg = {"type": m.FORWARD, "batch_id": 1, "activations": wire, "labels": labels}
    data = m.encode(msg)
    ops: dict[str, Callable[[], Any]] = {
        "memcpy of the payload (bytes(memoryview))": lambda: bytes(wire["data"]),
        "encode_tensor f32 (view, no copy)": lambda: encode_tensor(activations, "f32"),
        "encode_tensor f16 (cast)": lambda: encode_tensor(activations, "f16"),
        "encode_tensor f16, gradient-sized values (~1e-7: f16 subnormals)": lambda: encode_tensor(tiny, "f16"),
        "encode_tensor i8 (quantise)": lambda: encode_tensor(activations, "i8"),
        "messages.encode (msgpack.packb)": lambda: m.encode(msg),
        "msgpack.unpackb alone": lambda: msgpack.unpackb(data, raw=False),
        "np.isfinite(...).all() check alone": lambda: np.isfinite(activations).all(),
        "messages.decode (unpackb + frombuffer + finite check)": lambda: m.decode(data),
    }
    rows = []
    for name, fn in ops.items():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            r = fn()
            times.append(time.perf_counter() - t)
            del r
        rows.append({"op": name, "bytes": activations.nbytes, "p50_s": statistics.median(times),
                     "min_s": min(times), "first_s": times[0], "gb_s": activations.nbytes / statistics.median(times) / 1e9})
    return rows


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------
def report(res: dict[str, Any]) -> str:
    mc, a = res["machine"], res["args"]
    L = [f"## Split-learning benchmark ({res['date']})", "",
         f"Machine: {mc['cpu_model']}, {mc['usable_cores']} cores usable ({mc['cpu_count']} online), "
         f"{mc['memory_gib']} GiB RAM, GPU: {mc['gpu'] or 'none'}; torch {mc['torch']} with {mc['torch_threads']} threads, "
         f"numpy {mc['numpy']}, msgpack {mc['msgpack']}, websockets {mc['websockets']}, Python {mc['python']}.", ""]
    code = res.get("code", {})
    if code.get("commit") or a.get("note"):
        L += [f"Code: {code.get('commit') or 'not a git checkout'}{' (uncommitted changes)' if code.get('dirty') else ''}"
              f"{'. ' + a['note'] if a.get('note') else ''}", ""]
    L += [
         f"### 1. Training throughput: `{a['model']}`, batch {a['batch_size']}, split at `{SPLIT}`, "
         f"{a['steps']} timed steps after {a['warmup']} warm-up", "",
         "| configuration | samples/s | mean ms/batch | p50 ms/batch | vs unsplit | other processes' CPU (cores) |",
         "|---|---:|---:|---:|---:|---:|"]
    base = res["train"]["unsplit"]["samples_per_s"]
    for name, r in res["train"].items():
        other = "-" if r.get("other_load_cores") is None else f"{r['other_load_cores']:.2f}"
        L.append(f"| {r['label']} | {r['samples_per_s']:.1f} | {r['mean_s'] * 1e3:.1f} | {r['p50_s'] * 1e3:.1f} | "
                 f"{r['samples_per_s'] / base:.2f}x | {other} |")
    ag = res["train"].get("inprocess", {}).get("activation_grad")
    if ag:
        L += ["", f"Activation gradients (last in-process step): |g| median {ag['abs_median']:.2e}, max {ag['abs_max']:.2e}; "
              f"a plain cast to f16 would make {ag['f16_subnormal_fraction']:.0%} subnormal and round "
              f"{ag['f16_zero_fraction']:.0%} to zero; the protocol's scaled f16 zeroes "
              f"{ag['f16_codec_zero_fraction']:.0%} (f32: {ag['f32_zero_fraction']:.0%} zero)."]
    L += ["", "Where a batch's time goes (mean ms):", "", "| configuration | part | ms |", "|---|---|---:|"]
    for name, r in res["train"].items():
        for part, s in r.get("parts_mean_s", {}).items():
            L.append(f"| {r['label']} | {part} | {s * 1e3:.1f} |")
    L += ["", f"### 2. Bytes on the wire per sample (batch {a['batch_size']}, server head)", "",
          "| model | activation C x H x W | encoding | FORWARD B/sample | BACKWARD B/sample | both, per sample | source |",
          "|---|---|---|---:|---:|---:|---|"]
    for r in res["bytes"]:
        if "check" in r:
            continue
        both = r["per_sample_forward"] + r["per_sample_backward"]
        L.append(f"| {r['model']} | {' x '.join(map(str, r['activation_shape']))} | {r['encoding']} | "
                 f"{r['per_sample_forward']:,.1f} | {r['per_sample_backward']:,.1f} | {_human(both)} | {r['source']} |")
    chk = next(r for r in res["bytes"] if "check" in r)
    ovh = [r for r in res["bytes"] if r.get("source") == "measured"]
    L += ["", "Overhead per message beyond the tensor bytes (measured): "
          + ", ".join(f"{r['encoding']} FORWARD {r['forward_overhead_bytes']} B / BACKWARD {r['backward_overhead_bytes']} B"
                      for r in ovh)
          + f". Check of the analytic formula ({chk['check']}): predicted {chk['predicted']}, real {chk['real']}."]
    loop = [r for r in ovh if "websocket_loop_bytes" in r]
    if loop:
        L.append("Sizes seen in the websocket training loop (FORWARD, BACKWARD): "
                 + ", ".join(f"{r['encoding']} {r['websocket_loop_bytes']}" for r in loop) + ".")
    L += ["", "### 3. Protocol tensor throughput vs raw TCP on loopback (echo server in a child process)", "",
          "Payload = tensor bytes, both directions counted (FORWARD out, BACKWARD-sized reply back).", "",
          "| case | transport | round trips | payload MB/s | round trips/s | p50 ms/trip | vs asyncio TCP | vs sockets |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["transport"]:
        L.append(f"| {r['case']} | {r['transport']} | {r['trips']} | {r['payload_mb_s']:,.0f} | "
                 f"{r['round_trips_s']:.2f} | {r['p50_s'] * 1e3:.1f} | {r['vs_asyncio_tcp']:.2f} | "
                 f"{r['vs_blocking_sockets']:.2f} |")
    c0 = res["codec"][0]
    L += ["", f"One full-size FORWARD message alone ({c0['bytes'] / MB:.1f} MB of f32 activations), "
          f"median of {a['codec_reps']}:", "",
          "| operation | p50 ms | first call ms | GB/s (of f32 payload) |", "|---|---:|---:|---:|"]
    for r in res["codec"]:
        L.append(f"| {r['op']} | {r['p50_s'] * 1e3:.1f} | {r['first_s'] * 1e3:.1f} | {r['gb_s']:.2f} |")
    other = res.get("other_load_cores_whole_run")
    L += ["", f"Total benchmark time: {res['elapsed_s']:.0f} s; other processes used "
          f"{'?' if other is None else f'{other:.2f}'} cores on average meanwhile; peak RSS {res['peak_rss_mib']['self']:,.0f} MiB "
          f"(benchmark process), {res['peak_rss_mib']['children']:,.0f} MiB (largest child)."]
    return "\n".join(L) + "\n"


def _human(n: float) -> str:
    for unit, k in (("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:,.2f} {unit}"
    return f"{n:.0f} B"


def main(argv: list[str] | None = None) -> int:
    from splitface.common.options import add_model_arg, add_threads_arg, add_training_args, apply_threads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p, "vgg_face_small")  # the training benchmarks' model
    add_training_args(p, epochs=None, batch_size=64, lr=None)
    p.add_argument("--steps", type=int, default=8, help="timed training steps per configuration (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per configuration (default 2)")
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--full-presets", nargs="+", default=["vgg_face", "iresnet50"],
                   help="presets for the analytic bytes-on-the-wire rows (never built)")
    p.add_argument("--big-trips", type=int, default=5, help="timed round trips of the 8x64x224x224 case (default 5)")
    p.add_argument("--small-trips", type=int, default=50, help="timed round trips of the 8x16x64x64 case (default 50)")
    p.add_argument("--codec-reps", type=int, default=5)
    add_threads_arg(p)
    p.add_argument("--skip-training", action="store_true", help="only the bytes and transport benchmarks")
    p.add_argument("--note", default="", help="free text recorded in the report and JSON (e.g. which code was measured)")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "bench_split.json")
    p.add_argument("--txt", type=Path, default=None, help="markdown report (default: the JSON path with .txt)")
    args = p.parse_args(argv)

    from splitface.common.models import resolve_spec
    apply_threads(args)
    start = time.perf_counter()
    run_load = OtherLoad().__enter__()
    spec = resolve_spec(args.model)
    res: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "train": {}}
    res["args"]["split"] = SPLIT
    res["code"] = code_version()

    loop_bytes: dict[str, tuple[int, int]] = {}
    if not args.skip_training:
        batches = random_batches(spec, args.batch_size, args.num_classes, 4)
        configs = [("unsplit", "(a) unsplit, one process",
                    lambda: bench_unsplit(spec, args.num_classes, batches, args.warmup, args.steps)),
                   ("inprocess", "(b) split, one process, numpy hand-off",
                    lambda: bench_inprocess(spec, args.num_classes, batches, args.warmup, args.steps))]
        for enc in ("f32", "f16"):
            configs.append((f"websocket_{enc}", f"(c) split, websocket loopback, {enc}",
                            lambda enc=enc: bench_websocket(spec, args.num_classes, batches, args.warmup, args.steps, enc)))
        for key, label, fn in configs:
            log(f"training: {label}")
            with OtherLoad() as load:
                r = fn()
            r["other_load_cores"] = load.cores
            r["label"] = label
            res["train"][key] = r
            if "forward_bytes" in r:
                loop_bytes[key.split("_")[1]] = (r["forward_bytes"], r["backward_bytes"])

    res["loadavg_after_training"] = os.getloadavg()
    log("bytes on the wire")
    res["bytes"] = bench_bytes(args.model, args.batch_size, args.num_classes, args.full_presets, loop_bytes)
    log("protocol vs raw TCP")
    big = (8, 64, 224, 224)
    res["transport"] = bench_transport([
        {"name": "8 x 64 x 224 x 224 (102.8 MB)", "shape": big, "trips": args.big_trips, "warmup": 1},
        {"name": "8 x 16 x 64 x 64 (2.1 MB)", "shape": (8, 16, 64, 64), "trips": args.small_trips, "warmup": 3},
    ])
    log("msgpack encode/decode alone")
    res["codec"] = bench_codec(big, args.codec_reps)
    res["elapsed_s"] = time.perf_counter() - start
    run_load.__exit__(None, None, None)
    res["other_load_cores_whole_run"] = run_load.cores
    res["loadavg_end"] = os.getloadavg()
    res["peak_rss_mib"] = {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                           "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}

    if args.skip_training:
        res["train"] = {}
    txt = args.txt or args.json.with_suffix(".txt")
    write_report(args.json, res, txt, report(res) if res["train"] else report_no_train(res), newline=True)
    log(f"wrote {args.json} and {txt}")
    return 0


def report_no_train(res: dict[str, Any]) -> str:
    res = dict(res)
    res["train"] = {"unsplit": {"label": "(training skipped)", "samples_per_s": float("nan"), "mean_s": float("nan"),
                                "p50_s": float("nan")}}
    return report(res)


if __name__ == "__main__":
    sys.exit(main())
