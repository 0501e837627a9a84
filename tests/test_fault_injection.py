"""Crashes and dropped connections at exact points (issue #16, item 5), over real websockets on loopback.

Exactly-once is asserted from the counters: the server's per-device `last_applied` and applied-batch counts
and its step count (from its checkpoint, or the live server) against what each device committed."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.client import connect

from bench.load import check_counts, random_batches, start_device, start_server, stop_server, train_device
from splitface.device.connection import DEVICE_FAULTS, FAULT_ENV, DeviceClient, device_faults
from splitface.common.faults import FAULT_EXIT, Fault
from splitface.device.trainer import DeviceTrainer
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.server.app import SERVER_FAULTS, EdgeServer, ServerConfig, ServerThread, server_info
from splitface.server.auth import TokenAuthenticator, hash_token, issue_tokens
from splitface.server.checkpoint import ReplyStore, load_checkpoint
from splitface.server.trainer import ServerTrainer
from splitface.protocol import messages as m
from splitface.protocol.client_session import ClientSession

# The fuzz's tiny configuration (conv1 activations [4, 32, 32]); N: images per batch.
MODEL, SPLIT, NUM_CLASSES, N = {"family": "vgg_face", "input_size": 32, "width": 4, "fc_width": 32, "dropout": 0.0}, \
    "conv1", 5, 4
SIZE = MODEL["input_size"]


batch = random_batches(N, SIZE, NUM_CLASSES)  # batch id -> always the same batch, so replays match


def client_engine(head: str = "server") -> DeviceTrainer:
    return DeviceTrainer(resolve_spec(MODEL), SPLIT, head, NUM_CLASSES, TrainConfig(lr=0.005))


def client(url: str, device_id: str, token: str, head: str, faults: list[Fault] | None = None) -> DeviceClient:
    return DeviceClient(url, device_id, token, client_engine(head), N, reconnect_timeout_s=90, faults=faults)


def in_process_server(run_dir: Path, tokens: dict[str, str], **config) -> ServerThread:
    trainer = ServerTrainer(resolve_spec(MODEL), SPLIT, NUM_CLASSES, TrainConfig(), device="cpu")
    authenticate = TokenAuthenticator({d: hash_token(t) for d, t in tokens.items()})
    return ServerThread(EdgeServer(trainer, server_info(trainer, N, 64 << 20), authenticate,
                                   ServerConfig(port=0, run_dir=run_dir, **config)))


def test_fault_specs_are_checked(monkeypatch):
    assert Fault.parse("crash-after-batch:3", SERVER_FAULTS) == Fault("crash-after-batch", 3)
    assert device_faults("a=drop-after-forward:2, b=crash-before-backward:1,a=drop-before-backward:5") == {
        "a": [Fault("drop-after-forward", 2), Fault("drop-before-backward", 5)], "b": [Fault("crash-before-backward", 1)]}
    assert device_faults("") == {}
    monkeypatch.setenv(FAULT_ENV, "dev-0=crash-after-embeddings:4")  # how a test faults the simulator's devices
    assert DeviceClient("ws://127.0.0.1:1", "dev-0", "t", client_engine(), N).faults == [
        Fault("crash-after-embeddings", 4)]
    for bad in ("crash-after-batch", "crash-after-batch:0", "crash-after-batch:x", "explode:3", "drop-after-forward:1"):
        with pytest.raises(ValueError, match="KIND:N"):
            Fault.parse(bad, SERVER_FAULTS)
    with pytest.raises(ValueError, match="DEVICE_ID=KIND:N"):
        device_faults("drop-after-forward:1")
    assert len(DEVICE_FAULTS) == 8


def test_dropped_connection_in_each_phase_of_the_exchange(tmp_path):
    """A connection aborted after FORWARD, after EMBEDDINGS, after EMBEDDING_GRAD or before BACKWARD is read
    (device head), and after FORWARD or before BACKWARD (server head): each device reconnects once and every
    batch is applied exactly once."""
    cases = [("device", p) for p in ("after-forward", "after-embeddings", "after-embedding-grad", "before-backward")]
    cases += [("server", p) for p in ("after-forward", "before-backward")]
    tokens = {f"dev-{i}": f"token-{i}" for i in range(len(cases))}
    batches = 3
    with in_process_server(tmp_path, tokens) as server:
        clients = [client(server.url, d, tokens[d], head, [Fault(f"drop-{phase}", 2)])
                   for d, (head, phase) in zip(sorted(tokens), cases)]

        async def run() -> None:
            await asyncio.gather(*(train_device(c, batch, total=batches) for c in clients))
        asyncio.run(run())
        records = {d: r.last_applied for d, r in server.server.records.items()}
        counted = {d: c.batches for d, c in server.server.metrics.devices.items()}
        steps = server.trainer.steps
    for c, case in zip(clients, cases):
        assert c.faults == [], case  # it fired
        assert c.traffic.reconnects == 1, case
        assert c.engine.committed == batches, case
    assert records == counted == {d: batches for d in tokens}
    assert steps == batches * len(cases)


def test_checkpoint_keeps_only_the_replies_a_retry_can_need(tmp_path):
    """A device's last reply is kept (beside the checkpoint, byte for byte for its retry after a restart)
    until the device sends its next training batch; then it is dropped and the checkpoint names none."""
    tokens = {"a": "token-a", "b": "token-b"}
    trainer_spec = resolve_spec(MODEL).to_dict()
    sessions = {d: ClientSession(d, t, trainer_spec, SPLIT, "server", N, NUM_CLASSES) for d, t in tokens.items()}
    activations = np.random.default_rng(0).random((N, 4, SIZE, SIZE), dtype=np.float32)

    async def ask(url: str, device_id: str, *messages: bytes) -> list[bytes]:
        async with connect(url, max_size=64 << 20, compression=None) as ws:
            await ws.send(sessions[device_id].hello())
            sessions[device_id].accept_welcome(await ws.recv())
            replies = []
            for message in messages:
                await ws.send(message)
                replies.append(await ws.recv())
            return replies

    labels = [0, 1, 2, 3]
    with in_process_server(tmp_path, tokens) as server:
        a1, = asyncio.run(ask(server.url, "a", sessions["a"].forward(1, activations, labels)))
        # a's next batch (refused: 3e38 is beyond the range bound) proves it holds the reply of batch 1
        refused, = asyncio.run(ask(server.url, "a", sessions["a"].forward(2, np.full_like(activations, 3e38), labels)))
        assert m.decode(refused)["code"] == "bad_tensor"
        b1, = asyncio.run(ask(server.url, "b", sessions["b"].forward(1, activations, labels)))
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state["devices"] == {"a": {"last_applied": 1, "reply": None},
                                "b": {"last_applied": 1, "reply": ReplyStore.name("b", 1)}}
    assert sorted(p.name for p in (tmp_path / "replies").iterdir()) == [ReplyStore.name("b", 1)]
    with in_process_server(tmp_path, tokens) as server:
        b_retry, = asyncio.run(ask(server.url, "b", sessions["b"].forward(1, activations, labels)))
        a_retry, = asyncio.run(ask(server.url, "a", sessions["a"].forward(1, activations, labels)))
        steps = server.trainer.steps
    assert b_retry == b1 and m.decode(a1)["type"] == m.BACKWARD
    assert m.decode(a_retry)["code"] == "out_of_order"  # a had acknowledged it: no correct device retries it
    assert steps == 2


def test_a_device_away_past_the_retention_loses_its_reply_not_its_progress(tmp_path):
    """Bounded retention (--reply-retention): the last reply of a device that went away is deleted from disk
    once it has been away longer than the retention, without waiting for another batch; its progress stays, so
    a late retry of that batch is refused, never applied twice, and its next batch trains."""
    spec = resolve_spec(MODEL).to_dict()
    session = ClientSession("b", "token-b", spec, SPLIT, "server", N, NUM_CLASSES)
    activations = np.random.default_rng(0).random((N, 4, SIZE, SIZE), dtype=np.float32)

    async def ask(url: str, *messages: bytes) -> list[dict]:
        async with connect(url, max_size=64 << 20, compression=None) as ws:
            await ws.send(session.hello())
            session.accept_welcome(await ws.recv())
            replies = []
            for message in messages:
                await ws.send(message)
                replies.append(m.decode(await ws.recv()))
            return replies

    def stored() -> list[str]:
        replies = tmp_path / "replies"
        return sorted(p.name for p in replies.iterdir()) if replies.is_dir() else []

    with in_process_server(tmp_path, {"b": "token-b"}, reply_retention_s=3.0, checkpoint_every_batches=1) as server:
        first, = asyncio.run(ask(server.url, session.forward(1, activations, [0, 1, 2, 3])))
        assert first["type"] == m.BACKWARD
        assert stored() == [ReplyStore.name("b", 1)]   # checkpointed with the batch, for a retry after a restart
        for _ in range(150):   # the housekeeping loop checkpoints within a second of the retention running out
            if not stored() and server.server.records["b"].last_reply is None:
                break
            threading.Event().wait(0.1)
        assert stored() == []
        retry, second = asyncio.run(ask(server.url, session.forward(1, activations, [0, 1, 2, 3]),
                                        session.forward(2, activations, [0, 1, 2, 3])))
        steps = server.trainer.steps
    assert retry["code"] == "out_of_order" and second["type"] == m.BACKWARD
    assert steps == 2
    assert load_checkpoint(tmp_path / "checkpoint.pt")["devices"]["b"]["last_applied"] == 2


def _devices_in_thread(url: str, tokens: dict[str, str], heads: dict[str, str], total: int) -> tuple[threading.Thread, dict]:
    """Devices training `total` batches each in a thread of their own (the test restarts servers meanwhile)."""
    out: dict = {}

    def main() -> None:
        clients = [client(url, d, tokens[d], heads[d]) for d in sorted(heads)]

        async def run() -> None:
            await asyncio.gather(*(train_device(c, batch, total=total) for c in clients))
        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by the test
            out["error"] = exc
        out["clients"] = clients
    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.slow
def test_server_killed_at_exact_points_loses_and_doubles_nothing(tmp_path):
    """The server process exits hard between applying a step and replying, (1) at step 6, 2 steps after its
    last checkpoint: the devices go back to it (rolling back what they committed since); (2) at step 9, which
    the checkpoint taken at every batch holds: the device's retry gets its reply from the reply store. A
    third server finishes. The counters match the devices' exactly. (tests/test_integration.py crashes a
    server right after a reply, crash-after-batch.)"""
    tokens = issue_tokens(tmp_path / "tokens.json", ["dev-0", "dev-1"])
    heads, total = {"dev-0": "server", "dev-1": "device"}, 7
    runs = [("crash-between-apply-and-reply:6", "4", 4), ("crash-between-apply-and-reply:9", "1", 9)]
    proc, port = start_server(tmp_path, tmp_path / "tokens.json", NUM_CLASSES, "--max-batch", str(N),
                              "--checkpoint-every", "1000", "--checkpoint-every-batches", runs[0][1], "--fault", runs[0][0],
                              model=json.dumps(MODEL))
    thread, out = _devices_in_thread(f"ws://127.0.0.1:{port}", tokens, heads, total)
    for i, (fault, _, checkpointed) in enumerate(runs):
        assert proc.wait(120) == FAULT_EXIT, fault
        state = load_checkpoint(tmp_path / "checkpoint.pt")
        assert state["trainer"]["steps"] == checkpointed, fault
        if checkpointed == 9:  # step 9's reply is held for the device's retry
            assert sum(r["reply"] is not None for r in state["devices"].values()) >= 1
        options = ["--fault", runs[i + 1][0], "--checkpoint-every-batches", runs[i + 1][1]] if i + 1 < len(runs) else []
        proc, _ = start_server(tmp_path, tmp_path / "tokens.json", NUM_CLASSES, "--max-batch", str(N),
                               "--checkpoint-every", "1000", *options,
                               port=port, model=json.dumps(MODEL))
    thread.join(300)
    assert stop_server(proc) == 0
    assert "error" not in out, out.get("error")
    clients = out["clients"]
    committed = {c.device_id: c.engine.committed for c in clients}
    counts = check_counts(committed, load_checkpoint(tmp_path / "checkpoint.pt"))
    assert committed == {"dev-0": total, "dev-1": total}
    assert counts["lost"] == counts["double_applied"] == 0 and counts["mismatched_devices"] == []
    assert counts["server_steps"] == 2 * total
    assert sum(c.traffic.reconnects for c in clients) >= 3  # both devices at the first crash, one at least at the second


@pytest.mark.slow
def test_device_process_killed_mid_batch(tmp_path):
    """A device process exits hard right after sending the FORWARD of batch 3 (device head: it holds the
    shared model from then on): the server drops the U-turn and releases the model, another device trains,
    and the killed device's batches are applied exactly as far as it got (2: batch 3 never got its
    gradient). A server-head batch whose BACKWARD never arrives is the drop test's before-backward case."""
    tokens = {f"dev-{i}": f"token-{i}" for i in range(2)}
    with in_process_server(tmp_path, tokens, pending_timeout_s=600) as server:
        device = start_device(server.url, "dev-1", tokens["dev-1"], MODEL, "device", NUM_CLASSES, N, 6,
                              "dev-1=crash-after-forward:3")
        assert device.wait(180) == FAULT_EXIT
        survivor = client(server.url, "dev-0", tokens["dev-0"], "device")
        asyncio.run(train_device(survivor, batch, total=4))  # would wait 600 s if dev-1 still held the model
        records = {d: r.last_applied for d, r in server.server.records.items()}
        counted = {d: c.batches for d, c in server.server.metrics.devices.items()}
        steps = server.trainer.steps
    assert records == counted == {"dev-0": 4, "dev-1": 2}
    assert steps == 6
