"""Backbones: the paper's LRN, VGG-16 / arcface parameter counts, and exact splitting."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from splitface.common.models import (DEFAULT_SPLIT, PRESETS, ModelSpec, PaperLRN, activation_shape, build_backbone, build_device_part, build_classifier, resolve_spec, split_backbone, stage_names)

SMALL = ["vgg_face_small", "iresnet_small"]


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def meta_backbone(spec: ModelSpec) -> nn.Module:
    with torch.device("meta"):
        return build_backbone(spec)


def lrn_loop(a: torch.Tensor, u: int = 5, alpha: float = 1.0, beta: float = 0.5, gamma: float = 2.0) -> torch.Tensor:
    """The paper's formula, written out channel by channel."""
    c = a.shape[1]
    out = torch.empty_like(a)
    for i in range(c):
        lo, hi = max(0, i - u // 2), min(c - 1, i + u // 2)
        s = sum(a[:, j] ** 2 for j in range(lo, hi + 1))
        out[:, i] = a[:, i] / (gamma + alpha * s) ** beta
    return out


# --- PaperLRN -----------------------------------------------------------------


@pytest.mark.parametrize("channels", [7, 64])
def test_lrn_matches_paper_formula(channels: int) -> None:
    torch.manual_seed(0)
    a = torch.rand(2, channels, 5, 6, dtype=torch.float64) * 3
    got = PaperLRN(channels).double()(a)
    assert torch.allclose(got, lrn_loop(a), rtol=0, atol=1e-6)
    # Edge channels (clamped window) specifically.
    for i in (0, 1, channels - 2, channels - 1):
        assert torch.allclose(got[:, i], lrn_loop(a)[:, i], rtol=0, atol=1e-6)


def test_lrn_non_default_params() -> None:
    a = torch.rand(1, 9, 3, 3, dtype=torch.float64)
    got = PaperLRN(9, size=3, alpha=0.5, beta=0.75, gamma=1.0).double()(a)
    assert got.dtype == torch.float64
    assert torch.allclose(got, lrn_loop(a, u=3, alpha=0.5, beta=0.75, gamma=1.0), atol=1e-9)


def test_lrn_output_in_unit_interval_for_relu_inputs() -> None:
    torch.manual_seed(0)
    lrn = PaperLRN(16).double()
    for scale in (1e-6, 1.0, 1e2, 1e4, 1e6):
        out = lrn(torch.relu(torch.randn(2, 16, 4, 4, dtype=torch.float64) * scale))
        assert out.min() >= 0 and out.max() < 1, scale
    # float32: mathematically < 1, but a/sqrt(2+a^2) rounds to exactly 1.0 once a >~ 4e3.
    out32 = PaperLRN(16)(torch.relu(torch.randn(2, 16, 4, 4) * 1e6))
    assert out32.min() >= 0 and out32.max() <= 1


def test_lrn_differs_from_torch_lrn_which_divides_alpha_by_size() -> None:
    torch.manual_seed(0)
    a = torch.rand(2, 12, 4, 4, dtype=torch.float64) * 2
    ours = PaperLRN(12).double()(a)
    assert not torch.allclose(ours, nn.LocalResponseNorm(5, alpha=1.0, beta=0.5, k=2.0)(a), atol=1e-3)
    assert torch.allclose(ours, nn.LocalResponseNorm(5, alpha=5.0, beta=0.5, k=2.0)(a), atol=1e-12)


def test_lrn_costs_u_taps_not_a_channel_matrix() -> None:
    """The window sum is u shifted adds per value: no matrix product or convolution anywhere in it."""
    from torch.utils.flop_counter import FlopCounterMode

    a = torch.rand(2, 64, 8, 8).requires_grad_()
    lrn = PaperLRN(64)
    with FlopCounterMode(display=False) as counter:  # counts matrix products and convolutions, forward and backward
        lrn(a).sum().backward()
    assert counter.get_total_flops() == 0 and a.grad is not None
    graph = torch.export.export(lrn, (torch.rand(1, 64, 4, 4),)).graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert not any("conv" in op or "pool" in op or "pad" in op for op in ops), ops
    assert sum("slice" in op for op in ops) == 5 and sum("cat" in op for op in ops) == 1
    # edge channels and size 1 (no neighbours)
    x = torch.rand(1, 3, 2, 2, dtype=torch.float64)
    assert torch.allclose(PaperLRN(3, size=1)(x), lrn_loop(x, u=1), atol=1e-12)
    assert torch.allclose(PaperLRN(3, size=7)(x), lrn_loop(x, u=7), atol=1e-12)


def test_lrn_loads_files_saved_with_the_banded_kernel() -> None:
    """Backbones and device layers saved before the 5-tap form hold a "band" buffer: still loadable."""
    layer = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), PaperLRN(6))
    old = {**layer.state_dict(), "2.band": torch.ones(6, 6, 1, 1)}
    layer.load_state_dict(old)  # strict
    assert "2.band" not in layer.state_dict()


