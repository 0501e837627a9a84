"""splitface/net/fastws.py: connections that receive binary messages straight into their buffer and mask frames into their
own behave as websockets' own connections do, on a real loopback connection: the same messages for the same bytes,
the same close code for every hostile input (compared side by side with websockets' ServerConnection and
ClientConnection), the same frames on the wire, and the fast path really taken."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.utils import apply_mask

from splitface.net import fastws
from splitface.protocol import messages as m
from splitface.net import transport
from splitface.net.fastws import FastClientConnection, FastServerConnection, frame_header, xor_mask
from splitface.protocol.tensor import encode_tensor
from splitface.net.transport import CLIENT_WS_OPTIONS, SERVER_WS_OPTIONS, receive, send_fragments

SHAPE = (4, 16, 64, 64)   # 1 MiB of f32
LIMIT = 4 << 20           # the servers' max_size in these tests


def _forward(batch_id: int = 7) -> dict[str, Any]:
    activations = np.random.default_rng(batch_id).random(SHAPE, dtype=np.float32)
    return {"type": m.FORWARD, "batch_id": batch_id, "activations": encode_tensor(activations, "f32"),
            "labels": [1, 2, 3, 4]}


# ---- the pieces ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 13, 1000, 4099])
@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_xor_mask_is_websockets_mask(n, phase):
    data = bytearray(os.urandom(n + 3))
    key = os.urandom(4)
    for start in (0, 1, 3):                       # views at every alignment
        src = memoryview(data)[start:start + n]
        expected = apply_mask(bytes(os.urandom(phase)) + bytes(src), key)[phase:]
        out = bytearray(n)
        xor_mask(memoryview(out), src, key, phase)
        assert bytes(out) == expected
        inplace = bytearray(src)
        xor_mask(memoryview(inplace), memoryview(inplace), key, phase)
        assert bytes(inplace) == expected


@pytest.mark.parametrize("length", [0, 125, 126, 65535, 65536, 1 << 20])
@pytest.mark.parametrize("opcode,fin", [(Opcode.BINARY, True), (Opcode.BINARY, False), (Opcode.CONT, True),
                                        (Opcode.CONT, False)])
def test_frame_header_is_websockets_header(length, opcode, fin):
    payload = bytes(length)
    unmasked = Frame(opcode, payload, fin).serialize(mask=False)
    assert frame_header(opcode.value, fin, length, None) == unmasked[:len(unmasked) - length]
    masked = Frame(opcode, payload, fin).serialize(mask=True)
    head = masked[:len(masked) - length]
    assert frame_header(opcode.value, fin, length, head[-4:]) == head


def test_connections_are_buffered_protocols_with_websockets_methods():
    for cls, base in ((FastServerConnection, ServerConnection), (FastClientConnection, ClientConnection)):
        assert issubclass(cls, asyncio.BufferedProtocol) and issubclass(cls, base)
        # websockets' own callbacks win over BufferedProtocol's empty ones
        assert cls.eof_received is base.eof_received and cls.connection_made is base.connection_made


# ---- real connections: fast on both ends, or one end fast and the other websockets' own ---------------------------
async def _echo_pair(server_cls, client_cls, messages, fragment=transport.FRAGMENT_BYTES):
    """Send each message (bytes or parts) from a client to an echo server and back; returns what the server received,
    what came back, and how many messages each end took over."""
    got: list[Any] = []
    fast = {}

    async def echo(ws) -> None:
        try:
            while True:
                data = await receive(ws)
                got.append(data)
                if isinstance(data, str):
                    await ws.send(data)
                else:
                    await send_fragments(ws, data, fragment)
        except ConnectionClosed:
            fast["server"] = getattr(ws, "fast_messages", None)

    back = []
    async with serve(echo, "127.0.0.1", 0, create_connection=server_cls,
                     **{**SERVER_WS_OPTIONS, "max_size": LIMIT}) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", create_connection=client_cls,
                           **{**CLIENT_WS_OPTIONS, "max_size": LIMIT}) as ws:
            for message in messages:
                if isinstance(message, str):
                    await ws.send(message)
                else:
                    await send_fragments(ws, message, fragment)
                back.append(await receive(ws))
            fast["client"] = getattr(ws, "fast_messages", None)
        await asyncio.sleep(0.05)
    return got, back, fast


@pytest.mark.parametrize("ends", ["both", "server", "client"])
@pytest.mark.parametrize("fragment", [1, 7, 64 * 1024, 1 << 20])
def test_messages_arrive_as_sent(ends, fragment):
    server_cls = FastServerConnection if ends in ("both", "server") else ServerConnection
    client_cls = FastClientConnection if ends in ("both", "client") else ClientConnection
    small = m.encode({"type": m.FORWARD, "batch_id": 1,
                      "activations": encode_tensor(np.ones((2, 3), np.float32), "f32")})
    messages: list[Any] = [small, b"", b"x", "text \u00e9", os.urandom(3000)]
    if fragment >= 1024:                                       # within websockets' 4,096 fragments
        messages += [m.encode_parts(_forward(b)) for b in (7, 300, 70_000)] + [m.encode(_forward(9))]
    got, back, fast = asyncio.run(_echo_pair(server_cls, client_cls, messages, fragment))
    for message, received, returned in zip(messages, got, back):
        sent = message if isinstance(message, (str, bytes)) else b"".join(message)
        for data in (received, returned):
            assert type(data) is type(sent) if isinstance(sent, str) else isinstance(data, (bytes, memoryview))
            assert (data if isinstance(sent, str) else bytes(data)) == sent
    binary = sum(not isinstance(x, str) for x in messages)
    assert fast["server"] == (binary if ends in ("both", "server") else None)
    assert fast["client"] == (binary if ends in ("both", "client") else None)


def test_fast_path_engages_and_aligns_the_tensor():
    """The take-over really happens on both ends (a websockets release that changed how the connection is driven would
    make this fail instead of the connections silently falling back to websockets' path)."""
    async def run():
        results = []

        async def handler(ws) -> None:
            assert ws.taking_over                           # open, past the handshake
            data = await receive(ws)
            results.append((data, ws.fast_messages, ws.taking_over))
            await send_fragments(ws, data)
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0, create_connection=FastServerConnection,
                         **{**SERVER_WS_OPTIONS, "max_size": LIMIT}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", create_connection=FastClientConnection,
                               **{**CLIENT_WS_OPTIONS, "max_size": LIMIT}) as ws:
                for batch_id in (7, 300, 70_000):
                    await send_fragments(ws, m.encode_parts(_forward(batch_id)))
                    back = await receive(ws)
                    results.append((back, ws.fast_messages, ws.taking_over))
                    break
        return results

    (got, server_fast, server_engaged), (back, client_fast, client_engaged) = asyncio.run(run())
    assert server_fast == client_fast == 1 and server_engaged and client_engaged
    for data in (got, back):
        assert isinstance(data, memoryview) and type(data.obj) is bytes        # immutable, padded
        activations = m.decode(data)["activations"]
        assert activations.flags.aligned and not activations.flags.writeable
        assert np.shares_memory(activations, np.frombuffer(data.obj, np.uint8))  # viewed, not copied


