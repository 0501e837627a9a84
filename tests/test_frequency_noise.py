"""Noise shaped per frequency on the DCT release (PerImageGaussian.frequency_gamma, DCTDP-style): each frequency
gets noise z C / w_f, the guarantee is the plain mechanism's, and the setting travels with the run's description
so that the audit's attacker releases exactly as the device does."""
from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest
import torch

from splitface.device.trainer import DeviceTrainer, privatize
from splitface.common.models import PRESETS
from splitface.device.privacy.options import add_privacy_args, privacy_engines
from splitface.device.privacy.described import from_description
from splitface.device.privacy.mechanisms import PerImageGaussian
from splitface.common.transforms.dct import frequency_weights, zigzag

DCT = replace(PRESETS["iresnet_small"], release="dct", dct_drop=4)


def test_weights_follow_the_power_law_from_the_lowest_released_frequency():
    w = frequency_weights(4, 2.0).flatten()
    assert w.shape == (180,) and w[0] == 1.0 and torch.equal(w[:60], w[60:120])   # colour-major, same per colour
    u, v = zigzag()[4 + 59]
    assert w[59].item() == pytest.approx(((1 + u + v) / 3) ** 2)
    assert torch.equal(frequency_weights(4, 0.0), torch.ones(180, 1, 1))


def test_each_frequency_gets_noise_z_c_over_its_weight_at_the_same_epsilon():
    shaped, plain = PerImageGaussian(1e6, 1e-6, frequency_gamma=2.0), PerImageGaussian(1e6, 1e-6)
    assert shaped.image_event(100) == plain.image_event(100)   # post-processing of the weighted release
    zeros = torch.zeros(64, 180, 4, 4)   # nothing clipped: the release is the noise alone
    noise = privatize(DCT, shaped, zeros, torch.Generator().manual_seed(0))
    std = noise.transpose(0, 1).flatten(1).std(dim=1)
    expected = shaped.std / frequency_weights(4, 2.0).flatten()
    assert torch.allclose(std, expected, rtol=0.1)
    assert from_description(shaped.describe()).frequency_gamma == 2.0


def test_the_option_is_refused_where_it_means_nothing():
    p = argparse.ArgumentParser()
    add_privacy_args(p)
    with pytest.raises(SystemExit, match="per-image"):
        privacy_engines(p.parse_args(["--frequency-gamma", "2"]), 1)
    with pytest.raises(SystemExit, match="discrete"):
        privacy_engines(p.parse_args(["--mechanism", "per-image", "--noise-multiplier", "1", "--noise", "discrete",
                                      "--frequency-gamma", "2"]), 1)
    engine = privacy_engines(p.parse_args(["--mechanism", "per-image", "--noise-multiplier", "0.01",
                                           "--clip-norm", "8", "--frequency-gamma", "2"]), 1)()
    with pytest.raises(ValueError, match="dct"):
        DeviceTrainer(PRESETS["iresnet_small"], "conv1", "server", 5, privacy=engine)
    device = DeviceTrainer(DCT, "layer2", "server", 5, privacy=engine)
    images = np.random.default_rng(0).integers(0, 256, (2, 3, 64, 64), dtype=np.uint8)
    assert device.forward(images, ("train", 1), range(2), range(2)).shape == (2, 180, 16, 16)
