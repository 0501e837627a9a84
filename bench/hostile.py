"""Hostile-client benchmark: do honest devices keep training while others flood the server?

Run from the repository root (loopback only, about 45 s with the defaults):

    .venv/bin/python -m bench.hostile                       # writes results/reliability/hostile.json
    .venv/bin/python -m bench.hostile --help

One edge server (`splitface-server serve`, default limits, the tiny vgg_face_small configuration) runs in
its own process. N honest simulated devices (server head, random images and labels) train against it for
one phase alone (baseline) and for one phase beside a flood (same server, same run), which comes from other
loopback addresses as it would from other hosts:

- idle: connections that never send HELLO (127.0.0.2), reopened as soon as the server drops them;
- slow: connections that start a frame and trickle it a byte at a time (127.0.0.3), reopened likewise,
  half announcing a frame under the pre-authentication limit and half one over it;
- bad token: guessers sending HELLOs with wrong tokens as fast as they are answered (127.0.0.4), for a
  registered device id that is not training and for made-up ids.

It reports the honest devices' batches/s in each phase and their ratio, the server's resident memory
(sampled from /proc every 0.25 s), what each attacker got, and the CPU cores that the server, the honest
devices, the attackers and the whole machine kept busy: on a small shared machine the attackers' own CPU
use competes with the honest devices, which a server facing remote attackers would not see.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from splitface.protocol import messages as m
from splitface.protocol.client_session import ClientSession

MODEL, SPLIT, NUM_CLASSES, BATCH = "vgg_face_small", "conv1", 5, 8
IDLE_FROM, SLOW_FROM, GUESS_FROM = "127.0.0.2", "127.0.0.3", "127.0.0.4"


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine have been busy (every process, other users' included)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class Attack:
    """What one kind of attacker got."""
    connections: int = 0
    refused_at_upgrade: int = 0          # the TCP/HTTP upgrade itself failed
    close_codes: Counter = field(default_factory=Counter)
    held_s: list[float] = field(default_factory=list)   # how long the server kept each connection open
    replies: Counter = field(default_factory=Counter)     # ERROR codes / message types received
    welcomed: int = 0                                     # HELLOs accepted: must stay 0

    def summary(self, seconds: float) -> dict[str, Any]:
        held = np.array(self.held_s) if self.held_s else np.zeros(1)
        return {"connections": self.connections, "connections_per_s": self.connections / seconds,
                "refused_at_upgrade": self.refused_at_upgrade,
                "close_codes": {str(k): v for k, v in sorted(self.close_codes.items(), key=str)},
                "held_open_s": {"median": float(np.median(held)), "max": float(held.max())},
                "replies": dict(self.replies), "accepted": self.welcomed}


async def _open(url: str, source: str, attack: Attack):
    attack.connections += 1
    try:
        return await connect(url, compression=None, local_addr=(source, 0), open_timeout=10, max_size=1 << 20)
    except (OSError, InvalidHandshake, TimeoutError):
        attack.refused_at_upgrade += 1
        await asyncio.sleep(0.1)
        return None


async def _until_closed(ws, attack: Attack, opened: float) -> None:
    try:
        await ws.wait_closed()
    finally:
        attack.held_s.append(time.monotonic() - opened)
        attack.close_codes[ws.close_code] += 1


async def idle(url: str, attack: Attack, stop: asyncio.Event) -> None:
    while not stop.is_set():
        ws = await _open(url, IDLE_FROM, attack)
        if ws is not None:
            opened = time.monotonic()
            await asyncio.wait([asyncio.ensure_future(_until_closed(ws, attack, opened)),
                                asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
            await ws.close()


async def slow(url: str, attack: Attack, stop: asyncio.Event, announce: int) -> None:
    """Start a masked binary frame of `announce` bytes and send one byte of it every 0.5 s."""
    header = bytes([0x82, 0x80 | 127]) + announce.to_bytes(8, "big") + b"\x00\x00\x00\x00"
    while not stop.is_set():
        ws = await _open(url, SLOW_FROM, attack)
        if ws is None:
            continue
        opened = time.monotonic()
        closed = asyncio.ensure_future(_until_closed(ws, attack, opened))
        ws.transport.write(header)
        while not closed.done() and not stop.is_set() and not ws.transport.is_closing():
            ws.transport.write(b"\x00")
            await asyncio.wait([closed, asyncio.ensure_future(stop.wait())], timeout=0.5,
                               return_when=asyncio.FIRST_COMPLETED)
        if not closed.done():
            ws.transport.abort()
            await closed


async def guess(url: str, spec: dict, attack: Attack, stop: asyncio.Event, target: str | None) -> None:
    while not stop.is_set():
        device_id = target or "made-up-" + secrets.token_hex(4)
        session = ClientSession(device_id, secrets.token_urlsafe(24), spec, SPLIT, "server", BATCH, NUM_CLASSES)
        ws = await _open(url, GUESS_FROM, attack)
        if ws is None:
            continue
        opened = time.monotonic()
        try:
            await ws.send(session.hello())
            reply = m.decode(await ws.recv())
            if reply["type"] == m.WELCOME:
                attack.welcomed += 1
            else:
                attack.replies["locked_out" if "try again" in reply["message"] else reply["code"]] += 1
        except ConnectionClosed:
            pass
        await _until_closed(ws, attack, opened)


@dataclass
class Honest:
    client: Any  # DeviceClient
    next_batch: int = 1
    done: int = 0

    async def run(self, stop: asyncio.Event, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            images = rng.integers(0, 256, (BATCH, 3, 64, 64), dtype=np.uint8)
            labels = rng.integers(0, NUM_CLASSES, BATCH)
            ids = np.arange(BATCH) + BATCH * self.next_batch
            await self.client.train_batch(self.next_batch, images, labels, ids)
            self.next_batch += 1
            self.done += 1


async def flood(url: str, spec: dict, idle_n: int, slow_n: int, guessers: int, seconds: float) -> dict[str, Any]:
    """Every attacker for `seconds`; what each kind got."""
    kinds = {"idle": Attack(), "slow": Attack(), "bad_token": Attack()}
    stop = asyncio.Event()
    tasks = ([idle(url, kinds["idle"], stop) for _ in range(idle_n)]
             + [slow(url, kinds["slow"], stop, 8192 if i % 2 else 64 << 20) for i in range(slow_n)]
             + [guess(url, spec, kinds["bad_token"], stop, "victim" if i % 2 else None) for i in range(guessers)])
    cpu0 = time.process_time()
    running = [asyncio.ensure_future(t) for t in tasks]
    await asyncio.sleep(seconds)
    stop.set()
    done, pending = await asyncio.wait(running, timeout=30)
    failed = [t.exception() for t in done if t.exception() is not None]
    if failed or pending:
        raise RuntimeError(f"attackers failed ({failed[:3]}) or hung ({len(pending)})")
    return {**{k: a.summary(seconds) for k, a in kinds.items()},
            "attackers_cpu_s_per_s": (time.process_time() - cpu0) / seconds}


def flood_process(queue: "mp.Queue", nice: int, *args: Any) -> None:
    """The attackers run in a process of their own, as they would on other hosts: their event loop does not
    slow the honest devices', and at `nice` they yield this machine's CPUs (remote attackers use none of them).
    Puts their results, or the error."""
    os.nice(nice)
    try:
        queue.put(asyncio.run(flood(*args)))
    except Exception as exc:
        queue.put({"error": repr(exc)})
        raise


async def phase(honest: list[Honest], seconds: float, pid: int) -> dict[str, Any]:
    stop = asyncio.Event()
    before = [h.done for h in honest]
    rss: list[float] = []
    cpu0 = (cpu_s(pid), time.process_time(), machine_busy_s())
    start = time.monotonic()
    work = [asyncio.ensure_future(h.run(stop, i + int(start))) for i, h in enumerate(honest)]
    while time.monotonic() - start < seconds:
        rss.append(rss_mb(pid))
        await asyncio.sleep(0.25)
    stop.set()
    await asyncio.gather(*work)
    elapsed = time.monotonic() - start
    cpu = [(b - a) / elapsed for a, b in zip(cpu0, (cpu_s(pid), time.process_time(), machine_busy_s()))]
    batches = sum(h.done for h in honest) - sum(before)
    return {"seconds": elapsed, "honest_batches": batches, "honest_batches_per_s": batches / elapsed,
            "server_rss_mb": {"start": rss[0], "max": max(rss), "end": rss[-1]},
            # CPU cores busy on average: the server, the honest devices (this process), the whole machine
            "cpu_cores": {"server": cpu[0], "honest_devices": cpu[1], "machine": cpu[2],
                          "machine_cores": os.cpu_count()}}


def start_server(run_dir: Path, tokens: Path, threads: int) -> tuple[subprocess.Popen, int]:
    log = open(run_dir / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "splitface.server.cli", "serve", "--model", MODEL, "--split", SPLIT,
                             "--num-classes", str(NUM_CLASSES), "--tokens", str(tokens), "--port", "0",
                             "--run-dir", str(run_dir / "server"), "--max-batch", str(BATCH), "--device", "cpu",
                             "--threads", str(threads), "--checkpoint-every", "1e9"], stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in (run_dir / "server.log").read_text().splitlines():
            if line.startswith("READY "):
                return proc, int(line.split()[1])
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(run_dir / 'server.log').read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


async def bench(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    # Imported here: the attackers' process imports this module and needs none of torch.
    from splitface.device.connection import DeviceClient
    from splitface.device.trainer import DeviceTrainer
    from splitface.common.models import resolve_spec
    from splitface.server.auth import issue_tokens

    honest_ids = [f"honest-{i}" for i in range(args.devices)]
    tokens = issue_tokens(run_dir / "tokens.json", honest_ids + ["victim"])
    proc, port = start_server(run_dir, run_dir / "tokens.json", args.threads)
    url = f"ws://127.0.0.1:{port}"
    spec = resolve_spec(MODEL)
    try:
        honest = [Honest(DeviceClient(url, d, tokens[d], DeviceTrainer(spec, SPLIT, "server", NUM_CLASSES), BATCH))
                  for d in honest_ids]
        for h in honest:
            await h.client.connect()
        await phase(honest, 2.0, proc.pid)  # warm-up, not reported
        baseline = await phase(honest, args.phase_s, proc.pid)
        queue = mp.get_context("spawn").Queue()
        attackers = mp.get_context("spawn").Process(target=flood_process, args=(
            queue, args.attacker_nice, url, spec.to_dict(), args.idle, args.slow, args.guessers, args.phase_s + 2.0))
        attackers.start()
        await asyncio.sleep(2.0)   # the flood builds up (and the process starts) before counting
        flooded = await phase(honest, args.phase_s, proc.pid)
        attacks = await asyncio.to_thread(queue.get, True, 120)
        attackers.join(30)
        if "error" in attacks:
            raise RuntimeError(f"the attackers' process failed: {attacks['error']}")
        for h in honest:
            await h.client.close()
        return {
            "benchmark": "bench/hostile.py", "command": "python -m bench.hostile " + " ".join(sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "setup": {"model": MODEL, "split": SPLIT, "batch": BATCH, "honest_devices": args.devices,
                      "idle_connections": args.idle, "slow_connections": args.slow, "guessers": args.guessers,
                      "phase_s": args.phase_s, "server_threads": args.threads, "server_limits": "defaults",
                      "attacker_nice": args.attacker_nice},
            "baseline": baseline, "flood": flooded,
            "honest_ratio_flood_vs_baseline": flooded["honest_batches_per_s"] / baseline["honest_batches_per_s"],
            "attackers": attacks,
        }
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    from splitface.common.options import add_devices_arg, add_threads_arg

    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_devices_arg(parser, 4, help="honest devices")
    parser.add_argument("--idle", type=int, default=200, help="idle connections (above the per-address cap of 128)")
    parser.add_argument("--slow", type=int, default=50, help="trickling connections")
    parser.add_argument("--guessers", type=int, default=4, help="concurrent bad-token guessers")
    parser.add_argument("--phase-s", type=float, default=12.0, help="seconds of each measured phase")
    add_threads_arg(parser, 1, help="server torch threads")
    parser.add_argument("--attacker-nice", type=int, default=19,
                        help="niceness of the attackers' process (19: they yield the CPUs, as remote attackers "
                             "would use none of the server's; 0: they compete as equals)")
    parser.add_argument("--out", type=Path, default=Path("results/reliability/hostile.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