def test_recv_and_recv_streaming_give_the_message_without_padding():
    message = m.encode(_forward(8))
    assert -m.tensor_offset(message) % transport.ALIGN          # it is padded on arrival

    async def run():
        out = []

        async def handler(ws) -> None:
            out.append(await ws.recv())
            out.append(b"".join([f async for f in ws.recv_streaming()]))
            out.append(await ws.recv(decode=False))
            out.append(await receive(ws))
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0, create_connection=FastServerConnection,
                         **{**SERVER_WS_OPTIONS, "max_size": LIMIT}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", **{**CLIENT_WS_OPTIONS, "max_size": LIMIT}) as ws:
                for _ in range(4):
                    await send_fragments(ws, message, 64 * 1024)
                await asyncio.sleep(0.2)
        return out

    out = asyncio.run(run())
    assert [type(x) for x in out] == [bytes, bytes, bytes, memoryview]
    assert all(bytes(x) == message for x in out)


def test_control_frames_between_fragments_and_keepalive():
    """A ping between a message's fragments is answered and the message arrives whole; pings of the server's
    keepalive are answered by a fast client while it receives a large message."""
    message = m.encode(_forward())

    async def run():
        out = []

        async def handler(ws) -> None:
            out.append(await receive(ws))
            latency = await asyncio.wait_for(await ws.ping(), 5)      # answered by the fast client
            out.append(latency)
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0, create_connection=FastServerConnection,
                         **{**SERVER_WS_OPTIONS, "max_size": LIMIT}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", create_connection=FastClientConnection,
                               **{**CLIENT_WS_OPTIONS, "max_size": LIMIT}) as ws:
                frames = transport.fragments(message, 64 * 1024)

                async def with_pings():
                    for i, frame in enumerate(frames):
                        if i % 5 == 2:
                            pong = await ws.ping(b"p%d" % i)   # a control frame between two fragments
                            out.append(pong)
                        yield frame
                await ws.send(with_pings())
                for pong in [x for x in out if isinstance(x, asyncio.Future)]:
                    await asyncio.wait_for(pong, 5)
                await asyncio.sleep(0.2)
        return out

    out = asyncio.run(run())
    assert bytes(next(x for x in out if isinstance(x, memoryview))) == message
    assert all(x.done() for x in out if isinstance(x, asyncio.Future))
    assert any(isinstance(x, float) for x in out)