# --- specs ----------------------------------------------------------------------


def test_spec_round_trip_and_resolve() -> None:
    for name, spec in PRESETS.items():
        d = spec.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert ModelSpec.from_dict(json.loads(json.dumps(d))) == spec
        assert resolve_spec(name) is spec
        assert resolve_spec(d) == spec
    assert PRESETS["vgg_face"].embedding_dim == 4096
    assert PRESETS["iresnet50"].embedding_dim == 512
    with pytest.raises(ValueError, match="iresnet_small"):
        resolve_spec("no_such_model")
    with pytest.raises(ValueError, match="unknown ModelSpec keys"):
        ModelSpec.from_dict({"family": "vgg_face", "input_size": 64, "widht": 8})
    with pytest.raises(ValueError):
        ModelSpec("resnet", 112)
    with pytest.raises(ValueError):
        ModelSpec("vgg_face", 100)


# --- VGG-Face -------------------------------------------------------------------


def test_vgg_face_full_matches_vgg16_parameter_count() -> None:
    spec = PRESETS["vgg_face"]
    bb = meta_backbone(spec)
    assert n_params(bb) == 134_260_544  # VGG-16 without fc8
    assert n_params(bb) + n_params(build_classifier(spec, 1000)) == 138_357_544  # VGG-16 with 1000-way fc8
    names = stage_names(spec)
    assert names[:3] == ["conv1", "conv1_2", "pool1"]
    assert names[-4:] == ["conv5_3", "pool5", "fc6", "fc7"]
    assert sum(n.startswith("conv") for n in names) == 13
    assert activation_shape(spec, "conv1") == (64, 224, 224)
    assert activation_shape(spec, "pool5") == (512, 7, 7)
    assert isinstance(bb.stages["conv1"][2], PaperLRN)


# --- IResNet --------------------------------------------------------------------


def test_iresnet_shapes_and_counts() -> None:
    # arcface_torch: R18 24,025,600 and R50 43,590,848 parameters. Our stem drops
    # BN (128) + PReLU (64) and gains a conv bias (64): -128.
    r18, r50 = PRESETS["iresnet18"], PRESETS["iresnet50"]
    assert n_params(meta_backbone(r18)) == 24_025_600 - 128
    bb50 = meta_backbone(r50)
    assert n_params(bb50) == 43_590_848 - 128
    assert bb50.stages["features"].fc.weight.shape == (512, 512 * 7 * 7)
    assert [len(bb50.stages[f"layer{i}"]) for i in range(1, 5)] == [3, 4, 14, 3]
    assert stage_names(r50) == ["conv1", "layer1", "layer2", "layer3", "layer4", "features"]
    assert activation_shape(r50, "conv1") == (64, 112, 112)
    assert activation_shape(r50, "layer4") == (512, 7, 7)

    torch.manual_seed(0)
    bb18 = build_backbone(r18).eval()
    with torch.no_grad():
        out = bb18(torch.rand(1, 3, 112, 112))
    assert out.shape == (1, 512) and torch.isfinite(out).all()


# --- small presets: forward, split, sharing --------------------------------------


@pytest.mark.parametrize("name", SMALL)
def test_small_forward_and_exact_split(name: str) -> None:
    spec = PRESETS[name]
    torch.manual_seed(0)
    bb = build_backbone(spec).eval()
    x = torch.rand(2, 3, spec.input_size, spec.input_size)
    with torch.no_grad():
        full = bb(x)
    assert full.shape == (2, spec.embedding_dim)

    names = stage_names(spec)
    assert DEFAULT_SPLIT == names[0]
    bb_params = {id(p) for p in bb.parameters()}
    for split in names[:-1]:
        device, server = split_backbone(bb, split)
        with torch.no_grad():
            act = device(x)
            assert torch.equal(server(act), full), split
        if act.dim() == 4:
            assert tuple(act.shape[1:]) == activation_shape(spec, split)
        else:  # after fc6 the activation is flat, not (C, H, W)
            with pytest.raises(ValueError, match="does not produce"):
                activation_shape(spec, split)
        part_params = [p for m in (device, server) for p in m.parameters()]
        assert {id(p) for p in part_params} == bb_params and len(part_params) == len(bb_params)
        assert set(device.state_dict()) | set(server.state_dict()) == set(bb.state_dict())

    with pytest.raises(ValueError, match="valid splits"):
        split_backbone(bb, "nope")
    with pytest.raises(ValueError, match="last stage"):
        split_backbone(bb, names[-1])


def test_device_layer_output_bounded_and_per_image() -> None:
    spec = PRESETS["iresnet_small"]
    torch.manual_seed(0)
    device, _ = split_backbone(build_backbone(spec), DEFAULT_SPLIT)
    device.train()  # no batch statistics in the device layer, so train/eval and batching agree
    x = torch.rand(3, 3, spec.input_size, spec.input_size) * 255
    with torch.no_grad():
        act = device(x)
        assert act.min() >= 0 and act.max() < 1
        # Same up to float32 rounding (CPU conv kernels differ with batch size).
        assert torch.allclose(device(x[1:2]), act[1:2], atol=1e-4)


