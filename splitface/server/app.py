"""The asyncio websocket shell around the sans-I/O protocol and the shared trainer.

One model lock serialises all compute on the shared model. In the device-head flow a
device holds the lock from its FORWARD until its EMBEDDING_GRAD (the tail's graph must
not see a step in between), with a timeout so a silent device cannot stall the others.
The same server can host federated sessions (HELLO mode "federated"): they talk to a
`RoundBoard` that a federated engine fills (research/federated/websocket.py) and never
touch the split trainer; with no trainer the server hosts federated sessions only.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import torch
from prometheus_client import CollectorRegistry, start_http_server
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from splitface.common.compute import at_torch_threads
from splitface.common.faults import Fault, crash
from splitface.net.tls import is_loopback
from splitface.common.models import activation_shape
from splitface.protocol.round_board import RoundBoard
from splitface.protocol.server_session import (Action, Admit, Authenticator, DeviceRecord, Embed, Evaluate, Reply, ServerInfo, ServerSession, Train, TrainTail)

from splitface.protocol import messages as m
from splitface.protocol.clusters import ClusterRelay, HeadBoard
from splitface.net.fastws import FastServerConnection
from splitface.net.transport import SERVER_WS_OPTIONS, receive, reuse_large_buffers, send_fragments
from splitface.protocol.messages import Message, message_size

from splitface.server.auth import AuthThrottle, throttled
from splitface.server.checkpoint import (ImplausibleStatistics, RefusedState, ReplyStore, load_checkpoint, save_checkpoint)
from splitface.server.metrics import Metrics, PrometheusCollector
from splitface.server.recorder import Recorder
from splitface.server.trainer import ServerTrainer, StepRefused

log = logging.getLogger("splitface.server")

CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013
CLOSE_REPLACED = 4000
CLOSE_TIMEOUT = 4001

# Tests only (`--fault KIND:N`, N a server step, counted across restarts): exit hard right after the reply of
# step N was handed to the connection, or after step N was applied (and checkpointed, when the checkpoint
# interval in batches falls there) but before its reply exists.
SERVER_FAULTS = ("crash-after-batch", "crash-between-apply-and-reply")


@dataclass(frozen=True)
class Limits:
    """Defences against hostile or broken clients, declared once: `splitface-server serve` makes an option of
    each field (--max-connections, ...) with this default and help."""
    max_connections: int = field(default=1024, metadata={"help": "open connections in total; more are closed (1013)"})
    max_connections_per_address: int = field(default=128, metadata={
        "help": "open connections from one IP address (devices behind one NAT share it)"})
    pre_auth_max_bytes: int = field(default=16384, metadata={
        "help": "largest message before HELLO succeeds (closed 1009 beyond); then --max-message-mb applies"})
    hello_timeout_s: float = field(default=10.0, metadata={
        "help": "seconds from connect to a successful HELLO, partial frames included; then closed (1008)"})
    auth_free_per_device: int = field(default=5, metadata={
        "help": "failed authentications of a device id before it is locked out"})
    auth_free_per_address: int = field(default=20, metadata={
        "help": "failed authentications from an address before it is locked out"})
    auth_lockout_s: float = field(default=1.0, metadata={
        "help": "first lock-out after the free failures; doubles with each further failure"})
    auth_lockout_max_s: float = field(default=300.0, metadata={"help": "longest lock-out"})
    message_rate: float = field(default=100.0, metadata={
        "help": "messages per second a session may send on average; faster ones are held back (0: no limit)"})
    message_burst: int = field(default=200, metadata={"help": "messages a session may send at once above the rate"})
    message_timeout_s: float = field(default=120.0, metadata={
        "help": "after HELLO: seconds from a message's first byte to its last; a message still incomplete then is "
                "dropped and the connection closed (4002), so that a half-sent message cannot hold memory (0: none)"})

    def auth_throttle(self) -> AuthThrottle:
        return AuthThrottle(self.auth_free_per_device, self.auth_free_per_address, self.auth_lockout_s,
                            self.auth_lockout_max_s)


class RateLimit:
    """Token bucket for one session: a message beyond the burst waits for its token (back-pressure; an honest
    device, which waits for each reply, is never slowed at the default rate)."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, max(burst, 1)
        self.tokens = float(self.burst)
        self.at = time.monotonic()
        self.held = 0  # messages held back so far

    async def take(self) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1
        if self.tokens < 0:
            self.held += 1
            await asyncio.sleep(-self.tokens / self.rate)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    run_dir: Path = Path("runs/server")
    checkpoint_every_s: float = 30.0
    checkpoint_every_batches: int = 0     # 0: time-based only
    log_every_s: float = 10.0
    pending_timeout_s: float = 60.0       # device head: the U-turn's hold on the model, from when it took it
    record_max: int = 0                   # > 0: keep up to this many received training samples per device (audit)
    reply_retention_s: float = 3600.0     # a device away longer than this loses its stored last reply (see _forget_replies)
    gradient_rounding: str = "nearest"    # i8 gradients: "nearest" or "stochastic" (ServerSession)
    limits: Limits = field(default_factory=Limits)
    metrics_port: int | None = None       # Prometheus endpoint (0: a free port); None: none
    metrics_host: str = "127.0.0.1"
    tls_cert: Path | None = None          # PEM certificate chain: serve wss://
    tls_key: Path | None = None           # its private key (PEM)
    insecure: bool = False                # allow plain ws:// on a non-loopback address
    fault: Fault | None = None            # tests only: crash at an exact step (SERVER_FAULTS)

    def tls(self) -> ssl.SSLContext | None:
        """The server's TLS context; plain ws:// only on loopback unless `insecure` (tokens travel in HELLO)."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        if self.tls_cert is None:
            if not (self.insecure or is_loopback(self.host)):
                raise ValueError(f"refusing to serve plain ws:// on {self.host}: device tokens would cross the network "
                                 f"in clear; give --tls-cert/--tls-key, or --insecure (e.g. behind a TLS proxy)")
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    @property
    def replies_dir(self) -> Path:
        return self.run_dir / "replies"

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.json"

    @property
    def recordings_dir(self) -> Path:
        return self.run_dir / "recordings"


def server_info(trainer: ServerTrainer, max_batch: int, max_message_bytes: int) -> ServerInfo:
    return ServerInfo(model=trainer.spec.to_dict(), split=trainer.split,
                      activation_shape=activation_shape(trainer.spec, trainer.split),
                      embedding_dim=trainer.spec.embedding_dim, num_classes=trainer.num_classes,
                      max_batch=max_batch, max_message_bytes=max_message_bytes)


@dataclass
class _Connection:
    ws: ServerConnection
    session: ServerSession
    opened: float = field(default_factory=time.monotonic)
    holds_lock: bool = False
    lock_taken: float = 0.0               # monotonic time the U-turn took the model lock
    applied_step: int = 0                 # the server step of the training batch whose reply is being sent
    done: asyncio.Event = field(default_factory=asyncio.Event)
    displaced: bool = False               # closed before its HELLO to make room (EdgeServer._displace); uncounted


class EdgeServer:
    def __init__(self, trainer: ServerTrainer | None, info: ServerInfo, authenticate: Authenticator,
                 config: ServerConfig, board: RoundBoard | None = None, heads: HeadBoard | None = None):
        """`trainer` None: no split training (info.heads must then be empty); `board`: the federated rounds
        this server hosts; `heads`: FedGC's correction of device heads, opt-in (federated.fedgc.device_head_board)."""
        if trainer is None and info.heads:
            raise ValueError("a server without a split trainer must offer no heads")
        self.trainer, self.info, self.authenticate, self.config = trainer, info, authenticate, config
        self.board = board
        self.relay = ClusterRelay(info.embedding_dim)  # device heads' PrivacyFace clusters (SPEC.md section 8.1)
        self.heads = heads
        self.records: dict[str, DeviceRecord] = {}
        self.replies = ReplyStore(config.replies_dir)
        self.durable: dict[str, int] = {}
        self.metrics = Metrics()
        self.recorder = Recorder(config.recordings_dir, config.record_max) if config.record_max > 0 else None
        self.model_lock = asyncio.Lock()
        # one compute thread, each call at torch's thread count (splitface.common.compute says why)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.connections: dict[str, tuple[ServerConnection, asyncio.Event]] = {}
        self.away_since: dict[str, float] = {}   # device id -> monotonic time its last connection closed
        self.open_by_address: Counter[str] = Counter()
        # connections that have not completed HELLO, per address, oldest first: the ones a full server may displace
        self.unauthenticated: dict[str, dict[ServerConnection, _Connection]] = {}
        self._closing: set[asyncio.Task] = set()
        self.auth_throttle = config.limits.auth_throttle()
        self._batches_since_checkpoint = 0
        # the running statistics the last checkpoint holds (or the server started from): the next one is checked
        # against them (ServerTrainer.statistics_beyond)
        self._checkpointed_statistics = trainer.statistics() if trainer is not None else {}
        self._stop = asyncio.Event()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.ssl = config.tls()
        if config.fault is not None:
            Fault.parse(str(config.fault), SERVER_FAULTS)
            log.warning("fault injection armed (tests only): %s", config.fault)
        self._restore()

    # ---- checkpoints -------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must have been written for (the model map as the handshake compares it, so that a
        checkpoint from before a later model key reads as the same model)."""
        return {"model": m.model_identity(self.info.model), "split": self.info.split,
                "num_classes": self.info.num_classes}

    def _restore(self) -> None:
        if self.trainer is None:  # federated only: the federated engine checkpoints its own rounds
            return
        state = load_checkpoint(self.config.checkpoint_path)
        # replies written for a checkpoint that never landed may not match the batches redone after resuming
        self.replies.prune({r["reply"] for r in state["devices"].values() if r["reply"]} if state else set())
        if state is None:
            return
        if {**state["identity"], "model": m.model_identity(state["identity"]["model"])} != self._identity():
            raise SystemExit(f"{self.config.checkpoint_path} was written for {state['identity']}, "
                             f"not {self._identity()}; use another --run-dir")
        self.trainer.load_state_dict(state["trainer"])
        self._checkpointed_statistics = self.trainer.statistics()
        self.records = {d: DeviceRecord(r["last_applied"], self._stored_reply(d, r["reply"]))
                        for d, r in state["devices"].items()}
        self.durable = {d: r.last_applied for d, r in self.records.items()}
        self.away_since = {d: time.monotonic() for d in self.records}   # none is connected yet
        if "metrics" in state:  # counted as of the checkpoint, like the batches it holds
            self.metrics = Metrics.from_state(state["metrics"])
        log.info("resumed from %s at server step %d (%s)", self.config.checkpoint_path, self.trainer.steps,
                 ", ".join(f"{d}@{r.last_applied}" for d, r in sorted(self.records.items())) or "no devices")

    def _stored_reply(self, device_id: str, name: str | None) -> bytes | None:
        """A device's last reply from the reply store. If it is gone (e.g. checkpoint.pt copied without
        replies/), the server still starts: only that device's retry of that one batch gets out_of_order."""
        if name is None:
            return None
        try:
            return self.replies.load(name)
        except OSError as exc:
            log.error("%s: its last reply (batch %s) cannot be read from %s (%s); a retry of that batch will be "
                      "refused", device_id, name.rsplit("-", 1)[-1].split(".")[0], self.replies.folder, exc)
            return None

    async def checkpoint(self) -> None:
        """Consistent snapshot: taken under the model lock, so no step or U-turn is half done."""
        if self.trainer is None:
            return
        async with self.model_lock:
            await self._checkpoint_locked()

    async def _checkpoint_locked(self) -> None:
        """The checkpoint, by a caller holding the model lock. A device's last reply is kept only while the
        device may still need it: once it sent its next training batch it has that reply (the session forgets it), so
        the checkpoint holds one reply per device in the middle of a batch, not one per device."""
        state = {"identity": self._identity(), "trainer": self.trainer.state_dict(),
                 "metrics": self.metrics.state(), "saved_at": time.time()}
        self._forget_replies()
        records = {d: (r.last_applied, r.last_reply) for d, r in self.records.items()}
        try:
            await self._compute(self._save, state, records)
        except RefusedState as exc:  # cannot happen through guarded steps; never save it
            log.error("%s", exc)
            self._batches_since_checkpoint = 0  # retried at the next interval, not at once
            return
        devices = state["devices"]
        if self.recorder:
            await self._compute(self.recorder.flush)
        self.durable = {d: r["last_applied"] for d, r in devices.items()}
        self._batches_since_checkpoint = 0
        log.info("checkpoint at server step %d (%d replies kept)", self.trainer.steps,
                 sum(r["reply"] is not None for r in devices.values()))

    def _save(self, state: dict[str, Any], records: dict[str, tuple[int, Message | None]]) -> None:
        """In the worker thread: the replies first (new ones only), then the checkpoint naming them; replies
        no checkpoint names any more are deleted once it is in place."""
        statistics = self.trainer.statistics()
        beyond = self.trainer.statistics_beyond(self._checkpointed_statistics)
        if beyond:
            raise ImplausibleStatistics(f"refusing to checkpoint: the running statistics of {len(beyond)} batch norms "
                                        f"({', '.join(beyond[:3])}) moved further since the last checkpoint than "
                                        f"clipped updates can; {self.config.checkpoint_path} keeps the last good state")
        state["devices"] = {d: {"last_applied": applied,
                                "reply": self.replies.save(d, applied, reply) if reply is not None else None}
                            for d, (applied, reply) in records.items()}
        save_checkpoint(self.config.checkpoint_path, state)
        self._checkpointed_statistics = statistics
        self.replies.prune({r["reply"] for r in state["devices"].values() if r["reply"]})

    def _stale_replies(self) -> list[str]:
        """Devices away for longer than reply_retention_s that still have a stored reply."""
        now = time.monotonic()
        return [d for d, since in self.away_since.items() if now - since > self.config.reply_retention_s
                and d not in self.connections and self.records.get(d, DeviceRecord()).last_reply is not None]

    def _forget_replies(self) -> None:
        """Bounded retention: a device that left for good (a phone uninstalled, a run ended) would otherwise keep
        its last reply, a whole gradient, on disk for ever. Its progress stays, so exactly-once holds: a retry of
        that batch after the retention is refused out_of_order (the device restarts its epoch), never applied twice."""
        for d in self._stale_replies():
            self.records[d].last_reply = None
            log.info("%s: away for over %.0f s; its last reply (batch %d) is no longer kept", d,
                     self.config.reply_retention_s, self.records[d].last_applied)

    def durable_through(self, device_id: str) -> int:
        return self.durable.get(device_id, 0)

    # ---- serving -----------------------------------------------------------------------
    async def _compute(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, at_torch_threads,
                                                                torch.get_num_threads(), fn, *args)

    async def run(self, on_ready: Callable[[int], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        reuse_large_buffers()  # large messages' buffers are reused, not page-faulted afresh (splitface/net/transport.py)
        # Until HELLO succeeds a connection may send only small messages; _perform raises the limit on admission.
        async with serve(self.handle, self.config.host, self.config.port, ssl=self.ssl, process_request=self._screen,
                         max_size=min(self.config.limits.pre_auth_max_bytes, self.info.max_message_bytes),
                         close_timeout=2, create_connection=FastServerConnection,  # splitface/net/fastws.py
                         **SERVER_WS_OPTIONS) as server:  # a trickler cannot answer a close
            self.port = next(iter(server.sockets)).getsockname()[1]
            log.info("listening on %s://%s:%d", "wss" if self.ssl else "ws", self.config.host, self.port)
            exporter = self._start_exporter()
            if on_ready:
                on_ready(self.port)
            housekeeping = asyncio.create_task(self._housekeeping())
            await self._stop.wait()
            housekeeping.cancel()
            server.close(close_connections=True)
            await server.wait_closed()
            if exporter is not None:
                exporter.shutdown()
                exporter.server_close()
        await self.checkpoint()
        self.metrics.write(self.config.metrics_path, self._hardware())
        log.info("stopped: %s", self.metrics.line())
        self.executor.shutdown()

    def stop(self) -> None:
        self._stop.set()

    def _hardware(self) -> dict[str, Any]:
        """What metrics.json says of where the model runs and how it embeds a release in training and at test (none
        for a federated-only server)."""
        if self.trainer is None:
            return {}
        return {"accelerator": self.trainer.accelerator(), "train_embedding": self.trainer.train_embedding(),
                "test_embedding": self.trainer.test_embedding()}

    def _start_exporter(self) -> Any:
        """The Prometheus endpoint (HTTP, in its own thread), or None when no --metrics-port is given."""
        if self.config.metrics_port is None:
            return None
        registry = CollectorRegistry(auto_describe=True)
        registry.register(PrometheusCollector(lambda: self.metrics, lambda: len(self.connections)))
        httpd, _ = start_http_server(self.config.metrics_port, self.config.metrics_host, registry)
        self.metrics_port = httpd.server_port
        log.info("metrics on http://%s:%d/metrics", self.config.metrics_host, self.metrics_port)
        return httpd

    async def _housekeeping(self) -> None:
        last_ckpt = last_log = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            due = self._batches_since_checkpoint and now - last_ckpt >= self.config.checkpoint_every_s
            if due or self._stale_replies():  # the checkpoint drops stale replies and deletes their files
                await self.checkpoint()
                last_ckpt = now
            if now - last_log >= self.config.log_every_s:
                log.info("%s", self.metrics.line())
                self.metrics.write(self.config.metrics_path, self._hardware())
                last_log = now

    async def _admit(self, device_id: str, ws: ServerConnection, done: asyncio.Event) -> None:
        """One connection per device: a reconnecting device retires its stale connection first."""
        old = self.connections.get(device_id)
        if old is not None:
            old_ws, old_done = old
            log.info("%s reconnected; closing its previous connection", device_id)
            await old_ws.close(CLOSE_REPLACED, "replaced by a newer connection")
            await old_done.wait()
        self.connections[device_id] = (ws, done)
        self.away_since.pop(device_id, None)

    def _refusal(self, address: str) -> str | None:
        """Why a new connection from `address` is refused, or None. A full server first makes room by displacing
        a connection that has not completed its HELLO from the address holding the most connections, if that
        address holds more than this one will (`_displace`)."""
        limits = self.config.limits
        if self.open_by_address[address] >= limits.max_connections_per_address:
            return f"too many connections from this address ({limits.max_connections_per_address})"
        if sum(self.open_by_address.values()) >= limits.max_connections and not self._displace(address):
            return f"server full ({limits.max_connections} connections)"
        return None

    def _displace(self, address: str) -> bool:
        """The fair share of a full server (otherwise eight addresses reconnecting could hold all 1,024 slots):
        close the oldest connection still without a successful HELLO of the address holding the most connections,
        when it holds more than `address` would with the new one. Authenticated sessions are never displaced, so
        a device with a valid token keeps its place, and a newcomer gets in while some address holds more than
        its share in connections that have not authenticated. True when a place was freed."""
        mine = self.open_by_address[address] + 1
        candidates = [a for a, waiting in self.unauthenticated.items() if waiting and self.open_by_address[a] > mine]
        if not candidates:
            return False
        victim = max(candidates, key=lambda a: self.open_by_address[a])
        ws, conn = next(iter(self.unauthenticated[victim].items()))
        self._forget_unauthenticated(victim, ws)
        conn.displaced = True
        self._count_closed(victim)  # its place is free now; its handler skips the count when it ends
        log.warning("server full: displacing a connection from %s (%d open, not authenticated) for one from %s",
                    victim, self.open_by_address[victim] + 1, address)
        self.metrics.closed("displaced")
        closing = asyncio.get_running_loop().create_task(ws.close(CLOSE_TRY_AGAIN, "server full: displaced by a fair share"))
        self._closing.add(closing)   # held until done: the loop keeps only weak references to tasks
        closing.add_done_callback(self._closing.discard)
        return True

    def _forget_unauthenticated(self, address: str, ws: ServerConnection) -> None:
        waiting = self.unauthenticated.get(address)
        if waiting is not None:
            waiting.pop(ws, None)
            if not waiting:
                del self.unauthenticated[address]

    def _count_closed(self, address: str) -> None:
        self.open_by_address[address] -= 1
        if not self.open_by_address[address]:
            del self.open_by_address[address]

    def _screen(self, connection: ServerConnection, request: Any) -> Any:
        """Before the WebSocket upgrade: refuse over the connection limits with HTTP 503, which costs less than
        upgrading and closing (`handle` checks again, and closes with 1013: connections upgrading at once all
        pass here)."""
        refusal = self._refusal(_peer(connection))
        if refusal is None:
            return None
        self.metrics.closed("connection_limit")
        return connection.respond(503, refusal + "\n")

    def _deadline(self, conn: "_Connection") -> tuple[float | None, int, str]:
        """How long the next message may take: a new connection has until its HELLO deadline; a device holding
        the model in a U-turn, until its lock timeout counted from when it took the lock (other messages do
        not re-arm it)."""
        if conn.session.device_id is None:
            limit = self.config.limits.hello_timeout_s
            return limit - (time.monotonic() - conn.opened), CLOSE_POLICY, f"no hello within {limit:g} s"
        if conn.holds_lock:
            limit = self.config.pending_timeout_s
            return (limit - (time.monotonic() - conn.lock_taken), CLOSE_TIMEOUT,
                    f"embedding gradient not received within {limit:g} s")
        return None, 0, ""

    async def handle(self, ws: ServerConnection) -> None:
        address = _peer(ws)
        refusal = self._refusal(address)
        if refusal:
            log.warning("refused a connection from %s: %s", address, refusal)
            self.metrics.closed("connection_limit")
            await ws.close(CLOSE_TRY_AGAIN, refusal)
            return
        self.open_by_address[address] += 1
        authenticate = throttled(self.authenticate, self.auth_throttle, address)
        # metrics.epsilon: each device's last reported spent epsilon, the gauge's figures and checkpointed with them
        conn = _Connection(ws, ServerSession(self.info, authenticate, self.records, self.durable_through, self.board,
                                             self.relay, epsilon=self.metrics.epsilon, heads=self.heads,
                                             gradient_rounding=self.config.gradient_rounding))
        self.unauthenticated.setdefault(address, {})[ws] = conn
        session = conn.session
        rate = RateLimit(self.config.limits.message_rate, self.config.limits.message_burst)
        try:
            while True:
                timeout, code, reason = self._deadline(conn)
                try:
                    data = await asyncio.wait_for(receive(ws), timeout)   # on a timeout the connection is closed
                except TimeoutError:
                    log.warning("%s from %s: %s; closing", session.device_id or "connection", address, reason)
                    self.metrics.closed("hello_timeout" if code == CLOSE_POLICY else "lock_timeout")
                    await ws.close(code, reason)
                    break
                await rate.take()
                action = session.receive(data)
                if isinstance(action, Reply) and (code := _error_code(action.data)):
                    self.metrics.error(code)
                if session.device_id:
                    self.metrics.traffic(session.device_id, bytes_in=len(data))
                reply = await self._perform(conn, action)
                await send_fragments(ws, reply)
                if session.device_id:
                    self.metrics.traffic(session.device_id, bytes_out=message_size(reply))
                if conn.applied_step:
                    if self._fault_due("crash-after-batch", conn.applied_step):
                        await _drained(ws)  # the reply has left this process: the device will get it
                        crash(f"server {self.config.fault}")
                    conn.applied_step = 0
                if isinstance(action, Reply) and action.close:
                    self.metrics.closed("protocol_error")
                    await ws.close(CLOSE_POLICY, "protocol error")
                    break
        except ConnectionClosed:
            pass
        finally:
            session.close()
            if conn.holds_lock:
                self._release(conn)
            if session.device_id and self.connections.get(session.device_id, (None,))[0] is ws:
                del self.connections[session.device_id]
                self.away_since[session.device_id] = time.monotonic()
            self._forget_unauthenticated(address, ws)
            if not conn.displaced:
                self._count_closed(address)
            if rate.held:
                log.info("%s from %s: %d messages held back by the rate limit", session.device_id, address, rate.held)
            conn.done.set()

    async def _perform(self, conn: "_Connection", action: Action) -> Message:
        """Carry out one action and return the reply: bytes, or a BACKWARD's parts (ServerSession.applied_parts)."""
        session = conn.session
        if isinstance(action, Reply):
            return action.data
        if isinstance(action, Admit):
            conn.ws.protocol.max_message_size = self.info.max_message_bytes  # authenticated: the announced limit
            self._forget_unauthenticated(_peer(conn.ws), conn.ws)          # no longer displaceable
            if self.config.limits.message_timeout_s and hasattr(conn.ws, "message_timeout_s"):
                conn.ws.message_timeout_s = self.config.limits.message_timeout_s   # splitface/net/fastws.py
            await self._admit(action.device_id, conn.ws, conn.done)
            self.metrics.sessions += 1
            if session.mode == "federated":
                log.info("%s connected (federated)", action.device_id)
            else:
                log.info("%s connected (%s head), resume from batch %d", action.device_id, session.head,
                         session.record.last_applied + 1)
            return session.welcome()
        if isinstance(action, Embed) and not action.eval:
            # The U-turn starts: hold the model until this device's embedding gradient arrives.
            if not conn.holds_lock:
                await self.model_lock.acquire()
                conn.holds_lock = True
                conn.lock_taken = time.monotonic()
            reply, ok = await self._run(conn, action.batch_id, self._embed, session, action)
            if not ok:
                self._release(conn)
        elif isinstance(action, TrainTail):
            reply, _ = await self._run(conn, action.batch_id, self._train_tail, session, action)
            self._release(conn)
        elif conn.holds_lock:  # an eval batch in the middle of this device's own U-turn
            reply, _ = await self._run(conn, action.batch_id, self._work, session, action)
        else:
            async with self.model_lock:
                reply, _ = await self._run(conn, action.batch_id, self._work, session, action)
        return reply

    def _release(self, conn: "_Connection") -> None:
        self.trainer.drop_pending()
        conn.holds_lock = False
        self.model_lock.release()

    async def _run(self, conn: "_Connection", batch_id: int, fn: Callable, *args: Any) -> tuple[Message, bool]:
        """Run compute in the worker thread (the caller holds the model lock): (reply, True), or an ERROR and
        False when it raised (nothing applied): a refused step gets its own code, anything else `server_error`
        (logged with its trace). A training step is checkpointed here, before its reply is sent, when it
        completes --checkpoint-every-batches."""
        session = conn.session
        start = time.perf_counter()
        try:
            reply, n, loss, n_correct, train = await self._compute(fn, *args)
        except StepRefused as exc:
            log.warning("%s: batch %d refused: %s", session.device_id, batch_id, exc.message)
            session.failed(batch_id, exc.message)  # forgets a pending device-head batch
            self.metrics.error(exc.code.value)
            return m.encode(m.error(exc.code, exc.message, batch_id)), False
        except Exception:
            log.exception("%s: batch %d failed", session.device_id, batch_id)
            self.metrics.error("server_error")
            return session.failed(batch_id, "the server failed on this batch; it was not applied"), False
        if train:
            self.metrics.batch(session.device_id, n, time.perf_counter() - start, loss, n_correct)
            self._batches_since_checkpoint += 1
            if 0 < self.config.checkpoint_every_batches <= self._batches_since_checkpoint:
                await self._checkpoint_locked()
            conn.applied_step = self.trainer.steps
            if self._fault_due("crash-between-apply-and-reply", conn.applied_step):
                crash(f"server {self.config.fault}")
        return reply, True

    def _fault_due(self, kind: str, step: int) -> bool:
        fault = self.config.fault
        return fault is not None and fault.kind == kind and fault.at == step

    # Compute, in the worker thread. Each returns (reply, samples, loss, n_correct, was_training); the
    # replies carry server_s, the server's compute time, so a device can split its round trip.
    def _work(self, session: ServerSession, action: Train | Evaluate | Embed) -> tuple:
        start = time.perf_counter()
        if isinstance(action, Train):
            grad, loss, n_correct = self.trainer.train_server_head(action.activations, action.labels)
            # sent from the gradient's own buffer: the trainer returns a fresh array per step (applied_parts)
            reply = session.applied_parts(action.batch_id, grad, loss, n_correct, server_s=time.perf_counter() - start)
            if self.recorder:
                self.recorder.record(session.device_id, action.batch_id, action.activations, action.labels)
            return reply, len(grad), loss, n_correct, True
        if isinstance(action, Evaluate):
            loss, n_correct = self.trainer.evaluate(action.activations, action.labels)
            n = len(action.labels)
            return session.eval_result(action.batch_id, loss, n_correct, n), n, None, None, False
        embeddings = self.trainer.embed(action.activations, train=False)
        reply = session.embedded(action.batch_id, embeddings, eval=True, server_s=time.perf_counter() - start)
        return reply, len(embeddings), None, None, False

    def _embed(self, session: ServerSession, action: Embed) -> tuple:
        start = time.perf_counter()
        embeddings = self.trainer.embed(action.activations, train=True)
        if self.recorder:
            self.recorder.record(session.device_id, action.batch_id, action.activations, None)
        return session.embedded(action.batch_id, embeddings, server_s=time.perf_counter() - start), len(embeddings), \
            None, None, False

    def _train_tail(self, session: ServerSession, action: TrainTail) -> tuple:
        start = time.perf_counter()
        grad = self.trainer.train_tail(action.grad)
        if self.recorder:
            self.recorder.record_embedding_grad(session.device_id, action.batch_id, action.grad)
        return session.applied_parts(action.batch_id, grad, server_s=time.perf_counter() - start), len(grad), None, \
            None, True


async def _drained(ws: ServerConnection, within_s: float = 10.0) -> None:
    """Wait until the connection's write buffer is handed to the kernel (it then sends it even if this
    process exits at once)."""
    deadline = time.monotonic() + within_s
    while ws.transport.get_write_buffer_size() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def _peer(connection: ServerConnection) -> str:
    """The peer's IP address: the key of the per-address limits."""
    return str(connection.remote_address[0]) if connection.remote_address else "?"


def _error_code(reply: Message) -> str | None:
    """The code of an ERROR the session built (errors are small `bytes`: larger replies and parts are not decoded)."""
    if not isinstance(reply, bytes) or len(reply) > 4096:
        return None
    try:
        message = msgpack.unpackb(reply)
    except ValueError:
        return None
    return message.get("code") if isinstance(message, dict) and message.get("type") == m.ERROR else None


class ServerThread:
    """An EdgeServer in its own event loop on a background thread: for tests, benchmarks and
    notebooks that drive devices from the calling thread. Use as a context manager."""

    def __init__(self, server: EdgeServer):
        self.server = server
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _main(self) -> None:
        async def go() -> None:
            self._loop = asyncio.get_running_loop()
            await self.server.run(on_ready=lambda port: self._ready.set())
        asyncio.run(go())

    @property
    def trainer(self) -> ServerTrainer | None:
        return self.server.trainer

    def call(self, coroutine: Any) -> Any:
        """Run a coroutine on the server's event loop (where sessions and the round board live) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def url(self) -> str:
        return f"{'wss' if self.server.ssl else 'ws'}://{self.server.config.host}:{self.server.port}"

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("edge server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop (the server checkpoints on the way out); safe to call twice."""
        if self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(self.server.stop)
            self._thread.join(120)
