"""Shared fixtures: the real LFW copy and an in-process edge server on loopback."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from device_sdk.models import resolve_spec
from edge_server.app import EdgeServer, ServerConfig, server_info
from edge_server.auth import TokenAuthenticator, hash_token
from edge_server.trainer import ServerTrainer, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
LFW = ROOT.parent / "shared" / "data" / "lfw"
TOKENS = {"device-0": "token-zero", "device-1": "token-one", "device-2": "token-two"}


@pytest.fixture(scope="session")
def lfw() -> Path:
    if not (LFW / "images").is_dir():
        pytest.skip(f"LFW not found at {LFW}")
    return LFW


class ServerThread:
    """An EdgeServer running in its own event loop in a background thread."""

    def __init__(self, trainer: ServerTrainer, run_dir: Path, max_batch: int = 64, max_message_bytes: int = 64 << 20,
                 **config):
        self.trainer = trainer
        info = server_info(trainer, max_batch, max_message_bytes)
        self.server = EdgeServer(trainer, info, TokenAuthenticator({d: hash_token(t) for d, t in TOKENS.items()}),
                                 ServerConfig(port=0, run_dir=run_dir, **config))
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def go() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.run(on_ready=lambda port: self._ready.set())
        asyncio.run(go())

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.port}"

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        assert self._ready.wait(30), "server did not start"
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.stop)
            self._thread.join(60)


def small_trainer(num_classes: int = 5, model: str = "vgg_face_small", **kw) -> ServerTrainer:
    return ServerTrainer(resolve_spec(model), "conv1", num_classes, TrainConfig(**kw))
