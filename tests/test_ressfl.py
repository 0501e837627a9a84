"""Attacker-aware pre-training (research/ressfl.py): NoPeek's distance correlation, NoPeek's penalty in the
device's own training step, and a tiny pre-training whose file carries the trained bottleneck that devices then
load frozen."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from splitface.device.trainer import DeviceTrainer, PrivacyEngine, initial_layer
from splitface.common.models import PRESETS
from splitface.device.privacy.nopeek import distance_correlation
from research.ressfl import attacker_aware_pretrain


def test_distance_correlation_is_one_for_a_copy_and_small_for_independent_batches():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 8, 8)
    assert distance_correlation(x, 2 * x + 1).item() == pytest.approx(1.0, abs=1e-4)
    # the sample statistic is biased upwards for independent batches in high dimension, but stays below a
    # dependent pair's
    assert distance_correlation(x, torch.randn(64, 5)).item() < 0.8 < distance_correlation(x, torch.tanh(x)).item()
    x.requires_grad_(True)
    distance_correlation(x, x.flatten(1)[:, :4] ** 2).backward()   # a penalty: it has a gradient
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_nopeek_penalty_trains_the_device_layer_towards_lower_distance_correlation():
    spec = replace(PRESETS["iresnet_small"], release="bottleneck", bottleneck_channels=4, bottleneck_stride=2)
    images = np.random.default_rng(0).integers(0, 256, (16, 3, 64, 64), dtype=np.uint8)

    def dcor_after_steps(weight: float, steps: int) -> tuple[float, float]:
        engine = DeviceTrainer(spec, "conv1", "server", 5, privacy=PrivacyEngine(nopeek_weight=weight, secret=1))
        dcors = []
        for b in range(1, steps + 1):
            released = engine.forward(images, ("train", b), range(16), range(16))
            dcors.append(distance_correlation(torch.from_numpy(images).float(), torch.from_numpy(released)).item())
            engine.commit(b, np.zeros_like(released))  # no server gradient: only the penalty can move the layer
        return dcors[0], dcors[-1]

    plain_first, plain_last = dcor_after_steps(0.0, 3)
    first, last = dcor_after_steps(5.0, 3)
    assert plain_first == first and plain_last == plain_first   # same start; without the penalty nothing moves
    assert last < first
    assert PrivacyEngine(nopeek_weight=5.0).report(layer_trains=True)["nopeek_weight"] == 5.0
    with pytest.raises(ValueError, match="plain"):
        PrivacyEngine(nopeek_weight=1.0, layer_training="frozen")
    with pytest.raises(ValueError, match="no parameters"):
        DeviceTrainer(replace(spec, release="dct"), "layer2", "server", 5, privacy=PrivacyEngine(nopeek_weight=1.0))


@pytest.mark.slow
def test_pretraining_writes_a_bottleneck_the_devices_load(tmp_path, lfw):
    spec = replace(PRESETS["iresnet_small"], release="bottleneck", bottleneck_channels=4, bottleneck_stride=2)
    out = tmp_path / "ressfl.pt"
    meta = attacker_aware_pretrain(spec, "conv1", lfw, out, epochs=1, lambda_id=0, lambda_dcor=0.5, limit=48,
                                   batch_size=16, progress=False)
    assert meta["images"] == 48 and meta["history"][0]["rec_mse"] > 0 and meta["lambda_rec"] == 1.0
    seeded, loaded = initial_layer(spec, "conv1", seed=0), initial_layer(spec, "conv1", seed=0, weights=out)
    trained = {k: v for k, v in loaded.state_dict().items() if k.startswith("stages.bottleneck.")}
    assert trained and any(not torch.equal(v, seeded.state_dict()[k]) for k, v in trained.items())
    with pytest.raises(ValueError, match="give one"):
        attacker_aware_pretrain(PRESETS["iresnet_small"], "conv1", lfw, out, epochs=1)
