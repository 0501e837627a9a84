"""Release transforms (splitface/common/transforms): the spec and CLI carry them, the DCT is the orthonormal
block DCT, dropped frequencies never leave the device, device + server is still one model (trained
over the real websocket), and the exported device programs match eager PyTorch."""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitface.common.options import add_model_args, model_argv, model_spec
from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer, PrivacyEngine, to_input
from splitface.common.models import (PRESETS, ModelSpec, activation_shape, build_backbone, build_classifier, split_backbone)
from splitface.common.models.weights import load_into, save_backbone
from splitface.common.optim import TrainConfig, exponential_decay, make_sgd
from splitface.device.privacy.mechanisms import PerActivationGaussian, PerImageGaussian
from splitface.device.runtimes import load_runtime
from splitface.common.transforms.dct import BlockDCT, zigzag
from splitface.server.trainer import ServerTrainer
from splitface.export.verify import export_verified
from tests.conftest import TOKENS, serve_in_thread

SMALL = PRESETS["iresnet_small"]
BOTTLENECK = replace(SMALL, release="bottleneck", bottleneck_channels=4, bottleneck_stride=2)
DCT = replace(SMALL, release="dct")
NUM_CLASSES, LR, DECAY_STEPS = 5, 0.05, 4


def test_spec_keeps_old_keys_and_round_trips_the_new_ones():
    old = {"family": "iresnet", "input_size": 64, "width": 16, "fc_width": 4096, "depth": 18, "embedding_size": 128,
           "dropout": 0.0, "release_pool": 1}
    assert {k: SMALL.to_dict()[k] for k in old} == old and list(SMALL.to_dict())[:len(old)] == list(old)
    assert ModelSpec.from_dict(old) == SMALL  # a dict without the new keys means no transform
    for spec in (BOTTLENECK, DCT, replace(DCT, dct_drop=0, dct_keep=100), replace(DCT, dct_stem_blocks=2)):
        assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown ModelSpec keys"):
        ModelSpec.from_dict({**DCT.to_dict(), "dct_upsample": 2})
    for bad in (dict(release="jpeg"), dict(dct_keep=5), dict(release="dct", dct_keep=190), dict(release="dct", dct_drop=64),
                dict(release="bottleneck", release_pool=2), dict(release="bottleneck", bottleneck_channels=0),
                dict(dct_stem_blocks=1), dict(release="dct", dct_stem_blocks=-1)):
        with pytest.raises(ValueError):
            replace(SMALL, **bad)


