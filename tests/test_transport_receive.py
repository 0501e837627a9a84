"""splitface.net.transport.receive: messages assembled as their fragments arrive are the bytes that were sent, placed
so that decode views their tensor, under the same limits as websockets' recv() (the whole message's max_size,
its bound on fragments); and the server's replies as parts are the bytes of its replies as one buffer."""
from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from splitface.protocol import messages as m
from splitface.net import transport
from splitface.protocol.errors import ProtocolError
from splitface.protocol.server_session import DeviceRecord, ServerInfo, ServerSession
from splitface.protocol.tensor import encode_tensor
from splitface.net.transport import CLIENT_WS_OPTIONS, SERVER_WS_OPTIONS, receive, send_fragments
from splitface.protocol.messages import Message

SHAPE = (4, 16, 64, 64)   # 1 MiB of f32: decode views tensors of messages this large


def _forward(batch_id: int = 7, labels: list[int] | None = None) -> dict[str, Any]:
    activations = np.random.default_rng(batch_id).random(SHAPE, dtype=np.float32)
    return {"type": m.FORWARD, "batch_id": batch_id, "activations": encode_tensor(activations, "f32"),
            "labels": labels if labels is not None else [1, 2, 3, 4]}


async def _serve_one(message: Message, fragment: int, max_size: int | None = None,
                     client_action=None) -> tuple[list[Any], int | None]:
    """A real server that receives with `receive`; a client sends `message` in frames of `fragment` bytes (or does
    `client_action(ws)`). What the server received (or the exception it got), and the close code the client saw."""
    got: list[Any] = []

    async def handler(ws) -> None:
        try:
            got.append(await receive(ws))
        except ConnectionClosed as exc:
            got.append(exc)

    options = {**SERVER_WS_OPTIONS, "max_size": max_size or m.DEFAULT_MAX_MESSAGE_BYTES}
    async with serve(handler, "127.0.0.1", 0, **options) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", **{**CLIENT_WS_OPTIONS, "max_size": None}) as ws:
            try:
                if client_action:
                    await client_action(ws)
                else:
                    await send_fragments(ws, message, fragment)
                await ws.wait_closed() if client_action else await asyncio.sleep(0)
                await asyncio.wait_for(ws.recv(), 5)
            except (ConnectionClosed, TimeoutError) as exc:
                code = exc.rcvd.code if isinstance(exc, ConnectionClosed) and exc.rcvd else None
                await asyncio.sleep(0.05)   # the handler has returned
                return got, code
    return got, None


@pytest.mark.parametrize("fragment", [1, 7, 64 * 1024, 1 << 20])
def test_fragmented_message_arrives_as_sent(fragment):
    small = {"type": m.FORWARD, "batch_id": 1, "activations": encode_tensor(np.ones((2, 3), np.float32), "f32")}
    message = m.encode(small if fragment < 1024 else _forward())   # within MAX_FRAGMENTS frames
    got, _ = asyncio.run(_serve_one(message, fragment))
    assert len(got) == 1 and bytes(got[0]) == message


def test_parts_arrive_with_the_tensor_aligned_and_viewed():
    for batch_id in (7, 300, 70_000):        # the tensor's offset in the message moves with batch_id's width
        message = _forward(batch_id)
        parts = m.encode_parts(message)
        got, _ = asyncio.run(_serve_one(parts, 64 * 1024))
        data = got[0]
        assert bytes(data) == msgpack.packb(m.wire_form(message), use_bin_type=True)
        assert isinstance(data, (bytes, memoryview)) and type(getattr(data, "obj", data)) is bytes   # immutable
        activations = m.decode(data)["activations"]
        assert activations.flags.aligned and not activations.flags.writeable
        assert np.shares_memory(activations, np.frombuffer(getattr(data, "obj", data), np.uint8))   # a view
        assert np.array_equal(activations, np.frombuffer(message["activations"]["data"], np.float32).reshape(SHAPE))


def test_one_frame_message_is_returned_as_websockets_gives_it():
    message = m.encode(_forward())
    got, _ = asyncio.run(_serve_one(message, len(message)))
    assert type(got[0]) is bytes and got[0] == message


def test_text_message_stays_text_and_decode_refuses_it():
    async def send_text(ws) -> None:
        await ws.send(["hel", "lo"])     # a fragmented text message
        await ws.close()
    got, _ = asyncio.run(_serve_one(b"", 0, client_action=send_text))
    assert got[0] == "hello"
    with pytest.raises(ProtocolError, match="got text"):
        m.decode(got[0])


def test_message_one_byte_over_the_limit_is_refused_with_1009():
    message = m.encode(_forward())                                # 1 MiB and a bit, in 64 KiB frames
    got, code = asyncio.run(_serve_one(message, 64 * 1024, max_size=len(message) - 1))
    assert code == 1009 and len(got) == 1 and isinstance(got[0], ConnectionClosed)   # never a partial message
    got, code = asyncio.run(_serve_one(message, 64 * 1024, max_size=len(message)))   # at the limit: accepted
    assert bytes(got[0]) == message


