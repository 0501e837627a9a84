"""splitface/net/reconnect.py against real websockets servers on loopback: a server that refuses (HTTP 503, or
nothing listening yet) and then accepts is reached; a deadline or an attempt limit ends the tries with
ConnectionError; an untrusted certificate and the server's ERROR are never retried."""
from __future__ import annotations

import asyncio
import random
import socket
import ssl
import time
from http import HTTPStatus

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from splitface.net.reconnect import Backoff, connect_with_backoff
from splitface.net.tls import UntrustedServer
from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode, RemoteError
from splitface.protocol.vectors import generate as gen

FAST = Backoff(first_s=0.05, factor=2.0, max_s=0.2, jitter=0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dialer:
    """An attempt as a device makes it: open, send HELLO, return the server's first reply (decoded by the client
    session, so an ERROR raises RemoteError); counts its attempts and closes what a failed one opened."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None):
        self.url, self.ssl = url, ssl_context
        self.session = gen.client("server")
        self.ws = None
        self.attempts = self.cleanups = 0

    async def attempt(self) -> dict:
        self.attempts += 1
        self.ws = await connect(self.url, ssl=self.ssl, open_timeout=5)
        await self.ws.send(self.session.hello())
        return self.session.receive(await self.ws.recv(), set(m.SCHEMA))

    async def cleanup(self) -> None:
        self.cleanups += 1
        if self.ws is not None:
            ws, self.ws = self.ws, None
            await ws.close()

    async def dial(self, **kw) -> dict:
        kw.setdefault("backoff", FAST)
        try:
            return await connect_with_backoff(self.attempt, url=self.url, name="phone-01", cleanup=self.cleanup, **kw)
        finally:
            await self.cleanup()


async def welcome_everyone(ws) -> None:
    await ws.recv()
    await ws.send(gen.server(gen.client("server")).welcome())
    await ws.wait_closed()


def test_a_server_that_refuses_then_accepts_is_reached():
    """HTTP 503 (a full server) twice, then the handshake goes through: three attempts, the WELCOME returned."""
    handshakes = []

    def busy_at_first(connection, request):
        handshakes.append(time.monotonic())
        if len(handshakes) <= 2:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "full\n")
        return None

    async def scenario():
        async with serve(welcome_everyone, "127.0.0.1", 0, process_request=busy_at_first) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            dialer = Dialer(f"ws://127.0.0.1:{port}")
            reply = await dialer.dial(timeout_s=10)
            return dialer, reply

    dialer, reply = asyncio.run(scenario())
    assert reply["type"] == m.WELCOME
    assert dialer.attempts == 3 and len(handshakes) == 3
    gaps = [b - a for a, b in zip(handshakes, handshakes[1:])]
    assert gaps[0] >= 0.045 and gaps[1] >= 0.095   # 0.05 s, then doubled


def test_a_server_not_yet_listening_is_reached_once_it_starts():
    """Connection refused (nothing on the port) until the server starts 0.3 s later."""
    port = free_port()

    async def scenario():
        dialer = Dialer(f"ws://127.0.0.1:{port}")
        task = asyncio.create_task(dialer.dial(timeout_s=10))
        await asyncio.sleep(0.3)
        assert not task.done() and dialer.attempts >= 2   # refused so far, still trying
        async with serve(welcome_everyone, "127.0.0.1", port):
            reply = await asyncio.wait_for(task, 10)
        return dialer, reply

    dialer, reply = asyncio.run(scenario())
    assert reply["type"] == m.WELCOME and dialer.cleanups >= dialer.attempts


def test_the_deadline_ends_the_tries():
    """Nothing ever listens: ConnectionError once the deadline has passed, not a back-off step later."""
    port = free_port()
    dialer = Dialer(f"ws://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"phone-01: cannot reach ws://127.0.0.1:{port} after \d+ attempts") as exc:
        asyncio.run(dialer.dial(timeout_s=0.5, backoff=Backoff(first_s=0.05, factor=2, max_s=0.4, jitter=0)))
    took = time.monotonic() - start
    assert 0.5 <= took < 1.5, took
    assert isinstance(exc.value.__cause__, OSError) and dialer.attempts >= 3


def test_the_attempt_limit_ends_the_tries():
    port = free_port()
    dialer = Dialer(f"ws://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match="after 3 attempts"):
        asyncio.run(dialer.dial(timeout_s=None, attempts=3))
    assert dialer.attempts == 3 == dialer.cleanups - 1   # and the final close of dial()


def test_the_servers_error_is_not_retried():
    """An ERROR reply (here: unauthorized) raises at once: retrying cannot change it."""
    async def refuse(ws):
        await ws.recv()
        await ws.send(m.encode(m.error(ErrorCode.UNAUTHORIZED, "wrong token")))

    async def scenario():
        async with serve(refuse, "127.0.0.1", 0) as server:
            dialer = Dialer(f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}")
            with pytest.raises(RemoteError, match="unauthorized"):
                await dialer.dial(timeout_s=10)
            return dialer

    dialer = asyncio.run(scenario())
    assert dialer.attempts == 1 and dialer.cleanups >= 1


def test_an_untrusted_certificate_is_never_retried(pki):
    """A wss:// server whose certificate the device's CA did not sign: UntrustedServer at the first attempt."""
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(pki / "cert.pem", pki / "key.pem")
    device_tls = ssl.create_default_context(cafile=pki / "other-ca.pem")

    async def scenario():
        async with serve(welcome_everyone, "127.0.0.1", 0, ssl=server_tls) as server:
            dialer = Dialer(f"wss://localhost:{next(iter(server.sockets)).getsockname()[1]}", device_tls)
            start = time.monotonic()
            with pytest.raises(UntrustedServer, match=r"phone-01: TLS certificate of wss://localhost:\d+ not accepted"):
                await dialer.dial(timeout_s=30)
            return dialer, time.monotonic() - start

    dialer, took = asyncio.run(scenario())
    assert dialer.attempts == 1 and took < 5


def test_delays_grow_to_their_cap_with_bounded_jitter():
    plain = Backoff(first_s=0.2, factor=2, max_s=2.0, jitter=0)
    delays = plain.delays()
    assert [next(delays) for _ in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    jittered = Backoff(first_s=0.2, factor=2, max_s=2.0, jitter=0.1).delays(random.Random(0))
    got = [next(jittered) for _ in range(200)]
    assert all(0.18 <= d <= 0.22 for d in got[:1]) and all(1.8 <= d <= 2.2 for d in got[5:])
    assert len(set(got[5:])) > 100   # spread, not one instant
    with pytest.raises(ValueError):
        Backoff(jitter=1.0)
