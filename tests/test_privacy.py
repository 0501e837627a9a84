"""Privacy: mechanisms' noise and clipping, the accountant against dp_accounting, the budget guard,
the LRN bound, DP-SGD's per-sample gradients, and the planner."""
from __future__ import annotations

import json
import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from torch import nn

from splitface.common.models import PaperLRN
from splitface.common.accountants.ledger import PrivacyAccountant, epsilon_of
from splitface.device.privacy.budget import BudgetExceeded, BudgetGuard
from splitface.device.privacy.dpsgd import clipped_noisy_grad, dpsgd_event, per_sample_grads
from splitface.device.privacy.mechanisms import (PAPER_LRN_SENSITIVITY, NoNoise, PerActivationGaussian, PerImageGaussian, classic_gaussian_sigma, noise_generator)
from splitface.device.privacy.planner import per_activation_view, plan_per_image

DELTA = 1e-5
G = dp_event.GaussianDpEvent


def library_eps(event: dp_event.DpEvent, delta: float = DELTA) -> float:
    acc = PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
    acc.compose(event)
    return acc.get_epsilon(delta)


# ---- mechanisms -------------------------------------------------------------------------

def test_per_activation_noise_scale_matches_formula() -> None:
    m = PerActivationGaussian(3.0, DELTA)
    expected = PAPER_LRN_SENSITIVITY * math.sqrt(2 * math.log(1.25 / DELTA)) / 3.0
    assert m.std == pytest.approx(expected, rel=1e-12)
    assert m.sigma == pytest.approx(classic_gaussian_sigma(3.0, DELTA))
    assert m.activation_event() == G(2 * m.sigma)
    assert m.image_event(100).noise_multiplier == pytest.approx(2 * m.sigma / 10)
    assert m.describe()["noise_std"] == m.std


@pytest.mark.parametrize("mech", [PerActivationGaussian(3.0, DELTA), PerImageGaussian(2.0, 0.7)])
def test_empirical_noise_std(mech) -> None:
    x = torch.zeros(4, 250_000, dtype=torch.float64)
    noise = mech.privatize(x, noise_generator(1, 0)) - x
    assert noise.mean().abs() < 0.01 * mech.std
    assert noise.std().item() == pytest.approx(mech.std, rel=0.02)


def test_clipping_bounds_norm_and_keeps_small_images() -> None:
    torch.manual_seed(0)
    m = PerImageGaussian(clip_norm=1.5, noise_multiplier=0.0)
    big = torch.randn(8, 3, 5, 5, dtype=torch.float64) * 10
    small = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    small = small / small.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1) * 0.5
    out = m.privatize(torch.cat([big, small, torch.zeros(1, 3, 5, 5, dtype=torch.float64)]), noise_generator(0))
    norms = out.flatten(1).norm(dim=1)
    assert (norms[:8] - 1.5).abs().max() < 1e-9
    assert torch.equal(out[8:16], small)
    assert torch.equal(out[16], torch.zeros(3, 5, 5, dtype=torch.float64))


def test_privatize_is_differentiable() -> None:
    m = PerImageGaussian(clip_norm=1.0, noise_multiplier=0.3)
    a = torch.tensor([[3.0, 4.0, 0.0]], dtype=torch.float64)  # norm 5: clipped
    jac = torch.autograd.functional.jacobian(lambda x: m.privatize(x, noise_generator(7, 1)), a)[0, :, 0, :]
    n = a.norm()
    clip_jac = (torch.eye(3, dtype=torch.float64) - torch.outer(a[0], a[0]) / n**2) / n  # d(C a/|a|)/da, C=1
    assert torch.allclose(jac, clip_jac, atol=1e-12)
    small = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64)
    for mech in (m, PerActivationGaussian(3.0, DELTA), NoNoise()):
        j = torch.autograd.functional.jacobian(lambda x: mech.privatize(x, noise_generator(7, 1)), small)[0, :, 0, :]
        assert torch.allclose(j, torch.eye(3, dtype=torch.float64))


