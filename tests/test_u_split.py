"""PrivacyFace in U-shaped split training: the CLUSTERS relay (SPEC.md section 8.1) in the sans-I/O session and
over a real loopback server with two device-head devices on real LFW faces, each with its own people."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.conftest import TOKENS, serve_in_thread, small_trainer
from splitface.device.connection import DeviceClient
from splitface.device.federated.consensus import consensus_loss
from splitface.common.dplc import DPLCConfig
from splitface.common.models import resolve_spec
from splitface.device.federated.u_split import ConsensusEngine, ConsensusHead, train_u_split
from research.federated.population import private_faces
from splitface.protocol import messages as m
from splitface.protocol.clusters import ClusterRelay, HeadBoard
from splitface.protocol.errors import ErrorCode
from splitface.protocol.client_session import ClientSession
from splitface.protocol.server_session import Admit, Reply, ServerInfo, ServerSession

DIM = 4
INFO = ServerInfo(model={"family": "toy"}, split="conv1", activation_shape=(2,), embedding_dim=DIM, num_classes=3,
                  max_batch=2)


def _session(device_id: str, head: str, relay: ClusterRelay | None,
             heads: HeadBoard | None = None) -> tuple[ServerSession, ClientSession]:
    client = ClientSession(device_id, "t", {"family": "toy"}, "conv1", head, 2, 3 if head == "server" else None)
    server = ServerSession(INFO, lambda d, t: True, {}, lambda d: 0, relay=relay, heads=heads)
    assert isinstance(server.receive(client.hello()), Admit)
    return server, client


def _error(action) -> str:
    assert isinstance(action, Reply)
    message = m.decode(action.data)
    assert message["type"] == m.ERROR
    return message["code"]


def test_relay_returns_the_other_devices_latest_releases():
    relay = ClusterRelay(DIM)
    (a, ca), (b, cb) = _session("phone-a", "device", relay), _session("phone-b", "device", relay)
    first = np.eye(DIM, dtype=np.float32)[:2]
    got = m.decode(a.receive(ca.clusters(first)).data)["clusters"]
    assert got.shape == (0, DIM)  # nobody else has released yet
    got = m.decode(b.receive(cb.clusters(np.eye(DIM, dtype=np.float32)[3:])).data)["clusters"]
    np.testing.assert_array_equal(got, first)
    # a's new release replaces its old one; a never gets its own back
    np.testing.assert_array_equal(m.decode(b.receive(cb.clusters(np.zeros((0, DIM), np.float32))).data)["clusters"],
                                  first)
    np.testing.assert_array_equal(m.decode(a.receive(ca.clusters(first[1:])).data)["clusters"], np.zeros((0, DIM)))
    np.testing.assert_array_equal(relay.latest["phone-a"], first[1:])


def test_relay_refusals_leave_the_session_open_and_store_nothing():
    relay = ClusterRelay(DIM)
    server_head, client = _session("phone-s", "server", relay)
    raw = lambda x: m.encode({"type": m.CLUSTERS, "clusters": np.asarray(x, np.float32)})  # noqa: E731
    assert _error(server_head.receive(raw(np.eye(DIM)[:1]))) == ErrorCode.BAD_STATE.value
    s, _ = _session("phone-d", "device", relay)
    assert _error(s.receive(raw(np.ones((1, DIM)) / 2 * 1.2))) == ErrorCode.BAD_TENSOR.value  # norm 1.2
    assert _error(s.receive(raw(np.eye(DIM + 1)[:1, :]))) == ErrorCode.BAD_TENSOR.value  # wrong width
    assert _error(s.receive(raw(np.tile(np.eye(DIM)[:1], (65, 1))))) == ErrorCode.BAD_TENSOR.value  # > 64 rows
    assert relay.latest == {} and not s.closed
    no_relay, c = _session("phone-n", "device", None)
    assert _error(no_relay.receive(c.clusters(np.eye(DIM)[:1]))) == ErrorCode.UNSUPPORTED.value
    assert no_relay.closed  # unsupported is fatal (SPEC.md section 12)


def test_fedgc_head_board_corrects_each_upload_with_the_others_latest():
    from research.federated.fedgc import device_head_board, gradient_correction
    board = device_head_board(DIM, lr=0.1, lam=20.0, scale=4.0)
    (a, ca), (b, cb) = _session("phone-a", "device", None, board), _session("phone-b", "device", None, board)
    rng = np.random.default_rng(0)
    head_a, head_b = rng.normal(size=(2, DIM)).astype(np.float32), rng.normal(size=(3, DIM)).astype(np.float32)
    alone = m.decode(a.receive(ca.class_embeddings(head_a)).data)["class_embeddings"]
    np.testing.assert_allclose(alone, head_a, atol=1e-6)  # no other device: no negatives, no correction
    got = m.decode(b.receive(cb.class_embeddings(head_b)).data)["class_embeddings"]
    expected = gradient_correction({"phone-a": torch.tensor(alone), "phone-b": torch.from_numpy(head_b)},
                                   lr=0.1, lam=20.0, scale=4.0)
    np.testing.assert_array_equal(got, expected["phone-b"].numpy())
    np.testing.assert_array_equal(board.latest["phone-a"], expected["phone-a"].numpy())  # a's corrected too
    assert not np.allclose(got, head_b)
    server_head, cs = _session("phone-s", "server", None, board)
    raw = m.encode({"type": m.CLASS_EMBEDDINGS, "class_embeddings": head_a})
    assert _error(server_head.receive(raw)) == ErrorCode.BAD_STATE.value
    assert _error(a.receive(ca.class_embeddings(np.zeros((1, DIM), np.float32)))) == ErrorCode.BAD_TENSOR.value
    off, co = _session("phone-o", "device", None)
    assert _error(off.receive(co.class_embeddings(head_a))) == ErrorCode.UNSUPPORTED.value and off.closed


def test_consensus_engine_head_step_is_the_consensus_loss():
    spec = resolve_spec("vgg_face_small")
    engine = ConsensusEngine(spec, "conv1", "device", 2)
    e = np.random.default_rng(0).normal(size=(3, spec.embedding_dim)).astype(np.float32)
    y = np.array([0, 1, 1])
    for received in (None, torch.nn.functional.normalize(torch.randn(2, spec.embedding_dim), dim=1)):
        engine.received = received
        grad, loss, _ = engine.head_step(e, y)
        x = torch.from_numpy(e).requires_grad_(True)
        h = engine.head_loss
        expected = consensus_loss(x, engine.classifier.weight.detach(), torch.from_numpy(y), received, h.rho, h.scale,
                                  h.margin, h.kind)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-6)
        np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_two_devices_exchange_clusters_over_a_real_server(tmp_path, lfw):
    """Two device-head devices, two LFW people each (identity-partitioned), one shared server backbone: after
    their first batch each releases its DPLC clusters and trains against the other's, as relayed; with the
    opt-in FedGC correction on, each also uploads its head and adopts the server's correction."""
    faces = private_faces(lfw, max_users=4, seed=0)
    images, labels = faces.load(64, 160), faces.labels
    trainer = small_trainer(num_classes=2)
    config = DPLCConfig(min_members=1, queries=2, epsilon=1.0)  # T = 1: a 2-person device always releases
    from research.federated.fedgc import device_head_board
    with serve_in_thread(trainer, tmp_path, max_batch=8) as server:
        server.server.heads = device_head_board(trainer.spec.embedding_dim, lr=0.1)  # opt-in, before any connection
        async def device(k: int) -> tuple[ConsensusEngine, list[float]]:
            mine = np.isin(labels, [2 * k, 2 * k + 1])
            engine = ConsensusEngine(trainer.spec, "conv1", "device", 2, head_loss=ConsensusHead(rho=config.rho))
            client = DeviceClient(server.url, f"device-{k}", TOKENS[f"device-{k}"], engine, batch_size=8)
            await client.connect()
            try:
                losses = await train_u_split(client, engine, images[mine], labels[mine] - 2 * k, epochs=1,
                                             batch_size=2, exchange_every=1, config=config, seed=k,
                                             fedgc_every=1)
            finally:
                await client.close()
            return engine, losses

        async def both():
            first = await device(0)  # device 0 finishes first: device 1 then always receives its last release
            return first, await device(1)

        (e0, l0), (e1, l1) = asyncio.run(both())
    assert e0.dplc_calls >= 1 and e1.dplc_calls >= 1
    relay = server.server.relay
    assert set(relay.latest) == {"device-0", "device-1"}
    assert len(relay.latest["device-0"]) >= 1
    np.testing.assert_array_equal(e1.received.numpy(), relay.latest["device-0"])  # what device 0 last released
    np.testing.assert_allclose(np.linalg.norm(e1.received.numpy(), axis=1), 1.0, rtol=1e-5)
    assert all(np.isfinite(l0)) and all(np.isfinite(l1)) and trainer.steps == len(l0) + len(l1)
    assert {d: h.shape for d, h in server.server.heads.latest.items()} == {  # FedGC: the server holds both heads
        "device-0": (2, trainer.spec.embedding_dim), "device-1": (2, trainer.spec.embedding_dim)}
