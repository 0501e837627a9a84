"""The reconstruction attack on a reduced CPU configuration with real faces: without noise the
curious server re-identifies people far above chance; with strong noise it falls to chance.

Private: 10 LFW people with >= 10 images (training images released, test images = the attacker's
other photos). Public (the attacker's training data): LFW people with 3..9 images, disjoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitface.common.data import load_lfw
from splitface.device.trainer import to_input
from splitface.common.models import build_backbone, resolve_spec, split_backbone
from splitface.common.models.lrn import PaperLRN
from splitface.device.privacy.mechanisms import NoNoise, PerActivationGaussian
from research.audit.attack import reconstruction_report, releases
from research.audit.inversion import RidgeInversion
from research.audit.recognizer import Eigenfaces

pytestmark = pytest.mark.slow  # real processes or real-face training: the full tier


@pytest.fixture(scope="module")
def setting(lfw):
    private = load_lfw(lfw, min_images=10, max_identities=10)
    public = load_lfw(lfw, min_images=3, max_images=9)
    public_train = public.train.subset(np.random.default_rng(0).permutation(len(public.train))[:800])
    torch.manual_seed(0)
    layer, _ = split_backbone(build_backbone(resolve_spec("iresnet_small")), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0   # as the per-activation mechanism runs it; the attacker knows the public layer
    images = {name: to_input(s.load(64, 160)).numpy() for name, s in
              (("public", public_train), ("private", private.train), ("photos", private.test))}
    return layer, images, private.train.labels, private.test.labels


def attack(setting, mechanism) -> dict:
    layer, images, ids, photo_ids = setting
    inversion = RidgeInversion().fit(releases(layer, images["public"], mechanism, seed=1), images["public"])
    recon = inversion.reconstruct(releases(layer, images["private"], mechanism, seed=2))
    eigenfaces = Eigenfaces().fit(images["public"])
    references = {"eigenfaces": (eigenfaces.embed(images["photos"]), eigenfaces.embed(images["private"]))}
    report = reconstruction_report(recon, images["private"], ids, photo_ids, {"eigenfaces": eigenfaces}, references)
    return {**report, **report["recognizers"]["eigenfaces"]}


def test_without_noise_the_server_reidentifies_far_above_chance(setting):
    r = attack(setting, NoNoise())
    assert r["risk@1_clean_upper_bound"] >= 3 * r["risk@1_chance"]   # the recognizer is worth something
    assert r["risk@1"] >= 2.5 * r["risk@1_chance"]
    assert r["linkage_pixels"] > 0.8 and r["psnr_db"] > 20


def test_with_strong_noise_it_falls_to_chance(setting):
    r = attack(setting, PerActivationGaussian(0.05, 1e-5))   # noise std ~68 per value, activations < 0.58
    assert r["risk@1"] <= r["risk@1_chance"] + 0.1
    assert r["linkage_pixels"] < 0.05
