"""The device engine's privacy paths: what it releases, what it records, how its layer learns."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splitface.device.trainer import DeviceTrainer
from splitface.device.privacy.engine import PrivacyEngine
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.device.privacy.budget import BudgetExceeded
from splitface.device.privacy.mechanisms import NoNoise, PerActivationGaussian, PerImageGaussian

SPEC = resolve_spec("iresnet_small")
RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8)
LABELS = np.array([0, 1, 1, 2])
IDS = np.array([10, 11, 12, 13])
GRAD = RNG.normal(0, 1e-3, (4, 16, 64, 64)).astype(np.float32)


def _engine(**privacy) -> DeviceTrainer:
    return DeviceTrainer(SPEC, "conv1", "server", 3, TrainConfig(lr=0.1, momentum=0.0, seed=3),
                        PrivacyEngine(**{"secret": 42, **privacy}))


def _step(engine: DeviceTrainer, batch_id: int = 1) -> np.ndarray:
    released = engine.forward(IMAGES, ("train", batch_id), IDS, LABELS)
    engine.commit(batch_id, GRAD)
    return released


def _weights(engine: DeviceTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.layer.parameters()]


def test_dpsgd_without_noise_or_clipping_equals_plain_sgd():
    plain, dpsgd = _engine(), _engine(layer_training="dpsgd", dpsgd_clip=1e9, dpsgd_noise=0.0)
    _step(plain), _step(dpsgd)
    for p, q in zip(_weights(plain), _weights(dpsgd), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_dpsgd_clips_noises_and_is_recorded_jointly():
    engine = _engine(layer_training="dpsgd", dpsgd_clip=1e-4, dpsgd_noise=1.0)
    before = _weights(engine)
    _step(engine)
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(engine), strict=True))
    report = engine.privacy_report()
    assert not report["guarantee_void"] and math.isinf(report["epsilon_image"]["max"])  # NoNoise releases
    noisy = _engine(mechanism=PerImageGaussian(1.0, 5.0), layer_training="dpsgd", dpsgd_noise=5.0)
    _step(noisy)
    # image 11 and 12 share identity 1: the one DP-SGD draw counts for both jointly
    assert noisy.privacy.accountant.epsilon_identity(1) > noisy.privacy.accountant.epsilon_image(11)


def test_frozen_layer_never_changes_and_the_noise_is_keyed():
    engine = _engine(mechanism=PerImageGaussian(1.0, 1.0), layer_training="frozen")
    before = _weights(engine)
    first = _step(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine), strict=True))
    again = engine.forward(IMAGES, ("train", 1), IDS, LABELS)   # a replay: same key, same noise, not recounted
    assert np.array_equal(first, again)
    releases = engine.privacy.accountant.report()["releases"]
    other = engine.forward(IMAGES, ("train", 2), IDS, LABELS)
    assert not np.array_equal(first, other) and engine.privacy.accountant.report()["releases"] > releases
    assert np.linalg.norm(first - engine.evaluate_release(IMAGES, ("eval", 0, 0), IDS, LABELS)) > 0


def test_per_activation_clamps_the_lrn_input_and_the_guard_refuses():
    engine = _engine(mechanism=PerActivationGaussian(3.0, 1e-5), layer_training="frozen", budget_epsilon=1e3)
    assert all(m.input_max == 1.0 for m in engine.layer.modules() if hasattr(m, "input_max"))
    with pytest.raises(BudgetExceeded):  # one per-activation release of 16x64x64 values is far past 1e3
        engine.forward(IMAGES, ("train", 1), IDS, LABELS)
    assert engine.privacy.accountant.report()["releases"] == 0


def test_plain_training_with_noise_is_flagged_void():
    engine = _engine(mechanism=PerImageGaussian(1.0, 1.0))
    _step(engine)
    assert engine.privacy_report()["guarantee_void"]
    assert not _engine(mechanism=NoNoise()).privacy_report()["guarantee_void"]


def test_discrete_noise_releases_integers_keyed_per_release_and_resumes_its_books(tmp_path):
    """--noise discrete through the engine: int8 multiples of the public step, the same integers for a re-sent
    release (the key derives from the secret and the release), zCDP in the books, and the books on disk."""
    from splitface.common.accountants.ledger import epsilon_of
    from splitface.device.privacy.discrete import DiscreteGaussianMechanism

    mech = DiscreteGaussianMechanism(clip_norm=8.0, noise_multiplier=2.0)
    state = tmp_path / "device-0.privacy.json"
    engine = _engine(mechanism=mech, state_path=state)
    before = _weights(engine)
    first = engine.forward(IMAGES[:1], ("train", 1), IDS[:1], LABELS[:1])
    steps = first / np.float32(mech.step)
    assert np.array_equal(steps, np.rint(steps)) and np.abs(steps).max() <= 127 and np.abs(steps).max() > 0
    assert engine.integer_step == mech.step  # what the client sends the integers at (test_discrete_noise)
    engine.commit(1, GRAD[:1])  # the layer learns through the release (straight-through)
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(engine), strict=True))
    eps = engine.privacy.accountant.epsilon_image(IDS[0])
    assert eps == epsilon_of(mech.image_event(0), 1e-5)
    assert engine.privacy_report()["mechanism"]["name"] == "discrete_gaussian"

    # a restarted device resumes its secret and its books: the re-sent release repeats its integers, for free
    resumed = _engine(mechanism=mech, layer_training="frozen", state_path=state)  # the initial layer again
    assert resumed.privacy.accountant.epsilon_image(IDS[0]) == eps
    assert np.array_equal(resumed.forward(IMAGES[:1], ("train", 1), IDS[:1], LABELS[:1]), first)
    assert resumed.privacy.accountant.epsilon_image(IDS[0]) == eps
    other = resumed.forward(IMAGES[:1], ("train", 2), IDS[:1], LABELS[:1])
    assert not np.array_equal(other, first) and resumed.privacy.accountant.epsilon_image(IDS[0]) > eps
