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

This module names no websocket library (protocol/ depends on numpy and msgpack only); its settings are
plain keyword arguments of websockets' connect() and serve().
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any, Sequence

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


Message = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


def fragments(data: Message, size: int = FRAGMENT_BYTES) -> list[memoryview]:
    """`data` (one buffer, or the consecutive parts of a message from messages.encode_parts) as consecutive views
    of at most `size` bytes (no copy); one view for a short or empty message. Empty parts are left out."""
    if size < 1:
        raise ValueError(f"fragment size must be positive, not {size}")
    views = [memoryview(data).cast("B")] if isinstance(data, (bytes, bytearray, memoryview)) else \
        [memoryview(p).cast("B") for p in data]
    out = [v[i:i + size] for v in views for i in range(0, len(v), size)]
    return out or [memoryview(b"")]


def message_size(data: Message) -> int:
    """Bytes of a message given whole or as parts."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    return sum(memoryview(p).nbytes for p in data)


async def send_fragments(ws: Any, data: Message, size: int = FRAGMENT_BYTES) -> None:
    """Send one binary message (whole or as parts) on a websockets connection, in frames of at most `size` bytes."""
    parts = fragments(data, size)
    await ws.send(parts[0] if len(parts) == 1 else parts)


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
