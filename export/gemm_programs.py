"""The trainable device layer (conv + ReLU + the paper's LRN) in ops that XNNPACK runs with weights as inputs.

XNNPACK (ExecuTorch 1.5.1's `XnnpackPartitioner`) delegates a convolution only when its weights are
constants, so a layer that trains ran its conv on ExecuTorch's portable kernels (seconds per batch). It
does delegate a batched matrix multiply of two run-time tensors (`bmm`), slices, cat, pad, add, mul,
rsqrt, ceil and clamp. So both programs here write the conv as im2col (the k x k shifted slices of the
padded image, concatenated: K = C k^2 rows, plus a row of ones that carries the bias) times the weight
matrix, and keep every large tensor in ops XNNPACK runs:

- `GemmReleaseProgram`: (images, noise[, mask], weight, bias) -> the release, as `ReleaseProgram`;
- `GemmWeightGrad`: (images, grad, weight, bias) -> (d weight, d bias) of sum(release * grad), the
  closed form: columns^T times the gradient through the LRN and the ReLU, one bmm for both.

The LRN's d^-beta is rsqrt for the paper's beta = 1/2 (XNNPACK's pow takes only the power 2); its
derivative masks are [r > 0] = clamp(ceil(r), 0, 1) for r = relu(x) >= 0, exactly, and [r > m] the
same way for the DP clamp, because comparisons would fall back to portable kernels. Only stride 1 and
dilation 1 are covered (XNNPACK's slice takes no step); `gemm_refusal` says why for any other layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from device_sdk.models.lrn import PaperLRN


def gemm_refusal(layer: nn.Module) -> str | None:
    """Why the im2col programs cannot express `layer`, or None: they cover exactly conv + ReLU + PaperLRN
    with a stride-1, dilation-1 conv and beta = 1/2 (VGG-Face's and IResNet's conv1 stage)."""
    leaves = [m for m in layer.modules() if not list(m.children())]
    kinds = [type(m) for m in leaves]
    if kinds != [nn.Conv2d, nn.ReLU, PaperLRN]:
        return "the im2col programs cover conv + ReLU + LRN; found " + " + ".join(k.__name__ for k in kinds)
    conv, _, lrn = leaves
    if conv.stride != (1, 1) or conv.dilation != (1, 1) or conv.groups != 1 or conv.padding_mode != "zeros" \
            or isinstance(conv.padding, str) or conv.bias is None:
        return "the im2col programs need a biased conv with stride 1, dilation 1, groups 1 and numeric zero padding"
    if lrn.beta != 0.5:
        return f"the im2col programs compute the LRN's d^-beta as rsqrt (beta 1/2); this LRN has beta {lrn.beta}"
    return None


def _parts(layer: nn.Module) -> tuple[nn.Conv2d, PaperLRN]:
    refusal = gemm_refusal(layer)
    if refusal:
        raise ValueError(refusal)
    leaves = [m for m in layer.modules() if not list(m.children())]
    return leaves[0], leaves[2]


def columns(conv: nn.Conv2d, images: torch.Tensor) -> torch.Tensor:
    """im2col: (N, k_h k_w C + 1, H W), tap-major then channel, and a last row of ones for the bias."""
    n, _, h, w = images.shape
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    padded = F.pad(images, (pw, pw, ph, ph))
    ho, wo = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    taps = [padded[:, :, i:i + ho, j:j + wo] for i in range(kh) for j in range(kw)]
    taps.append(images.new_ones((n, 1, ho, wo)))
    return torch.cat(taps, dim=1).reshape(n, -1, ho * wo)


def weight_matrix(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(O, k_h k_w C + 1): the conv weight in `columns`' row order, the bias as the last column."""
    return torch.cat([weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1), bias[:, None]], dim=1)


def _conv_relu(conv: nn.Conv2d, cols: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """relu(conv(images)) as (N, O, H W): one bmm of the weight matrix with the columns."""
    mat = weight_matrix(weight, bias)
    return torch.relu(torch.bmm(mat.expand(cols.shape[0], *mat.shape), cols))


def _lrn_denominator(lrn: PaperLRN, a: torch.Tensor) -> torch.Tensor:
    """rsqrt(gamma + alpha * window(a^2)) = d^-beta for beta 1/2."""
    return torch.rsqrt(lrn.gamma + lrn.alpha * lrn.window_sum(a * a))


def _indicator_positive(t: torch.Tensor) -> torch.Tensor:
    """[t > 0] for t >= 0 or any float t, exactly, in ops XNNPACK delegates (no comparison kernel there)."""
    return torch.clamp(torch.ceil(t), 0.0, 1.0)


class GemmReleaseProgram(nn.Module):
    """layer(images) [* mask] + noise with weight and bias as inputs, every large op XNNPACK-delegable."""

    def __init__(self, layer: nn.Module, masked: bool = False):
        super().__init__()
        self.conv, self.lrn = _parts(layer)
        self.masked = masked

    def forward(self, images: torch.Tensor, noise: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mask, (weight, bias) = (rest[0], rest[1:]) if self.masked else (None, rest)
        r = _conv_relu(self.conv, columns(self.conv, images), weight, bias).reshape(noise.shape)
        a = r if self.lrn.input_max is None else torch.clamp(r, 0.0, float(self.lrn.input_max))
        out = a * _lrn_denominator(self.lrn, a)
        return (out if mask is None else out * mask) + noise


class GemmWeightGrad(nn.Module):
    """d/d(weight, bias) of sum(layer(images) * grad), in closed form (`LayerVJP`'s formulas for this chain):

    with r = relu(conv), a = clamp(r, 0, m), d = gamma + alpha window(a^2):
      g_a = g d^-1/2 - alpha a window(g a d^-3/2)          (2 alpha beta = alpha for beta 1/2)
      g_conv = g_a [r > 0] [r <= m]
      (d weight | d bias) = sum over the batch of g_conv (O, H W) @ columns^T (H W, K + 1).
    A masked release's gradient arrives masked already (the runtimes multiply it), so no mask input here.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.conv, self.lrn = _parts(layer)

    def forward(self, images: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cols = columns(self.conv, images)
        r = _conv_relu(self.conv, cols, weight, bias).reshape(grad.shape)
        m = self.lrn.input_max
        a = r if m is None else torch.clamp(r, 0.0, float(m))
        inv = _lrn_denominator(self.lrn, a)
        g_a = grad * inv - self.lrn.alpha * a * self.lrn.window_sum(grad * a * (inv * inv * inv))
        g = g_a * _indicator_positive(r)
        if m is not None:
            g = g * (1.0 - _indicator_positive(r - float(m)))
        n, o = grad.shape[:2]
        full = torch.bmm(g.reshape(n, o, -1), cols.transpose(1, 2)).sum(dim=0)  # (O, K + 1)
        kh, kw = self.conv.kernel_size
        d_weight = full[:, :-1].reshape(o, kh, kw, -1).permute(0, 3, 1, 2)
        return d_weight, full[:, -1]
