"""The noise options: the fast ChaCha20 stream refuses chosen seeds and draws exact uniform integers (and the
numpy ChaCha of any round count, the native float noise's reference, is ChaCha20 and ChaCha8 as published);
the discrete Gaussian matches its law (variance and tails) and runs in integers after quantisation and
an exactly checked per-image clip; its DP statement is rho-zCDP in quantised units, converted by
dp_accounting, between the continuous Gaussian's exact curve and Bun & Steinke's bound."""
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

from splitface.device.privacy import discrete
from splitface.common.accountants.ledger import epsilon_of
from splitface.device.privacy.discrete import (DiscreteGaussian, DiscreteGaussianMechanism, clip_quantise, squared_norms)
from splitface.device.privacy.fastnoise import NoiseStream, chacha_words, fresh_key, gaussian
import msgpack

from splitface.protocol.client_session import ClientSession
from splitface.protocol.tensor import decode_tensor, encode_tensor

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


def test_chacha_words_is_chacha20_at_20_rounds_and_the_published_chacha8_at_8():
    """The numpy ChaCha that the native runner's ChaCha8 noise is held to: at 20 rounds it is the `cryptography`
    package's ChaCha20 (RFC 8439, nonce zero) from any block on; at 8 it gives the published ChaCha8 keystream
    (draft-strombergson-chacha-test-vectors, TC1: key and IV zero, its first two blocks); the block counter does
    not wrap at 2^32 (its high half is word 13)."""
    for first, blocks in ((0, 20), (7, 3)):
        assert chacha_words(KEY, first, blocks, 20).astype("<u4").tobytes() == \
            NoiseStream(KEY, counter=first).random_bytes(64 * blocks)
    tc1 = ("3e00ef2f895f40d67f5bb8e81f09a5a12c840ec3ce9a7f3b181be188ef711a1e"
           "984ce172b9216f419f445367456d5619314a42a3da86b001387bfdb80e0cfe42"
           "d2aefa0deaa5c151bf0adb6c01f2a5adc0fd581259f9a2aadcf20f8fd566a26b"
           "5032ec38bbc5da98ee0c6f568b872a65a08abf251deb21bb4b56e5d8821e68aa")
    assert chacha_words(bytes(32), 0, 2, 8).astype("<u4").tobytes().hex() == tc1
    assert not np.array_equal(chacha_words(KEY, 2**32, 1, 8), chacha_words(KEY, 0, 1, 8))  # no 32-bit wrap
    for rounds in (7, 0, 8.0):
        with pytest.raises(ValueError, match="even int"):
            chacha_words(KEY, 0, 1, rounds)
    with pytest.raises(ValueError, match="32 bytes, not 5 bytes"):
        chacha_words(b"short", 0, 1, 8)
    for first, blocks in ((-1, 1), (0, -1), (2**64 - 1, 2)):
        with pytest.raises(ValueError, match="counter range"):
            chacha_words(KEY, first, blocks, 8)


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


def test_release_is_integer_after_an_exact_clip_and_reaches_the_wire():
    x = torch.rand(3, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.05, 1.0, 3.0])[
        :, None, None, None]  # norms ~0.5, ~9, ~28
    mech = DiscreteGaussianMechanism(clip_norm=4.0, noise_multiplier=0.5, step=1 / 50)
    assert mech.bound == 200 and mech.noise.sigma2 == 100**2  # B = C / step steps, sigma = z B
    q = clip_quantise(x, mech.step, mech.bound)
    assert q.dtype == np.int64 and q.shape == (3, 256)
    assert (squared_norms(q) <= 200**2).all() and squared_norms(q)[1:].min() >= 198**2  # clipped to B, not far below
    for seed in range(20):  # every clipped image ends close below B (rounding's overshoot is scaled back out)
        big = torch.rand(8, 256, generator=torch.Generator().manual_seed(seed)) * 3
        assert ((squared_norms(clip_quantise(big, mech.step, 200)) - 195.5**2) >= 0).all()
    np.testing.assert_array_equal(q[0], np.round(x[0].reshape(-1).double().numpy() * 50))  # the small one: rounded
    released = mech.release(x, KEY)
    assert released.dtype == np.int8 and released.shape == (3, 4, 8, 8)
    # the same key gives the same integers: q plus the sampler's draws, clamped to the protocol's i8 range
    want = np.clip(q.reshape(-1) + mech.noise.sample(q.size, NoiseStream(KEY)), -127, 127).reshape(x.shape)
    np.testing.assert_array_equal(released, want)
    wire = encode_tensor(mech.values(released).numpy(), "i8", scale=mech.step)  # the integers, with the step
    assert bytes(wire["data"]) == released.tobytes() and wire["scale"] == mech.step
    np.testing.assert_array_equal(decode_tensor(wire), mech.values(released).numpy())  # value = q * step
    # the layer learns through the release as if it were its output (straight-through)
    a = x.clone().requires_grad_(True)
    out = mech.straight_through(a, released)
    assert torch.equal(out.detach(), mech.values(released))
    out.sum().backward()
    assert torch.equal(a.grad, torch.ones_like(x))


