"""websockets connections that receive a binary message straight into its buffer and mask frames into their own.

The device client's and the edge server's (which imports it from here, as it imports the client's fault hooks):
splitface/protocol/ stays numpy and msgpack only. Written against websockets 17 (pyproject pins the major version), whose
parser state and connection attributes it reads (below); tests/test_fastws.py fails if they change.

websockets (17.x) copies every byte of a received message three or four times in user space: asyncio's 256 KiB
`recv` into a new `bytes`, its StreamReader's `bytearray +=`, the frame's slice, the server's unmasking into new
`bytes`, then recv()'s join of the fragments (docs/transport.md has the profile). These connection classes
(`create_connection=` of websockets' serve() and connect()) keep websockets for everything but the payloads of a
binary message's data frames:

- They are asyncio *buffered* protocols: the kernel writes into one reused 256 KiB buffer (`recv_into`).
- A small frame parser runs ahead of websockets. Every byte that is not the payload of a binary message's data
  frame (the opening handshake, text messages, ping / pong / close frames, anything malformed) goes to websockets
  as it arrived, and websockets does with it what it always does. A binary message's data frames are taken over:
  websockets is given each one's header with a zero length (same FIN, RSV and opcode bits, same MASK bit), so that
  its own checks and its fragmentation state (opcode order, RSV bits, masking required of clients and forbidden
  to servers, continuation rules, control frames between fragments, the close handshake) see every frame; the
  payload is unmasked in place (numpy XOR over 32-bit words) and copied once into the message's `io.BytesIO`.
- Limits: a frame that would take the message past websockets' `max_size` (or a fragment past its fragment limit)
  is not taken over: websockets gets its real header, with its count of the message so far, and refuses it as it
  would have (1009). A message of more than MAX_FRAGMENTS frames fails the connection with 1009, as recv() does.
- The message is handed to websockets' assembler as one binary frame of `bytes`, so recv(), recv_streaming() and
  `async for` behave as before. Its first tensor is placed at a multiple of transport.ALIGN behind a few bytes of
  padding (as transport.receive does): `recv_view()` returns it as a memoryview past the padding (what
  transport.receive uses, and messages.decode views), recv() as `bytes` without the padding (a copy when there is
  padding).
- Sending (`send_parts`, used by transport.send_fragments): the frames websockets' send() of the same parts would
  write (a BINARY frame, CONTINUATION frames, an empty final one; one frame for one part), each header and
  payload written into one new buffer, the client's mask applied on the way (numpy XOR) instead of websockets'
  mask, then serialisation into `io.BytesIO`, then `getvalue()`.

The take-over starts once websockets' parser is idle between frames (state OPEN, nothing buffered, waiting for a
frame's first byte), which `_parser_idle` reads from the parser generator's `gi_yieldfrom` chain; a failed
connection is recognised by its parser being websockets' `discard`. Those are details of websockets'
implementation: if a release changes the parser, the connection never takes over (it stays a plain websockets
connection); a renamed attribute raises. tests/test_fastws.py fails either way (`test_fast_path_engages`, the
side-by-side tests), and pyproject pins websockets 17.

Flow control: reading pauses as soon as one finished message waits unread (max_queue is (0, 0) on these
connections), so a reader that stops reading holds one message besides the one under way.
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
from websockets.asyncio.messages import MAX_FRAGMENTS as WEBSOCKETS_MAX_FRAGMENTS
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import TooManyFragments
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import OPEN, SERVER, Protocol
from websockets.streams import StreamReader

from splitface.protocol.messages import tensor_offset
from splitface.net.transport import ALIGN, release_free_memory

READ_BYTES = 256 * 1024          # the kernel's reads (asyncio's own recv size)
HEAD_PEEK = 4096                 # bytes of a message looked at for its first tensor's offset before it is placed
_CONT, _TEXT, _BINARY = Opcode.CONT.value, Opcode.TEXT.value, Opcode.BINARY.value
# Close code of a message that did not arrive whole within `message_timeout_s` (the edge server's 4002, SPEC.md §2).
CLOSE_MESSAGE_TIMEOUT = 4002
# A dropped message at least this large hands the allocator's free memory back (transport.release_free_memory).
RELEASE_AFTER_BYTES = 16 << 20


def _parser_idle(protocol: Protocol) -> bool:
    """Whether websockets' parser waits for the first byte of a frame with nothing buffered (see the module doc)."""
    if protocol.state is not OPEN or protocol.extensions or protocol.reader.buffer or protocol.current_size is not None:
        return False
    gen, chain = protocol.parser, []
    while gen is not None:
        chain.append(getattr(gen, "gi_code", None))
        gen = getattr(gen, "gi_yieldfrom", None)
    return len(chain) >= 2 and chain[-1] is StreamReader.at_eof.__code__ and Protocol.parse.__code__ in chain