def test_close_handshake_after_fast_messages():
    async def run():
        codes = {}

        async def handler(ws) -> None:
            await receive(ws)
            try:
                await receive(ws)
            except ConnectionClosed as exc:
                codes["server"] = (type(exc).__name__, exc.rcvd.code)

        async with serve(handler, "127.0.0.1", 0, create_connection=FastServerConnection,
                         **{**SERVER_WS_OPTIONS, "max_size": LIMIT}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            ws = await connect(f"ws://127.0.0.1:{port}", create_connection=FastClientConnection,
                               **{**CLIENT_WS_OPTIONS, "max_size": LIMIT})
            await send_fragments(ws, m.encode(_forward()), 64 * 1024)
            await ws.close()
            codes["client"] = (ws.close_code, ws.protocol.close_rcvd.code)
            await asyncio.sleep(0.05)
        return codes

    assert asyncio.run(run()) == {"server": ("ConnectionClosedOK", 1000), "client": (1000, 1000)}


def test_compression_negotiated_leaves_frames_to_websockets():
    """With permessage-deflate (RSV1 frames) the connection never takes a message over; messages still arrive."""
    async def run():
        out = []

        async def handler(ws) -> None:
            out.append(await receive(ws))
            out.append(ws.fast_messages)
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0, create_connection=FastServerConnection,
                         **{**SERVER_WS_OPTIONS, "max_size": LIMIT, "compression": "deflate"}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", **{**CLIENT_WS_OPTIONS, "compression": "deflate"}) as ws:
                assert ws.protocol.extensions
                await send_fragments(ws, bytes(200_000), 64 * 1024)
                await asyncio.sleep(0.2)
        return out

    data, fast = asyncio.run(run())
    assert bytes(data) == bytes(200_000) and fast == 0


# ---- hostile peers: the same outcome as websockets' own connections -------------------------------------------------
def _frame(opcode: int, payload: bytes, fin: bool = True, mask: bool = True, rsv: int = 0,
           length: int | None = None) -> bytes:
    key = os.urandom(4) if mask else None
    head = bytearray(frame_header(opcode, fin, len(payload) if length is None else length, key))
    head[0] |= rsv << 4
    return bytes(head) + (apply_mask(payload, key) if key else payload)


def _close_code(data: bytes) -> int | None:
    """The code of the first close frame in a server's (unmasked) frames."""
    pos = 0
    while pos + 2 <= len(data):
        opcode, code = data[pos] & 0x0F, data[pos + 1] & 0x7F
        pos += 2
        if code == 126:
            code, pos = struct.unpack_from("!H", data, pos)[0], pos + 2
        elif code == 127:
            code, pos = struct.unpack_from("!Q", data, pos)[0], pos + 8
        if opcode == 0x8:
            return struct.unpack_from("!H", data, pos)[0] if code >= 2 else 1005
        pos += code
    return None


async def _raw_handshake(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw TCP client to `server` past the opening handshake: what it writes next are frames, as they are."""
    port = next(iter(server.sockets)).getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
    return reader, writer


async def _hostile_client(server_cls, payload: bytes, drop: bool = False, max_fragments: int | None = None):
    """A raw client: the opening handshake, then `payload` as it is. What the server's receive() returned (or the
    exception it raised) and the close code the server sent."""
    got: list[Any] = []

    async def handler(ws) -> None:
        try:
            while True:
                data = await receive(ws)
                got.append(bytes(data) if not isinstance(data, str) else data)
        except ConnectionClosed as exc:
            got.append(type(exc).__name__)

    async with serve(handler, "127.0.0.1", 0, create_connection=server_cls,
                     **{**SERVER_WS_OPTIONS, "max_size": 1 << 20}) as server:
        reader, writer = await _raw_handshake(server)
        writer.write(payload)
        await writer.drain()
        if drop:
            await asyncio.sleep(0.1)
            writer.transport.abort()
            await asyncio.sleep(0.2)
            return got, None
        data = b""
        try:   # until the server's close frame (a server that closes cleanly waits for ours before closing TCP)
            while _close_code(data) is None and (chunk := await asyncio.wait_for(reader.read(65536), 5)):
                data += chunk
        except TimeoutError:
            pass
        writer.close()
        await asyncio.sleep(0.05)
    return got, _close_code(data)


_OK = _frame(0x2, b"ok")                                   # a message taken over first (the fast path is engaged)
_BIG = os.urandom(200_000)
HOSTILE = {
    "unmasked frame from a client": _OK + _frame(0x2, b"abc", mask=False),
    "RSV1 without an extension": _OK + _frame(0x2, _BIG, rsv=4),
    "RSV1 on a continuation": _OK + _frame(0x2, b"a", fin=False) + _frame(0x0, _BIG, rsv=4),
    "invalid opcode": _OK + _frame(0x3, b"abc"),
    "continuation without a message": _OK + _frame(0x0, _BIG),
    "binary frame inside a binary message": _OK + _frame(0x2, _BIG, fin=False) + _frame(0x2, b"x"),
    "text frame inside a binary message": _OK + _frame(0x2, b"a", fin=False) + _frame(0x1, b"x"),
    "binary frame inside a text message": _OK + _frame(0x1, b"a", fin=False) + _frame(0x2, _BIG),
    "fragmented ping": _OK + _frame(0x9, b"p", fin=False),
    "ping of 126 bytes": _OK + _frame(0x9, bytes(126)),
    "close inside a fragmented message": _OK + _frame(0x2, _BIG, fin=False) + _frame(0x8, struct.pack("!H", 1000)),
    "invalid UTF-8 across text fragments": _OK + _frame(0x1, "\u00e9".encode()[:1], fin=False) + _frame(0x0, b"x"),
    "one frame over max_size": _OK + _frame(0x2, b"", length=(1 << 20) + 1),
    "fragments over max_size": _OK + _frame(0x2, _BIG, fin=False) + _frame(0x0, _BIG, fin=False)
    + _frame(0x0, _BIG, fin=False) + _frame(0x0, _BIG, fin=False) + _frame(0x0, _BIG, fin=False)
    + _frame(0x0, _BIG),
    "at max_size in fragments": _OK + _frame(0x2, bytes(1 << 19), fin=False) + _frame(0x0, bytes(1 << 19))
    + _frame(0x8, struct.pack("!H", 1000)),
    "a ping and a pong between fragments": _OK + _frame(0x2, _BIG, fin=False) + _frame(0x9, b"p")
    + _frame(0xA, b"q") + _frame(0x0, _BIG) + _frame(0x8, struct.pack("!H", 1000)),
    "text message then binary": _OK + _frame(0x1, "h\u00e9".encode(), fin=False) + _frame(0x0, b"llo")
    + _frame(0x2, _BIG) + _frame(0x8, struct.pack("!H", 1000)),
    "empty close frame": _OK + _frame(0x8, b""),
    "close with an invalid code": _OK + _frame(0x8, struct.pack("!H", 999)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_client_gets_what_websockets_gives(case):
    stock = asyncio.run(_hostile_client(ServerConnection, HOSTILE[case]))
    fast = asyncio.run(_hostile_client(FastServerConnection, HOSTILE[case]))
    assert fast == stock
    assert stock[1] is not None                  # every case ends with a close frame from the server
    if case.startswith(("unmasked", "RSV1", "invalid opcode", "continuation", "binary frame", "text frame",
                        "fragmented ping", "ping of", "close inside")):
        assert stock[1] == 1002
    if case.endswith("over max_size"):
        assert stock[1] == 1009


def test_too_many_fragments_are_refused_with_1009(monkeypatch):
    monkeypatch.setattr(transport, "MAX_FRAGMENTS", 8)          # websockets' connections via transport.receive
    monkeypatch.setattr(fastws, "WEBSOCKETS_MAX_FRAGMENTS", 8)
    within = _OK + _frame(0x2, b"a", fin=False) + b"".join(_frame(0x0, b"b", fin=False) for _ in range(6)) \
        + _frame(0x0, b"c") + _frame(0x8, struct.pack("!H", 1000))                   # 8 frames
    over = _OK + _frame(0x2, b"a", fin=False) + b"".join(_frame(0x0, b"b", fin=False) for _ in range(7)) \
        + _frame(0x0, b"c")                                                           # 9 frames
    for payload, expected in ((within, ([b"ok", b"abbbbbbc", "ConnectionClosedOK"], 1000)),
                              (over, ([b"ok", "ConnectionClosedError"], 1009))):
        assert asyncio.run(_hostile_client(FastServerConnection, payload)) == expected
        assert asyncio.run(_hostile_client(ServerConnection, payload)) == expected


@pytest.mark.parametrize("where", ["mid-header", "mid-frame", "between fragments"])
def test_connection_dropped_mid_message_raises_connection_closed(where):
    frame = _frame(0x2, _BIG, fin=False)
    payload = _OK + {"mid-header": frame[:5], "mid-frame": frame[:100_000], "between fragments": frame}[where]
    for cls in (FastServerConnection, ServerConnection):
        got, _ = asyncio.run(_hostile_client(cls, payload, drop=True))
        assert got == [b"ok", "ConnectionClosedError"]


# ---- hostile servers: a fast client gets what websockets' client gets ----------------------------------------------
async def _hostile_server(client_cls, payload: bytes):
    """A raw server: the opening handshake, then `payload`. What the client's receive() returned (or the
    exception) and the close code it sent."""
    async def handle(reader, writer) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        key = next(line.split(b":", 1)[1].strip() for line in request.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key"))
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n" + payload)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    got: list[Any] = []
    async with connect(f"ws://127.0.0.1:{port}", create_connection=client_cls, close_timeout=0.2,
                       **{k: v for k, v in CLIENT_WS_OPTIONS.items() if k != "close_timeout"},
                       max_size=1 << 20) as ws:
        try:
            while True:
                data = await receive(ws)
                got.append(bytes(data) if not isinstance(data, str) else data)
        except ConnectionClosed as exc:
            got.append((type(exc).__name__, exc.sent.code if exc.sent else None))
    server.close()
    return got


_SOK = _frame(0x2, b"ok", mask=False)
HOSTILE_SERVER = {
    "masked frame from a server": _SOK + _frame(0x2, _BIG, mask=True),
    "masked continuation from a server": _SOK + _frame(0x2, b"a", fin=False, mask=False) + _frame(0x0, _BIG),
    "one frame over max_size": _SOK + _frame(0x2, b"", length=(1 << 20) + 1, mask=False),
    "fragments over max_size": _SOK + b"".join(_frame(0x2 if i == 0 else 0x0, _BIG, fin=i == 5, mask=False)
                                               for i in range(6)),
    "fragments with a ping": _SOK + _frame(0x2, _BIG, fin=False, mask=False) + _frame(0x9, b"p", mask=False)
    + _frame(0x0, _BIG, mask=False),
}


@pytest.mark.parametrize("case", list(HOSTILE_SERVER))
def test_hostile_server_gets_what_websockets_gives(case):
    stock = asyncio.run(_hostile_server(ClientConnection, HOSTILE_SERVER[case]))
    fast = asyncio.run(_hostile_server(FastClientConnection, HOSTILE_SERVER[case]))
    assert fast == stock
    if case.startswith("masked"):
        assert stock[-1] == ("ConnectionClosedError", 1002)
    if case.endswith("max_size"):
        assert stock[-1] == ("ConnectionClosedError", 1009)


# ---- the frames on the wire -----------------------------------------------------------------------------------------
def _parse_frames(data: bytes) -> list[tuple[int, bool, bool, bytes]]:
    """(opcode, fin, masked, unmasked payload) of each frame."""
    out, pos = [], 0
    while pos < len(data):
        head1, head2 = data[pos], data[pos + 1]
        code, pos = head2 & 0x7F, pos + 2
        if code == 126:
            code, pos = struct.unpack_from("!H", data, pos)[0], pos + 2
        elif code == 127:
            code, pos = struct.unpack_from("!Q", data, pos)[0], pos + 8
        key = None
        if head2 & 0x80:
            key, pos = data[pos:pos + 4], pos + 4
        payload = data[pos:pos + code]
        pos += code
        out.append((head1 & 0x0F, bool(head1 & 0x80), key is not None, apply_mask(payload, key) if key else payload))
    return out


@pytest.mark.parametrize("server_side", [True, False])
def test_frames_on_the_wire_are_websockets_frames(server_side):
    """send_parts writes the frames websockets' send() writes for the same parts (the mask keys aside)."""
    parts = transport.fragments(m.encode_parts(_forward()), 300_000)

    async def capture(cls) -> bytes:
        captured = bytearray()

        class Sink:   # a transport that keeps what is written
            def write(self, data):
                captured.extend(data)

            def is_closing(self):
                return False

        from websockets.protocol import SERVER, CLIENT
        from websockets.server import ServerProtocol
        from websockets.client import ClientProtocol
        from websockets.uri import parse_uri
        protocol = ServerProtocol() if server_side else ClientProtocol(parse_uri("ws://x/"))
        protocol.state = fastws.OPEN
        assert protocol.side is (SERVER if server_side else CLIENT)
        conn = cls.__new__(cls)
        Connection_init = fastws.Connection.__init__
        Connection_init(conn, protocol)
        conn.transport = Sink()
        conn.paused = False
        await (conn.send_parts(parts) if hasattr(conn, "send_parts") else conn.send(parts))
        await conn.send(b"single")
        return bytes(captured)

    base = ServerConnection if server_side else ClientConnection
    fast_cls = FastServerConnection if server_side else FastClientConnection
    stock, fast = asyncio.run(capture(base)), asyncio.run(capture(fast_cls))
    assert _parse_frames(fast) == _parse_frames(stock)
    if server_side:
        assert fast == stock                       # no mask: byte for byte
    frames = _parse_frames(fast)
    assert [f[0] for f in frames] == [2] + [0] * len(parts) + [2]
    assert all(f[2] == (not server_side) for f in frames)


