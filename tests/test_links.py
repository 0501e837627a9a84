"""bench/links.py's link emulator: bytes arrive intact and in order, never faster than the link allows, and
each direction's traffic is counted."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from bench.links import Link, Relay


def _echo_server() -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("relay closed early")
        out += chunk
    return bytes(out)


def test_relay_paces_both_directions_and_keeps_the_bytes():
    link = Link("test", up_mbit_s=8, down_mbit_s=16, rtt_ms=40)
    payload = bytes(range(256)) * 1024            # 256 KiB
    listener, port = _echo_server()
    with listener, Relay(link, ("127.0.0.1", port)) as relay:
        with socket.create_connection(("127.0.0.1", relay.port)) as s:
            relay.mark()
            t = time.perf_counter()
            s.sendall(payload)
            echoed = _recv_exact(s, len(payload))
            elapsed = time.perf_counter() - t
    assert echoed == payload
    assert relay.up.burst.bytes == len(payload) and relay.down.burst.bytes == len(payload)
    # The echo overlaps the two directions, but the last byte crosses the up link at 8 Mbit/s, then comes back,
    # each way half the RTT later: never faster than that.
    assert elapsed >= len(payload) * 8 / 8e6 + 0.040
    assert relay.up.burst.last_delivery - relay.up.burst.first_arrival >= len(payload) * 8 / 8e6 + 0.020


def test_link_refuses_impossible_settings():
    with pytest.raises(ValueError, match="positive"):
        Link("broken", up_mbit_s=0, down_mbit_s=10, rtt_ms=10)
    with pytest.raises(ValueError, match="RTT"):
        Link("broken", up_mbit_s=1, down_mbit_s=10, rtt_ms=-1)
