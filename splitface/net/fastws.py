"""websockets connections that receive a binary message straight into its buffer and mask frames into their own.

`FastServerConnection` and `FastClientConnection` (`create_connection=` of websockets' serve() and connect()) are
asyncio buffered protocols: the kernel writes into one reused buffer, and a small frame parser of their own reads
every frame header after the opening handshake. The payload of a binary message's data frames is unmasked in place
and copied once into the message's buffer; websockets then sees each such frame as its header with a zero length,
so that its own checks and fragmentation state follow every frame. Everything else (the handshake, text, control
frames, frames websockets would refuse, anything once the connection leaves OPEN) goes to websockets as it arrived.
Only websockets' public sans-I/O surface is used: `Protocol.receive_data` (through the connection's
`data_received`), its events, `state`, `fail()` and the `max_size` it was built with; no parser state is read.

A finished message goes to websockets' assembler as one binary frame, its first tensor placed at a multiple of
transport.ALIGN behind a few bytes of padding: `recv_view()` returns it past the padding, recv() and
recv_streaming() without it. `send_parts` writes the frames websockets' send() would write for the same parts,
masking a client's frames into a buffer of its own. docs/transport.md has the design and the measurements.
"""
from __future__ import annotations

import asyncio
import collections
import io
import secrets
import struct
from typing import Any, Sequence

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import OPEN, Protocol

from splitface.protocol.messages import tensor_offset
from splitface.net.transport import ALIGN, release_free_memory

try:    # websockets >= 17: recv() refuses a message of more frames (1009)
    from websockets.asyncio.messages import MAX_FRAGMENTS as WEBSOCKETS_MAX_FRAGMENTS
    from websockets.exceptions import TooManyFragments
except ImportError:   # before: transport.receive's bound, the same default and environment variable
    from splitface.net.transport import MAX_FRAGMENTS as WEBSOCKETS_MAX_FRAGMENTS
    TooManyFragments = None  # type: ignore[assignment,misc]

READ_BYTES = 256 * 1024          # the kernel's reads (asyncio's own recv size)
HEAD_PEEK = 4096                 # bytes of a message looked at for its first tensor's offset before it is placed
_CONT, _TEXT, _BINARY = Opcode.CONT.value, Opcode.TEXT.value, Opcode.BINARY.value
# Close code of a message that did not arrive whole within `message_timeout_s` (the edge server's 4002, SPEC.md §2).
CLOSE_MESSAGE_TIMEOUT = 4002
# A dropped message at least this large hands the allocator's free memory back (transport.release_free_memory).
RELEASE_AFTER_BYTES = 16 << 20
_ZERO_KEY = b"\0\0\0\0"
# What the connection does with the bytes it receives: look for the end of the opening handshake (websockets gets
# them all); read frame headers (taking binary messages over); hand everything to websockets, for good.
_HANDSHAKE, _FRAMES, _PASS = "handshake", "frames", "pass"


