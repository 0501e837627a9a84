"""The im2col programs (`export/gemm_programs.py`) are the device layer exactly: their release equals eager
PyTorch and their closed-form weight gradient equals autograd, with and without the DP clamp, masked or not;
they refuse a layer they cannot express. (Their export to XNNPACK, and that nothing large runs outside it, is checked in test_export.py.)"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from device_sdk.models import build_device_part, resolve_spec
from device_sdk.models.lrn import PaperLRN
from export.gemm_programs import GemmReleaseProgram, GemmWeightGrad, gemm_refusal
from export.verify import reference


def conv1(model: str, clamp: float | None) -> nn.Module:
    torch.manual_seed(0)
    layer = build_device_part(resolve_spec(model), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = clamp
    return layer


@pytest.mark.parametrize("model", ["vgg_face_small", "iresnet_small"])
@pytest.mark.parametrize("clamp", [None, 1.0])
def test_im2col_release_and_gradient_equal_eager(model, clamp):
    layer = conv1(model, clamp)
    images = torch.rand(3, 3, 20, 24) * 3  # values above the clamp exercise its mask; not square
    with torch.no_grad():
        shape = layer(images).shape
    g = torch.Generator().manual_seed(1)
    noise, grad = 0.1 * torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    mask = (torch.rand(3, shape[1], 1, 1, generator=g) < 0.5).float()
    weights = [p.detach() for p in layer.parameters()]
    want, want_grads = reference(layer, images, noise, grad, weights, mask)
    got = GemmReleaseProgram(layer, masked=True)(images, noise, mask, *weights)
    assert (got - want).abs().max() < 1e-5
    assert (GemmReleaseProgram(layer)(images, noise, *weights) - reference(layer, images, noise, grad, weights,
                                                                            grads=False)[0]).abs().max() < 1e-5
    # the runtimes hand the gradient program the masked server gradient
    got_grads = GemmWeightGrad(layer)(images, grad * mask, *weights)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_im2col_refuses_what_it_cannot_express():
    assert gemm_refusal(conv1("iresnet_small", None)) is None
    strided = conv1("iresnet_small", None)
    strided.stages["conv1"][0].stride = (2, 2)
    assert "stride 1" in gemm_refusal(strided)
    deeper = nn.Sequential(conv1("iresnet_small", None), nn.Conv2d(64, 4, 1), nn.Tanh())
    assert "found Conv2d + ReLU + PaperLRN + Conv2d + Tanh" in gemm_refusal(deeper)
    with pytest.raises(ValueError, match="cover conv"):
        GemmReleaseProgram(deeper)

