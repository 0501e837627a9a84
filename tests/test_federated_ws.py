"""Federated rounds over the protocol (SPEC.md section 15): the sans-I/O round rules, bad uploads refused,
a device that drops mid-round left out, one server hosting split and federated sessions, and (slow) real
device processes across a killed server giving the same global model as the in-process backend, bit for bit."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from splitface.net.tls import UntrustedServer
from splitface.device.federated import LocalConfig
from splitface.device.federated.device import FederatedDevice
from splitface.device.federated.wire import (backbone_template, config_from_wire, config_to_wire, state_from_wire, state_to_wire, upload_shapes)
from splitface.common.models import ModelSpec, build_backbone
from splitface.common.models.weights import save_backbone
from splitface.common.optim import TrainConfig
from splitface.server.app import EdgeServer, ServerConfig, ServerThread, server_info
from splitface.server.auth import TokenAuthenticator, hash_token
from splitface.server.checkpoint import load_checkpoint
from research.federated import FederatedConfig, FederatedRun, load_population, virtual_clients
from research.federated.rounds import CRASH_EXIT_CODE
from research.federated.tasks import run_task
from research.federated.websocket import WebsocketBackend, client_device_id, federated_server
from splitface.server.trainer import ServerTrainer
from splitface.protocol import messages as m
from splitface.protocol.client_session import ClientSession, FederatedClientSession
from splitface.protocol.round_board import RoundBoard
from splitface.protocol.server_session import Admit, Reply, ServerInfo, ServerSession

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=16, dropout=0.0)
TOKEN = "fed-token"


# --- the sans-I/O round rules ------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


SHAPES = {"a": (2, 3), "b": (4,)}
CONFIG, _ = config_to_wire(LocalConfig(batch_size=4))


def opened(clock: Clock, sampled=("d1", "d2"), quorum: int = 2, clip: float | None = 1.0) -> RoundBoard:
    board = RoundBoard({"toy": 1}, clock=clock)
    board.open(3, {d: 10 + i for i, d in enumerate(sampled)}, CONFIG, clip, SHAPES,
               {"w": np.ones(2, np.float32)}, None, quorum, deadline_s=30.0)
    return board


def connect(board: RoundBoard, device_id: str) -> tuple[ServerSession, FederatedClientSession, dict]:
    info = ServerInfo(model={"toy": 1}, split="", activation_shape=(), embedding_dim=1, num_classes=0, max_batch=0,
                      heads=())
    session = ServerSession(info, lambda d, t: t == TOKEN, {}, lambda d: 0, board)
    client = FederatedClientSession(device_id, TOKEN, {"toy": 1})
    assert isinstance(session.receive(client.hello()), Admit)
    return session, client, m.decode(session.welcome())


def delta(scale: float = 0.1) -> dict[str, np.ndarray]:
    return {k: np.full(shape, scale, np.float32) for k, shape in SHAPES.items()}


def norm_of(d: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in d.values()))


def refused(session: ServerSession, data: bytes) -> str:
    action = session.receive(data)
    assert isinstance(action, Reply) and not action.close, "a refused upload leaves the session open"
    message = m.decode(action.data)
    assert message["type"] == m.ERROR, message
    return message["code"]


def test_round_start_model_and_update_flow():
    clock = Clock()
    board = opened(clock)
    session, client, start = connect(board, "d1")
    assert start["type"] == m.ROUND_START and start["round_id"] == 3 and start["seed"] == 10
    assert start["clip_norm"] == 1.0 and start["deadline_s"] == 30.0 and start["config"] == CONFIG
    model = m.decode(session.receive(client.model_request(3)).data)
    assert model["type"] == m.MODEL and model["round_id"] == 3 and model["weights"]["w"].tolist() == [1.0, 1.0]
    d = delta()
    ack = m.decode(session.receive(client.update(3, d, norm_of(d), 5, 0.5)).data)
    assert ack == {"type": m.UPDATE_ACK, "round_id": 3}
    assert m.decode(session.receive(client.round_request()).data)["type"] == m.ROUND_WAIT  # nothing more for it
    assert list(board.current.uploads) == ["d1"] and not board.current.closed  # quorum is 2


def test_bad_uploads_are_refused_and_never_stored():
    clock = Clock()
    board = opened(clock, sampled=("d1", "d2", "d3"), quorum=3, clip=1.0)
    session, client, _ = connect(board, "d1")
    good = delta()
    n = norm_of(good)
    assert refused(session, client.update(4, good, n, 5, 0.5)) == "bad_state"  # a round not open (yet)
    assert refused(session, client.update(2, good, n, 5, 0.5)) == "round_closed"  # an earlier round: late
    assert refused(session, client.update(3, {**good, "b": np.zeros(5, np.float32)}, n, 5, 0.5)) == "bad_tensor"
    assert refused(session, client.update(3, {"a": good["a"]}, n, 5, 0.5)) == "bad_tensor"  # a name missing
    assert refused(session, client.update(3, {**good, "c": np.zeros(1, np.float32)}, n, 5, 0.5)) == "bad_tensor"
    big = delta(1.0)  # norm 3.16 > clip 1.0, claimed honestly
    assert refused(session, client.update(3, big, norm_of(big), 5, 0.5)) == "bad_tensor"
    assert refused(session, client.update(3, good, n / 2, 5, 0.5)) == "bad_tensor"  # larger than the norm it claims
    nan = msgpack.packb({"type": "update", "round_id": 3, "delta": {
        "a": {"dtype": "f32", "shape": [2, 3], "data": np.array([0, 0, 0, 0, 0, np.nan], "<f4").tobytes()},
        "b": {"dtype": "f32", "shape": [4], "data": bytes(16)}}, "norm": 0.0, "examples": 1, "loss": 0.0})
    assert refused(session, nan) == "bad_tensor"
    assert board.current.uploads == {}  # nothing refused was kept
    outsider, outsider_client, wait = connect(board, "d9")  # not sampled
    assert wait["type"] == m.ROUND_WAIT
    assert refused(outsider, outsider_client.model_request(3)) == "bad_state"
    assert refused(outsider, outsider_client.update(3, good, n, 5, 0.5)) == "bad_state"
    session.receive(client.update(3, good, n, 5, 0.5))
    assert refused(session, client.update(3, good, n, 5, 0.5)) == "bad_state"  # a second upload
    assert list(board.current.uploads) == ["d1"]
    assert np.array_equal(board.current.uploads["d1"]["delta"]["a"], good["a"])
    assert refused(session, m.encode({"type": m.FORWARD, "batch_id": 1, "activations": np.zeros((1, 1), np.float32)})) \
        == "bad_state"  # a federated session cannot send split messages


def test_quorum_closes_the_round_and_late_uploads_are_refused():
    clock = Clock()
    board = opened(clock, quorum=1)
    closed = []
    board.on_complete = closed.append
    s1, c1, _ = connect(board, "d1")
    s2, c2, _ = connect(board, "d2")
    m.decode(s2.receive(c2.model_request(3)).data)
    s1.receive(c1.update(3, delta(), norm_of(delta()), 5, 0.5))
    assert closed == [3] and board.current.closed
    assert refused(s2, c2.update(3, delta(), norm_of(delta()), 5, 0.5)) == "round_closed"
    assert m.decode(s2.receive(c2.round_request()).data) == {"type": m.ROUND_WAIT, "closed_round": 3,
                                                             "retry_after_s": 1.0, "finished": False}
    assert list(board.close()) == ["d1"]


def test_deadline_ends_a_round_for_late_devices():
    clock = Clock()
    board = opened(clock)
    session, client, _ = connect(board, "d1")
    clock.now = 31.0
    assert refused(session, client.model_request(3)) == "round_closed"
    assert refused(session, client.update(3, delta(), norm_of(delta()), 5, 0.5)) == "round_closed"
    assert m.decode(session.receive(client.round_request()).data)["type"] == m.ROUND_WAIT
    with pytest.raises(RuntimeError, match="still open"):
        board.open(4, {}, CONFIG, None, SHAPES, {"w": np.ones(1, np.float32)}, None, 1, 1.0)
    board.close()
    with pytest.raises(ValueError, match="completed already"):
        board.open(2, {}, CONFIG, None, SHAPES, {"w": np.ones(1, np.float32)}, None, 1, 1.0)


def test_handshake_modes():
    board = RoundBoard({"toy": 1})
    split_info = ServerInfo(model={"toy": 1}, split="conv1", activation_shape=(2,), embedding_dim=4, num_classes=3,
                            max_batch=2)
    fed = FederatedClientSession("d1", TOKEN, {"toy": 1})
    # a server without a board hosts no federated session
    reply = ServerSession(split_info, lambda d, t: True, {}, lambda d: 0).receive(fed.hello())
    assert reply.close and m.decode(reply.data)["code"] == "unsupported"
    # the federated model must be the run's
    other = FederatedClientSession("d1", TOKEN, {"toy": 2}).hello()
    reply = ServerSession(split_info, lambda d, t: True, {}, lambda d: 0, board).receive(other)
    assert reply.close and m.decode(reply.data)["code"] == "model_mismatch"
    # one server, both modes: a split session cannot send round messages
    split = ClientSession("d2", TOKEN, {"toy": 1}, "conv1", "device", 2)
    session = ServerSession(split_info, lambda d, t: True, {}, lambda d: 0, board)
    assert isinstance(session.receive(split.hello()), Admit) and session.mode == "split"
    assert m.decode(session.receive(fed.round_request()).data)["code"] == "bad_state"
    # a federated-only server refuses split sessions
    fed_only = dataclasses.replace(split_info, heads=())
    reply = ServerSession(fed_only, lambda d, t: True, {}, lambda d: 0, board).receive(split.hello())
    assert reply.close and m.decode(reply.data)["code"] == "unsupported"


def test_round_config_and_weights_cross_the_wire_exactly():
    assert list(m.LOCAL_CONFIG) == [f.name for f in dataclasses.fields(LocalConfig) if f.name != "clip_norm"]
    for config in (LocalConfig(batch_size=8, lr=0.01, clip_norm=0.05), LocalConfig()):
        wire, clip = config_to_wire(config)
        decoded = m.decode(m.encode({"type": m.ROUND_START, "round_id": 1, "seed": 2**32 - 1, "config": wire,
                                     "deadline_s": 1.0, "max_message_bytes": 10}))
        assert config_from_wire(decoded["config"], clip) == config
    torch.manual_seed(3)
    backbone = build_backbone(TINY)
    backbone.train()(torch.randn(2, 3, 16, 16))  # batch-norm statistics and the int step counter move
    state = backbone.state_dict()
    message = m.decode(m.encode({"type": m.MODEL, "round_id": 1, "weights": state_to_wire(state)}))
    back = state_from_wire(message["weights"], backbone_template(TINY))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in state.items())
    assert set(upload_shapes(TINY)) == {k for k, _ in backbone.named_parameters()}


# --- over sockets -------------------------------------------------------------------------------------------

CONFIG_WS = FederatedConfig(method="dp-fedemb", rounds=1, users_per_client=3, clients_per_round=2.0, local_epochs=1,
                            batch_size=4, client_lr=0.05, noise_multiplier=1.0, clip_norm=0.5, seed=0)


@pytest.fixture(scope="module")
def population(lfw):
    return load_population(lfw, TINY.input_size, max_users=6, seed=0)


@pytest.fixture(scope="module")
def init_state():
    torch.manual_seed(0)
    return build_backbone(TINY).state_dict()


def run_devices(devices: list[FederatedDevice]) -> threading.Thread:
    async def all_of() -> None:
        await asyncio.gather(*(d.run() for d in devices))
    thread = threading.Thread(target=asyncio.run, args=(all_of(),), daemon=True)
    thread.start()
    return thread


def test_a_device_that_drops_mid_round_is_left_out(population, init_state, tmp_path):
    """Two devices sampled, one leaves after downloading the model; the round closes on its quorum (half) with
    the other's update: the global model equals the in-process round with that client missing, bit for bit.
    The same server also serves a split session."""
    clients = virtual_clients(len(population.users), CONFIG_WS.users_per_client, CONFIG_WS.seed)
    assert len(clients) == 2
    trainer = ServerTrainer(TINY, "conv1", 3, TrainConfig())
    board = RoundBoard(TINY.to_dict(), retry_after_s=0.1)
    digests = {client_device_id(c): hash_token(TOKEN) for c in range(2)}
    server = EdgeServer(trainer, server_info(trainer, 4, 64 << 20), TokenAuthenticator(digests),
                        ServerConfig(port=0, run_dir=tmp_path / "server"), board=board)
    with ServerThread(server) as thread:
        url = thread.url
        split_reply = asyncio.run(_split_hello(url))
        assert split_reply["type"] == m.WELCOME  # one server, both modes
        devices = [FederatedDevice(url, client_device_id(c), TOKEN, TINY, *population.of_users(clients[c]),
                                   leave_in_round=1 if c == 1 else None) for c in range(2)]
        devices_done = run_devices(devices)
        backend = WebsocketBackend(thread, quorum=0.5, deadline_s=120)
        run = FederatedRun(CONFIG_WS, TINY, population, init_state, tmp_path / "ws", backend)
        run.run(log=lambda _: None)
        backend.finish()
        devices_done.join(60)
    assert not devices_done.is_alive()
    assert devices[0].trained == [1] and devices[1].trained == []
    assert run.history[0]["sampled"] == 2 and run.history[0]["clients"] == 1

    def without_client_1(tasks):
        return [None if t.client == 1 else run_task(t) for t in tasks]
    reference = FederatedRun(CONFIG_WS, TINY, population, init_state, tmp_path / "ref", without_client_1)
    reference.run(log=lambda _: None)
    ours, theirs = run.backbone.state_dict(), reference.backbone.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not all(torch.equal(ours[k], init_state[k]) for k in ours)


async def _split_hello(url: str) -> dict:
    from websockets.asyncio.client import connect
    split = ClientSession("client-0", TOKEN, TINY.to_dict(), "conv1", "device", 2)
    async with connect(url) as ws:
        await ws.send(split.hello())
        return m.decode(await ws.recv())


# --- real device processes across a killed server (slow) ----------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_device_processes_across_a_server_kill_equal_the_in_process_run(lfw, tmp_path):
    """Three device processes train a 3-round DP-FedEmb run over websockets. The run starts under
    `python -m research.federated --backend websocket`, whose process dies in round 2 (update applied in memory,
    not checkpointed); the hosting server (`python -m research.federated.served`) resumes it with the same options (as --federated-*) while serving a
    split session at once (a `splitface-device sim` process trains an epoch); the federated devices reconnect. The
    final global model and accountant equal the uninterrupted in-process run's bit for bit (all on one thread)."""
    population = load_population(lfw, TINY.input_size, max_users=12, seed=0)
    config = dataclasses.replace(CONFIG_WS, rounds=3, users_per_client=4, clients_per_round=2.0)
    clients = virtual_clients(len(population.users), config.users_per_client, config.seed)
    torch.manual_seed(0)
    init = build_backbone(TINY)
    save_backbone(tmp_path / "init.pt", TINY, init)
    tokens = {d: f"token-{d}" for d in [*(client_device_id(c) for c in range(len(clients))), "split-0"]}
    (tmp_path / "tokens.json").write_text(json.dumps({d: hash_token(t) for d, t in tokens.items()}))
    (tmp_path / "split-tokens.json").write_text(json.dumps({"split-0": tokens["split-0"]}))
    port = _free_port()
    run = {"data": lfw, "model": json.dumps(TINY.to_dict()), "init": tmp_path / "init.pt", "out": tmp_path / "run",
           "max-users": 12, "users-per-client": 4, "clients-per-round": 2, "batch-size": 4, "local-epochs": 1,
           "client-lr": 0.05, "clip-norm": 0.5, "method": "dp-fedemb", "noise-multiplier": 1.0, "rounds": 3,
           "view1-limit": 20, "round-deadline-s": 120}

    def options(prefix: str) -> list[str]:  # the same run's options, as either command declares them
        return [a for k, v in run.items() for a in (f"--{prefix}{k}", str(v))]
    crashed = subprocess.Popen([sys.executable, "-m", "research.federated", *options(""), "--threads", "1",
                                "--backend", "websocket", "--port", str(port), "--tokens", str(tmp_path / "tokens.json"),
                                "--crash-in-round", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    devices = []
    for c, members in enumerate(clients):
        images, labels = population.of_users(members)
        np.savez(tmp_path / f"c{c}.npz", images=images, labels=labels)
        (tmp_path / f"c{c}.token").write_text(tokens[client_device_id(c)])
        devices.append(subprocess.Popen(
            [sys.executable, "-m", "splitface.device.federated", "--url", f"ws://127.0.0.1:{port}", "--device-id",
             client_device_id(c), "--token-file", str(tmp_path / f"c{c}.token"), "--data", str(tmp_path / f"c{c}.npz"),
             "--model", json.dumps(TINY.to_dict())], cwd=ROOT, stdout=open(tmp_path / f"c{c}.log", "w"),
            stderr=subprocess.STDOUT, text=True))
    served = split = None
    try:
        out, _ = crashed.communicate(timeout=300)
        assert crashed.returncode == CRASH_EXIT_CODE, out[-3000:]
        assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["round"] == 1
        log = tmp_path / "serve.log"
        served = subprocess.Popen(
            [sys.executable, "-m", "research.federated.served", "--model", json.dumps(TINY.to_dict()), "--num-classes",
             "2", "--tokens", str(tmp_path / "tokens.json"), "--port", str(port), "--run-dir", str(tmp_path / "split"),
             "--max-batch", "8", "--threads", "1", *options("federated-")], cwd=ROOT, stdout=open(log, "w"),
            stderr=subprocess.STDOUT)
        split = subprocess.Popen(
            [sys.executable, "-m", "splitface.device_cli", "sim", "--server", f"ws://127.0.0.1:{port}", "--tokens",
             str(tmp_path / "split-tokens.json"), "--data", str(lfw), "--model", json.dumps(TINY.to_dict()),
             "--min-images", "10", "--max-images", "11", "--max-identities", "2", "--devices", "1", "--epochs", "1",
             "--batch-size", "8", "--crop", "160", "--threads", "1", "--no-progress", "--reconnect-timeout", "120",
             "--results", str(tmp_path / "split" / "sim.json")], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        split_out, _ = split.communicate(timeout=300)
        assert split.returncode == 0, split_out[-3000:] + log.read_text()[-3000:]
        for d in devices:
            d.wait(300)
        assert all(d.returncode == 0 for d in devices), device_logs(tmp_path) + log.read_text()[-3000:]
        assert served.poll() is None, log.read_text()[-3000:]  # the federated run over, split is still served
        served.terminate()
        assert served.wait(60) == 0, log.read_text()[-3000:]
    finally:
        for process in (crashed, *devices, served, split):
            if process is not None and process.poll() is None:
                process.kill()
    text = log.read_text()
    assert "resuming after round 1" in text and "user-level epsilon" in text, text[-3000:]
    sim = json.loads((tmp_path / "split" / "sim.json").read_text())["devices"][0]  # its epoch, trained by the server
    assert len(sim["epochs"]) == 1 and sim["epochs"][0]["samples"] == sim["train_samples"] > 0
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert state["round"] == 3 and [h["round"] for h in state["history"]] == [1, 2, 3]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = FederatedRun(config, TINY, population, init.state_dict(), tmp_path / "whole")
        whole.run(log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(v, state["backbone"][k]) for k, v in whole.backbone.state_dict().items())
    assert state["accountant"] == whole.accountant.state()
    trained = [json.loads((tmp_path / f"c{c}.log").read_text().strip().splitlines()[-1])["rounds"]
               for c in range(len(clients))]
    assert sum(len(r) for r in trained) >= sum(h["clients"] for h in state["history"])


def device_logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(folder.glob("c*.log")))


def test_device_trains_from_the_round_messages_as_in_process(population, init_state):
    """The device's path (ROUND_START + MODEL bytes -> train_client -> UPDATE bytes) gives the in-process client's
    update bit for bit, here with the global head in MODEL (FedAvg; FedEmb's local head: the socket tests)."""
    from research.federated.tasks import ClientTask
    images, labels = population.of_users(np.array([0, 1, 2]))
    torch.manual_seed(1)
    head = {"weight": torch.randn(6, 16) * 0.01, "bias": torch.zeros(6)}
    task = ClientTask(1, 0, TINY, init_state, images, labels, LocalConfig(batch_size=4, lr=0.05, clip_norm=0.5), 123,
                      head)
    config, clip = config_to_wire(task.config)
    board = RoundBoard(TINY.to_dict())
    board.open(1, {"client-0": task.seed}, config, clip, upload_shapes(TINY, (6, 16)), state_to_wire(init_state),
               state_to_wire(head), 1, 60.0)
    device = FederatedDevice("ws://127.0.0.1:1", "client-0", TOKEN, TINY, images, labels)
    update = m.decode(device._train(m.decode(board.offer("client-0")), m.decode(board.model_for("client-0", 1))))
    expected = run_task(task)
    assert set(update["delta"]) == set(expected.delta)
    assert all(np.array_equal(update["delta"][k], v.numpy()) for k, v in expected.delta.items())
    assert update["norm"] == expected.norm and update["loss"] == expected.loss
    assert m.decode(board.accept("client-0", update))["type"] == m.UPDATE_ACK


def test_hostile_round_messages_get_protocol_errors_and_store_nothing_bad():
    """Seeded mutations (splitface.protocol.mutate) of every federated vector fed to an admitted federated session with a
    round open: each gets a well-formed reply, never an exception, and whatever was stored is a valid update."""
    import random

    from splitface.protocol.mutate import mutate
    from splitface.protocol.vectors import generate as gen
    vectors = [p.read_bytes() for p in sorted((Path(gen.__file__).parent / "federated").glob("*.msgpack"))]
    rng = random.Random(0)
    codes: set[str] = set()
    for i in range(600):
        board = gen.federated_board()
        session = ServerSession(ServerInfo(model=gen.MODEL, split="", activation_shape=(), embedding_dim=1,
                                           num_classes=0, max_batch=0, heads=()),
                                lambda d, t: t == gen.TOKEN, {}, lambda d: 0, board)
        assert isinstance(session.receive(FederatedClientSession(gen.FEDERATED_DEVICE, gen.TOKEN,
                                                                 dict(gen.MODEL)).hello()), Admit)
        _, data = mutate(rng.choice(vectors), rng)
        reply = m.decode(session.receive(data).data)
        codes.add(reply.get("code", reply["type"]))
        for upload in board.current.uploads.values():
            assert list(upload["delta"]) == ["conv.weight"] and upload["delta"]["conv.weight"].shape == (2, 2)
            assert np.isfinite(upload["delta"]["conv.weight"]).all()
            assert np.linalg.norm(upload["delta"]["conv.weight"].astype(np.float64)) <= 0.05
    assert {"bad_message", "bad_tensor", "bad_state"} <= codes  # the mutations reached every kind of refusal


def test_federated_devices_use_wss_and_refuse_an_untrusted_server(tmp_path):
    """The federated server serves wss:// like the split one; a device trusting its CA joins (and hears the run is
    finished), one trusting another CA fails clearly instead of sending its token."""
    import trustme
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(tmp_path / "cert.pem")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    other.cert_pem.write_to_path(tmp_path / "other.pem")
    server = federated_server(TINY, {"client-0": hash_token(TOKEN)}, tmp_path / "server", host="localhost",
                              tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem")
    images, labels = np.zeros((2, 3, 16, 16), np.uint8), np.array([0, 1])
    with server as thread:
        assert thread.url.startswith("wss://")
        WebsocketBackend(thread).finish()
        trusting = FederatedDevice(thread.url, "client-0", TOKEN, TINY, images, labels, ca_file=tmp_path / "ca.pem")
        assert asyncio.run(trusting.run()) == []
        wary = FederatedDevice(thread.url, "client-0", TOKEN, TINY, images, labels, ca_file=tmp_path / "other.pem")
        with pytest.raises(UntrustedServer, match="not accepted"):  # at once, not after the reconnect timeout
            asyncio.run(wary.run())
