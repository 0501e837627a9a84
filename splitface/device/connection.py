"""A device's connection to the edge server (a small client surface, in the spirit of Flower).

It survives dropped connections: it reconnects, learns from WELCOME what the server has
applied, re-sends the exact bytes of the batch in flight (the server answers a retry from
its cache instead of applying it twice), and rolls its own state back when the server
restarted from an older checkpoint.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from splitface.common.compute import in_compute_thread
from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode, RemoteError
from splitface.protocol.client_session import CannotResume, ClientSession, Resume, Rollback as RollbackTo
from splitface.net.transport import CLIENT_WS_OPTIONS, receive, reuse_large_buffers, send_fragments
from splitface.protocol.messages import Message, message_size

from splitface.common.faults import Fault, crash
from splitface.device.trainer import DeviceTrainer
from splitface.net.reconnect import connect_with_backoff
from splitface.net.tls import tls_context
from splitface.net.fastws import FastClientConnection
from splitface.device.meter import BatchCost, EnergyCounter, Stopwatch, peak_rss_bytes
from splitface.device.privacy.state import check_server_figure, spent_epsilon

log = logging.getLogger("splitface.device")


class ConnectionLost(Exception):
    pass


FAULT_ENV = "SPLITFACE_DEVICE_FAULTS"  # tests only: "device-1=crash-after-forward:3,device-2=drop-before-backward:2"


# The points of a training batch where a device fault can strike (both heads: after-forward, before-backward).
DEVICE_PHASES = ("after-forward", "after-embeddings", "after-embedding-grad", "before-backward")
DEVICE_FAULTS = tuple(f"{action}-{phase}" for action in ("drop", "crash") for phase in DEVICE_PHASES)


def device_faults(spec: str | None = None) -> dict[str, list[Fault]]:
    """Device faults by device id from `spec` (default: the SPLITFACE_DEVICE_FAULTS environment variable, so a
    test can fault the simulator's process): comma-separated `DEVICE_ID=KIND:N`."""
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    faults: dict[str, list[Fault]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        device_id, sep, fault = item.partition("=")
        if not sep or not device_id:
            raise ValueError(f"{FAULT_ENV}: {item!r} is not DEVICE_ID=KIND:N")
        faults.setdefault(device_id, []).append(Fault.parse(fault, DEVICE_FAULTS))
    return faults


class Rollback(Exception):
    """The server restarted from a checkpoint; the device went back to `batch_id`."""

    def __init__(self, batch_id: int):
        super().__init__(f"server resumed from its checkpoint; device rolled back to batch {batch_id}")
        self.batch_id = batch_id


@dataclass
class Traffic:
    sent: int = 0
    received: int = 0
    reconnects: int = 0
    round_trip_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class BatchResult:
    batch_id: int
    n: int
    loss: float
    n_correct: int
    device_s: float        # forward + head + backward + step on the device
    round_trip_s: float    # send to reply, server compute included
    bytes_sent: int
    bytes_received: int
    cost: BatchCost        # the same batch split into phases, for the cost meter


@dataclass
class PreparedBatch:
    """A training batch's FORWARD, made and counted by the privacy engine but not yet sent."""
    batch_id: int
    labels: np.ndarray
    message: list[m.Part]  # messages.encode_parts: the activations are sent from their own buffer, not copied
    watch: Stopwatch
    energy0: float | None
    traffic0: tuple[float, ...] = (0, 0, 0.0, 0.0)
    server_s: list[float] = field(default_factory=list)
    head: dict[str, Any] = field(default_factory=dict)


class DeviceClient:
    def __init__(self, url: str, device_id: str, token: str, engine: DeviceTrainer, batch_size: int,
                 encodings: dict[str, str] | None = None, reconnect_timeout_s: float = 120.0, server_retries: int = 3,
                 max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES, ca_file: Path | None = None,
                 insecure: bool = False, faults: list[Fault] | None = None):
        """`max_message_bytes`: the largest server message accepted (the spec's floor is 2^30, raised to the
        server's announced limit if that is larger); the client never accepts unbounded messages. `ca_file`:
        the CA certificates (PEM) trusted for a wss:// server; `insecure`: allow plain ws:// off loopback.
        `faults` (tests only; default: this device's entries in SPLITFACE_DEVICE_FAULTS) crash the process
        or drop the connection at an exact phase of a batch."""
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, not {max_message_bytes}")
        self.ssl = tls_context(url, ca_file, insecure)
        self.url = url
        self.max_message_bytes = max_message_bytes
        self.engine = engine
        # The engine's state (weights, pending releases, the accountant) is changed by a release made in a worker
        # thread and by a reconnect's rollback on the event loop; a pipelined device can do both at once. Every
        # use of the engine holds this lock, so each sees the other's effects whole.
        self._engine_lock = asyncio.Lock()
        self.session = ClientSession(device_id, token, engine.spec.to_dict(), engine.split, engine.head, batch_size,
                                     engine.num_classes if engine.head == "server" else None,
                                     dict(encodings or {"activations": "f32", "gradients": "f32"}),
                                     pack_patch=engine.spec.mask_patch if engine.spec.release == "mask" else None)
        self.reconnect_timeout_s = reconnect_timeout_s
        self.energy = EnergyCounter()
        self.server_retries = server_retries
        self.traffic = Traffic()
        self._ws: ClientConnection | None = None
        self._in_flight: int | None = None  # the training batch whose FORWARD is being sent and not yet answered
        self._eval_id = 0
        self.faults = list(device_faults().get(device_id, []) if faults is None else faults)
        for fault in self.faults:
            Fault.parse(str(fault), DEVICE_FAULTS)  # a bad kind fails here, not at its batch

    @property
    def device_id(self) -> str:
        return self.session.device_id

    # ---- connection --------------------------------------------------------------------
    async def connect(self) -> None:
        """Connect and handshake, retrying until the server answers; then reconcile progress."""
        reuse_large_buffers()  # large tensors' buffers are reused, not page-faulted afresh (splitface/net/transport.py)

        async def attempt() -> dict[str, Any]:
            self._ws = await connect(self.url, max_size=self.max_message_bytes, ssl=self.ssl,
                                     create_connection=FastClientConnection, **CLIENT_WS_OPTIONS)
            await self._ws.send(self.session.hello())
            welcome = self.session.accept_welcome(await self._ws.recv())
            self._ws.protocol.max_message_size = max(self.max_message_bytes, self.session.max_message_bytes)
            return welcome

        # an ERROR (unauthorised, wrong model...) is not retried: retrying cannot help
        welcome = await connect_with_backoff(attempt, url=self.url, name=self.device_id,
                                             timeout_s=self.reconnect_timeout_s, cleanup=self.close)
        async with self._engine_lock:
            try:
                check_server_figure(self.device_id, self.engine.privacy.state_path,
                                    spent_epsilon(self.engine.privacy.guard), welcome.get("spent_epsilon"))
            except Exception:  # LostPrivacyState: it stops here instead of spending its budget again (SPEC 5.11)
                await self.close()
                raise
            try:
                decision = self.session.reconcile(self.engine.committed, self._in_flight)
            except CannotResume as exc:
                await self.close()
                raise RuntimeError(f"{self.device_id}: {exc.message}: {self._why_not(exc)}") from exc
            self._act_on(decision)

    def _spent(self) -> float | None:
        """This device's spent epsilon with the release just made counted; None without a formal mechanism."""
        spent = spent_epsilon(self.engine.privacy.guard)
        return spent if math.isfinite(spent) else None

    def _why_not(self, exc: CannotResume) -> str:
        if exc.reason != "server_ahead":
            return "the server's WELCOME contradicts itself; this device cannot rejoin it"
        engine = self.engine
        where = (f"its training state {engine.progress.path} is older than the server's record (replaced by an "
                 f"older copy, or kept for another run)" if engine.progress is not None else
                 "it keeps no training state (no --state-dir), so a restarted device begins again at batch 0")
        return f"the device lost its state ({where}); it cannot rejoin this run"

    def _act_on(self, decision: Resume | RollbackTo) -> None:
        """Carry out the session's decision after WELCOME (SPEC.md sections 10, 11): a Resume needs nothing but the
        retry loop, which re-sends the batch in flight; a rollback restores the server's last applied batch."""
        engine = self.engine
        engine.forget_before(decision.forget_before)
        if isinstance(decision, Resume):
            return
        log.warning("%s: server resumed at batch %d, device was at %d: rolling back", self.device_id,
                    decision.batch_id, engine.committed)
        engine.rollback(decision.batch_id)
        raise Rollback(decision.batch_id)

    async def reconnect(self) -> None:
        self.traffic.reconnects += 1
        await self.close()
        await self.connect()

    async def close(self) -> None:
        if self._ws is not None:
            ws, self._ws = self._ws, None
            await ws.close()

    def _fault(self, phase: str, batch_id: int) -> None:
        """Fire an injected fault due at this phase of this training batch (tests only)."""
        for fault in self.faults:
            action, _, at_phase = fault.kind.partition("-")
            if at_phase != phase or fault.at != batch_id:
                continue
            self.faults.remove(fault)
            if action == "crash":
                crash(f"{self.device_id}: {fault}")
            log.warning("%s: fault injection: %s; aborting the connection", self.device_id, fault)
            if self._ws is not None:
                self._ws.transport.abort()  # no close frame: as if the network went away
            raise ConnectionLost(f"injected fault {fault}")

    async def request(self, data: Message, expect: set[str], batch_id: int, phase: str | None = None) -> dict[str, Any]:
        """Send `data`, return the validated reply. `phase` names the message for fault injection: the faults
        `*-after-<phase>` fire once it is sent and `*-before-backward` when a BACKWARD has arrived."""
        if self._ws is None:
            raise ConnectionLost("not connected")
        start = time.perf_counter()
        try:
            await send_fragments(self._ws, data)
            if phase:
                self._fault("after-" + phase, batch_id)
            reply = await receive(self._ws)   # assembled in its buffer, the tensor aligned (splitface/net/fastws.py)
        except (ConnectionClosed, OSError) as exc:
            raise ConnectionLost(str(exc)) from exc
        if phase and self.faults and m.decode(reply)["type"] == m.BACKWARD:
            self._fault("before-backward", batch_id)
        self.traffic.round_trip_s += time.perf_counter() - start
        self.traffic.sent += message_size(data)
        self.traffic.received += len(reply)
        start = time.perf_counter()
        try:
            return self.session.receive(reply, expect, batch_id)
        finally:
            self.traffic.decode_s += time.perf_counter() - start

    async def _with_retries(self, attempt) -> Any:
        """Run `attempt()` until it gets through: reconnect on a lost connection, retry a server failure."""
        failures = 0
        while True:
            try:
                return await attempt()
            except ConnectionLost as exc:
                log.info("%s: connection lost (%s); reconnecting", self.device_id, exc)
                await self.reconnect()  # may raise Rollback
            except RemoteError as exc:
                failures += 1
                if exc.code != ErrorCode.SERVER_ERROR.value or failures > self.server_retries:
                    raise

    # ---- training and evaluation --------------------------------------------------------
    async def train_batch(self, batch_id: int, images: np.ndarray, labels: np.ndarray,
                          image_ids: np.ndarray) -> BatchResult:
        """One training batch; raises BudgetExceeded (nothing sent) if the release would overspend."""
        prepared = await self.prepare_batch(batch_id, images, labels, image_ids)
        return await self.commit_batch(prepared, await self.send_batch(prepared))

    async def prepare_batch(self, batch_id: int, images: np.ndarray, labels: np.ndarray,
                            image_ids: np.ndarray) -> PreparedBatch:
        """The batch's release, encoded, not yet sent (a pipelined device makes it while the previous batch is
        at the server); raises BudgetExceeded, with nothing sent, if the release would overspend."""
        engine = self.engine
        watch = Stopwatch()
        energy0 = self.energy.read_joules()
        async with self._engine_lock:
            with watch("forward"):
                activations = await in_compute_thread(engine.forward, images, ("train", batch_id), image_ids, labels)
            with watch("encode"):
                forward = self.session.forward_parts(batch_id, activations,
                                                     labels if engine.head == "server" else None,
                                                     spent_epsilon=self._spent(), integer_step=engine.integer_step)
        return PreparedBatch(batch_id, labels, forward, watch, energy0)

    async def send_batch(self, prepared: PreparedBatch) -> dict[str, Any]:
        """Send the prepared FORWARD (with the device head's step if the server answers with embeddings) and
        return the BACKWARD, retrying across reconnects; the device's state does not change here."""
        engine, batch_id, watch = self.engine, prepared.batch_id, prepared.watch
        prepared.traffic0 = (self.traffic.sent, self.traffic.received, self.traffic.round_trip_s,
                             self.traffic.decode_s)

        async def attempt() -> dict[str, Any]:
            prepared.server_s.clear()
            reply = await self.request(prepared.message, {m.BACKWARD, m.EMBEDDINGS}, batch_id, "forward")
            if reply["type"] == m.EMBEDDINGS:
                self._fault("after-embeddings", batch_id)
                prepared.server_s.append(reply.get("server_s", math.nan))
                with watch("head"):
                    grad, prepared.head["loss"], prepared.head["n_correct"] = await in_compute_thread(
                        engine.head_step, reply["embeddings"], prepared.labels, batch_id)
                with watch("encode"):
                    message = self.session.embedding_grad(batch_id, grad)
                reply = await self.request(message, {m.BACKWARD}, batch_id, "embedding-grad")
            elif engine.head == "device" and not prepared.head:
                # BACKWARD alone: the server had applied this batch before this (restarted) device committed it;
                # its head step is the one it kept on disk before sending the EMBEDDING_GRAD
                prepared.head["loss"], prepared.head["n_correct"] = engine.kept_head_step(batch_id)
            prepared.server_s.append(reply.get("server_s", math.nan))
            return reply

        self._in_flight = batch_id
        try:
            return await self._with_retries(attempt)
        finally:
            self._in_flight = None

    async def commit_batch(self, prepared: PreparedBatch, backward: dict[str, Any]) -> BatchResult:
        """Apply the batch's BACKWARD on the device and account for what the batch cost."""
        engine, watch, traffic0 = self.engine, prepared.watch, prepared.traffic0
        async with self._engine_lock:
            with watch("backward"):
                await in_compute_thread(engine.commit, prepared.batch_id, backward["grad"], backward["durable_through"])
        loss = backward.get("loss", prepared.head.get("loss"))
        n_correct = backward.get("n_correct", prepared.head.get("n_correct"))
        t = watch.seconds
        energy1 = self.energy.read_joules()
        round_trip = self.traffic.round_trip_s - traffic0[2]
        sent, received = self.traffic.sent - traffic0[0], self.traffic.received - traffic0[1]
        server_total = sum(prepared.server_s)
        energy0 = prepared.energy0
        cost = BatchCost(forward_s=t["forward"], backward_s=t["backward"] + t.get("head", 0.0),
                         serialise_s=t["encode"] + self.traffic.decode_s - traffic0[3], round_trip_s=round_trip,
                         server_s=None if math.isnan(server_total) else server_total, bytes_sent=sent,
                         bytes_received=received, peak_rss_bytes=peak_rss_bytes(),
                         energy_j=None if energy0 is None or energy1 is None else energy1 - energy0)
        device_s = t["forward"] + t.get("head", 0.0) + t["backward"]
        return BatchResult(prepared.batch_id, len(prepared.labels), float(loss), int(n_correct), device_s, round_trip,
                           sent, received, cost)

    async def evaluate_batch(self, images: np.ndarray, labels: np.ndarray, image_ids: np.ndarray,
                             release: tuple) -> tuple[float, int]:
        """(summed loss, correct) on a batch; changes no model state, but is a counted release."""
        engine = self.engine
        async with self._engine_lock:
            activations = await in_compute_thread(engine.evaluate_release, images, release, image_ids, labels)
            self._eval_id += 1
            eval_id = self._eval_id
            message = self.session.forward_parts(eval_id, activations, labels if engine.head == "server" else None,
                                                 eval=True, spent_epsilon=self._spent(),
                                                 integer_step=engine.integer_step)
        reply = await self._with_retries(lambda: self.request(message, {m.EVAL_RESULT, m.EMBEDDINGS}, eval_id))
        if reply["type"] == m.EVAL_RESULT:
            return reply["loss"] * reply["n"], reply["n_correct"]
        loss, n_correct = await in_compute_thread(engine.classify, reply["embeddings"], labels)
        return loss * len(labels), n_correct