def _discarding(protocol: Protocol) -> bool:
    """Whether websockets' parser throws its input away: after `Protocol.fail` (a refused frame, a keepalive timeout),
    when a failed connection delivers nothing more."""
    return getattr(protocol.parser, "gi_code", None) is Protocol.discard.__code__


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


class _FastFrames:
    """The mixin of FastServerConnection and FastClientConnection (module doc)."""

    protocol: Protocol
    transport: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Flow control counts a taken-over message as one frame: reading pauses as soon as one finished message waits
        # unread (websockets' own queue holds max_queue frames, here whole messages), so a reader that stops reading
        # holds one message besides the one under way, as websockets with a 1 MiB-fragment queue holds a few MiB.
        kwargs["max_queue"] = (0, 0)
        super().__init__(*args, **kwargs)
        self._scratch = memoryview(bytearray(READ_BYTES))
        self._engaged = False       # the parser below runs ahead of websockets
        self._passthrough = False   # for good: websockets' state left OPEN (closing, failed)
        self._head = bytearray()    # a frame header being read
        self._raw_left = 0          # bytes of a frame websockets parses itself still to come
        self._left = 0              # payload bytes of a taken-over frame still to come
        self._key: bytes | None = None
        self._phase = 0             # payload bytes of the frame so far, mod 4 (the mask's position)
        self._fin = False
        self._swallow = False       # websockets' events of a zero-length stand-in frame are not delivered
        self._message: io.BytesIO | None = None   # the binary message being taken over
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
        """Bytes for websockets' own parser, as they arrived."""
        super().data_received(bytes(data))  # type: ignore[misc]

    def _feed(self, view: memoryview) -> None:
        self._parse(view)
        if self.message_timeout_s:
            self._watch_message()

    def _parse(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            if not self._engaged:
                if self._passthrough or not _parser_idle(self.protocol):
                    self._forward(view[pos:])
                    return
                self._engaged = True
            if self._left:
                if _discarding(self.protocol):   # failed mid-frame: websockets throws the rest away, and so do we
                    self._stop_taking_over()
                    self._forward(view[pos:])
                    return
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
            if self._raw_left:
                k = min(self._raw_left, n - pos)
                self._forward(view[pos:pos + k])
                self._raw_left -= k
                pos += k
                continue
            # a frame header: 2 bytes, then 2 or 8 of length, then 4 of mask key
            need = 2 if len(self._head) < 2 else self._header_length()
            k = min(need - len(self._head), n - pos)
            self._head += view[pos:pos + k]
            pos += k
            if len(self._head) >= 2 and len(self._head) == self._header_length():
                self._header()

    def _header_length(self) -> int:
        code = self._head[1] & 0x7F
        return 2 + (2 if code == 126 else 8 if code == 127 else 0) + (4 if self._head[1] & 0x80 else 0)

    def _header(self) -> None:
        head, self._head = self._head, bytearray()
        protocol = self.protocol
        if protocol.state is not OPEN:
            # Closing: after our close() websockets still parses, and delivers the rest of a message under way, so
            # the message so far goes to its assembler as a first fragment and websockets takes it from here.
            # Failed: websockets discards everything, the message under way too.
            if self._message is not None and not _discarding(protocol):
                self._hand_over()
            self._stop_taking_over()
            self._forward(head)
            return
        head1, head2 = head[0], head[1]
        opcode, fin, masked = head1 & 0x0F, bool(head1 & 0x80), bool(head2 & 0x80)
        code = head2 & 0x7F
        length = struct.unpack_from("!H", head, 2)[0] if code == 126 else \
            struct.unpack_from("!Q", head, 2)[0] if code == 127 else code
        ours = (head1 & 0x70) == 0 and masked == (protocol.side is SERVER) and not protocol.extensions and (
            (opcode == _BINARY and self._message is None and protocol.current_size is None)
            or (opcode == _CONT and self._message is not None))
        so_far = self._size if self._message is not None else 0
        if ours and self._oversize(length, so_far):
            # websockets refuses it (1009) with its own count of the message, as it would have
            if self._message is not None:
                protocol.current_size = so_far
            self._drop_message()
            ours = False
        if not ours:
            self._forward(head)
            self._raw_left = length
            return
        if self._message is None:
            self._message, self._peek, self._size, self._frames = io.BytesIO(), bytearray(), 0, 0
            self._next_peek = 64
        self._frames += 1
        if self._frames > WEBSOCKETS_MAX_FRAGMENTS:
            self._too_many_fragments()
            return
        # websockets sees the frame with a zero length: its checks and fragmentation state follow every frame
        self._swallow = True
        try:
            self._forward(frame_header(opcode, fin, 0, b"\0\0\0\0" if masked else None))
        finally:
            self._swallow = False
        if protocol.state is not OPEN or protocol.parser_exc is not None:   # refused: nothing more is taken over
            self._stop_taking_over()
            return
        if not fin:
            protocol.current_size = self._size + length   # what websockets counts after this frame
        self._left, self._fin, self._phase = length, fin, 0
        self._key = bytes(head[-4:]) if masked else None
        if not length:
            self._frame_done()

    def _under_way(self) -> bool:
        """Whether part of a frame or of a fragmented message has arrived and the rest has not (ours or websockets')."""
        protocol = self.protocol
        return bool(self._message is not None or self._left or self._raw_left or self._head
                    or protocol.current_size is not None or protocol.reader.buffer)

    def _watch_message(self) -> None:
        """After input: a message under way has its deadline running from its first byte; none, no deadline."""
        if self.protocol.state is OPEN and self._under_way():
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

    def _oversize(self, length: int, so_far: int) -> bool:
        """Whether websockets would refuse a frame of `length` bytes after `so_far` bytes of its message."""
        protocol = self.protocol
        limit, fragment_limit = protocol.max_message_size, protocol.max_fragment_size
        return (limit is not None and length > limit - so_far) or \
            (fragment_limit is not None and length > fragment_limit)

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

    def _frame_done(self) -> None:
        if not self._fin:
            return
        if _discarding(self.protocol):   # the connection failed while the frame arrived: nothing is delivered
            self._stop_taking_over()
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

    def _hand_over(self) -> None:
        """The message under way, as far as it came, to websockets' assembler as a non-final BINARY frame (without
        its padding): websockets' parser, which saw every frame's header, goes on with the CONTINUATION frames."""
        message, peek = self._message, self._peek
        assert message is not None
        data = bytes(peek) if peek is not None else message.getvalue()[self._pad:]
        self._pads.append(0)
        super().process_event(Frame(Opcode.BINARY, data, False))  # type: ignore[misc]

    def _drop_message(self) -> None:
        large = self._message is not None and self._size >= RELEASE_AFTER_BYTES
        self._message = self._peek = None
        self._left = self._pad = 0
        if large:
            release_free_memory()

    def _stop_taking_over(self) -> None:
        self._drop_message()
        self._engaged, self._passthrough = False, True

    def _too_many_fragments(self) -> None:
        """recv()'s refusal of a message of too many frames: 1009, the connection failed."""
        self._stop_taking_over()
        self.set_connection_exc(TooManyFragments(WEBSOCKETS_MAX_FRAGMENTS))  # type: ignore[attr-defined]
        self.protocol.fail(CloseCode.MESSAGE_TOO_BIG, "too many fragments")
        self._forward(b"")   # websockets writes its close frame and arms its close timeout, as after any input

    def process_event(self, event: Any) -> None:
        if isinstance(event, Frame):
            if self._swallow and event.opcode in (Opcode.BINARY, Opcode.CONT):
                return
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
        protocol = self.protocol
        if (opcode == _CONT) != protocol.expect_continuation_frame:
            raise RuntimeError("data frame out of order")   # send_parts holds send_in_progress: cannot happen
        protocol.expect_continuation_frame = not fin
        key = secrets.token_bytes(4) if protocol.side is not SERVER else None
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


__all__ = ["FastServerConnection", "FastClientConnection", "Connection", "xor_mask", "frame_header"]