def test_cli_builds_the_spec_and_hands_it_on_unchanged():
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--model", "iresnet_small", "--split", "layer2", "--release", "dct", "--dct-keep", "60",
                         "--dct-stem-blocks", "2"])
    assert model_spec(args) == replace(DCT, dct_keep=60, dct_stem_blocks=2)
    again = p.parse_args(model_argv(args))  # what the demo gives the server and the simulator
    assert model_spec(again) == model_spec(args) and again.split == "layer2"
    # a key added later is named only when set: commands recorded before it stay the same
    assert "--dct-stem-blocks" not in model_argv(p.parse_args(["--model", "iresnet_small", "--release", "dct"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--release", "dct", "--dct-stem-blocks", "-1"])
    assert model_spec(p.parse_args(["--model", "iresnet_small"])) == SMALL
    # run.sh names the DCT's server stage; --release none alone overrides the release and its stage with it
    assert model_spec(p.parse_args(["--model", "iresnet_small", "--dct-stem-blocks", "2", "--release", "none"])) == SMALL


def test_bottleneck_releases_few_bounded_values():
    assert activation_shape(BOTTLENECK, "conv1") == (4, 32, 32)
    assert activation_shape(replace(BOTTLENECK, bottleneck_stride=1), "layer1") == (4, 32, 32)
    torch.manual_seed(0)
    device, server = split_backbone(build_backbone(BOTTLENECK), "conv1")
    assert list(device.stages) == ["conv1", "bottleneck"] and list(server.stages)[:2] == ["bottleneck_server", "layer1"]
    released = device(torch.rand(2, 3, 64, 64))
    assert released.shape == (2, 4, 32, 32) and released.abs().max() < 1
    assert server(released).shape == (2, SMALL.embedding_size)


def test_dct_is_the_orthonormal_block_dct_and_inverts_when_nothing_is_dropped():
    import scipy.fft as scipy_fft  # scipy comes with scikit-learn (the audit extra, installed by the test command)
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    dct = BlockDCT(upsample=1, drop=0).double()
    out = dct(x)
    assert out.shape == (2, 192, 4, 4)
    for n, c, bi, bj in [(0, 0, 0, 0), (1, 2, 3, 1), (0, 1, 2, 3)]:
        block = x[n, c, 8 * bi:8 * bi + 8, 8 * bj:8 * bj + 8].numpy()
        want = scipy_fft.dctn(block, norm="ortho")
        got = out[n, 64 * c:64 * (c + 1), bi, bj].numpy()
        assert np.allclose(got, [want[u, v] for u, v in zigzag()], rtol=0, atol=1e-6)  # float32 basis
    back = F.conv_transpose2d(out, dct.basis, stride=8, groups=3)
    assert torch.allclose(back, x, rtol=0, atol=1e-6)


def test_dct_dropped_frequencies_are_absent_from_the_release():
    assert activation_shape(DCT, "layer2") == (189, 16, 16)  # 128 px (upsampled 2x) -> 16x16 blocks
    assert activation_shape(replace(DCT, dct_drop=6), "layer3") == (174, 8, 8)
    torch.manual_seed(0)
    device, server = split_backbone(build_backbone(DCT), "layer2")
    assert list(device.stages) == ["dct"] and list(server.stages) == ["dct_server", "layer3", "layer4", "features"]
    assert not list(device.parameters()) and not device.state_dict()  # no learned layer on the device
    # A flat image is pure DC: with the DC dropped, nothing of it is released.
    flat = torch.full((1, 3, 64, 64), 0.7)
    assert device(flat).abs().max() < 1e-5
    assert BlockDCT(upsample=2, drop=0)(flat).abs().max() > 1
    # Same for the lowest 6 frequencies: a smooth ramp's energy there never leaves the device.
    ramp = torch.linspace(0, 1, 8).repeat(1, 3, 8, 1)
    assert BlockDCT(drop=6)(ramp).abs().max() < 0.1 * BlockDCT(drop=0)(ramp).abs().max()


def test_dct_keep_releases_a_random_subset_per_image_repeated_on_resend():
    engine = DeviceTrainer(replace(DCT, dct_keep=20), "layer2", "server", NUM_CLASSES)
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 64, 64), dtype=np.uint8)
    released = engine.forward(images, ("train", 1), range(4), range(4))
    kept = np.abs(released).sum(axis=(2, 3)) > 0
    assert (kept.sum(axis=1) == 20).all() and len({tuple(k) for k in kept}) == 4
    assert np.array_equal(engine.forward(images, ("train", 1), range(4), range(4)), released)  # a re-sent batch
    engine.commit(1, np.ones_like(released))  # no device parameters: nothing to step
    # The per-image mechanism clips each image's kept channels and then noises every channel.
    noisy = DeviceTrainer(replace(DCT, dct_keep=20), "layer2", "server", NUM_CLASSES,
                         privacy=PrivacyEngine(PerImageGaussian(1.0, 0.5)))
    released = noisy.forward(images, ("train", 1), range(4), range(4))
    assert (np.abs(released).sum(axis=(2, 3)) > 0).all()


def test_engine_refuses_what_would_break_the_per_image_argument():
    with pytest.raises(ValueError, match="batch norm"):
        DeviceTrainer(replace(BOTTLENECK, bottleneck_stride=1), "layer1", "server", NUM_CLASSES)
    DeviceTrainer(BOTTLENECK, "layer1", "server", NUM_CLASSES, privacy=PrivacyEngine(layer_training="frozen"))
    with pytest.raises(ValueError, match="per-image"):
        DeviceTrainer(BOTTLENECK, "conv1", "server", NUM_CLASSES, privacy=PrivacyEngine(PerActivationGaussian(3, 1e-5)))
    with pytest.raises(ValueError, match="no parameters"):
        DeviceTrainer(DCT, "layer2", "server", NUM_CLASSES, privacy=PrivacyEngine(layer_training="dpsgd"))


def _unsplit_steps(spec, split, batches):
    """The whole model in one process: both parts built from the seed as device and server build them."""
    torch.manual_seed(0)
    device, server = split_backbone(build_backbone(spec), split)
    model = torch.nn.Sequential(device, server)
    torch.manual_seed(1)
    classifier = build_classifier(spec, NUM_CLASSES)
    opt = make_sgd(list(model.parameters()) + list(classifier.parameters()), LR, 0.9)
    sched = exponential_decay(opt, 0.1, DECAY_STEPS)
    losses = []
    for images, labels in batches:
        model.train()
        opt.zero_grad()
        loss = F.cross_entropy(classifier(model(to_input(images))), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return device, server, classifier, losses


@pytest.mark.parametrize("spec,split", [(BOTTLENECK, "conv1"), (DCT, "layer2"), (replace(DCT, dct_stem_blocks=1), "layer2")])
def test_split_with_transform_equals_unsplit_model(tmp_path, spec, split):
    """Two SGD steps of engine + websocket + server trainer, each side building its part from the seed,
    equal two steps of the whole model in one process, bit for bit (the same kernels on the same values with the
    same thread count: see tests/test_split_exact.py)."""
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (6, 3, 64, 64), dtype=np.uint8), rng.integers(0, NUM_CLASSES, 6)) for _ in range(2)]
    ref_device, ref_server, ref_classifier, ref_losses = _unsplit_steps(spec, split, batches)
    config = TrainConfig(lr=LR, decay_steps=DECAY_STEPS, seed=0)
    trainer = ServerTrainer(spec, split, NUM_CLASSES, config)
    torch.manual_seed(1)
    trainer.classifier.load_state_dict(build_classifier(spec, NUM_CLASSES).state_dict())
    engine = DeviceTrainer(spec, split, "server", NUM_CLASSES, config)
    with serve_in_thread(trainer, tmp_path) as server:
        async def run():
            client = DeviceClient(server.url, "device-0", TOKENS["device-0"], engine, batch_size=8)
            await client.connect()
            results = [await client.train_batch(i + 1, images, labels, np.arange(len(labels)) + 100 * i)
                       for i, (images, labels) in enumerate(batches)]
            await client.close()
            return results
        results = asyncio.run(run())
    assert [r.loss for r in results] == ref_losses
    for part, ref in [(engine.layer, ref_device), (trainer.tail, ref_server), (trainer.classifier, ref_classifier)]:
        for (name, p), (_, q) in zip(part.named_parameters(), ref.named_parameters(), strict=True):
            assert torch.equal(p, q), f"{name} weights differ by {float((p - q).abs().max()):.3g}"