def test_build_is_deterministic_given_seed() -> None:
    spec = PRESETS["vgg_face_small"]
    torch.manual_seed(123)
    a = build_backbone(spec).state_dict()
    torch.manual_seed(123)
    b = build_backbone(spec).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    head = build_classifier(spec, 10)
    assert head.in_features == 256 and head.out_features == 10


def test_release_pool_shrinks_what_the_device_sends():
    """release_pool=k: the device average-pools k x k before release, the server upsamples back."""
    from dataclasses import replace

    spec = replace(PRESETS["iresnet_small"], release_pool=4)
    assert activation_shape(spec, "conv1") == (16, 16, 16)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    device, server = split_backbone(build_backbone(spec), "conv1")
    x = torch.rand(2, 3, 64, 64)
    released = device(x)
    assert released.shape == (2, 16, 16, 16)
    assert torch.allclose(released, torch.nn.functional.avg_pool2d(device.stages["conv1"](x), 4))
    assert server(released).shape == (2, spec.embedding_dim)
    with pytest.raises(ValueError):
        replace(spec, release_pool=0)


def test_iresnet_trains_on_a_batch_of_one() -> None:
    """The spec allows N = 1: batch norm then uses (and keeps) its running statistics; larger batches are torch's."""
    spec = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=8)  # layer4 ends at 1x1: BN2d sees 1 value too
    torch.manual_seed(0)
    bb = build_backbone(spec).train()
    single = set()  # batch norms that saw one value per channel
    for name, m in bb.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
            m.register_forward_pre_hook(lambda mod, a, name=name: single.add(name) if a[0].numel() == a[0].shape[1]
                                        else None)
    before = {k: v.clone() for k, v in bb.state_dict().items()}
    x = torch.rand(1, 3, 16, 16)
    out = bb(x)
    out.sum().backward()
    assert out.shape == (1, 8) and torch.isfinite(out).all()
    assert bb.stages["features"].fc.weight.grad.abs().sum() > 0
    assert "stages.features.features" in single and any(isinstance(bb.get_submodule(n), nn.BatchNorm2d) for n in single)
    for name in single:
        for buffer in ("running_mean", "running_var"):
            assert torch.equal(before[f"{name}.{buffer}"], bb.state_dict()[f"{name}.{buffer}"]), name
    features = bb.stages["features"].features
    z1 = torch.randn(1, 8)
    with torch.no_grad():  # for one value per channel, training mode is eval mode
        assert torch.equal(features.train()(z1), features.eval()(z1))
    # Two images: the batch statistics of torch's own batch norm, running statistics updated.
    ref = nn.BatchNorm1d(8).train()
    ref.load_state_dict(features.state_dict())
    z = torch.randn(2, 8)
    assert torch.equal(features.train()(z), ref(z))
    assert torch.equal(features.running_mean, ref.running_mean) and not torch.equal(ref.running_mean, before[
        "stages.features.features.running_mean"])


def _device_parts_agree(spec: ModelSpec, split: str, run: bool = True) -> None:
    torch.manual_seed(7)
    full, _ = split_backbone(build_backbone(spec), split)
    after_full = torch.get_rng_state()
    torch.manual_seed(7)
    alone = build_device_part(spec, split)
    assert torch.equal(torch.get_rng_state(), after_full), "the RNG is not where the full build leaves it"
    assert list(alone.stages) == list(full.stages)
    want, got = full.state_dict(), alone.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert all(p.device.type == "cpu" for p in alone.parameters())
    if run:
        x = torch.rand(2, 3, spec.input_size, spec.input_size)
        with torch.no_grad():
            assert torch.equal(alone.eval()(x), full.eval()(x))


@pytest.mark.parametrize("name", SMALL)
def test_device_part_alone_equals_the_full_builds_at_every_split(name: str) -> None:
    """A device builds only its stages, yet draws the same weights from the same seed as a full build."""
    spec = PRESETS[name]
    for split in stage_names(spec)[:-1]:
        _device_parts_agree(spec, split, run=split == DEFAULT_SPLIT)


def test_device_part_alone_with_release_transforms() -> None:
    from dataclasses import replace

    spec = PRESETS["iresnet_small"]
    _device_parts_agree(replace(spec, release="bottleneck", bottleneck_channels=4, bottleneck_stride=2), "conv1")
    _device_parts_agree(replace(spec, release="dct", dct_drop=1), "layer2", run=False)
    _device_parts_agree(replace(spec, release_pool=4), "conv1", run=False)
    _device_parts_agree(replace(PRESETS["vgg_face_small"], release="bottleneck"), "conv2_1", run=False)


@pytest.mark.slow
def test_full_size_vgg_face_device_part_alone() -> None:
    """The full-size model too (fc6 alone is 103M parameters: its draws are replayed in chunks, never stored)."""
    _device_parts_agree(PRESETS["vgg_face"], "conv1")