def test_rounding_past_the_bound_is_redone_inside_it():
    # (0.6, 0.6) steps has norm 0.85 <= 1, but rounds to (1, 1), norm^2 2 > 1: scaled by 1/sqrt(2), rounded again
    q = clip_quantise(torch.tensor([[0.6, 0.6], [0.6, 0.0]]), 1.0, 1)
    np.testing.assert_array_equal(q, [[0, 0], [1, 0]])
    with pytest.raises(ValueError, match="non-finite"):
        clip_quantise(torch.tensor([[math.inf, 0.0]]), 1.0, 1)


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
    from dp_accounting import dp_event
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    z = 1.0
    mech = DiscreteGaussianMechanism(clip_norm=2.0, noise_multiplier=z, step=1 / 58)
    assert mech.bound == 116 and mech.sensitivity_sq == 232**2  # replace one image: Delta = 2B steps
    assert mech.rho() == Fraction(2) / Fraction(z) ** 2 == Fraction(232**2, 2 * 116**2)  # exact: Delta^2 / (2 sigma^2)
    event = mech.image_event(64)
    assert event == dp_event.ZCDpEvent(2.0)
    # the accountant composes it with dp_accounting's RDP accountant: nothing hand-rolled
    rdp = RdpAccountant()
    rdp.compose(dp_event.ZCDpEvent(2.0), 3)
    eps = epsilon_of(dp_event.SelfComposedDpEvent(event, 3), 1e-5)
    assert eps == rdp.get_epsilon(1e-5)
    # no better than the continuous Gaussian at the same z (its exact curve, PLD, pessimistic) ...
    pld = PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
    pld.compose(dp_event.GaussianDpEvent(z), 3)
    assert pld.get_epsilon(1e-5) <= eps
    # ... and no worse than Bun & Steinke's conversion of 3 rho
    rho = 3 * float(mech.rho())
    assert eps <= rho + 2 * math.sqrt(rho * math.log(1e5))
    with pytest.raises(ValueError, match="noise_multiplier > 0"):
        DiscreteGaussianMechanism(2.0, 0.0)
    with pytest.raises(ValueError, match="coarser than the clip norm"):
        DiscreteGaussianMechanism(2.0, 1.0, step=3.0)
    with pytest.raises(ValueError, match="bit integers"):
        DiscreteGaussian(Fraction(10**12, 7))


def test_noise_discrete_option_builds_the_exact_mechanism():
    import argparse

    from splitface.device.privacy.options import add_privacy_args, privacy_engines

    p = argparse.ArgumentParser()
    add_privacy_args(p)
    args = p.parse_args(["--mechanism", "per-image", "--noise", "discrete", "--clip-norm", "4", "--noise-multiplier",
                         "0.5"])
    engine = privacy_engines(args, releases_per_image=1)()
    assert isinstance(engine.mechanism, DiscreteGaussianMechanism) and engine.mechanism.step == 4 / 127
    assert engine.secret != privacy_engines(args, releases_per_image=1)().secret  # each device: its own CSPRNG secret
    for argv, message in ((["--noise", "discrete", "--noise-multiplier", "1"], "give --mechanism per-image"),
                          (["--mechanism", "per-image", "--noise", "discrete", "--target-epsilon", "3"],
                           "needs --noise-multiplier")):
        with pytest.raises(SystemExit, match=message):
            privacy_engines(p.parse_args(argv), releases_per_image=1)


def test_an_auditor_rebuilds_the_discrete_mechanism_from_a_runs_description():
    """Evaluation and the audit rebuild a run's mechanism from its results (privacy.described)."""
    from splitface.device.privacy.described import from_description
    mechanism = DiscreteGaussianMechanism(8.0, 0.5, step=8.0 / 127)
    rebuilt = from_description(mechanism.describe())
    assert isinstance(rebuilt, DiscreteGaussianMechanism) and rebuilt.describe() == mechanism.describe()


@pytest.mark.parametrize("negotiated", ["f32", "f16", "i8"])
def test_the_integers_travel_as_they_are_whatever_encoding_was_negotiated(negotiated):
    """A discrete release is sent as its int8 integers with the public step as the i8 scale: one byte a value,
    exactly what the mechanism drew (with f32 it would cost four, and i8's peak-derived scale would re-round)."""
    mech = DiscreteGaussianMechanism(clip_norm=8.0, noise_multiplier=1.0)
    released = mech.release(torch.rand(2, 4, 8, 8), KEY)
    session = ClientSession("d", "t", {}, "conv1", "server", 2, 5, encodings={"activations": negotiated,
                                                                              "gradients": "f32"})
    message = msgpack.unpackb(session.forward(1, mech.values(released).numpy(), np.array([0, 1]),
                                              integer_step=mech.step))
    assert message["activations"] == {"dtype": "i8", "shape": [2, 4, 8, 8], "data": released.tobytes(),
                                      "scale": mech.step}


def test_a_fixed_scale_refuses_values_that_would_not_decode_exactly():
    step = 0.25
    with pytest.raises(ValueError, match="not int8 integers"):
        encode_tensor(np.array([0.25, 0.3], np.float32), "i8", scale=step)   # 0.3 is not a multiple of the step
    with pytest.raises(ValueError, match="not int8 integers"):
        encode_tensor(np.array([128 * step], np.float32), "i8", scale=step)  # outside int8's symmetric range
    with pytest.raises(ValueError, match="fixed scale is for i8"):
        encode_tensor(np.zeros(2, np.float32), "f16", scale=step)