def test_too_many_fragments_are_refused_with_1009(monkeypatch):
    monkeypatch.setattr(transport, "MAX_FRAGMENTS", 8)
    message = m.encode(_forward())
    # websockets sends an iterable's pieces as frames, then an empty final frame
    got, code = asyncio.run(_serve_one(message, len(message) // 7 + 1))    # 7 pieces, 8 frames: within the bound
    assert bytes(got[0]) == message
    got, code = asyncio.run(_serve_one(message, len(message) // 8 + 1))    # 9 frames
    assert code == 1009 and isinstance(got[0], ConnectionClosed)


def test_connection_dropped_mid_message_raises_connection_closed():
    message = m.encode(_forward())

    async def drop(ws) -> None:
        frames = transport.fragments(message, 64 * 1024)

        async def some_frames():
            for frame in frames[:5]:
                yield frame
            await asyncio.sleep(0.1)
            ws.transport.abort()                  # no more frames, no close frame: as if the network went away
        try:
            await ws.send(some_frames())
        except ConnectionClosed:
            pass
    got, _ = asyncio.run(_serve_one(b"", 0, client_action=drop))
    assert len(got) == 1 and isinstance(got[0], ConnectionClosed)


def test_tensor_offset_needs_the_tensors_header():
    parts = m.encode_parts(_forward())
    whole = b"".join(parts)
    offset = len(parts[0])                        # the head part ends where the tensor's bytes start
    assert m.tensor_offset(parts[0]) == offset == m.tensor_offset(whole)
    assert all(m.tensor_offset(whole[:k]) is None for k in range(offset))
    assert m.tensor_offset(m.encode({"type": m.ROUND_REQUEST})) is None


def test_decode_views_byte_views_of_bytes_only():
    whole = m.encode(_forward(8))
    pad = -m.tensor_offset(whole) % transport.ALIGN   # as receive places it
    assert pad                                        # the tensor is not aligned in `whole` itself
    padded = bytes(pad) + whole
    viewed = m.decode(memoryview(padded)[pad:])["activations"]
    assert viewed.flags.aligned and np.shares_memory(viewed, np.frombuffer(padded, np.uint8))
    mutable = bytearray(padded)
    copied = m.decode(memoryview(mutable)[pad:])["activations"]   # a bytearray may change: copied, as before
    assert not np.shares_memory(copied, np.frombuffer(mutable, np.uint8))
    assert np.array_equal(viewed, copied)


def _server_session(encoding: str) -> ServerSession:
    """A session as the edge server holds it once a device is admitted (applied only needs that state)."""
    info = ServerInfo(model={"name": "test"}, split="conv1", activation_shape=SHAPE[1:], embedding_dim=8,
                      num_classes=10, max_batch=8)
    s = ServerSession(info, lambda device, token: True, {}, lambda device: 0)
    s.device_id, s.grad_encoding = "d", encoding
    return s


@pytest.mark.parametrize("encoding", ["f32", "f16", "i8", "i8c"])
def test_backward_as_parts_is_the_bytes_of_backward(encoding):
    grad = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    sessions = [_server_session(encoding), _server_session(encoding)]
    whole = sessions[0].applied(5, grad, loss=1.25, n_correct=3, server_s=0.5)
    parts = sessions[1].applied_parts(5, grad, loss=1.25, n_correct=3, server_s=0.5)
    assert b"".join(parts) == whole
    assert sessions[1].record == DeviceRecord(5, parts)   # kept as parts for a retry
    shared = any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), grad) for p in parts)
    assert shared == (encoding == "f32")                  # f32: sent from the gradient's own buffer


def test_reply_parts_are_checkpointed_as_their_bytes(tmp_path):
    from splitface.server.checkpoint import ReplyStore   # torch: only for this test
    grad = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    parts = _server_session("f32").applied_parts(9, grad)
    store = ReplyStore(tmp_path)
    name = store.save("d", 9, parts)
    assert store.load(name) == b"".join(parts) == _server_session("f32").applied(9, grad)



def test_the_trainer_returns_a_fresh_gradient_each_step():
    """applied_parts sends an f32 gradient from its own memory and keeps those views for a retry: the edge server's
    trainer must hand back a new array every step, never one it writes into again."""
    from tests.conftest import small_trainer   # torch: only for this test
    from splitface.common.models import activation_shape

    trainer = small_trainer()
    shape = activation_shape(trainer.spec, trainer.split)
    rng = np.random.default_rng(5)
    acts = rng.standard_normal((4, *shape)).astype(np.float32)
    first, _, _ = trainer.train_server_head(acts, np.arange(4) % 5)
    kept = first.copy()
    second, _, _ = trainer.train_server_head(rng.standard_normal((4, *shape)).astype(np.float32), np.arange(4) % 5)
    assert not np.shares_memory(first, second)
    assert np.array_equal(first, kept)
