"""The im2col programs (`splitface/export/gemm_programs.py`) are the device layer exactly: their release equals eager
PyTorch and their closed-form weight gradient equals autograd, with and without the DP clamp, masked or not;
they refuse a layer they cannot express. Their strip forms (the native runner's), run over the strips of an
image and put together, are the same release and gradient. Exported, they run in XNNPACK alone and still
match (slow tier)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitface.common.models import build_device_part, resolve_spec
from splitface.common.models.lrn import PaperLRN
from splitface.export.gemm_programs import (GemmReleaseProgram, GemmWeightGrad, conv_grad, gemm_refusal,
                                            strip_constants, strip_example)
from splitface.device.runtimes.parity import reference


def conv1(model: str, clamp: float | None) -> nn.Module:
    torch.manual_seed(0)
    layer = build_device_part(resolve_spec(model), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = clamp
    return layer


@pytest.mark.parametrize("clamp, alpha", [(None, 1.0), (1.0, 0.5)])
def test_strip_programs_put_together_are_the_layer(clamp, alpha):
    """Each strip padded with the conv's halo as the native runner cuts it: the release program's LRN inputs,
    through the LRN with the constants that the program carries (the runner's part), stacked are the layer's
    output; the gradient program on each strip's conv gradient (`conv_grad`, the runner's part),
    summed, is the image's weight gradient (alpha 1 skips its multiply; 0.5 keeps it)."""
    layer, rows = conv1("iresnet_small", clamp), 4
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.alpha = alpha
    images = torch.rand(2, 3, 12, 20) * 3
    weights = [p.detach() for p in layer.parameters()]
    with torch.no_grad():
        shape = layer(images).shape
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    want, want_grads = reference(layer, images, torch.zeros(shape), grad, weights)
    assert strip_example(layer, rows, 20).shape == (1, 3, rows + 2, 22)
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1))
    strips = [padded[:, :, t:t + rows + 2] for t in range(0, 12, rows)]
    outs = [GemmReleaseProgram(layer, strip=True)(s, *weights) for s in strips]  # (the LRN's input, the conv's)
    constants = strip_constants(layer)
    assert constants["lrn_input_max"] == (clamp or 0.0)
    lrn = PaperLRN(shape[1], constants["lrn_size"], constants["lrn_alpha"], 0.5, constants["lrn_gamma"],
                   constants["lrn_input_max"] or None)
    assert (lrn(torch.cat([a for a, _ in outs], dim=2)) - want).abs().max() < 1e-5
    parts = [GemmWeightGrad(layer, strip=True)(s, conv_grad(lrn, x, grad[:, :, t:t + rows]), *weights)
             for s, (_, x), t in zip(strips, outs, range(0, 12, rows))]
    for a, b in zip((sum(p) for p in zip(*parts)), want_grads, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    with pytest.raises(ValueError, match="no mask"):
        GemmReleaseProgram(layer, masked=True, strip=True)


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



@pytest.mark.slow  # lowering the two programs: several seconds
def test_exported_im2col_programs_run_in_xnnpack_and_match_eager(tmp_path):
    from splitface.device.runtimes.executorch_gemm import ExecuTorchGemmRuntime
    from splitface.device.runtimes.manifest import RELEASE_GEMM_PTE, VJP_GEMM_PTE, Manifest
    from splitface.export.artifacts import example_inputs, export_gemm_ptes
    from splitface.device.runtimes.parity import check

    layer = conv1("iresnet_small", 1.0).eval()
    images, noise = example_inputs(layer, 2, 32)
    release, vjp = export_gemm_ptes(layer, images, noise, None)
    # No conv, matrix product or elementwise kernel outside XNNPACK (a .pte names the kernels it calls).
    for name, pte in ((RELEASE_GEMM_PTE, release), (VJP_GEMM_PTE, vjp)):
        assert b"XnnpackBackend" in pte, name
        assert not [op for op in (b"convolution", b"bmm", b"aten::mul", b"aten::add", b"aten::cat", b"rsqrt", b"ceil")
                    if op in pte], name
        (tmp_path / name).write_bytes(pte)
    manifest = Manifest(2, list(images.shape), list(noise.shape), ["stages.conv1.0.weight", "stages.conv1.0.bias"],
                        False, 1.0, gemm_refusal=None)
    runtime = ExecuTorchGemmRuntime(tmp_path, manifest)
    assert not runtime.static_weights and runtime.trainable
    weights = [p.detach().clone() for p in layer.parameters()]
    g = torch.Generator().manual_seed(2)
    perturbed = [w + 0.05 * w.abs().mean() * torch.randn(w.shape, generator=g) for w in weights]
    for ws in (weights, perturbed):  # the weights are read at run time: a training step needs no new program
        for batch in (images * 3, images[:1]):  # above the clamp; a short batch, zero-padded
            result = check(layer, runtime, batch, ws, "im2col")
            assert result["ok"] and result["grad_max_rel_err"] > 0
