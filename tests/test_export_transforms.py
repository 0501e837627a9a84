"""Release transforms through the exported programs: the dct release's per-image channel subset is an
input of the release programs (as the noise is), a device part the backward programs cannot cover gets
release programs that still match eager PyTorch and runtimes that refuse to train it, and the runtimes
refuse a mask they cannot apply. (The plain bottleneck and dct exports are checked in test_transforms.py.)"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from splitface.common.models import PRESETS, build_device_part
from splitface.device.runtimes import NotTrainable, load_runtime
from splitface.device.runtimes.base import mask_args, training_args
from splitface.common.transforms import release_mask
from splitface.device.runtimes.manifest import Manifest
from splitface.export.artifacts import transform_mask
from splitface.export.verify import export_verified
from splitface.export.exporter import EXPORTER

DCT_KEEP = replace(PRESETS["iresnet_small"], release="dct", dct_drop=4, dct_keep=36)  # the frontier's point
DEEP_BOTTLENECK = replace(PRESETS["iresnet_small"], release="bottleneck", bottleneck_channels=4, bottleneck_stride=2)


@pytest.mark.slow  # an export: about 10 s
def test_dct_channel_subset_is_a_program_input_and_matches_eager(tmp_path):
    layer = build_device_part(DCT_KEEP, "layer2")
    mask_shape = transform_mask(DCT_KEEP, layer)
    assert mask_shape == (180, 1, 1)  # 3 colours x (64 - 4) frequencies
    manifest = export_verified(layer, 64, 2, tmp_path, mask=mask_shape)
    assert manifest.mask_shape == [2, 180, 1, 1] and manifest.trainable
    checks = manifest.verification["checks"]
    assert {name.split(":")[0] for name in checks} == {"executorch", "onnxruntime"}
    assert all(c["ok"] and c["release_max_abs_err"] <= 1e-4 for c in checks.values())
    import onnx
    assert [i.name for i in onnx.load(str(tmp_path / "release.onnx")).graph.input] == ["images", "noise", "mask"]

    # The mask the engine draws for a release (keyed generator), applied inside the program, before the noise.
    images = torch.rand(2, 3, 64, 64)
    mask = release_mask(DCT_KEEP, 2, (180, 16, 16), torch.Generator().manual_seed(5))
    noise = 0.1 * torch.randn(2, 180, 16, 16)
    with torch.no_grad():
        want = layer(images) * mask + noise
    for backend in ("executorch", "onnxruntime"):
        runtime = load_runtime(backend, layer, 64, 2, tmp_path, exporter=EXPORTER)
        got = runtime.release(images, noise, [], mask)
        assert (got - want).abs().max() < 1e-4
        assert mask.flatten(1).sum(1).tolist() == [36, 36]  # each image releases 36 of its 180 channels,
        assert ((got - noise) * (1 - mask)).abs().max() < 1e-6  # the others carry noise alone
        # no mask given: nothing hidden (the engine's path that masks outside the program)
        unmasked = runtime.release(images[:1], noise[:1], [])
        assert (unmasked - (layer(images[:1]).detach() + noise[:1])).abs().max() < 1e-4
        assert runtime.weight_grads(images, noise, torch.ones_like(noise), [], mask) == []  # nothing to train


def test_runtimes_refuse_a_mask_they_cannot_apply_and_a_layer_they_cannot_train():
    plain = Manifest(2, [2, 3, 64, 64], [2, 4, 32, 32], ["w"], False, None)
    with pytest.raises(ValueError, match="without a mask input"):
        mask_args(plain, 2, torch.ones(2, 4, 1, 1))
    assert mask_args(plain, 2, None) == []
    masked = replace(plain, mask_shape=[2, 4, 1, 1])
    assert mask_args(masked, 1, None)[0].tolist() == [[[[1.0]]] * 4, [[[0.0]]] * 4]  # ones, then the padding row
    with pytest.raises(ValueError, match=r"take \(1, 4, 1, 1\) for 1 images"):
        mask_args(masked, 1, torch.ones(1, 4, 2, 2))
    grad = torch.ones(2, 4, 32, 32)
    mask = torch.tensor([1.0, 0, 1, 0]).reshape(1, 4, 1, 1)
    assert training_args(masked, "x", grad, mask)[:, 1].abs().sum() == 0  # no gradient through hidden channels
    refused = replace(plain, training_refusal="found BatchNorm2d")
    assert not refused.trainable
    with pytest.raises(NotTrainable, match="BatchNorm2d.*--backend torch"):
        training_args(refused, "onnxruntime", grad, None)


@pytest.mark.slow
def test_deeper_split_releases_match_eager_and_runtimes_refuse_to_train(tmp_path):
    torch.manual_seed(0)
    layer = build_device_part(DEEP_BOTTLENECK, "layer1")  # conv1 + LRN + IResNet's layer1 (batch norms) + bottleneck
    manifest = export_verified(layer, 64, 2, tmp_path)
    assert "BatchNorm2d" in manifest.training_refusal and not manifest.trainable
    assert not (tmp_path / "train.pte").exists() and not (tmp_path / "vjp.onnx").exists()
    checks = manifest.verification["checks"]
    assert any("perturbed" in name for name in checks) and all(c["ok"] for c in checks.values())
    images, weights = torch.rand(2, 3, 64, 64), [p.detach() for p in layer.parameters()]
    noise = torch.zeros(manifest.activation_shape)
    for backend in ("executorch", "onnxruntime"):
        runtime = load_runtime(backend, layer, 64, 2, tmp_path, exporter=EXPORTER)
        assert not runtime.trainable
        np.testing.assert_allclose(runtime.release(images, noise, weights), layer(images).detach(), atol=1e-4)
        with pytest.raises(NotTrainable, match="BatchNorm2d"):
            runtime.weight_grads(images, noise, torch.ones_like(noise), weights)


@pytest.mark.slow  # an export: a few seconds
def test_facemae_patch_mask_is_a_program_input_and_matches_eager(tmp_path):
    spec = replace(PRESETS["iresnet_small"], release="mask", mask_patch=8, mask_ratio=0.75)
    layer = build_device_part(spec, "conv1")  # the image, clamped to [0, 1]: nothing to train
    mask_shape = transform_mask(spec, layer)
    assert mask_shape == (1, 64, 64)
    manifest = export_verified(layer, 64, 2, tmp_path, mask=mask_shape)
    assert manifest.mask_shape == [2, 1, 64, 64] and manifest.weight_names == []
    assert all(c["ok"] for c in manifest.verification["checks"].values())
    images = torch.rand(2, 3, 64, 64) * 1.2  # values above 1 exercise the clamp
    mask = release_mask(spec, 2, (3, 64, 64), torch.Generator().manual_seed(3))  # the engine's draw
    noise = 0.05 * torch.randn(2, 3, 64, 64)
    want = images.clamp(0, 1) * mask + noise
    for backend in ("executorch", "onnxruntime"):
        got = load_runtime(backend, layer, 64, 2, tmp_path, exporter=EXPORTER).release(images, noise, [], mask)
        assert (got - want).abs().max() < 1e-5
    assert mask.mean(dim=(1, 2, 3)).tolist() == [0.25, 0.25]  # 16 of the 64 patches visible