async def _fed(server_cls, chunks: list[bytes], between) -> list[Any]:
    """A raw client's opening handshake, then `chunks` handed to the server connection's receive callbacks one by
    one (as the kernel's reads would be), `between(ws)` awaited after each. What the handler's recv() returned."""
    got: list[Any] = []
    ready = asyncio.Event()
    conn: dict[str, Any] = {}

    async def handler(ws) -> None:
        conn["ws"] = ws
        ready.set()
        try:
            while True:
                got.append(await asyncio.wait_for(ws.recv(), 2))
        except ConnectionClosed as exc:
            got.append(("closed", exc.sent.code if exc.sent else None))

    async with serve(handler, "127.0.0.1", 0, create_connection=server_cls,
                     **{**SERVER_WS_OPTIONS, "max_size": 1 << 20, "ping_interval": None, "close_timeout": 0.5}) as server:
        reader, writer = await _raw_handshake(server)
        await ready.wait()
        ws = conn["ws"]
        for chunk in chunks:
            if ws.transport.is_closing():
                break
            if isinstance(ws, FastServerConnection):
                ws.get_buffer(-1)[:len(chunk)] = chunk
                ws.buffer_updated(len(chunk))
            else:
                ws.data_received(chunk)
            await between(ws)
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.sleep(0.05)
    return got


