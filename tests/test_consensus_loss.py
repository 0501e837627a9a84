"""PrivacyFace's consensus-aware loss (Eq. 5) on constructed embeddings, centres and clusters."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from splitface.device.federated.consensus import cluster_logits, consensus_loss

S, M, RHO = 16.0, 0.4, 0.6


def plain_margin_softmax(f: torch.Tensor, w: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference, written out: -log(e^{s psi(theta_y)} / (e^{s psi(theta_y)} + sum_{j != y} e^{s cos theta_j}))."""
    losses = []
    for i in range(len(f)):
        cos = [float(F.cosine_similarity(f[i], w[j], dim=0)) for j in range(len(w))]
        theta = math.acos(cos[y[i]])
        target = S * (math.cos(theta + M) if kind == "arcface" else cos[y[i]] - M)
        others = sum(math.exp(S * c) for j, c in enumerate(cos) if j != y[i])
        losses.append(-math.log(math.exp(target) / (math.exp(target) + others)))
    return torch.tensor(sum(losses) / len(losses), dtype=torch.float64)


@pytest.mark.parametrize("kind", ["arcface", "cosface"])
def test_equals_the_plain_margin_softmax_without_clusters(kind):
    g = torch.Generator().manual_seed(0)
    f, w = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 1, 0])
    reference = plain_margin_softmax(f, w, y, kind)
    for none in (None, torch.zeros(0, 5, dtype=torch.float64)):
        loss = consensus_loss(f, w, y, none, RHO, scale=S, margin=M, kind=kind)
        assert float(loss) == pytest.approx(float(reference), rel=1e-9)


def _at(angle: float) -> torch.Tensor:
    """A unit vector in the (e0, e1) plane at `angle` from e0."""
    return torch.tensor([[math.cos(angle), math.sin(angle), 0.0, 0.0]], dtype=torch.float64)


def test_cluster_term_is_the_cosine_to_the_caps_nearest_point():
    p = _at(0.0)
    for theta in (0.1, RHO - 0.01):  # inside the cap: the largest logit, s
        assert float(cluster_logits(_at(theta), p, RHO, S)) == pytest.approx(S)
    assert float(cluster_logits(_at(RHO + 0.5), p, RHO, S)) == pytest.approx(S * math.cos(0.5))


def test_pushes_embeddings_out_of_a_received_cluster():
    w = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # the client's own class, far from the cluster
    y = torch.tensor([0])
    p = _at(0.0)  # another client's sanitised cluster at e0
    near, far = _at(RHO + 0.05), _at(math.pi / 2)
    near_f = F.normalize(near + 0.3 * w, dim=1)  # the embedding leans to its class, still near the cluster
    # an embedding inside or near the cluster costs more than one far from it
    inside = F.normalize(_at(0.1) + 0.3 * w, dim=1)
    assert float(consensus_loss(inside, w, y, p, RHO, S, M)) >= float(consensus_loss(near_f, w, y, p, RHO, S, M))
    assert float(consensus_loss(near_f, w, y, p, RHO, S, M)) > float(consensus_loss(F.normalize(far + 0.3 * w, dim=1),
                                                                                      w, y, p, RHO, S, M))
    # one gradient step on the embedding moves it away from the cluster, further than without the cluster
    angle = lambda x: math.acos(float(F.cosine_similarity(x, p)))  # noqa: E731

    def step_away(clusters: torch.Tensor | None) -> float:
        f = near_f.clone().requires_grad_(True)
        consensus_loss(f, w, y, clusters, RHO, S, M).backward()
        return angle((f - 0.05 * f.grad).detach()) - angle(near_f)

    with_cluster, without = step_away(p), step_away(None)
    assert with_cluster > 1e-3 and with_cluster > without + 1e-3


def test_bad_input_is_refused():
    f, w, y = torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="clusters"):
        consensus_loss(f, w, y, torch.randn(2, 5), RHO)
    with pytest.raises(ValueError, match="labels"):
        consensus_loss(f, w, torch.tensor([0, 3]), None, RHO)
    with pytest.raises(ValueError, match="margin kind"):
        consensus_loss(f, w, y, None, RHO, kind="sphereface")


@pytest.mark.slow
def test_privacyface_round_relays_only_other_clients_clusters(lfw):
    import numpy as np

    from splitface.common.dplc import DPLCConfig
    from splitface.device.federated.private_head import HeadConfig
    from splitface.common.models import build_backbone, resolve_spec
    from research.federated.methods import MethodConfig, PrivateHeadRun
    from research.federated.population import load_population
    spec = resolve_spec("iresnet_small")
    torch.manual_seed(0)
    dplc = DPLCConfig(rho=0.01, min_members=1, queries=2, epsilon=math.inf)  # each centre alone in its cap
    run = PrivateHeadRun(MethodConfig("privacyface", rounds=2, users_per_client=2, clients_per_round=2,
                                      head=HeadConfig(epochs=1, batch_size=4, rho=0.01), dplc=dplc),
                         spec, load_population(lfw, spec.input_size, max_users=4), build_backbone(spec).state_dict())
    history = run.run(log=lambda s: None)
    assert history[0]["clusters_received_mean"] == 0  # nothing released before the first round
    assert history[1]["clusters_received_mean"] == 2  # each of the 2 clients gets the other's 2 clusters
    for c, clusters in run.clusters.items():  # eps = inf, T = 1: each of the 2 centres is its own cluster
        np.testing.assert_allclose(clusters, F.normalize(run.heads[c], dim=1).numpy(), atol=1e-5)
        received = run._received(c).numpy()
        assert not any(np.isclose(received, row, atol=1e-6).all(axis=1).any() for row in clusters)
    assert run.privacy()["epsilon"] is None  # no noise, no guarantee
    assert run.privacy()["releases"] == 2 * 2  # but its releases are counted: 2 calls of Q = 2
