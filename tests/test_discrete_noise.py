"""The noise options: the fast ChaCha20 stream refuses chosen seeds and draws exact uniform integers;
the discrete Gaussian matches its law (variance and tails) and runs in integers after quantisation;
its DP statement sits between the continuous Gaussian's exact curve and Bun & Steinke's bound."""
from __future__ import annotations

import ast
import inspect
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation

from device_sdk.privacy import discrete
from device_sdk.privacy.discrete import (DiscreteGaussian, DiscreteGaussianRelease, box_sensitivity_sq,
                                         epsilon_from_zcdp, quantise, zcdp_rho)
from device_sdk.privacy.fastnoise import NoiseStream, fresh_key, gaussian
from protocol.tensor import decode_tensor

KEY = bytes(range(32))  # tests only: production keys come from fresh_key()


def test_stream_refuses_chosen_seeds_and_keys_differ():
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseStream(1234)
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseStream(b"short")
    assert len(fresh_key()) == 32 and fresh_key() != fresh_key()
    assert NoiseStream(KEY).random_bytes(64) == NoiseStream(KEY).random_bytes(64)  # replayable from its key
    assert NoiseStream(KEY).random_bytes(64) != NoiseStream(KEY, counter=1).random_bytes(64)
    assert NoiseStream(KEY, counter=1).random_bytes(64) == NoiseStream(KEY).random_bytes(128)[64:]  # counter-based


@pytest.mark.parametrize("bound", [1, 3, 10, 2**33 + 1])
def test_uniform_below_is_uniform(bound):
    n = 30_000
    x = NoiseStream(KEY).uniform_below(bound, n)
    assert x.dtype == np.int64 and x.min() >= 0 and x.max() < bound
    cells = min(bound, 10)
    counts = np.bincount(x * cells // bound, minlength=cells)  # equal cells of [0, bound)
    expected = n / cells
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < cells - 1 + 6 * math.sqrt(2 * max(cells - 1, 1)) + 1  # far inside a 1e-6 tail


def test_fast_gaussian_has_unit_variance():
    g = gaussian((200_001,), NoiseStream(KEY))
    assert g.dtype == torch.float32 and g.shape == (200_001,)
    assert abs(float(g.mean())) < 0.015 and abs(float(g.var()) - 1) < 0.02
    assert abs(float((g.abs() > 2).float().mean()) - 0.0455) < 0.004


@pytest.mark.parametrize("sigma2", [Fraction(1, 4), 4, Fraction(101, 3)])
def test_discrete_gaussian_matches_its_pmf(sigma2):
    dg = DiscreteGaussian(sigma2)
    n = 6000
    z = dg.sample(n, NoiseStream(KEY))
    assert z.dtype == np.int64
    var = dg.variance()
    assert abs(float(z.mean())) < 5 * math.sqrt(var / n)
    # the sample variance's standard error is about var sqrt(2 / n) (a little more with the lattice's kurtosis)
    assert abs(float((z.astype(np.float64) ** 2).mean()) - var) < 5 * var * math.sqrt(3 / n)
    # each value's frequency, and the two-sided tail beyond 2 sigma, against the law
    support = np.arange(-3 * math.ceil(math.sqrt(var)), 3 * math.ceil(math.sqrt(var)) + 1)
    for k, p in zip(support, dg.pmf(support)):
        assert abs(np.mean(z == k) - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3
    far = np.abs(np.arange(-1000, 1001)) > 2 * math.sqrt(float(sigma2))
    tail = float(dg.pmf(np.arange(-1000, 1001))[far].sum())
    assert abs(float(np.mean(np.abs(z) > 2 * math.sqrt(float(sigma2)))) - tail) < 5 * math.sqrt(tail / n) + 1e-3
    if sigma2 == Fraction(1, 4):  # far from a rounded continuous Gaussian: P(0) = 0.787 (vs 0.683)
        assert abs(dg.pmf(np.array([0]))[0] - 0.7866) < 1e-3


def test_release_is_integer_after_quantisation_and_reaches_the_wire():
    x = torch.rand(2, 4, 8, 8) * 0.6  # LRN outputs lie in [0, 1/sqrt(3))
    mech = DiscreteGaussianRelease(scale=1 / 200, q_min=0, q_max=116, sigma2=900,
                                   sensitivity_sq=box_sensitivity_sq(4 * 8 * 8, 0, 116))
    released = mech.release(x, NoiseStream(KEY))
    assert released.dtype == np.int8 and released.shape == (2, 4, 8, 8)
    q = quantise(x, 1 / 200, 0, 116)
    assert q.dtype == np.int64 and q.max() <= 116
    # the same key gives the same integers: q plus the sampler's draws, clamped to the protocol's i8 range
    want = np.clip(q.reshape(-1) + mech.noise.sample(q.size, NoiseStream(KEY)), -127, 127).reshape(q.shape)
    np.testing.assert_array_equal(released, want)
    decoded = decode_tensor(mech.wire(released))  # the i8 tensor with the public scale: value = q * scale
    np.testing.assert_array_equal(decoded, released.astype(np.float32) * np.float32(1 / 200))


SAMPLER_FUNCTIONS = [discrete.bernoulli_exp_at_most_one, discrete.bernoulli_exp, discrete.discrete_laplace,
                     DiscreteGaussian.sample, NoiseStream.uniform_below]


@pytest.mark.parametrize("fn", SAMPLER_FUNCTIONS, ids=lambda f: f.__qualname__)
def test_sampler_has_no_floating_point(fn):
    """No float constant, no float conversion, no transcendental function in the exact sampler's code."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
    floats = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, float)]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not floats and not names & {"float", "float32", "float64", "exp", "log", "sqrt", "torch", "random"}, fn


def test_dp_statement_in_quantised_units():
    sigma2 = Fraction(116**2)  # sigma = Delta: epsilon about 4.4 at delta = 1e-5
    delta_sq = box_sensitivity_sq(1, 0, 116)  # one value in [0, 116] steps: Delta = 116
    rho = zcdp_rho(delta_sq, sigma2)
    assert rho == Fraction(1, 2)  # exact: Delta^2 / (2 sigma^2)
    eps = epsilon_from_zcdp(float(rho), 1e-5)
    # no better than the continuous Gaussian with the same ratio (exactly rho-zCDP, its curve is exact) ...
    z = 1.0
    pld = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3)  # pessimistic
    from dp_accounting import dp_event
    pld.compose(dp_event.GaussianDpEvent(z))
    assert pld.get_epsilon(1e-5) <= eps
    # ... and no worse than Bun & Steinke's conversion
    assert eps <= float(rho) + 2 * math.sqrt(float(rho) * math.log(1e5))
    mech = DiscreteGaussianRelease(1 / 200, 0, 116, sigma2, delta_sq)
    assert mech.rho() == rho and mech.epsilon(1e-5) == eps
    # the accountant's REPLACE_ONE convention: a shift of 2r against noise z r, so z = 2 sigma / Delta
    assert mech.dp_event().noise_multiplier == pytest.approx(2.0)
    with pytest.raises(ValueError, match="sensitivity_sq"):
        DiscreteGaussianRelease(1 / 200, 0, 116, sigma2, 0)
    with pytest.raises(ValueError, match="q_min"):
        DiscreteGaussianRelease(1 / 200, 0, 300, sigma2, 1)
    with pytest.raises(ValueError, match="bit integers"):
        DiscreteGaussian(Fraction(10**12, 7))