def test_exported_bottleneck_matches_eager(tmp_path):
    torch.manual_seed(0)
    layer, _ = split_backbone(build_backbone(BOTTLENECK), "conv1")
    manifest = export_verified(layer, 64, 2, tmp_path)
    assert manifest.activation_shape == [2, 4, 32, 32]
    assert all(c["ok"] for c in manifest.verification["checks"].values())
    assert any("perturbed" in name for name in manifest.verification["checks"])  # weights read at run time


def test_exported_dct_matches_eager_and_trains_through_the_engine(tmp_path):
    spec = replace(DCT, dct_keep=30)
    engine = DeviceTrainer(spec, "layer2", "server", NUM_CLASSES)
    manifest = export_verified(engine.layer, 64, 2, tmp_path)
    assert manifest.weight_names == [] and manifest.activation_shape == [2, 189, 16, 16]
    assert all(c["ok"] for c in manifest.verification["checks"].values())
    assert not (tmp_path / "train.pte").exists() and not (tmp_path / "vjp.onnx").exists()
    images = np.random.default_rng(0).integers(0, 256, (2, 3, 64, 64), dtype=np.uint8)
    eager = engine.forward(images, ("train", 1), [0, 1], [0, 1])
    engine.attach_runtime(load_runtime("onnxruntime", engine.layer, 64, 2, tmp_path))
    released = engine.forward(images, ("train", 1), [0, 1], [0, 1])
    assert np.abs(released - eager).max() < 1e-4  # same keyed channel subset, same values
    engine.commit(1, np.ones_like(released))
    assert engine.committed == 1