def test_noise_is_keyed() -> None:
    m = PerActivationGaussian(3.0, DELTA)
    x = torch.zeros(2, 100)
    a = m.privatize(x, noise_generator(123, 1, 5))
    assert torch.equal(a, m.privatize(x, noise_generator(123, 1, 5)))
    assert not torch.equal(a, m.privatize(x, noise_generator(123, 1, 6)))
    assert not torch.equal(a, m.privatize(x, noise_generator(124, 1, 5)))
    assert not torch.equal(a, m.privatize(x, noise_generator(123, 15)))
    assert torch.equal(NoNoise().privatize(x, noise_generator(0)), x)


# ---- accountant -------------------------------------------------------------------------

def test_accountant_matches_library() -> None:
    acc = PrivacyAccountant(DELTA)
    acc.record("train:1", [0, 1], [10, 10], G(2.0))
    assert acc.epsilon_image(0) == pytest.approx(library_eps(G(2.0)), rel=1e-9)
    assert acc.epsilon_image(0) == pytest.approx(4.377, abs=2e-3)
    for b in range(2, 6):
        acc.record(f"train:{b}", [0], [10], G(2.0))
    assert acc.epsilon_image(0) == pytest.approx(library_eps(dp_event.SelfComposedDpEvent(G(2.0), 5)), rel=1e-9)
    # Identity 10 = image 0's five releases and image 1's one.
    assert acc.epsilon_identity(10) == pytest.approx(library_eps(dp_event.SelfComposedDpEvent(G(2.0), 6)), rel=1e-9)
    assert acc.epsilon_image(99) == 0.0
    assert acc.max_epsilon_image() == acc.epsilon_image(0)
    assert acc.max_epsilon_identity() == acc.epsilon_identity(10)
    mixed = PrivacyAccountant(DELTA)
    mixed.record("a", [0], [0], G(2.0))
    mixed.record("b", [0], [0], G(3.0))
    assert mixed.epsilon_image(0) == pytest.approx(library_eps(dp_event.ComposedDpEvent([G(2.0), G(3.0)])), rel=1e-6)


def test_replays_are_idempotent_and_noise_free_is_infinite() -> None:
    acc = PrivacyAccountant(DELTA)
    acc.record("train:1", [0, 1], [0, 1], G(2.0))
    before = acc.epsilon_image(0)
    acc.record("train:1", [0, 1], [0, 1], G(2.0))
    assert acc.epsilon_image(0) == before and acc.epsilon_identity(0) == before
    assert acc.report()["releases"] == 1
    acc.record("eval:0:0", [1], [1], NoNoise().image_event(10))
    assert acc.epsilon_image(1) == math.inf and acc.epsilon_identity(1) == math.inf
    assert acc.epsilon_image(0) == before
    rep = acc.report()
    assert rep["epsilon_image"]["max"] == math.inf and rep["images"] == 2
    assert acc.epsilon_if([0], [0], G(0.0), "image") == math.inf
    with pytest.raises(ValueError):
        acc.record("x", [0], [5], G(2.0))  # image 0 belongs to identity 0


def test_pld_vs_rdp_cross_check() -> None:
    acc = PrivacyAccountant(DELTA)
    for b in range(10):
        acc.record(f"train:{b}", [0], [0], G(3.0))
    pld, rdp = acc.epsilon_image(0), acc.rdp_epsilon_image(0)
    assert pld <= rdp <= 1.25 * pld
    # The conversion REPLACE_ONE G(z) == ADD_OR_REMOVE G(z/2), checked with PLD itself.
    add_remove = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3)
    add_remove.compose(G(1.0))
    assert add_remove.get_epsilon(DELTA) == pytest.approx(library_eps(G(2.0)), rel=1e-6)


