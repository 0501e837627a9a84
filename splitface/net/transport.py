"""How the protocol's messages should travel: websocket settings and sending in fragments.

Measured by bench/transport.py (docs/transport.md): a 100 MB message spent most of its time not in
msgpack or the socket but in first-touch page faults, because every large buffer along the way (the
packed message, the masked frame, the transport's write buffer, the received frame, the unpacked tensor)
is a fresh allocation, which glibc serves with a new mmap of zeroed pages and unmaps again when freed.
Two changes take that away without touching the bytes of a message or any limit:

- `send_fragments`: a message goes out as a fragmented websocket message of FRAGMENT_BYTES frames
  (RFC 6455 5.4). The receiver's websocket library reassembles the same bytes and checks the same size
  limit on the whole message, so nothing changes for it; the sender masks and buffers a frame at a time
  (cache-sized, reused memory) instead of the whole message.
- `reuse_large_buffers`: glibc keeps freed large blocks for the next message instead of unmapping them
  (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD). The cost: the process keeps its peak heap resident.

A third, `receive`, takes the reassembly of fragments out of websockets' hands: it copies each fragment, as it
arrives, into the message's buffer (while the sender is still sending, and from memory that is still in the
cache), and places the message so that its tensor is aligned, which lets messages.decode view it.

A fourth, splitface/net/fastws.py, is a pair of websockets connection classes that read a binary message's frames
straight into the message's buffer and mask frames into their own; `send_fragments` and `receive` use their
`send_parts` and `recv_view` when a connection has them.

This module names no websocket library (splitface/protocol/ depends on numpy and msgpack only; splitface/net/fastws.py imports websockets);
its settings are plain keyword arguments of websockets' connect() and serve(), and it uses the connections' public
methods.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import platform
from typing import Any, AsyncIterator

from splitface.protocol.messages import Message, tensor_offset

FRAGMENT_BYTES = 1 << 20
# Largest block glibc serves from its heap after reuse_large_buffers (above it: mmap, as before).
HEAP_BLOCK_LIMIT = 1 << 30

# websockets' settings shared by both ends: no per-message deflate (tensors do not compress, and it costs a
# pass over every byte), a short receive queue, pings far apart (a 100 MB message may take seconds on a link).
COMMON_WS_OPTIONS: dict[str, Any] = {"compression": None, "max_queue": 4, "ping_interval": 30, "ping_timeout": 120}
# The sender's write buffer may hold a few fragments before it waits for the socket to drain.
WRITE_LIMIT = 4 * FRAGMENT_BYTES
SERVER_WS_OPTIONS: dict[str, Any] = {**COMMON_WS_OPTIONS, "write_limit": WRITE_LIMIT}
CLIENT_WS_OPTIONS: dict[str, Any] = {**COMMON_WS_OPTIONS, "write_limit": WRITE_LIMIT, "open_timeout": 10,
                                     "close_timeout": 2}



# websockets' recv() refuses a message of more fragments (its default, WEBSOCKETS_MAX_FRAGMENTS) with close code
# 1009; `receive` keeps that bound, so that no sender can make it take a Python step per byte of a message.
# The same environment variable sets both.
MAX_FRAGMENTS = int(os.environ.get("WEBSOCKETS_MAX_FRAGMENTS", "4096"))
CLOSE_MESSAGE_TOO_BIG = 1009
# A received message is placed so that its first tensor starts at a multiple of this many bytes (bytes objects'
# contents are 16-byte aligned in CPython): enough for every dtype of the wire and for SIMD loads.
ALIGN = 16


def fragments(data: Message, size: int = FRAGMENT_BYTES) -> list[memoryview]:
    """`data` (one buffer, or the consecutive parts of a message from messages.encode_parts) as consecutive views
    of at most `size` bytes (no copy); one view for a short or empty message. Empty parts are left out."""
    if size < 1:
        raise ValueError(f"fragment size must be positive, not {size}")
    views = [memoryview(data).cast("B")] if isinstance(data, (bytes, bytearray, memoryview)) else \
        [memoryview(p).cast("B") for p in data]
    out = [v[i:i + size] for v in views for i in range(0, len(v), size)]
    return out or [memoryview(b"")]


async def send_fragments(ws: Any, data: Message, size: int = FRAGMENT_BYTES) -> None:
    """Send one binary message (whole or as parts) on a websockets connection, in frames of at most `size` bytes."""
    parts = fragments(data, size)
    send_parts = getattr(ws, "send_parts", None)    # splitface.net.fastws's connections: frames masked into their buffers
    if send_parts is not None:
        await send_parts(parts)
    else:
        await ws.send(parts[0] if len(parts) == 1 else parts)


async def receive(ws: Any) -> bytes | memoryview | str:
    """The next message on a websockets connection, as `ws.recv()` would return it, assembled while it arrives.

    A message of one frame is returned as websockets gives it. A fragmented one is copied fragment by fragment
    into one buffer (io.BytesIO, whose getvalue() hands over its bytes without a copy), behind a few bytes of
    padding chosen from the first fragment so that the message's first tensor lands at a multiple of ALIGN: the
    result is then a memoryview of immutable bytes, which messages.decode views like `bytes`. websockets checks
    the connection's max_size on every frame, as for recv(), and fails the connection with 1009 when a message
    outgrows it; `receive` adds recv()'s bound of MAX_FRAGMENTS. A text message is returned as `str`.

    Unlike recv(), `receive` must not be cancelled once a message has started (websockets' recv_streaming):
    the connection is then unusable, and the caller closes it (the edge server does, on a deadline).

    On a connection of splitface/net/fastws.py (the edge server's and the device client's), the connection has already
    assembled and placed the message while it arrived: `receive` returns its `recv_view()`.

    On websockets' own connections it pays on a server: websockets unmasks each fragment into new `bytes`, which
    recv_streaming hands over as they are. A client's fragments are not masked and websockets keeps them as
    bytearrays, which recv_streaming copies once more: there recv() (one join at the end) measured as fast
    (bench/transport.py)."""
    recv_view = getattr(ws, "recv_view", None)      # splitface.net.fastws's connections assemble and align it themselves
    if recv_view is not None:
        return await recv_view()
    stream = ws.recv_streaming()
    first = await anext(stream)
    second = await anext(stream, None)
    if second is None:
        return first
    if isinstance(first, str):
        return "".join([first, second, *[f async for f in _bounded(ws, stream, 2)]])
    pad = -(tensor_offset(first) or 0) % ALIGN
    out = io.BytesIO()
    for part in (bytes(pad), first, second):
        out.write(part)
    async for fragment in _bounded(ws, stream, 2):
        out.write(fragment)
    data = out.getvalue()
    return memoryview(data)[pad:] if pad else data


async def _bounded(ws: Any, stream: AsyncIterator[Any], seen: int) -> AsyncIterator[Any]:
    """The rest of a message's fragments, `seen` of them already taken; past MAX_FRAGMENTS in all, the connection
    is closed with 1009 and websockets' ConnectionClosed raised, as recv() does."""
    async for fragment in stream:
        seen += 1
        if seen > MAX_FRAGMENTS:
            await ws.close(CLOSE_MESSAGE_TOO_BIG, "too many fragments")
            await ws.wait_closed()
            raise ws.protocol.close_exc
        yield fragment


def release_free_memory() -> bool:
    """Hand the allocator's free memory back to the system (glibc's malloc_trim): after `reuse_large_buffers` it
    keeps its peak heap, which is right for the next honest message and wrong after a message that will never come
    whole (a half-sent one, dropped). Returns whether anything was released; False off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    path = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(path), "malloc_trim", None) if path else None
    return bool(trim(0)) if trim is not None else False


_tuned: bool | None = None


def reuse_large_buffers() -> bool:
    """Let glibc reuse freed blocks up to HEAP_BLOCK_LIMIT instead of unmapping them (once per process).

    Returns whether the allocator took the settings: False off glibc (nothing is changed there)."""
    global _tuned
    if _tuned is None:
        _tuned = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            path = ctypes.util.find_library("c")
            mallopt = getattr(ctypes.CDLL(path), "mallopt", None) if path else None
            if mallopt is not None:
                m_trim_threshold, m_mmap_threshold = -1, -3   # <malloc.h>
                _tuned = bool(mallopt(m_mmap_threshold, HEAP_BLOCK_LIMIT)) and \
                    bool(mallopt(m_trim_threshold, 2**31 - 1))
    return _tuned