def xor_mask(dst: memoryview, src: memoryview, key: bytes, phase: int = 0) -> None:
    """dst[i] = src[i] ^ key[(phase + i) % 4] (RFC 6455 5.3); dst may be src (in place). Same length."""
    n = len(src)
    if phase:
        key = key[phase:] + key[:phase]
    n4 = n & ~3
    if n4:
        word = np.frombuffer(key, np.uint32)[0]
        np.bitwise_xor(np.frombuffer(src, np.uint32, n4 // 4), word, out=np.frombuffer(dst, np.uint32, n4 // 4))
    for i in range(n4, n):
        dst[i] = src[i] ^ key[i & 3]


def frame_header(opcode: int, fin: bool, length: int, key: bytes | None) -> bytes:
    """An RFC 6455 frame header, as websockets' Frame.serialize writes it (shortest length form)."""
    head1 = (0x80 if fin else 0) | opcode
    mask = 0x80 if key is not None else 0
    if length < 126:
        head = struct.pack("!BB", head1, mask | length)
    elif length < 65536:
        head = struct.pack("!BBH", head1, mask | 126, length)
    else:
        head = struct.pack("!BBQ", head1, mask | 127, length)
    return head + key if key is not None else head


def _limits(protocol: Protocol) -> tuple[int | None, int | None]:
    """The (message, fragment) size limits websockets' parser applies: the `max_size` the protocol was built with."""
    if hasattr(protocol, "max_message_size"):
        return protocol.max_message_size, protocol.max_fragment_size
    return protocol.max_size, None  # type: ignore[attr-defined]   # websockets < 16: one limit


class _FastFrames:
    """The mixin of FastServerConnection and FastClientConnection (module doc)."""

    protocol: Protocol
    transport: Any
    _client = False   # the side: a server's peer masks its frames, a client's does not; a client masks its own

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Flow control counts a taken-over message as one frame: reading pauses as soon as one finished message waits
        # unread (websockets' own queue holds max_queue frames, here whole messages), so a reader that stops reading
        # holds one message besides the one under way, as websockets with a 1 MiB-fragment queue holds a few MiB.
        kwargs["max_queue"] = (0, 0)
        super().__init__(*args, **kwargs)
        self._scratch = memoryview(bytearray(READ_BYTES))
        self._mode = _HANDSHAKE
        self._tail = b""            # the handshake's last bytes so far (its blank line may span reads)
        self._plain: bool | None = None   # no extension negotiated (known once the connection is open)
        self._head = bytearray()    # a frame header being read
        self._raw_left = 0          # payload bytes of a frame websockets parses itself still to come
        self._raw_message = False   # a fragmented message websockets assembles itself is under way
        self._left = 0              # payload bytes of a taken-over frame still to come
        self._opcode = _BINARY      # the taken-over frame's opcode, FIN bit and mask key
        self._fin = False
        self._key: bytes | None = None
        self._phase = 0             # its payload bytes so far, mod 4 (the mask's position)
        self._swallow = False       # websockets' events of a zero-length stand-in frame are not delivered
        self._resume = False        # websockets goes on with a message handed back to it: its next frame starts it
        self._message: io.BytesIO | None = None   # the binary message being taken over
        self._announced = False     # websockets has seen its first frame (as a stand-in)
        self._peek: bytearray | None = None       # its first bytes, until its first tensor's offset is known
        self._pad = 0
        self._next_peek = 64        # the peek's length at which its offset is looked for next
        self._size = 0              # its bytes so far
        self._frames = 0            # its frames so far
        self._pads: collections.deque[int] = collections.deque()  # per message handed to the assembler, in order
        self.fast_messages = 0      # messages taken over (tests, benchmarks)
        # Seconds from a message's first byte to its last (None: no deadline); the edge server sets it on admission.
        # Past it the message is dropped and the connection failed with CLOSE_MESSAGE_TIMEOUT.
        self.message_timeout_s: float | None = None
        self._message_timer: asyncio.TimerHandle | None = None

    @property
    def taking_over(self) -> bool:
        """Whether the connection reads frame headers ahead of websockets (open, past the handshake)."""
        return self._mode is _FRAMES

    # ---- receiving: asyncio's buffered protocol ------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._feed(self._scratch[:nbytes])

    def data_received(self, data: bytes) -> None:
        """A transport that does not support buffered protocols: the same path, through the scratch buffer."""
        view = memoryview(data)
        for i in range(0, len(view), READ_BYTES):
            chunk = view[i:i + READ_BYTES]
            self._scratch[:len(chunk)] = chunk
            self._feed(self._scratch[:len(chunk)])

    def _forward(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes for websockets, through its connection's data_received (Protocol.receive_data, then its events)."""
        super().data_received(bytes(data))  # type: ignore[misc]

    def _feed(self, view: memoryview) -> None:
        self._parse(view)
        if self.message_timeout_s:
            self._watch_message()

    def _parse(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        if self._mode is _HANDSHAKE:
            pos = self._handshake(view)
        while pos < n:
            if self._mode is _PASS:
                self._forward(view[pos:])
                return
            if self._raw_left:   # a frame of websockets' own: the state is looked at past its end
                k = min(self._raw_left, n - pos)
                self._forward(view[pos:pos + k])
                self._raw_left -= k
                pos += k
                continue
            if self.protocol.state is not OPEN:
                # Closing (our close(): websockets still parses, and delivers a message under way) or failed
                # (websockets discards everything): either way websockets takes every byte from here.
                self._pass()
                continue
            if self._left:
                k = min(self._left, n - pos)
                chunk = view[pos:pos + k]
                if self._key is not None:
                    xor_mask(chunk, chunk, self._key, self._phase)
                self._store(chunk)
                self._left -= k
                self._phase = (self._phase + k) & 3
                pos += k
                if not self._left:
                    self._frame_done()
                continue
            # a frame header: 2 bytes, then 2 or 8 of length, then 4 of mask key
            need = 2 if len(self._head) < 2 else self._header_length()
            k = min(need - len(self._head), n - pos)
            self._head += view[pos:pos + k]
            pos += k
            if len(self._head) >= 2 and len(self._head) == self._header_length():
                self._header()

    def _handshake(self, view: memoryview) -> int:
        """The opening handshake's bytes to websockets, up to its blank line (a handshake request or a 101 response
        has no body); returns where the frames start in `view` (its length if the handshake goes on). Frames start
        the take-over only if the connection is open then: a server still deciding (a client that did not wait
        for the response) or a refused handshake leaves every byte to websockets."""
        data = self._tail + bytes(view)
        end = data.find(b"\r\n\r\n")
        if end < 0:
            self._tail = data[-3:]
            self._forward(view)
            return len(view)
        end += 4 - len(self._tail)
        self._tail = b""
        self._forward(view[:end])
        self._mode = _FRAMES    # _parse passes every byte on for good if the connection is not open when it comes
        return end

    def _header_length(self) -> int:
        code = self._head[1] & 0x7F
        return 2 + (2 if code == 126 else 8 if code == 127 else 0) + (4 if self._head[1] & 0x80 else 0)

    def _header(self) -> None:
        head = self._head
        head1, head2 = head[0], head[1]
        opcode, fin, masked = head1 & 0x0F, bool(head1 & 0x80), bool(head2 & 0x80)
        code = head2 & 0x7F
        length = struct.unpack_from("!H", head, 2)[0] if code == 126 else \
            struct.unpack_from("!Q", head, 2)[0] if code == 127 else code
        if opcode == _BINARY:
            ours = self._message is None and not self._raw_message
        else:
            ours = opcode == _CONT and self._message is not None
        ours = ours and not head1 & 0x70 and masked != self._client and self._no_extensions()
        if ours and self._oversize(length):
            ours = False    # websockets refuses it (1009), with its count of the message so far (below)
        if not ours:
            if opcode < 8 and self._message is not None:
                # a data frame of the message that websockets refuses, or assembles itself: the message so far is
                # websockets' from here (a frame websockets counts), and the frame follows it
                self._hand_back(in_frame=False)
                self._raw_message = True
            if opcode in (_TEXT, _BINARY, _CONT):
                self._raw_message = not fin if opcode != _CONT else (self._raw_message and not fin)
            self._head = bytearray()
            self._forward(head)
            self._raw_left = length
            return
        self._head = bytearray()
        if self._message is None:
            self._message, self._peek, self._size, self._frames = io.BytesIO(), bytearray(), 0, 0
            self._next_peek, self._announced = 64, False
        self._frames += 1
        if self._frames > WEBSOCKETS_MAX_FRAGMENTS:
            self._too_many_fragments()
            return
        self._opcode, self._fin, self._left, self._phase = opcode, fin, length, 0
        self._key = bytes(head[-4:]) if masked else None
        if not length:
            self._frame_done()

    def _no_extensions(self) -> bool:
        """Whether the handshake negotiated no extension (websockets would transform the payload)."""
        if self._plain is None:
            response = getattr(self, "response", None)
            if response is None:
                return False
            self._plain = not response.headers.get_all("Sec-WebSocket-Extensions")
        return self._plain

    def _oversize(self, length: int) -> bool:
        """Whether websockets would refuse a frame of `length` bytes after the message's bytes so far."""
        limit, fragment_limit = _limits(self.protocol)
        so_far = self._size if self._message is not None else 0
        return (limit is not None and length > limit - so_far) or \
            (fragment_limit is not None and length > fragment_limit)

    def _frame_done(self) -> None:
        """A taken-over frame arrived whole: websockets sees its header with a zero length (a stand-in whose events
        are not delivered), then a final frame's message goes to websockets' assembler."""
        self._swallow = True
        try:
            self._forward(frame_header(self._opcode, self._fin, 0, None if self._client else _ZERO_KEY))
        finally:
            self._swallow = False
        self._announced = True
        if self.protocol.state is not OPEN:   # refused (our checks make it websockets' too): nothing is delivered
            self._drop_message()
            self._pass()
            return
        if not self._fin:
            return
        message, peek, pad = self._message, self._peek, self._pad
        assert message is not None
        if peek is not None:          # a short message, or no tensor in its first bytes: no padding
            message.write(peek)
            pad = 0
        self._message = self._peek = None
        self._pad = 0
        self._pads.append(pad)
        self.fast_messages += 1
        super().process_event(Frame(Opcode.BINARY, message.getvalue(), True))  # type: ignore[misc]

    def _hand_back(self, in_frame: bool) -> None:
        """The message under way to websockets, as frames it parses itself: what arrived of it as non-final frames
        (each within its fragment limit), then, `in_frame`, a header for the rest of the current frame, whose bytes
        follow as they arrive. A parsing websockets counts, checks and assembles the message as if it had seen it
        all; a failed one discards it."""
        message = self._message
        assert message is not None
        fragment_limit = _limits(self.protocol)[1] or (1 << 62)
        key = None if self._client else _ZERO_KEY
        data = memoryview(self._peek) if self._peek is not None else message.getbuffer()[self._pad:]
        self._message = self._peek = None   # forwarding may run websockets' callbacks: the message is theirs
        self._resume = True
        opcode = _CONT if self._announced else _BINARY
        for start in range(0, max(len(data), 1), fragment_limit):
            piece = data[start:start + fragment_limit]
            self._forward(frame_header(opcode, False, len(piece), key))
            for i in range(0, len(piece), READ_BYTES):
                self._forward(piece[i:i + READ_BYTES])
            opcode = _CONT
        if in_frame:
            rest_key = None if self._key is None else self._key[self._phase:] + self._key[:self._phase]
            self._forward(frame_header(_CONT, self._fin, self._left, rest_key))
            self._raw_left, self._left = self._left, 0
        del data, message
        self._drop_message(size=self._size)

    def _pass(self) -> None:
        """websockets takes every byte from here, for good: a message under way and a header begun are handed to it."""
        if self._message is not None:
            self._hand_back(in_frame=bool(self._left))
        self._mode = _PASS
        if self._head:
            head, self._head = self._head, bytearray()
            self._forward(head)

    def _under_way(self) -> bool:
        """Whether part of a frame or of a fragmented message has arrived and the rest has not."""
        return bool(self._message is not None or self._left or self._raw_left or self._head or self._raw_message)

    def _watch_message(self) -> None:
        """After input: a message under way has its deadline running from its first byte; none, no deadline."""
        if self._mode is _FRAMES and self.protocol.state is OPEN and self._under_way():
            if self._message_timer is None:
                self._message_timer = self.loop.call_later(  # type: ignore[attr-defined]
                    self.message_timeout_s, self._message_timed_out)
        else:
            self._message_arrived()

    def _message_arrived(self) -> None:
        if self._message_timer is not None:
            self._message_timer.cancel()
            self._message_timer = None

    def _message_timed_out(self) -> None:
        """The message under way missed its deadline: drop what arrived of it and fail the connection (4002)."""
        self._message_timer = None
        if self.protocol.state is not OPEN:
            return
        self._stop_taking_over()
        self.protocol.fail(CLOSE_MESSAGE_TIMEOUT, f"message not received whole within {self.message_timeout_s:g} s")
        self._forward(b"")   # websockets writes its close frame and arms its close timeout, as after any input

    def _store(self, chunk: memoryview) -> None:
        message = self._message
        assert message is not None
        self._size += len(chunk)
        if self._peek is None:
            message.write(chunk)
            return
        self._peek += chunk
        if len(self._peek) < min(self._next_peek, HEAD_PEEK):
            return      # looked at as it doubles, so that a message of tiny frames costs a few walks, not one a byte
        self._next_peek = 2 * len(self._peek)
        offset = tensor_offset(memoryview(self._peek)[:HEAD_PEEK])
        if offset is None and len(self._peek) < HEAD_PEEK:
            return
        self._pad = -(offset or 0) % ALIGN
        message.write(bytes(self._pad))
        message.write(self._peek)
        self._peek = None

    def _drop_message(self, size: int | None = None) -> None:
        large = (self._size if self._message is not None else size or 0) >= RELEASE_AFTER_BYTES
        self._message = self._peek = None
        self._left = self._pad = 0
        if large:
            release_free_memory()

    def _stop_taking_over(self) -> None:
        """The message under way is dropped and websockets gets every byte from here (it is failing the connection)."""
        self._drop_message()
        self._mode = _PASS
        self._head = bytearray()

    def _too_many_fragments(self) -> None:
        """recv()'s refusal of a message of too many frames: 1009, the connection failed."""
        self._stop_taking_over()
        if TooManyFragments is not None:
            self.set_connection_exc(TooManyFragments(WEBSOCKETS_MAX_FRAGMENTS))  # type: ignore[attr-defined]
        self.protocol.fail(CloseCode.MESSAGE_TOO_BIG, "too many fragments")
        self._forward(b"")   # websockets writes its close frame and arms its close timeout, as after any input

    def process_event(self, event: Any) -> None:
        if isinstance(event, Frame) and event.opcode in (Opcode.BINARY, Opcode.CONT, Opcode.TEXT):
            if self._swallow:
                return
            if self._resume:   # the first frame of a message handed back starts it in the assembler
                self._resume = False
                if event.opcode is Opcode.CONT:
                    event = Frame(Opcode.BINARY, event.data, event.fin)
            if event.opcode in (Opcode.BINARY, Opcode.TEXT):   # a message websockets assembles: no padding
                self._pads.append(0)
        super().process_event(event)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._message_arrived()
        self._drop_message()
        super().connection_lost(exc)  # type: ignore[misc]

    # ---- receiving: the connection's methods ---------------------------------------------------------------------
    async def recv_view(self) -> bytes | memoryview | str:
        """The next message, as recv() returns it, except that a binary message whose first tensor was placed at an
        aligned address is a memoryview of immutable `bytes`, past the padding (messages.decode views it)."""
        data = await super().recv()  # type: ignore[misc]
        pad = self._pads.popleft()
        return memoryview(data)[pad:] if pad else data

    async def recv(self, decode: bool | None = None) -> Any:
        data = await super().recv(decode)  # type: ignore[misc]
        pad = self._pads.popleft()
        return data[pad:] if pad else data   # padding decodes to as many characters: decode=True too

    async def recv_streaming(self, decode: bool | None = None) -> Any:
        first = True
        async for fragment in super().recv_streaming(decode):  # type: ignore[misc]
            if first:
                first, pad = False, self._pads.popleft()
                if pad:
                    fragment = fragment[pad:]
            yield fragment

    # ---- sending -------------------------------------------------------------------------------------------------
    async def send_parts(self, parts: Sequence[memoryview]) -> None:
        """One binary message whose frames' payloads are `parts` (non-empty, flat byte views), framed as websockets'
        send() frames them (one frame for one part; else the parts as non-final frames, then an empty final one)."""
        while self.send_in_progress is not None:  # type: ignore[attr-defined]
            await asyncio.shield(self.send_in_progress)  # type: ignore[attr-defined]
        if len(parts) == 1:
            async with self.send_context():  # type: ignore[attr-defined]
                self._send_frame(_BINARY, True, parts[0])
            return
        self.send_in_progress = self.loop.create_future()  # type: ignore[attr-defined]
        try:
            for i, part in enumerate([*parts, memoryview(b"")]):
                async with self.send_context():  # type: ignore[attr-defined]
                    self._send_frame(_BINARY if i == 0 else _CONT, i == len(parts), part)
        except Exception:
            # as websockets' send(): a message half sent makes the connection unusable
            async with self.send_context():  # type: ignore[attr-defined]
                self.protocol.fail(CloseCode.INTERNAL_ERROR, "error in fragmented message")
            raise
        finally:
            self.send_in_progress.set_result(None)  # type: ignore[attr-defined]
            self.send_in_progress = None

    def _send_frame(self, opcode: int, fin: bool, payload: memoryview) -> None:
        """Write one data frame to the transport (the caller holds send_context: the connection is OPEN)."""
        key = secrets.token_bytes(4) if self._client else None
        header = frame_header(opcode, fin, len(payload), key)
        # A new buffer per frame (the transport may keep a reference to what it has not sent yet); the payload starts
        # at offset 16, aligned for the mask's 32-bit words, with the header (at most 14 bytes) just before it.
        out = memoryview(np.empty(16 + len(payload), np.uint8))
        out[16 - len(header):16] = header
        if key is not None:
            xor_mask(out[16:], payload, key)
        else:
            out[16:] = payload
        self.transport.write(out[16 - len(header):])


class FastServerConnection(_FastFrames, ServerConnection, asyncio.BufferedProtocol):
    """websockets' ServerConnection with the receive and send paths of this module: `serve(...,
    create_connection=FastServerConnection)`."""


class FastClientConnection(_FastFrames, ClientConnection, asyncio.BufferedProtocol):
    """websockets' ClientConnection with the receive and send paths of this module: `connect(...,
    create_connection=FastClientConnection)`."""

    _client = True


__all__ = ["FastServerConnection", "FastClientConnection", "Connection", "xor_mask", "frame_header"]
