"""The substitute-client attack: when the devices' layer has drifted from the seeded one the server
knows, fitting a copy to the recorded releases (public faces only) brings the copy's releases closer
to the device's in distribution, and so makes better attack training pairs."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from splitface.common.data import load_lfw
from splitface.device.trainer import initial_layer, to_input
from splitface.common.models import resolve_spec
from splitface.device.privacy.mechanisms import NoNoise
from research.audit.attack import layer_outputs
from research.audit.run import public_faces
from research.audit.substitute import fit_substitute

pytestmark = pytest.mark.slow  # real processes or real-face training: the full tier


def test_the_substitute_moves_towards_the_devices_layer(lfw):
    spec = resolve_spec("iresnet_small")
    seeded = initial_layer(spec, "conv1", seed=0).eval()
    device = copy.deepcopy(seeded)
    torch.manual_seed(1)
    with torch.no_grad():   # the device trained its layer: weights the server never saw
        conv = device.stages["conv1"][0]
        conv.weight.mul_(1.6).add_(0.05 * torch.randn_like(conv.weight))
        conv.bias.add_(0.2)
    private = to_input(load_lfw(lfw, max_identities=6).train.load(64, 160)[:96]).numpy()
    public = to_input(public_faces(lfw, 160).load(64, 160)).numpy()
    recorded = layer_outputs(device, private)
    substitute, fit = fit_substitute(seeded, spec, NoNoise(), public, recorded, steps=60, lr=5e-3)
    assert fit["mmd_after"] < 0.7 * fit["mmd_before"], fit
    gap = lambda layer: float(np.abs(layer_outputs(layer, public[:32]) - layer_outputs(device, public[:32])).mean())  # noqa: E731
    assert gap(substitute) < gap(seeded)
