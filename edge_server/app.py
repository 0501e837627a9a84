"""The asyncio websocket shell around the sans-I/O protocol and the shared trainer.

One model lock serialises all compute on the shared model. In the device-head flow a
device holds the lock from its FORWARD until its EMBEDDING_GRAD (the tail's graph must
not see a step in between), with a timeout so a silent device cannot stall the others.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from device_sdk.models import activation_shape
from protocol.session import (
    Action,
    Admit,
    Authenticator,
    DeviceRecord,
    Embed,
    Evaluate,
    Reply,
    ServerInfo,
    ServerSession,
    Train,
    TrainTail,
)

from protocol import messages as m

from .checkpoint import NonFiniteState, load_checkpoint, save_checkpoint
from .metrics import Metrics
from .recorder import Recorder
from .trainer import ServerTrainer, StepRefused

log = logging.getLogger("splitface.server")

CLOSE_POLICY = 1008
CLOSE_REPLACED = 4000
CLOSE_TIMEOUT = 4001


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    run_dir: Path = Path("runs/server")
    checkpoint_every_s: float = 30.0
    checkpoint_every_batches: int = 0     # 0: time-based only
    log_every_s: float = 10.0
    pending_timeout_s: float = 60.0
    record_max: int = 0                   # > 0: keep up to this many received training samples per device (audit)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

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
    holds_lock: bool = False
    lock_taken: float = 0.0               # monotonic time the U-turn took the model lock
    done: asyncio.Event = field(default_factory=asyncio.Event)


class EdgeServer:
    def __init__(self, trainer: ServerTrainer, info: ServerInfo, authenticate: Authenticator, config: ServerConfig):
        self.trainer, self.info, self.authenticate, self.config = trainer, info, authenticate, config
        self.records: dict[str, DeviceRecord] = {}
        self.durable: dict[str, int] = {}
        self.metrics = Metrics()
        self.recorder = Recorder(config.recordings_dir, config.record_max) if config.record_max > 0 else None
        self.model_lock = asyncio.Lock()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.connections: dict[str, tuple[ServerConnection, asyncio.Event]] = {}
        self._batches_since_checkpoint = 0
        self._stop = asyncio.Event()
        self.port: int | None = None
        self._restore()

    # ---- checkpoints -------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {"model": self.info.model, "split": self.info.split, "num_classes": self.info.num_classes}

    def _restore(self) -> None:
        state = load_checkpoint(self.config.checkpoint_path)
        if state is None:
            return
        if state["identity"] != self._identity():
            raise SystemExit(f"{self.config.checkpoint_path} was written for {state['identity']}, "
                             f"not {self._identity()}; use another --run-dir")
        self.trainer.load_state_dict(state["trainer"])
        self.records = {d: DeviceRecord(r["last_applied"], r["last_reply"]) for d, r in state["devices"].items()}
        self.durable = {d: r.last_applied for d, r in self.records.items()}
        log.info("resumed from %s at server step %d (%s)", self.config.checkpoint_path, self.trainer.steps,
                 ", ".join(f"{d}@{r.last_applied}" for d, r in sorted(self.records.items())) or "no devices")

    async def checkpoint(self) -> None:
        """Consistent snapshot: taken under the model lock, so no step or U-turn is half done."""
        async with self.model_lock:
            devices = {d: {"last_applied": r.last_applied, "last_reply": r.last_reply} for d, r in self.records.items()}
            state = {"identity": self._identity(), "trainer": self.trainer.state_dict(), "devices": devices,
                     "saved_at": time.time()}
            try:
                await self._compute(save_checkpoint, self.config.checkpoint_path, state)
            except NonFiniteState as exc:
                log.error("%s", exc)
                return
            if self.recorder:
                await self._compute(self.recorder.flush)
            self.durable = {d: r["last_applied"] for d, r in devices.items()}
            self._batches_since_checkpoint = 0
        log.info("checkpoint at server step %d", self.trainer.steps)

    def durable_through(self, device_id: str) -> int:
        return self.durable.get(device_id, 0)

    # ---- serving -----------------------------------------------------------------------
    async def _compute(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self, on_ready: Callable[[int], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        async with serve(self.handle, self.config.host, self.config.port, max_size=self.info.max_message_bytes,
                         compression=None, max_queue=4, write_limit=2 ** 24, ping_interval=30,
                         ping_timeout=120) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            log.info("listening on ws://%s:%d", self.config.host, self.port)
            if on_ready:
                on_ready(self.port)
            housekeeping = asyncio.create_task(self._housekeeping())
            await self._stop.wait()
            housekeeping.cancel()
            server.close(close_connections=True)
            await server.wait_closed()
        await self.checkpoint()
        self.metrics.write(self.config.metrics_path)
        log.info("stopped: %s", self.metrics.line())
        self.executor.shutdown()

    def stop(self) -> None:
        self._stop.set()

    async def _housekeeping(self) -> None:
        last_ckpt = last_log = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            due_batches = 0 < self.config.checkpoint_every_batches <= self._batches_since_checkpoint
            if self._batches_since_checkpoint and (due_batches or now - last_ckpt >= self.config.checkpoint_every_s):
                await self.checkpoint()
                last_ckpt = now
            if now - last_log >= self.config.log_every_s:
                log.info("%s", self.metrics.line())
                self.metrics.write(self.config.metrics_path)
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

    async def handle(self, ws: ServerConnection) -> None:
        conn = _Connection(ws, ServerSession(self.info, self.authenticate, self.records, self.durable_through))
        session = conn.session
        try:
            while True:
                try:
                    timeout = self.config.pending_timeout_s if conn.holds_lock else None
                    data = await asyncio.wait_for(ws.recv(), timeout)
                except TimeoutError:
                    log.warning("%s: no embedding gradient within %.0fs; dropping its batch", session.device_id,
                                self.config.pending_timeout_s)
                    await ws.close(CLOSE_TIMEOUT, "embedding gradient not received in time")
                    break
                action = session.receive(data)
                if session.device_id:
                    self.metrics.traffic(session.device_id, bytes_in=len(data))
                reply = await self._perform(conn, action)
                await ws.send(reply)
                if session.device_id:
                    self.metrics.traffic(session.device_id, bytes_out=len(reply))
                if isinstance(action, Reply) and action.close:
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
            conn.done.set()

    async def _perform(self, conn: "_Connection", action: Action) -> bytes:
        """Carry out one action and return the reply bytes."""
        session = conn.session
        if isinstance(action, Reply):
            return action.data
        if isinstance(action, Admit):
            await self._admit(action.device_id, conn.ws, conn.done)
            log.info("%s connected (%s head), resume from batch %d", action.device_id, session.head,
                     session.record.last_applied + 1)
            return session.welcome()
        if isinstance(action, Embed) and not action.eval:
            # The U-turn starts: hold the model until this device's embedding gradient arrives.
            if not conn.holds_lock:
                await self.model_lock.acquire()
                conn.holds_lock = True
                conn.lock_taken = time.monotonic()
            reply, ok = await self._run(session, action.batch_id, self._embed, session, action)
            if not ok:
                self._release(conn)
        elif isinstance(action, TrainTail):
            reply, _ = await self._run(session, action.batch_id, self._train_tail, session, action)
            self._release(conn)
        elif conn.holds_lock:  # an eval batch in the middle of this device's own U-turn
            reply, _ = await self._run(session, action.batch_id, self._work, session, action)
        else:
            async with self.model_lock:
                reply, _ = await self._run(session, action.batch_id, self._work, session, action)
        return reply

    def _release(self, conn: "_Connection") -> None:
        self.trainer.drop_pending()
        conn.holds_lock = False
        self.model_lock.release()

    async def _run(self, session: ServerSession, batch_id: int, fn: Callable, *args: Any) -> tuple[bytes, bool]:
        """Run compute in the worker thread: (reply, True), or an ERROR and False when it raised (nothing
        applied): a refused step gets its own code, anything else `server_error` (logged with its trace)."""
        start = time.perf_counter()
        try:
            reply, n, loss, n_correct, train = await self._compute(fn, *args)
        except StepRefused as exc:
            log.warning("%s: batch %d refused: %s", session.device_id, batch_id, exc.message)
            session.failed(batch_id, exc.message)  # forgets a pending device-head batch
            return m.encode(m.error(exc.code, exc.message, batch_id)), False
        except Exception:
            log.exception("%s: batch %d failed", session.device_id, batch_id)
            return session.failed(batch_id, "the server failed on this batch; it was not applied"), False
        if train:
            self.metrics.batch(session.device_id, n, time.perf_counter() - start, loss, n_correct)
            self._batches_since_checkpoint += 1
        return reply, True

    # Compute, in the worker thread. Each returns (reply, samples, loss, n_correct, was_training); the
    # replies carry server_s, the server's compute time, so a device can split its round trip.
    def _work(self, session: ServerSession, action: Train | Evaluate | Embed) -> tuple:
        start = time.perf_counter()
        if isinstance(action, Train):
            grad, loss, n_correct = self.trainer.train_server_head(action.activations, action.labels)
            reply = session.applied(action.batch_id, grad, loss, n_correct, server_s=time.perf_counter() - start)
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
        return session.applied(action.batch_id, grad, server_s=time.perf_counter() - start), len(grad), None, None, True


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
    def trainer(self) -> ServerTrainer:
        return self.server.trainer

    @property
    def url(self) -> str:
        return f"ws://{self.server.config.host}:{self.server.port}"

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