def test_the_dct_stage_gains_residual_blocks_and_keeps_its_names_without_them():
    """dct_stem_blocks adds residual blocks at the split's shape after the server stage's conv; at 0 the stage is
    the conv, BN and ReLU alone, under the names that files saved before the option hold."""
    device, plain = split_backbone(build_backbone(DCT), "layer2")
    _, deep = split_backbone(build_backbone(replace(DCT, dct_stem_blocks=2)), "layer2")
    names = {k.split(".", 2)[2] for k in plain.state_dict() if ".dct_server." in k}
    assert names == {"conv.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    extra = {k for k in deep.state_dict() if ".dct_server." in k} - {k for k in plain.state_dict()}
    assert extra and all(".dct_server.blocks." in k for k in extra)
    release = device(torch.rand(4, 3, 64, 64))
    assert deep.stages.dct_server(release).shape == plain.stages.dct_server(release).shape


def test_a_start_with_one_dct_stage_refuses_a_model_with_another(tmp_path):
    """A file holding the DCT's trained server stage (a noise-aware start) loads only into a model whose stage has
    as many blocks: the conv alone does not silently leave the blocks at their seeded start."""
    torch.manual_seed(0)
    backbone = build_backbone(DCT)
    _, server = split_backbone(backbone, "layer2")
    stages = {k: v for k, v in server.state_dict().items() if k.split(".")[1] == "dct_server"}
    save_backbone(tmp_path / "start.pt", DCT, backbone, {}, stages)
    deeper = replace(DCT, dct_stem_blocks=2)
    with pytest.raises(ValueError, match="holds"):
        load_into(split_backbone(build_backbone(deeper), "layer2")[1], tmp_path / "start.pt", deeper)
    load_into(split_backbone(build_backbone(DCT), "layer2")[1], tmp_path / "start.pt", DCT)


def test_a_backbone_file_can_carry_trained_release_stages(tmp_path):
    """Attacker-aware pre-training trains the bottleneck with the backbone: its file carries both, both
    sides load them, and a model with another transform refuses the file."""
    spec = replace(PRESETS["iresnet_small"], release="bottleneck", bottleneck_channels=4, bottleneck_stride=2)
    torch.manual_seed(0)
    backbone = build_backbone(spec)
    device, server = split_backbone(backbone, "conv1")
    with torch.no_grad():
        for p in [*device.parameters(), *server.parameters()]:
            p.add_(0.5)
    stages = {k: v for part in (device, server) for k, v in part.state_dict().items()
              if k.split(".")[1] in ("bottleneck", "bottleneck_server")}
    save_backbone(tmp_path / "w.pt", spec, backbone, {}, stages)
    torch.manual_seed(1)
    device2, server2 = split_backbone(build_backbone(spec), "conv1")
    load_into(device2, tmp_path / "w.pt", spec), load_into(server2, tmp_path / "w.pt", spec)
    x = torch.rand(2, 3, 64, 64)
    for part in (device, server, device2, server2):
        part.eval()
    assert torch.equal(server(device(x)), server2(device2(x)))
    other = replace(spec, bottleneck_channels=8)
    with pytest.raises(ValueError, match="holds"):
        load_into(split_backbone(build_backbone(other), "conv1")[0], tmp_path / "w.pt", other)
