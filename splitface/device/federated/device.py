"""A federated device: connects to the edge server in federated mode and trains the rounds it is sampled for.

The loop (SPEC.md section 15): HELLO (mode federated) -> ROUND_START or ROUND_WAIT; for a ROUND_START,
MODEL_REQUEST -> MODEL, then `train_client` (the very function the in-process and Ray backends call) on this
device's own photos, then UPDATE -> UPDATE_ACK; then ROUND_REQUEST again, until a ROUND_WAIT says the run is
finished. A dropped connection is re-opened with back-off; the update of a round is kept (its exact bytes)
until acknowledged, so a device that reconnects into the same round re-sends it instead of training again,
and a late one (round_closed) is simply left out of that round.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from splitface.common.compute import in_compute_thread
from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode, RemoteError
from splitface.protocol.client_session import FederatedClientSession
from splitface.net.transport import CLIENT_WS_OPTIONS, send_fragments

from splitface.net.reconnect import connect_with_backoff
from splitface.net.tls import tls_context
from splitface.common.models import ModelSpec, build_classifier
from splitface.device.federated.local_round import train_client
from splitface.device.federated.wire import backbone_template, config_from_wire, state_from_wire

log = logging.getLogger("splitface.federated.device")


class FederatedDevice:
    def __init__(self, url: str, device_id: str, token: str, spec: ModelSpec, images: np.ndarray, labels: np.ndarray,
                 ca_file: Path | None = None, insecure: bool = False, reconnect_timeout_s: float = 120.0,
                 leave_in_round: int | None = None):
        """`leave_in_round` (tests): in that round, drop the connection after downloading the model and give the
        round up (as a phone that goes offline mid-round): reconnect, but take part only from the next round."""
        self.ssl = tls_context(url, ca_file, insecure)
        self.url, self.spec = url, spec
        self.images, self.labels = images, labels
        self.session = FederatedClientSession(device_id, token, spec.to_dict())
        self.reconnect_timeout_s = reconnect_timeout_s
        self.leave_in_round = leave_in_round
        self._given_up: int | None = None  # a round this device left; it does not rejoin it
        self.trained: list[int] = []  # rounds whose update the server acknowledged
        self._ws: ClientConnection | None = None
        self._pending: tuple[int, bytes] | None = None  # (round, UPDATE bytes) not yet acknowledged

    async def _connect(self) -> dict[str, Any]:
        """Connect and send HELLO; returns the first ROUND_START or ROUND_WAIT. Retries with back-off."""
        async def attempt() -> dict[str, Any]:
            self._ws = await connect(self.url, max_size=m.DEFAULT_MAX_MESSAGE_BYTES, ssl=self.ssl, **CLIENT_WS_OPTIONS)
            await self._ws.send(self.session.hello())
            return self.session.receive(await self._ws.recv(), {m.ROUND_START, m.ROUND_WAIT})

        # an ERROR (unauthorised, wrong model) is not retried: retrying cannot help
        return await connect_with_backoff(attempt, url=self.url, name=self.session.device_id,
                                          timeout_s=self.reconnect_timeout_s, cleanup=self.close)

    async def _ask(self, data: bytes, expect: set[str], round_id: int | None = None) -> dict[str, Any]:
        await send_fragments(self._ws, data)
        return self.session.receive(await self._ws.recv(), expect, round_id)

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
            self._ws = None

    async def run(self) -> list[int]:
        """Take part until the server says the run is finished; returns the rounds this device contributed to."""
        reply = await self._connect()
        while True:
            try:
                reply = await self._step(reply)
                if reply is None:
                    await self.close()
                    return self.trained
            except (OSError, ConnectionClosed):
                log.info("%s: connection lost; reconnecting", self.session.device_id)
                await self.close()
                reply = await self._connect()

    async def _step(self, reply: dict[str, Any]) -> dict[str, Any] | None:
        """Act on one ROUND_START / ROUND_WAIT; returns the next one (None: the run is finished)."""
        if reply["type"] == m.ROUND_WAIT:
            if reply["finished"]:
                return None
            await asyncio.sleep(reply["retry_after_s"])
            return await self._ask(self.session.round_request(), {m.ROUND_START, m.ROUND_WAIT})
        round_id = reply["round_id"]
        if round_id == self._given_up:
            await asyncio.sleep(0.2)
            return await self._ask(self.session.round_request(), {m.ROUND_START, m.ROUND_WAIT})
        if self._pending is None or self._pending[0] != round_id:
            try:
                model = await self._ask(self.session.model_request(round_id), {m.MODEL}, round_id)
            except RemoteError as exc:
                if exc.code != ErrorCode.ROUND_CLOSED.value:
                    raise
                return await self._ask(self.session.round_request(), {m.ROUND_START, m.ROUND_WAIT})
            if self.leave_in_round == round_id:
                self._given_up = round_id
                await self.close()
                raise ConnectionError("left mid-round (test)")
            self._pending = (round_id, await in_compute_thread(self._train, reply, model))
        try:
            await self._ask(self._pending[1], {m.UPDATE_ACK}, round_id)
            self.trained.append(round_id)
        except RemoteError as exc:
            if exc.code != ErrorCode.ROUND_CLOSED.value:
                raise
            log.info("%s: round %d closed before its update arrived; left out", self.session.device_id, round_id)
        self._pending = None
        return await self._ask(self.session.round_request(), {m.ROUND_START, m.ROUND_WAIT})

    def _train(self, start: dict[str, Any], model: dict[str, Any]) -> bytes:
        """train_client on this device's photos from the downloaded model; the UPDATE bytes."""
        backbone = state_from_wire(model["weights"], backbone_template(self.spec))
        head = None
        if "head" in model:
            classes = model["head"]["weight"].shape[0]
            with torch.random.fork_rng():
                like = build_classifier(self.spec, classes).state_dict()
            head = state_from_wire(model["head"], like)
        result = train_client(self.spec, backbone, self.images, self.labels,
                              config_from_wire(start["config"], start.get("clip_norm")), start["seed"], head)
        delta = {k: v.detach().numpy() for k, v in result.delta.items()}
        return self.session.update(start["round_id"], delta, result.norm, result.examples, result.loss)