def test_our_close_during_a_message_delivers_it_as_websockets_does():
    """The server closes while a fragmented message is under way (a replaced device's old connection, shutdown):
    websockets still delivers the message's rest, so the message taken over so far is handed to it."""
    chunks = [_frame(0x2, b"head" * 10, fin=False), _frame(0x0, b"tail" * 10), _frame(0x8, struct.pack("!H", 1000))]

    def run(server_cls) -> list[Any]:
        closing: list[asyncio.Task] = []

        async def between(ws) -> None:
            if not closing:
                closing.append(asyncio.create_task(ws.close()))
            await asyncio.sleep(0.01)
        return asyncio.run(_fed(server_cls, chunks, between))

    stock = run(ServerConnection)
    assert stock == [b"head" * 10 + b"tail" * 10, ("closed", 1000)]
    assert run(FastServerConnection) == stock


def test_a_connection_failed_during_a_frame_delivers_nothing():
    """A connection that fails while a taken-over frame arrives (as keepalive's ping timeout fails it) delivers no
    message, as websockets' own connection does: its parser discards the rest, and so does the fast path."""
    data = _frame(0x2, os.urandom(100_000))

    def run(server_cls) -> list[Any]:
        failed: list[asyncio.Task] = []

        async def between(ws) -> None:
            async def fail() -> None:
                async with ws.send_context():
                    ws.protocol.fail(1011, "keepalive ping timeout")
            if not failed:
                failed.append(asyncio.create_task(fail()))
            await asyncio.sleep(0.01)
        return asyncio.run(_fed(server_cls, [data[:5000], data[5000:]], between))

    stock = run(ServerConnection)
    assert stock == [("closed", 1011)]
    assert run(FastServerConnection) == stock