def test_joint_release_scales_identity_shift() -> None:
    acc = PrivacyAccountant(DELTA)
    acc.record("dpsgd:1", [0, 1, 2], [7, 7, 8], dpsgd_event(4.0), joint=True)
    assert acc.epsilon_image(0) == pytest.approx(library_eps(G(4.0)), rel=1e-9)
    assert acc.epsilon_identity(7) == pytest.approx(library_eps(G(2.0)), rel=1e-9)  # two images share one draw
    assert acc.epsilon_identity(8) == pytest.approx(library_eps(G(4.0)), rel=1e-9)
    acc.record("dpsgd:1", [3], [7], dpsgd_event(4.0), joint=True)  # a late part of the same step
    assert acc.epsilon_identity(7) == pytest.approx(library_eps(G(4.0 / 3)), rel=1e-9)


def test_state_dict_round_trip() -> None:
    acc = PrivacyAccountant(DELTA)
    acc.record("train:1", [0, 1], [0, 0], G(2.0))
    acc.record("dpsgd:1", [0, 1], [0, 0], G(5.0), joint=True)
    acc.record("eval:0:0", [2], [1], G(0.0))
    state = json.loads(json.dumps(acc.state_dict()))
    other = PrivacyAccountant(0.5)
    other.load_state_dict(state)
    assert other.report() == acc.report()
    other.record("train:1", [0], [0], G(2.0))  # still a replay after the reload
    assert other.epsilon_image(0) == acc.epsilon_image(0)


def test_epsilon_is_cached_per_history() -> None:
    acc = PrivacyAccountant(DELTA)
    for b in range(3):
        acc.record(f"train:{b}", list(range(2000)), [i % 50 for i in range(2000)], G(5.0))
    rep = acc.report()
    assert rep["images"] == 2000 and rep["epsilon_image"]["min"] == rep["epsilon_image"]["max"]
    assert len(acc._cache) <= 3


# ---- budget guard -----------------------------------------------------------------------

def test_budget_guard_refuses_and_records_nothing() -> None:
    acc = PrivacyAccountant(DELTA)
    budget = library_eps(dp_event.SelfComposedDpEvent(G(2.0), 2)) + 0.01
    guard = BudgetGuard(acc, budget)
    guard.admit("train:1", [0, 1], [0, 0], G(2.0))
    guard.admit("train:2", [0], [0], G(2.0))
    spent = acc.epsilon_image(0)
    with pytest.raises(BudgetExceeded) as info:
        guard.admit("train:3", [0, 1], [0, 0], G(2.0))
    err = info.value
    assert err.ids == [0] and err.spent == pytest.approx(spent) and err.would_be > budget and err.budget == budget
    assert "image 0" in str(err)
    assert acc.epsilon_image(0) == spent and acc.epsilon_image(1) == library_eps(G(2.0))
    assert "train:3" not in acc.state_dict()["releases"]
    guard.admit("train:2", [0], [0], G(2.0))  # a replay is free
    guard.admit("train:3", [1], [0], G(2.0))  # image 1 still has room
    ident = BudgetGuard(acc, budget, level="identity")
    with pytest.raises(BudgetExceeded, match="identity 0"):
        ident.admit("train:4", [5], [0], G(2.0))  # identity 0 already spent 4 releases


# ---- LRN bound --------------------------------------------------------------------------

def test_lrn_input_max_and_output_bound() -> None:
    torch.manual_seed(0)
    assert PaperLRN(8).output_bound() == 1.0
    lrn = PaperLRN(8, input_max=1.0).double()
    assert lrn.output_bound() == pytest.approx(1 / math.sqrt(3))
    assert lrn.output_bound() <= PAPER_LRN_SENSITIVITY
    for scale in (1e-3, 1.0, 1e3, 1e8):
        a = torch.randn(4, 8, 6, 6, dtype=torch.float64) * scale
        out = lrn(a)
        assert out.min() >= 0 and out.max() <= lrn.output_bound() * (1 + 1e-12)
        assert torch.equal(out, PaperLRN(8).double()(a.clamp(0, 1)))
    # One channel, value at input_max, neighbours zero: the bound is attained.
    a = torch.zeros(1, 8, 1, 1, dtype=torch.float64)
    a[0, 3] = 5.0
    assert lrn(a).max().item() == pytest.approx(lrn.output_bound(), rel=1e-12)


