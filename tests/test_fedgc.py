"""FedGC's gradient correction: autograd's gradient of the softmax regularizer against the closed form."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from research.federated.fedgc import gradient_correction, regularizer_gradient, softmax_regularizer, stack_heads


def closed_form_gradient(v: np.ndarray, owners: np.ndarray, s: float) -> np.ndarray:
    """grad_{v_m} Reg = s / (C |v_m|) (I - w_m w_m^T) sum_{j in N(m)} (P_mj + P_jm) w_j (fedgc.py's docstring)."""
    c = len(v)
    w = v / np.linalg.norm(v, axis=1, keepdims=True)
    neg = owners[:, None] != owners[None, :]  # N(i): other clients' classes
    p = np.zeros((c, c))
    for i in range(c):
        allowed = neg[i] | (np.arange(c) == i)
        e = np.where(allowed, np.exp(s * w[i] @ w.T), 0.0)
        p[i] = e / e.sum()
    grad = np.zeros_like(v)
    for m in range(c):
        pull = sum((p[m, j] + p[j, m]) * w[j] for j in range(c) if neg[m, j])
        grad[m] = s / (c * np.linalg.norm(v[m])) * (np.eye(v.shape[1]) - np.outer(w[m], w[m])) @ pull
    return grad


def test_gradient_matches_the_closed_form():
    rng = np.random.default_rng(0)
    heads = {"a": torch.from_numpy(rng.normal(size=(2, 3)) * 2), "b": torch.from_numpy(rng.normal(size=(1, 3))),
             "c": torch.from_numpy(rng.normal(size=(3, 3)) * 0.5)}
    weights, owners, _ = stack_heads(heads)
    for s in (1.0, 4.0):
        np.testing.assert_allclose(regularizer_gradient(weights, owners, s).numpy(),
                                   closed_form_gradient(weights.numpy(), owners.numpy(), s), rtol=1e-9, atol=1e-12)


def test_correction_is_the_scaled_gradient_step_and_keeps_shapes():
    rng = np.random.default_rng(1)
    heads = {0: torch.from_numpy(rng.normal(size=(2, 4))).float(), 1: torch.from_numpy(rng.normal(size=(3, 4))).float()}
    corrected = gradient_correction(heads, lr=0.1, lam=20.0, scale=2.0)
    weights, owners, _ = stack_heads(heads)
    step = 20.0 * 0.1 * regularizer_gradient(weights, owners, 2.0)
    for k, i in ((0, 0), (1, 1)):
        assert corrected[k].shape == heads[k].shape and corrected[k].dtype == torch.float32
        np.testing.assert_allclose(corrected[k].numpy(), (weights - step)[owners == i].numpy(), rtol=1e-6)
    # lambda = 0 and a single client (no cross-client negatives) change nothing
    assert torch.equal(gradient_correction(heads, lr=0.1, lam=0.0)[1], heads[1])
    alone = gradient_correction({0: heads[0]}, lr=0.1)
    assert torch.allclose(alone[0], heads[0])


def test_correction_spreads_overlapping_classes_of_different_clients():
    a = torch.tensor([[1.0, 0.05, 0.0]])
    b = torch.tensor([[1.0, -0.05, 0.0]])  # another client's class almost on top of a's
    before = float(F.cosine_similarity(a, b))
    corrected = gradient_correction({"a": a, "b": b}, lr=0.1, lam=20.0, scale=4.0)
    assert float(F.cosine_similarity(corrected["a"], corrected["b"])) < before - 1e-3
    weights, owners, _ = stack_heads({"a": a, "b": b})
    assert float(softmax_regularizer(torch.cat([corrected["a"], corrected["b"]]).double(), owners, 4.0)) < \
        float(softmax_regularizer(weights, owners, 4.0))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no class"):
        gradient_correction({}, lr=0.1)
    with pytest.raises(ValueError, match="one dim"):
        gradient_correction({0: torch.ones(2, 3), 1: torch.ones(2, 4)}, lr=0.1)
    with pytest.raises(ValueError, match="finite"):
        gradient_correction({0: torch.ones(2, 3), 1: torch.full((1, 3), float("nan"))}, lr=0.1)


@pytest.fixture(scope="module")
def tiny_federation(lfw):
    """Four real LFW private users (2 per client), the IResNet-small backbone from its seeded start."""
    from splitface.common.models import build_backbone, resolve_spec
    from research.federated.population import load_population
    spec = resolve_spec("iresnet_small")
    torch.manual_seed(0)
    return spec, load_population(lfw, spec.input_size, max_users=4), build_backbone(spec).state_dict()


@pytest.mark.slow
def test_a_fedgc_round_trains_and_corrects_every_head_it_holds(tiny_federation):
    import dataclasses

    from splitface.device.federated.private_head import HeadConfig
    from research.federated.methods import MethodConfig, PrivateHeadRun
    spec, population, init = tiny_federation
    head = HeadConfig(epochs=1, batch_size=4)
    runs = {lam: PrivateHeadRun(MethodConfig("fedgc", rounds=1, users_per_client=2, clients_per_round=2, head=head,
                                             fedgc_lambda=lam, fedgc_scale=4.0), spec, population, init)
            for lam in (0.0, 20.0)}
    for run in runs.values():
        run.run(log=lambda s: None)
    plain, corrected = runs[0.0], runs[20.0]
    assert set(plain.heads) == set(corrected.heads) and len(plain.heads) == 2
    # the same seeds train the same clients; only the correction differs, and it moved every held head
    first = next(iter(plain.heads))
    assert all(plain.heads[c].shape == corrected.heads[c].shape for c in plain.heads)
    assert not torch.allclose(plain.heads[first], corrected.heads[first])
    assert any(not torch.equal(p, init[k]) for k, p in corrected.backbone.state_dict().items())
    fixed = PrivateHeadRun(MethodConfig("fixed-head", rounds=1, users_per_client=2, clients_per_round=2,
                                        head=dataclasses.replace(head, train_head=False)), spec, population, init)
    start = {c: fixed._first_head(c, *population.of_users(fixed.clients[c])) for c in range(len(fixed.clients))}
    fixed.run(log=lambda s: None)
    assert all(torch.equal(fixed.heads[c], start[c]) for c in fixed.heads)  # the fixed head never trains


@pytest.mark.slow
def test_class_embedding_linkage_finds_a_head_row_equal_to_a_photos_embedding(tiny_federation):
    from splitface.device.federated.private_head import HeadConfig
    from research.federated.evaluate import recalibrate_bn
    from research.federated.methods import MethodConfig, PrivateHeadRun, class_embedding_linkage
    spec, population, init = tiny_federation
    run = PrivateHeadRun(MethodConfig("fedpe", rounds=1, users_per_client=2, clients_per_round=2,
                                      head=HeadConfig(epochs=1, batch_size=4)), spec, population, init)
    public = population.images[::2]
    model = recalibrate_bn(run.backbone, public)
    with torch.no_grad():
        for c, users in enumerate(run.clients):  # each row: the embedding of one photo of its own person
            first = [int(np.flatnonzero(population.labels == u)[0]) for u in users]
            run.heads[c] = model(torch.from_numpy(population.images[first]).float() / 255)
    link = class_embedding_linkage(run, public)
    assert link["linkage_rows"] == 4 and link["linkage_top1"] == 1.0
    shares = [float((population.labels == u).mean()) for u in range(4)]
    assert link["linkage_chance"] == pytest.approx(sum(shares) / 4)
    # the stronger attack's plumbing, with the audit's fast real recognizer (dlib in the bench): the rows
    # inverted into faces, matched against the same photos in the recognizer's own space
    from research.audit.recognizer import Eigenfaces
    from research.federated.methods import inverted_class_embedding_linkage
    faces = Eigenfaces(components=4).fit(public.astype(np.float32) / 255)
    photos = faces.embed(population.images.astype(np.float32) / 255)
    inverted = inverted_class_embedding_linkage(run, public, faces.embed, photos)
    assert inverted["inverted_linkage_rows"] == 4 and 0 <= inverted["inverted_linkage_top1"] <= 1
    assert inverted["inverted_linkage_chance"] == pytest.approx(link["linkage_chance"])
    with pytest.raises(ValueError, match="photo vectors"):
        inverted_class_embedding_linkage(run, public, faces.embed, photos[1:])