def test_a_handler_that_stops_reading_holds_one_message():
    """Flow control: a taken-over message is one frame in websockets' queue, so reading pauses as soon as one
    finished message waits unread; the sender blocks instead of the server holding every message it sends."""
    size = 4 << 20
    held: dict[str, int] = {}

    async def run() -> int:
        async def handler(ws) -> None:
            await asyncio.sleep(1.0)   # busy: not reading
            held["queued"] = sum(len(f.data) for f in ws.recv_messages.frames.queue)
            held["under_way"] = ws._size if ws._message is not None else 0
            await ws.close()

        sent = 0
        async with serve(handler, "127.0.0.1", 0, create_connection=FastServerConnection,
                         **{**SERVER_WS_OPTIONS, "max_size": 2 * size}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", **{**CLIENT_WS_OPTIONS, "max_size": 2 * size}) as ws:
                async def sender() -> None:
                    nonlocal sent
                    for _ in range(8):
                        await transport.send_fragments(ws, bytes(size))
                        sent += 1
                task = asyncio.create_task(sender())
                await asyncio.sleep(1.3)
                task.cancel()
        return sent

    sent = asyncio.run(run())
    assert held["queued"] == size and held["under_way"] < size   # one message waits, the next is under way
    assert sent < 8                                                # the rest waited for the reader


# ---- frame boundaries: any split of the input, control frames between fragments, a hand-back anywhere --------------
class _Sink:
    """A transport that keeps what the connection writes."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.data += b"<EOF>"

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _mframe(opcode: int, payload: bytes, fin: bool = True, key: bytes = b"\x12\x34\x56\x78") -> bytes:
    """A client's masked frame (a fixed key, so that every run sees the same bytes)."""
    return frame_header(opcode, fin, len(payload), key) + apply_mask(payload, key)


_TENSOR_MESSAGE = m.encode({"type": m.FORWARD, "batch_id": 1,
                            "activations": encode_tensor(np.arange(60, dtype=np.float32).reshape(3, 20), "f32")})
_CLOSE = _mframe(0x8, struct.pack("!H", 1000))
# a binary message in three frames with a ping and a pong between them (lengths in the 7-bit and 16-bit forms, and
# an empty final frame), a text message in two frames, a one-frame binary message of the 64-bit length form
_STREAM = (_mframe(0x2, _TENSOR_MESSAGE[:100], fin=False) + _mframe(0x9, b"ping")
           + _mframe(0x0, _TENSOR_MESSAGE[100:], fin=False) + _mframe(0xA, b"") + _mframe(0x0, b"")
           + _mframe(0x1, "h\u00e9".encode()[:2], fin=False) + _mframe(0x0, "h\u00e9".encode()[2:])
           + _mframe(0x2, bytes(range(256)) * 260))
_LONG_AT = len(_STREAM) - 256 * 260 - 14   # where the last frame's header starts


async def _direct(cls, chunks: list[bytes], at: int | None = None, action: str = "", max_size=1 << 20):
    """A server connection opened directly (no socket): `chunks` handed to its receive callbacks one by one, our own
    close() or a failure (`action`) before chunk `at`, then the TCP connection lost. What recv() returned, what
    the connection wrote, and how many messages it took over."""
    from websockets.datastructures import Headers
    from websockets.http11 import Request, Response
    from websockets.server import ServerProtocol
    protocol = ServerProtocol(state=fastws.OPEN, max_size=max_size)
    conn = cls(protocol, None, ping_interval=None, close_timeout=None)
    conn.request = Request("/", Headers())             # past the opening handshake, no server: no handler task
    sink = _Sink()
    fastws.Connection.connection_made(conn, sink)
    if isinstance(conn, FastServerConnection):
        conn.response = Response(101, "Switching Protocols", Headers())
        conn._mode = fastws._FRAMES                  # as past a handshake that negotiated no extension
    for i, chunk in enumerate(chunks):
        if i == at:
            if action == "close":                       # what close() does before it waits
                protocol.send_close(1000)
            else:                                       # what keepalive's ping timeout does
                protocol.fail(1011, "keepalive ping timeout")
            conn.send_data()
        if isinstance(conn, FastServerConnection):
            for start in range(0, len(chunk), fastws.READ_BYTES):
                piece = chunk[start:start + fastws.READ_BYTES]
                conn.get_buffer(-1)[:len(piece)] = piece
                conn.buffer_updated(len(piece))
        else:
            conn.data_received(chunk)
    conn.connection_lost(None)
    got: list[Any] = []
    try:
        while True:
            data = await asyncio.wait_for(conn.recv(), 1)
            got.append(bytes(data) if isinstance(data, (bytes, memoryview)) else data)
    except ConnectionClosed as exc:
        got.append((type(exc).__name__, exc.sent.code if exc.sent else None))
    return got, bytes(sink.data), getattr(conn, "fast_messages", None)


def _split_points() -> list[int]:
    """Every offset of the stream's small frames and of the long frame's header, a few within its payload."""
    return [*range(0, _LONG_AT + 15), _LONG_AT + 1000, len(_STREAM) - 3, len(_STREAM)]


def test_direct_harness_sees_the_stream_as_websockets_does():
    got, written, fast = asyncio.run(_direct(FastServerConnection, [_STREAM + _CLOSE]))
    assert got == [_TENSOR_MESSAGE, "h\u00e9", bytes(range(256)) * 260, ("ConnectionClosedOK", 1000)]
    assert fast == 2
    assert asyncio.run(_direct(ServerConnection, [_STREAM + _CLOSE]))[:2] == (got, written)


def test_a_stream_split_at_every_offset_gives_what_websockets_gives():
    """One cut anywhere (in a header, in a mask key, in a payload, between a message's fragments and the control
    frames between them) and a byte at a time: the same messages and the same frames written (pongs, the close)."""
    async def run():
        stock = await _direct(ServerConnection, [_STREAM + _CLOSE])
        for cut in _split_points():
            assert await _direct(FastServerConnection, [_STREAM[:cut], _STREAM[cut:] + _CLOSE]) == (*stock[:2], 2), cut
        small = [_STREAM[i:i + 1] for i in range(_LONG_AT + 15)]
        assert await _direct(FastServerConnection, small + [_STREAM[_LONG_AT + 15:] + _CLOSE]) == (*stock[:2], 2)
    asyncio.run(run())


@pytest.mark.parametrize("action", ["close", "fail"])
def test_closing_or_failing_at_any_offset_gives_what_websockets_gives(action):
    """Our close() (websockets still parses: a message under way is handed back to it, mid-frame too, and it
    assembles it) or a failure (websockets discards everything: nothing more is delivered) at any point of the
    stream: what the handler receives and what the connection writes are websockets' own."""
    async def run():
        for cut in _split_points():
            chunks = [_STREAM[:cut], _STREAM[cut:] + _CLOSE]
            stock = await _direct(ServerConnection, chunks, at=1, action=action)
            fast = await _direct(FastServerConnection, chunks, at=1, action=action)
            assert fast[:2] == stock[:2], cut
    asyncio.run(run())


def test_oversize_after_fragments_is_refused_with_websockets_count():
    """A frame that takes a taken-over message past max_size: the message so far goes to websockets, which refuses
    the frame (1009) with its own count, the close frame's reason included."""
    frames = [_mframe(0x2, bytes(600), fin=False), _mframe(0x9, b"p"), _mframe(0x0, bytes(300), fin=False),
              _mframe(0x0, bytes(200))]
    stream = b"".join(frames)
    for cut in range(0, len(stream) + 1, 7):
        chunks = [stream[:cut], stream[cut:]]
        stock = asyncio.run(_direct(ServerConnection, chunks, max_size=1000))
        assert asyncio.run(_direct(FastServerConnection, chunks, max_size=1000))[:2] == stock[:2]
        assert stock[0] == [("ConnectionClosedError", 1009)]


def test_frames_before_the_handshake_completes_go_to_websockets():
    """A client that sends frames before the server's 101 (in the same write as its request): the connection
    never takes over, websockets parses everything as it does on its own connections."""
    async def run(cls):
        got: list[Any] = []

        async def handler(ws) -> None:
            try:
                while True:
                    data = await receive(ws)
                    got.append(bytes(data) if not isinstance(data, str) else data)
            except ConnectionClosed as exc:
                got.append(type(exc).__name__)
            got.append(getattr(ws, "fast_messages", None))

        async with serve(handler, "127.0.0.1", 0, create_connection=cls,
                         **{**SERVER_WS_OPTIONS, "max_size": 1 << 20}) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            key = base64.b64encode(os.urandom(16)).decode()
            writer.write((f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
                         + _frame(0x2, b"early", fin=False) + _frame(0x0, b" bird"))
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_frame(0x2, b"later") + _CLOSE)
            await asyncio.sleep(0.2)
            writer.close()
            await asyncio.sleep(0.05)
        return got

    assert asyncio.run(run(FastServerConnection)) == [b"early bird", b"later", "ConnectionClosedOK", 0]
    assert asyncio.run(run(ServerConnection))[:3] == [b"early bird", b"later", "ConnectionClosedOK"]
