"""Server-level fuzz: hostile messages over real websockets against a real edge-server process.

    .venv/bin/python bench/fuzz_server.py [--messages 10000] [--seed 0] [--out results/reliability/fuzz.json]

Starts `splitface-server serve` on loopback with a tiny model and its default limits, then sends
`--messages` messages from a few concurrent workers. About a tenth are pre-HELLO: each on a fresh
connection from its own loopback address 127.0.0.x (as attackers elsewhere would; the honest devices use
127.0.0.1). The rest go to authenticated sessions (server and device head). Messages are honest ones and
the committed vectors, damaged by splitface/protocol/mutate.py, plus random bytes, random msgpack values, text frames
and out-of-order or duplicate batch ids. Each must be answered (a reply or a close) within --deadline s.

Counts: crashes (the server process exited: it is restarted and the fuzz goes on), hangs, unhandled
exceptions (tracebacks in the server's log; 1011 closes are counted beside them), outcomes by reply type,
error code and close code; afterwards an honest device in each head must train a few batches.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer
from splitface.common.models import activation_shape, resolve_spec
from splitface.common.options import add_seed_arg
from splitface.server.auth import hash_token
from splitface.protocol import messages as m
from splitface.protocol import mutate
from splitface.protocol.errors import ProtocolError
from splitface.protocol.client_session import ClientSession
from splitface.protocol.vectors import generate as vectors

ROOT = Path(__file__).resolve().parents[1]
# The tiny configuration: conv1 activations are [4, 32, 32] (16 KiB a sample in f32), embeddings 32 wide.
MODEL = {"family": "vgg_face", "input_size": 32, "width": 4, "fc_width": 32, "dropout": 0.0}
SPLIT, NUM_CLASSES, MAX_BATCH, MAX_MESSAGE_MB = "conv1", 5, 4, 1
WORKERS = (("fuzz-0", "server"), ("fuzz-1", "server"), ("fuzz-2", "server"), ("fuzz-3", "device"))
PRE_DEVICE = "fuzz-pre"            # the device id of pre-HELLO templates (admitted ones disturb no worker)
HONEST = (("honest-0", "server"), ("honest-1", "device"))
TOKENS = {d: f"token-{d}" for d in [w for w, _ in WORKERS] + [PRE_DEVICE] + [h for h, _ in HONEST]}
PRE_HELLO_SHARE = 0.1    # of messages: on a fresh connection, before any HELLO
HONEST_SHARE = 0.02      # of session steps: an honest training batch (keeps sequencing and the U-turn exercised)
VECTORS = sorted(Path(vectors.__file__).parent.glob("*.msgpack"))
TRACEBACK = "Traceback (most recent call last):"


@dataclass
class Tally:
    """What the fuzz sent and what came back."""
    messages: int = 0
    pre_hello: int = 0
    post_hello: int = 0
    hangs: int = 0
    outcomes: Counter = field(default_factory=Counter)   # "reply:backward", "error:bad_tensor", "close:1009", ...
    attacks: Counter = field(default_factory=Counter)    # how each message was made
    handshakes: int = 0                                  # setup HELLOs of the workers (not counted as messages)
    seconds: Counter = field(default_factory=Counter)    # total answer time by outcome
    hang_attacks: Counter = field(default_factory=Counter)
    progress_mismatches: list = field(default_factory=list)   # see Worker.check_progress

    def record(self, attack: str, outcome: str, pre_hello: bool, seconds: float) -> None:
        self.messages += 1
        self.seconds[outcome] += seconds
        self.pre_hello += pre_hello
        self.post_hello += not pre_hello
        self.attacks[attack] += 1
        self.outcomes[outcome] += 1
        if outcome == "hang":
            self.hangs += 1
            self.hang_attacks[attack] += 1


def close_code(exc: ConnectionClosed) -> str:
    return str(exc.rcvd.code) if exc.rcvd is not None else "none"


async def exchange(ws: ClientConnection, data: bytes | str, deadline: float) -> tuple[str, dict | None]:
    """Send one message and wait for its answer: ('reply:<type>' | 'error:<code>' | 'close:<code>' | 'hang', reply)."""
    try:
        await ws.send(data)
        raw = await asyncio.wait_for(ws.recv(), deadline)
    except (TimeoutError, asyncio.TimeoutError):
        return "hang", None
    except ConnectionClosed as exc:
        return f"close:{close_code(exc)}", None
    try:
        reply = m.decode(raw)
    except ProtocolError:
        return "invalid_reply", None
    return (f"error:{reply['code']}" if reply["type"] == m.ERROR else f"reply:{reply['type']}"), reply


def client_session(device_id: str, head: str, encoding: str = "f32") -> ClientSession:
    return ClientSession(device_id, TOKENS[device_id], resolve_spec(MODEL).to_dict(), SPLIT, head, MAX_BATCH,
                         NUM_CLASSES if head == "server" else None, {"activations": encoding, "gradients": encoding})


class Worker:
    """One authenticated device session that sends fuzz, plus its own pre-HELLO connections."""

    def __init__(self, server: "Target", device_id: str, head: str, rng: random.Random, deadline: float, tally: Tally):
        self.server, self.device_id, self.head, self.rng, self.deadline, self.tally = \
            server, device_id, head, rng, deadline, tally
        self.session = client_session(device_id, head, rng.choice(("f32", "f16", "i8")))
        self.act_shape = tuple(activation_shape(resolve_spec(MODEL), SPLIT))
        self.embedding_dim = resolve_spec(MODEL).embedding_dim
        self.ws: ClientConnection | None = None
        self.next_id = 1
        self.vectors = [p.read_bytes() for p in VECTORS]

    # ---- honest material -------------------------------------------------------------------
    def _n(self) -> int:
        return self.rng.randint(1, MAX_BATCH)

    def forward(self, batch_id: int, n: int | None = None, eval: bool = False) -> bytes:
        n = n or self._n()
        x = np.asarray(self.rng.random(), np.float32) * np.ones((n, *self.act_shape), np.float32)
        labels = [self.rng.randrange(NUM_CLASSES) for _ in range(n)] if self.head == "server" else None
        return self.session.forward(batch_id, x, labels, eval=eval)

    def grad(self, batch_id: int, n: int) -> bytes:
        return self.session.embedding_grad(batch_id, np.full((n, self.embedding_dim), 0.01, np.float32))

    def template(self) -> bytes:
        """An honest message to damage."""
        kind = self.rng.random()
        if kind < 0.4:   # damaged copies of the next batch; the few that stay valid train (N = 1 keeps them cheap)
            return self.forward(self.next_id, 1)
        if kind < 0.5:
            return self.forward(self.next_id + self.rng.randint(1, 3), 1)   # stays out of order if it survives
        if kind < 0.6:
            return self.forward(self.rng.randint(0, 9), 1, eval=True)
        if kind < 0.8 and self.head == "device":
            return self.grad(self.next_id, self._n())
        if kind < 0.85:
            return self.session.hello()
        return self.rng.choice(self.vectors)

    def fuzz_message(self) -> tuple[str, bytes | str]:
        r = self.rng.random()
        if r < 0.6:
            return mutate.mutate(self.template(), self.rng)
        if r < 0.7:
            i = self.rng.randrange(len(VECTORS))
            return f"vector:{VECTORS[i].stem[3:]}", self.vectors[i]
        if r < 0.78:
            return "random_bytes", bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(64)))
        if r < 0.86:
            return "random_value", mutate.pack(mutate.random_value(self.rng))
        if r < 0.89:
            return "text_frame", self.rng.choice(("", "hello", '{"type": "forward"}'))
        if r < 0.895:   # one byte over the announced limit: the websocket layer closes with 1009
            return "oversize", bytes(MAX_MESSAGE_MB * 2**20 + 1)
        offset = self.rng.choice((-1, -1, 0, 2, 5, -7, 2**40))   # relative to the last applied batch
        return "odd_batch_id", self.forward(max(self.next_id - 1 + offset, 0))

    # ---- sessions ----------------------------------------------------------------------------
    async def connect(self) -> None:
        self.ws = await connect(self.server.url, compression=None, max_size=None, open_timeout=self.deadline,
                                close_timeout=1)
        self.tally.handshakes += 1
        outcome, welcome = await exchange(self.ws, self.session.hello(), self.deadline)
        if outcome != "reply:welcome":
            raise RuntimeError(f"{self.device_id}: honest HELLO answered {outcome}")
        self.session.welcome = welcome
        self.next_id = welcome["resume_from"]

    async def drop(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            await ws.close()

    async def send(self, attack: str, data: bytes | str) -> tuple[str, dict | None]:
        start = time.perf_counter()
        outcome, reply = await exchange(self.ws, data, self.deadline)
        self.tally.record(attack, outcome, False, time.perf_counter() - start)
        if reply is not None and reply["type"] == m.BACKWARD:
            self.next_id = max(self.next_id, reply["batch_id"] + 1)
        if outcome.startswith("close") or outcome == "hang":
            await self.drop()
        return outcome, reply

    async def finish_u_turn(self, reply: dict | None) -> None:
        """Device head: a FORWARD answered by training EMBEDDINGS holds the shared model until its gradient
        comes (that is the protocol); send it at once, or close, so one fuzzing device does not stall all."""
        if self.ws is None or reply is None or reply["type"] != m.EMBEDDINGS or reply.get("eval"):
            return
        outcome, _ = await self.send("u_turn_gradient", self.grad(reply["batch_id"], len(reply["embeddings"])))
        if outcome != "reply:backward":
            await self.drop()

    async def honest_batch(self) -> None:
        n = self._n()
        outcome, reply = await self.send("honest_forward", self.forward(self.next_id, n))
        if self.head == "device" and self.ws is not None:
            for _ in range(self.rng.randint(0, 2)):       # fuzz in the middle of the U-turn
                if self.ws is None:
                    return
                await self.send(*self.fuzz_message())
            if self.ws is not None:
                outcome, reply = await self.send("honest_forward", self.forward(self.next_id, n))
                await self.finish_u_turn(reply)

    async def pre_hello(self) -> None:
        r = self.rng.random()
        hello = client_session(PRE_DEVICE, self.rng.choice(("server", "device"))).hello()
        if r < 0.5:
            attack, data = mutate.mutate(hello, self.rng)
        elif r < 0.7:
            attack, data = mutate.mutate(self.rng.choice(self.vectors), self.rng)
        elif r < 0.8:
            attack, data = "random_bytes", bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(64)))
        elif r < 0.9:
            i = self.rng.randrange(len(VECTORS))
            attack, data = f"vector:{VECTORS[i].stem[3:]}", self.vectors[i]
        elif r < 0.98:
            attack, data = "text_frame", "hello"
        else:           # over the pre-authentication limit (if the server has one) and far from a HELLO
            attack, data = "oversize", bytes(64 * 2**10)
        address = f"127.0.0.{self.rng.randint(2, 254)}"
        start = time.perf_counter()
        try:
            async with connect(self.server.url, compression=None, max_size=None, open_timeout=self.deadline,
                               close_timeout=1, local_addr=(address, 0)) as ws:
                outcome, _ = await exchange(ws, data, self.deadline)
        except (OSError, InvalidHandshake, TimeoutError, asyncio.TimeoutError) as exc:
            outcome = f"connect_failed:{type(exc).__name__}"
        self.tally.record("pre_hello:" + attack, outcome, True, time.perf_counter() - start)

    async def run(self, budget: "Budget") -> None:
        while budget.take():
            if self.rng.random() < PRE_HELLO_SHARE:
                await self.pre_hello()
                continue
            if self.ws is None:
                await self.server.alive()
                try:
                    await self.connect()
                except (RuntimeError, OSError, InvalidHandshake, TimeoutError, asyncio.TimeoutError) as exc:
                    # an honest HELLO refused: a finding in itself; this worker stops
                    self.tally.outcomes[f"worker_hello_failed:{exc}"[:120]] += 1
                    return
            if self.rng.random() < HONEST_SHARE:
                await self.honest_batch()
            else:
                _, reply = await self.send(*self.fuzz_message())
                if self.head == "device":
                    await self.finish_u_turn(reply)
        await self.drop()
        await self.check_progress()

    async def check_progress(self) -> None:
        """Exactly once, from the server's own counter: a fresh WELCOME's resume_from must be one past the last
        batch this device saw acknowledged (every BACKWARD it got), no more (a batch applied twice or without a
        reply) and no less (an acknowledged batch lost)."""
        expected = self.next_id
        try:
            await self.connect()
        except (RuntimeError, OSError, InvalidHandshake, TimeoutError, asyncio.TimeoutError) as exc:
            self.tally.outcomes[f"worker_hello_failed:{exc}"[:120]] += 1
            return
        if self.next_id != expected:
            self.tally.progress_mismatches.append(f"{self.device_id}: server resumes at {self.next_id}, "
                                                  f"device saw {expected - 1} acknowledged")
        await self.drop()


class Budget:
    def __init__(self, total: int):
        self.left = total

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


class Target:
    """Where the server is; `alive` is a hook for restarting a crashed server process (no-op in-process)."""

    def __init__(self, url: str):
        self.url = url

    async def alive(self) -> None:
        pass


async def fuzz(target: Target, messages: int, seed: int, deadline: float) -> Tally:
    tally = Tally()
    budget = Budget(messages)
    workers = [Worker(target, d, head, random.Random(f"{seed}-{d}"), deadline, tally) for d, head in WORKERS]
    await asyncio.gather(*(w.run(budget) for w in workers))
    return tally


async def honest_trains(url: str, batches: int = 3) -> bool:
    """Each head: a real DeviceClient trains `batches` batches with finite losses."""
    spec = resolve_spec(MODEL)
    rng = np.random.default_rng(0)
    for device_id, head in HONEST:
        client = DeviceClient(url, device_id, TOKENS[device_id], DeviceTrainer(spec, SPLIT, head, NUM_CLASSES),
                              batch_size=MAX_BATCH)
        try:
            await client.connect()
            for b in range(client.engine.committed + 1, client.engine.committed + 1 + batches):
                images = rng.integers(0, 256, (MAX_BATCH, 3, spec.input_size, spec.input_size), dtype=np.uint8)
                result = await client.train_batch(b, images, rng.integers(0, NUM_CLASSES, MAX_BATCH),
                                                  np.arange(MAX_BATCH) + MAX_BATCH * b)
                if not math.isfinite(result.loss):
                    return False
        except Exception as exc:  # noqa: BLE001 - any failure means "did not train"; say why
            print(f"honest {device_id} ({head} head) failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return False
        finally:
            await client.close()
    return True


def tracebacks(log_text: str) -> Counter:
    """Tracebacks in a server log, by what the log line before each says."""
    kinds: Counter = Counter()
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(TRACEBACK):
            before = lines[i - 1] if i else ""
            kinds["connection_handler_failed" if "connection handler failed" in before
                  else "batch_failed" if re.search(r"batch \d+ failed", before) else "other"] += 1
    return kinds


class ServerProcess(Target):
    """`splitface-server serve` in a subprocess, logging to a file; restarted if it dies."""

    def __init__(self, workdir: Path, server_root: Path = ROOT):
        super().__init__("")
        self.workdir, self.server_root = workdir, server_root
        self.log_path = workdir / "server.log"
        self.crashes = 0
        tokens = workdir / "tokens.json"
        tokens.write_text(json.dumps({d: hash_token(t) for d, t in TOKENS.items()}))
        self.command = [sys.executable, "-m", "splitface.server.cli", "serve", "--model", json.dumps(MODEL),
                        "--num-classes", str(NUM_CLASSES), "--tokens", str(tokens), "--port", "0",
                        "--run-dir", str(workdir / "run"), "--max-batch", str(MAX_BATCH),
                        "--max-message-mb", str(MAX_MESSAGE_MB), "--threads", "1", "--checkpoint-every", "5"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=self.server_root,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = re.search(r"^READY (\d+)$", self.log_path.read_text(errors="replace")[offset:], re.M)
            if ready:
                self.url = f"ws://127.0.0.1:{ready[1]}"
                return
            time.sleep(0.2)
        raise RuntimeError(f"server did not start; see {self.log_path}")

    async def alive(self) -> None:
        if self.proc.poll() is not None:
            self.crashes += 1
            await asyncio.to_thread(self.start)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "splitface/server", "splitface/protocol"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+uncommitted server/protocol changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(messages: int, seed: int, deadline: float, workdir: Path, server_root: Path = ROOT) -> dict[str, Any]:
    server = ServerProcess(workdir, server_root)
    server.start()
    start = time.perf_counter()
    tally = asyncio.run(fuzz(server, messages, seed, deadline))
    fuzz_s = time.perf_counter() - start
    asyncio.run(server.alive())
    trains = asyncio.run(honest_trains(server.url))
    died_before_stop = server.proc.poll() is not None
    returncode = server.stop()
    log_text = server.log_path.read_text(errors="replace")
    kinds = tracebacks(log_text)
    outcomes = dict(sorted(tally.outcomes.items()))
    return {
        "messages": tally.messages,
        "crashes": server.crashes + died_before_stop,
        "hangs": tally.hangs,
        "unhandled_exceptions": sum(kinds.values()),
        "honest_client_trains_after": trains,
        "pre_hello_messages": tally.pre_hello,
        "post_hello_messages": tally.post_hello,
        "closes_1011": tally.outcomes.get("close:1011", 0),
        "hangs_by_attack": dict(sorted(tally.hang_attacks.items())),
        "progress_mismatches": tally.progress_mismatches,
        "tracebacks_by_kind": dict(sorted(kinds.items())),
        "outcomes": outcomes,
        "errors_by_code": {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("error:")},
        "mean_answer_ms_by_outcome": {k: round(1000 * tally.seconds[k] / n, 1) for k, n in outcomes.items()},
        "batches_applied_during_fuzz": tally.outcomes.get("reply:backward", 0),
        "attacks": dict(sorted(tally.attacks.items())),
        "worker_handshakes": tally.handshakes,
        "server_exit_code": returncode,
        "fuzz_wall_s": round(fuzz_s, 1),
        "messages_per_s": round(tally.messages / fuzz_s, 1),
        "seed": seed,
        "deadline_s": deadline,
        "configuration": {"model": MODEL, "split": SPLIT, "num_classes": NUM_CLASSES, "max_batch": MAX_BATCH,
                          "max_message_mb": MAX_MESSAGE_MB, "workers": [list(w) for w in WORKERS],
                          "pre_hello_share": PRE_HELLO_SHARE, "honest_share": HONEST_SHARE,
                          "server_limits": "defaults"},
        "code": git_commit() if server_root == ROOT else f"server from {server_root}",
        "command": "python bench/fuzz_server.py --messages %d --seed %d" % (messages, seed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    add_seed_arg(parser, help="seeds the fuzzer's choice and mutation of messages")
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds a message may wait for its answer")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reliability" / "fuzz.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep the server's run dir and log here")
    parser.add_argument("--server-root", type=Path, default=ROOT,
                        help="run the server from another checkout (e.g. `git archive` of an older commit) to compare")
    args = parser.parse_args()
    if args.messages < 1:
        parser.error("--messages must be positive")
    with tempfile.TemporaryDirectory(prefix="fuzz-server-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run(args.messages, args.seed, args.deadline, workdir, args.server_root.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("messages", "crashes", "hangs", "unhandled_exceptions",
                                             "honest_client_trains_after", "messages_per_s")}))


if __name__ == "__main__":
    main()