@pytest.mark.parametrize("beta,input_max", [(0.5, None), (0.5, 3.0), (0.75, None), (0.75, 0.5), (0.75, 5.0),
                                            (0.3, 2.0), (1.0, None)])
def test_lrn_output_bound_numerically(beta: float, input_max: float | None) -> None:
    lrn = PaperLRN(5, alpha=0.7, beta=beta, gamma=1.5, input_max=input_max)
    grid = torch.logspace(-4, 6, 200_001, dtype=torch.float64)
    grid = grid if input_max is None else grid.clamp(max=input_max)
    f = grid / (lrn.gamma + lrn.alpha * grid**2) ** beta
    assert f.max().item() <= lrn.output_bound() * (1 + 1e-12)
    assert f.max().item() == pytest.approx(lrn.output_bound(), rel=1e-3)
    torch.manual_seed(1)
    out = lrn.double()(torch.relu(torch.randn(3, 5, 8, 8, dtype=torch.float64) * 1e3))
    assert out.max().item() <= lrn.output_bound() * (1 + 1e-12)
    assert PaperLRN(5, beta=0.3).output_bound() == math.inf


# ---- DP-SGD -----------------------------------------------------------------------------

def _device_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), PaperLRN(6)).double()


def test_per_sample_grads_match_loop_and_batch() -> None:
    layer = _device_layer()
    x = torch.rand(5, 3, 8, 8, dtype=torch.float64)
    g = torch.randn(5, 6, 8, 8, dtype=torch.float64)
    ps = per_sample_grads(layer, x, g)
    assert set(ps) == {n for n, _ in layer.named_parameters()}
    for i in range(5):
        layer.zero_grad()
        (layer(x[i:i + 1]) * g[i:i + 1]).sum().backward()
        for n, p in layer.named_parameters():
            assert torch.allclose(ps[n][i], p.grad, atol=1e-5)
    layer.zero_grad()
    (layer(x) * g).sum().backward()
    for n, p in layer.named_parameters():
        assert torch.allclose(ps[n].sum(0), p.grad, atol=1e-5)


def test_clipped_noisy_grad() -> None:
    torch.manual_seed(0)
    ps = {"w": torch.randn(4, 3, 2, dtype=torch.float64) * 3, "b": torch.randn(4, 2, dtype=torch.float64)}
    out = clipped_noisy_grad(ps, clip_norm=1.0, noise_multiplier=0.0, generator=noise_generator(0))
    norms = torch.sqrt(ps["w"].flatten(1).pow(2).sum(1) + ps["b"].pow(2).sum(1))
    f = (1.0 / norms).clamp(max=1.0)
    assert torch.allclose(out["w"], (ps["w"] * f[:, None, None]).mean(0))
    assert torch.allclose(out["b"], (ps["b"] * f[:, None]).mean(0))
    noisy = clipped_noisy_grad(ps, 1.0, 2.0, noise_generator(0, 3), batch_size=8)
    again = clipped_noisy_grad(ps, 1.0, 2.0, noise_generator(0, 3), batch_size=8)
    assert torch.equal(noisy["w"], again["w"]) and not torch.allclose(noisy["w"], out["w"] * 4 / 8)
    assert dpsgd_event(1.3) == G(1.3)


# ---- planner ----------------------------------------------------------------------------

@pytest.mark.parametrize("target,k", [(1.0, 1), (8.0, 60)])
def test_planner_hits_target(target: float, k: int) -> None:
    z = plan_per_image(target, DELTA, k)
    assert library_eps(dp_event.SelfComposedDpEvent(G(z), k)) == pytest.approx(target, rel=0.01)


def test_per_activation_view_is_not_per_image() -> None:
    view = per_activation_view(3.0, DELTA, numel=64 * 224 * 224, releases_per_image=2)
    assert view["epsilon_activation"] <= 3.0  # the classic formula is conservative for one value
    assert view["epsilon_image_per_release"] > 1e5
    assert view["epsilon_image_run"] > view["epsilon_image_per_release"]
    assert epsilon_of(G(0.0), DELTA) == math.inf
