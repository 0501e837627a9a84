"""splitface/net/transport.py: fragmented sends carry the same message under the same size limit, on a real
websockets connection on loopback."""
from __future__ import annotations

import asyncio
import platform

import msgpack
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from splitface.protocol import messages as m
from splitface.protocol.tensor import encode_tensor
from splitface.net.transport import CLIENT_WS_OPTIONS, SERVER_WS_OPTIONS, fragments, reuse_large_buffers, send_fragments
from splitface.protocol.messages import Message, message_size


def test_fragments_are_views_that_cover_the_message():
    data = bytes(range(256)) * 41   # 10,496 bytes: not a multiple of the fragment size
    parts = fragments(data, 1000)
    assert [len(p) for p in parts] == [1000] * 10 + [496]
    assert b"".join(parts) == data
    assert all(p.obj is data for p in parts)          # views of the message, not copies
    assert len(fragments(b"", 1000)) == 1 and fragments(data, len(data))[0].obj is data
    with pytest.raises(ValueError, match="positive"):
        fragments(data, 0)


def _forward(shape=(4, 16, 64, 64)) -> bytes:
    activations = np.random.default_rng(0).random(shape, dtype=np.float32)
    return m.encode({"type": m.FORWARD, "batch_id": 7, "activations": encode_tensor(activations, "f32"),
                     "labels": [1, 2, 3, 4]})


async def _exchange(message: Message, fragment: int, max_size: int) -> tuple[list[bytes], int | None]:
    """Send `message` in fragments to a real server with `max_size`; what it received, and the close code seen."""
    received: list[bytes] = []

    async def handler(ws) -> None:
        async for data in ws:
            received.append(data)
            await send_fragments(ws, data, fragment)   # the server's reply goes out fragmented too

    async with serve(handler, "127.0.0.1", 0, **{**SERVER_WS_OPTIONS, "max_size": max_size}) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", **{**CLIENT_WS_OPTIONS, "max_size": None}) as ws:
            await send_fragments(ws, message, fragment)
            try:
                echo = await ws.recv()
            except ConnectionClosed as exc:
                return received, exc.rcvd.code if exc.rcvd else None
            assert echo == b"".join(fragments(message))
            return received, None


def test_fragmented_message_arrives_whole_and_decodes():
    message = _forward()
    received, closed = asyncio.run(_exchange(message, 64 * 1024, m.DEFAULT_MAX_MESSAGE_BYTES))
    assert closed is None and received == [message]            # 17 frames, one message, the same bytes
    decoded = m.decode(received[0])
    assert decoded["batch_id"] == 7 and decoded["activations"].shape == (4, 16, 64, 64)


def test_fragments_of_parts_are_views_of_each_part():
    parts = [b"head", memoryview(bytes(range(256)) * 10), b"", b"tail"]
    views = fragments(parts, 1000)
    assert [len(v) for v in views] == [4, 1000, 1000, 560, 4]     # no frame spans two parts; empty parts are left out
    assert b"".join(views) == b"".join(parts) and message_size(parts) == len(b"".join(parts))
    assert views[1].obj is parts[1].obj                           # the tensor's own buffer, not a copy
    assert len(fragments([b""], 1000)) == 1 and message_size(b"abc") == 3


def test_message_parts_arrive_as_packb_bytes():
    activations = np.random.default_rng(1).random((4, 16, 64, 64), dtype=np.float32)
    message = {"type": m.FORWARD, "batch_id": 7, "activations": activations, "labels": [1, 2, 3, 4]}
    parts = m.encode_parts(message)
    assert any(isinstance(p, memoryview) for p in parts)
    received, closed = asyncio.run(_exchange(parts, 64 * 1024, m.DEFAULT_MAX_MESSAGE_BYTES))
    assert closed is None and received == [msgpack.packb(m.wire_form(message), use_bin_type=True)]
    assert np.array_equal(m.decode(received[0])["activations"], activations)


def test_size_limit_counts_the_whole_fragmented_message():
    message = _forward()                                        # 1 MiB and a bit, in 64 KiB frames
    received, closed = asyncio.run(_exchange(message, 64 * 1024, len(message) - 1))
    assert received == [] and closed == 1009                    # refused although every frame is small


@pytest.mark.skipif(not (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"),
                    reason="the allocator settings exist on glibc only (elsewhere the function changes nothing)")
def test_reuse_large_buffers_takes_on_glibc():
    assert reuse_large_buffers() is True
    assert reuse_large_buffers() is True                        # once per process; asking again is harmless
