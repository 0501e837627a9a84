"""The websocket backend (`--backend websocket`): each round published on the edge server's `RoundBoard` and
trained by real device processes over the protocol's round messages (SPEC.md section 15).

Virtual client c is the device `client-<c>` (`client_device_id`); it holds that client's photos itself. A
round opens with the sampled devices and their seeds, and closes when `quorum` of them have uploaded or at its
deadline; a device that has not uploaded by then is left out of the round (None to the round logic). The
accepted uploads come back in task order, so the round logic sums them in the order the in-process backend
does and the global model is the same (docs/federated.md says which equality holds).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from splitface.device.federated import ClientResult
from splitface.device.federated.wire import config_to_wire, state_to_wire, upload_shapes
from splitface.common.models import ModelSpec
from splitface.protocol import messages as m
from splitface.protocol.round_board import RoundBoard
from splitface.protocol.server_session import ServerInfo

from splitface.server.app import EdgeServer, ServerConfig, ServerThread
from splitface.server.auth import TokenAuthenticator
from research.federated.tasks import ClientTask


def client_device_id(client: int) -> str:
    """The device id that serves virtual client `client`."""
    return f"client-{client}"


def federated_only_info(spec: ModelSpec, max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES) -> ServerInfo:
    """ServerInfo of a server that hosts no split training (split HELLOs are answered `unsupported`)."""
    return ServerInfo(model=spec.to_dict(), split="", activation_shape=(), embedding_dim=spec.embedding_dim,
                      num_classes=0, max_batch=0, max_message_bytes=max_message_bytes, heads=())


def federated_server(spec: ModelSpec, digests: dict[str, str], run_dir: Path, completed: int = 0,
                     host: str = "127.0.0.1", port: int = 0, retry_after_s: float = 0.5,
                     **config: Any) -> ServerThread:
    """An edge server hosting the federated run only, in a background thread (start it with `with`).
    `digests`: the device tokens' digests (splitface.server.auth); `completed`: the run's last checkpointed round."""
    info = federated_only_info(spec)
    board = RoundBoard(spec.to_dict(), completed=completed, retry_after_s=retry_after_s,
                       max_message_bytes=info.max_message_bytes)
    return ServerThread(EdgeServer(None, info, TokenAuthenticator(digests),
                                   ServerConfig(host=host, port=port, run_dir=run_dir, **config), board=board))


class ServedLoop:
    """What WebsocketBackend drives (ServerThread's `server`, `call` and `url`) for an EdgeServer running on an
    event loop the caller does not own: `splitface-server serve`, whose server keeps the main thread (and its
    signals) while the round logic runs on a thread of its own."""

    def __init__(self, server: EdgeServer, loop: asyncio.AbstractEventLoop):
        self.server, self.loop = server, loop

    def call(self, coroutine: Any) -> Any:
        """Run a coroutine on the server's loop (where the board lives) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    @property
    def url(self) -> str:
        return f"{'wss' if self.server.ssl else 'ws'}://{self.server.config.host}:{self.server.port}"


class WebsocketBackend:
    """A round's clients trained by the devices connected to `server` (an EdgeServer with a board, on a
    ServerThread or a ServedLoop)."""

    def __init__(self, server: ServerThread | ServedLoop, quorum: float = 1.0, deadline_s: float = 600.0):
        if not 0 < quorum <= 1 or not deadline_s > 0:
            raise ValueError(f"quorum must be in (0, 1] and deadline_s > 0, got {quorum}, {deadline_s}")
        if server.server.board is None:
            raise ValueError("the server hosts no federated rounds (no RoundBoard)")
        self.server, self.board = server, server.server.board
        self.quorum, self.deadline_s = quorum, deadline_s
        self.url = server.url

    def __call__(self, tasks: Sequence[ClientTask]) -> list[ClientResult | None]:
        if not tasks:
            return []
        if not all(isinstance(t, ClientTask) for t in tasks):
            raise TypeError("the protocol's round messages carry ClientTasks only (the DP-FedEmb family's); "
                            "private-head methods run in process or on Ray")
        first = tasks[0]
        config, clip_norm = config_to_wire(first.config)
        head_shape = None if first.head_state is None else tuple(first.head_state["weight"].shape)
        seeds = {client_device_id(t.client): t.seed for t in tasks}
        round_args = dict(round_id=first.round, seeds=seeds, config=config, clip_norm=clip_norm,
                          upload_shapes=upload_shapes(first.spec, head_shape),
                          weights=state_to_wire(first.backbone_state),
                          head=None if first.head_state is None else state_to_wire(first.head_state),
                          quorum=math.ceil(self.quorum * len(tasks)), deadline_s=self.deadline_s)
        uploads = self.server.call(self._round(round_args))
        return [_result(uploads.get(client_device_id(t.client))) for t in tasks]

    async def _round(self, round_args: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """On the server's loop: open the round, wait for its quorum or deadline, close it."""
        done = asyncio.Event()
        self.board.on_complete = lambda _: done.set()
        self.board.open(**round_args)
        try:
            await asyncio.wait_for(done.wait(), self.deadline_s)
        except TimeoutError:
            pass
        return dict(self.board.close())

    def finish(self) -> None:
        """The run is over: devices asking for work are told so (and exit)."""
        async def finish() -> None:
            self.board.finish()
        self.server.call(finish())


def _result(upload: dict[str, Any] | None) -> ClientResult | None:
    if upload is None:
        return None
    delta = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in upload["delta"].items()}
    return ClientResult(delta, float(upload["norm"]), int(upload["examples"]), float(upload["loss"]))


@contextlib.contextmanager
def hosted_rounds(spec: ModelSpec, digests: dict[str, str], run_dir: Path, host: str = "127.0.0.1", port: int = 0,
                  quorum: float = 1.0, deadline_s: float = 600.0, drain_s: float = 10.0,
                  log: Callable[[str], None] = print, **config: Any) -> Iterator[WebsocketBackend]:
    """A federated edge server for the duration of a run, and its backend (`config`: more ServerConfig fields,
    e.g. tls_cert/tls_key). When the run ends normally the devices are told it is finished and given `drain_s`
    to hear it and disconnect before the server stops."""
    with federated_server(spec, digests, run_dir, host=host, port=port, **config) as server:
        log(f"federated rounds served at {server.url} (devices client-0, client-1, ...)")
        backend = WebsocketBackend(server, quorum, deadline_s)
        yield backend  # an exception (a crash) skips telling the devices: they reconnect to the next server
        backend.finish()
        until = time.monotonic() + drain_s
        while server.server.connections and time.monotonic() < until:
            time.sleep(0.1)


def launch_devices(url: str, spec: ModelSpec, clients: Sequence[tuple[np.ndarray, np.ndarray]], folder: Path,
                   tokens: dict[str, str], threads: int = 1) -> list[subprocess.Popen]:
    """One device process (`python -m splitface.device.federated`) per virtual client on this machine, each with
    its own photos in `folder/client-<c>.npz` and its token (`tokens`, by device id)."""
    folder.mkdir(parents=True, exist_ok=True)
    processes = []
    for c, (images, labels) in enumerate(clients):
        device_id = client_device_id(c)
        np.savez(folder / f"{device_id}.npz", images=images, labels=labels)
        (folder / f"{device_id}.token").write_text(tokens[device_id])
        os.chmod(folder / f"{device_id}.token", 0o600)
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "splitface.device.federated", "--url", url, "--device-id", device_id,
             "--token-file", str(folder / f"{device_id}.token"), "--data", str(folder / f"{device_id}.npz"),
             "--model", json.dumps(spec.to_dict()), "--threads", str(threads)],
            stdout=open(folder / f"{device_id}.log", "w"), stderr=subprocess.STDOUT))
    return processes
