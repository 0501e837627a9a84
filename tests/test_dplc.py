"""DPLC (PrivacyFace Algorithm 1) on constructed class centres, and its identity-level accounting."""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from splitface.common.dplc import DPLCConfig, dplc, dplc_sigma, mean_sensitivity, scaled_rho
from splitface.common.accountants.clusters import identity_epsilon, query_noise_multiplier


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def rotated(axis: int, towards: int, angle: float, dim: int = 8) -> np.ndarray:
    """The unit vector at `angle` from e_axis, in the plane of e_axis and e_towards."""
    v = np.zeros(dim)
    v[axis], v[towards] = math.cos(angle), math.sin(angle)
    return v


# three centres near e0 (within 0.2 rad of it), two near e1, one alone at e2
CENTRES = np.stack([rotated(0, 3, 0.0), rotated(0, 3, 0.15), rotated(0, 4, 0.2),
                    rotated(1, 5, 0.0), rotated(1, 5, 0.3), rotated(2, 6, 0.0)]) * 3.0  # any norm


def test_sigma_is_the_papers_formula():
    rho, eps, delta = 1.0, 2.0, 1e-5
    assert dplc_sigma(4, eps, delta, rho) == pytest.approx(
        2 / (4 * eps) * math.sqrt((1 - math.cos(2 * rho)) * math.log(1.25 / delta)))
    # the classic Gaussian mechanism with the cap's replace-one sensitivity gives the same
    assert dplc_sigma(4, eps, delta, rho) == pytest.approx(
        mean_sensitivity(rho, 4) * math.sqrt(2 * math.log(1.25 / delta)) / eps)
    assert dplc_sigma(8, eps, delta, rho) == pytest.approx(dplc_sigma(4, eps, delta, rho) / 2)  # 1/|S|
    assert dplc_sigma(4, math.inf, delta, rho) == 0.0
    # the noise multiplier the accountant composes is sigma / Delta, free of |S| and rho
    assert dplc_sigma(5, eps, delta, 0.7) / mean_sensitivity(0.7, 5) == pytest.approx(query_noise_multiplier(eps, delta))


def test_greedy_coverage_and_the_threshold():
    result = dplc(CENTRES, DPLCConfig(rho=0.4, min_members=2, queries=3, epsilon=math.inf), np.random.default_rng(0))
    assert result.sizes == [3, 2] and result.covered == 5 and result.reason == "threshold"  # e2 alone < T
    expected = np.stack([unit(CENTRES[:3].mean(0)), unit(CENTRES[3:5].mean(0))])
    np.testing.assert_allclose(result.clusters, expected, atol=1e-6)
    one = dplc(CENTRES, DPLCConfig(rho=0.4, min_members=1, queries=1, epsilon=math.inf), np.random.default_rng(0))
    assert one.sizes == [3] and one.reason == "queries"  # Q bounds the releases
    all_of_them = dplc(CENTRES, DPLCConfig(rho=0.4, min_members=1, queries=5, epsilon=math.inf),
                       np.random.default_rng(0))
    assert all_of_them.sizes == [3, 2, 1] and all_of_them.reason == "exhausted"


def test_nothing_released_when_no_cap_reaches_T():
    result = dplc(CENTRES, DPLCConfig(rho=0.4, min_members=4, queries=3), np.random.default_rng(0))
    assert not result.released and result.clusters.shape == (0, 8) and result.reason == "threshold"
    assert result.covered == 0


def test_release_is_the_mean_plus_gaussian_of_the_formulas_sigma():
    config = DPLCConfig(rho=0.4, min_members=2, queries=1, epsilon=4.0, delta=1e-5)
    result = dplc(CENTRES, config, np.random.default_rng(7))
    sigma = dplc_sigma(3, 4.0, 1e-5, 0.4)
    expected = unit(np.stack([unit(c) for c in CENTRES[:3]]).mean(0) + np.random.default_rng(7).normal(0, sigma, 8))
    assert result.sigmas == [pytest.approx(sigma)]
    np.testing.assert_allclose(result.clusters[0], expected, atol=1e-6)
    assert np.linalg.norm(result.clusters[0]) == pytest.approx(1.0, abs=1e-6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="rho"):
        DPLCConfig(rho=2.0)
    with pytest.raises(ValueError, match="non-zero"):
        dplc(np.zeros((2, 4)), DPLCConfig(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="matrix"):
        dplc(np.ones(4), DPLCConfig(), np.random.default_rng(0))


def test_scaled_rho_keeps_the_papers_cap_in_128_dims():
    assert scaled_rho(512) == pytest.approx(1.3)
    assert math.cos(scaled_rho(128)) * math.sqrt(128) == pytest.approx(math.cos(1.3) * math.sqrt(512))


def _gaussian_delta(epsilon: float, z: float) -> float:
    """The exact delta(epsilon) of one Gaussian mechanism of multiplier z (Balle and Wang 2018)."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    return phi(1 / (2 * z) - epsilon * z) - math.exp(epsilon) * phi(-1 / (2 * z) - epsilon * z)


def test_composed_identity_epsilon_from_dp_accounting():
    config = DPLCConfig(queries=2, epsilon=1.0, delta=1e-5)
    report = identity_epsilon(config, rounds=5, delta=1e-5)
    z = math.sqrt(2 * math.log(1.25 / 1e-5)) / 1.0
    assert report["noise_multiplier"] == pytest.approx(z) and report["releases"] == 10
    # 10 Gaussians of multiplier z compose exactly to one of multiplier z / sqrt(10): check PLD against the
    # analytic delta of that one Gaussian at the epsilon it reports
    assert _gaussian_delta(report["epsilon"], z / math.sqrt(10)) == pytest.approx(1e-5, rel=0.05)
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 10)).get_epsilon(1e-5)
    assert report["epsilon"] == pytest.approx(direct, rel=0.02)
    assert report["epsilon"] <= report["epsilon_rdp"]  # RDP is an upper bound
    # one query is tighter than its nominal classic-bound epsilon; composing over rounds costs more
    assert report["query_epsilon_pld"] < 1.0 < report["epsilon"]
    assert identity_epsilon(config, rounds=10, delta=1e-5)["epsilon"] > report["epsilon"]
    assert identity_epsilon(DPLCConfig(epsilon=math.inf), rounds=5, delta=1e-5)["epsilon"] is None
