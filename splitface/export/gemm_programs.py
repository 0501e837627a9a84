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
- `strip=True` on either: the native runner's form, over a strip of a few image rows that it cuts with
  the conv's halo (`strip_example`), and only the GEMMs and the clamp: the release program ends at the LRN's
  input (and returns the conv's output beside it), and the gradient program starts from the conv's gradient.
  The runner does the rest in C++ while the strip is in cache (the LRN and its backward, `conv_grad`; the
  constants are the release program's constant methods, `strip_constants`), and draws and adds the noise: a
  few passes where XNNPACK runs each elementwise op as its own (the LRN alone was about fifteen, its backward
  about thirty).

The LRN's d^-beta is rsqrt for the paper's beta = 1/2 (XNNPACK's pow takes only the power 2); its
derivative masks are [r > 0] = clamp(ceil(r), 0, 1) for r = relu(x) >= 0, exactly, and [r > m] the
same way for the DP clamp, because comparisons would fall back to portable kernels. Only stride 1 and
dilation 1 are covered (XNNPACK's slice takes no step); `gemm_refusal` says why for any other layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.models.lrn import PaperLRN


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


def columns(conv: nn.Conv2d, images: torch.Tensor, padded: bool = False) -> tuple[torch.Tensor, tuple[int, int]]:
    """im2col: (N, k_h k_w C + 1, H W), tap-major then channel, and a last row of ones for the bias; and (H, W).

    `padded`: `images` already carries the conv's zero padding (a strip of rows with its halo, cut by the
    native runner), so the taps are taken from it as it is and the output is the strip's rows only.
    """
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    if not padded:
        images = F.pad(images, (pw, pw, ph, ph))
    n, _, h, w = images.shape
    ho, wo = h - kh + 1, w - kw + 1
    taps = [images[:, :, i:i + ho, j:j + wo] for i in range(kh) for j in range(kw)]
    taps.append(images.new_ones((n, 1, ho, wo)))
    return torch.cat(taps, dim=1).reshape(n, -1, ho * wo), (ho, wo)


def strip_example(layer: nn.Module, rows: int, width: int, channels: int = 3) -> torch.Tensor:
    """A strip program's example input: one strip of `rows` output rows of a `width`-wide image, with the
    conv's zero-padding halo on every side, as the native runner cuts it."""
    conv, _ = _parts(layer)
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    if 2 * ph != kh - 1 or 2 * pw != kw - 1:
        raise ValueError("strips need a 'same' conv (output rows = input rows)")
    return torch.rand(1, channels, rows + kh - 1, width + kw - 1)


def weight_matrix(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(O, k_h k_w C + 1): the conv weight in `columns`' row order, the bias as the last column."""
    return torch.cat([weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1), bias[:, None]], dim=1)


def _conv(cols: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """conv(images) as (N, O, H W): one bmm of the weight matrix with the columns."""
    mat = weight_matrix(weight, bias)
    return torch.bmm(mat.expand(cols.shape[0], *mat.shape), cols)


def _lrn_input(lrn: PaperLRN, x: torch.Tensor) -> torch.Tensor:
    """The LRN's input a = clamp(relu(x), 0, m) as one clamp(x, 0, m): one pass over the map instead of two."""
    return torch.relu(x) if lrn.input_max is None else torch.clamp(x, 0.0, float(lrn.input_max))


def _times_alpha(lrn: PaperLRN, t: torch.Tensor) -> torch.Tensor:
    """alpha * t, without the multiply when alpha is 1 (the paper's): each op here is a pass over the map."""
    return t if lrn.alpha == 1 else lrn.alpha * t


def _lrn_denominator(lrn: PaperLRN, a: torch.Tensor) -> torch.Tensor:
    """rsqrt(gamma + alpha * window(a^2)) = d^-beta for beta 1/2."""
    return torch.rsqrt(lrn.gamma + _times_alpha(lrn, lrn.window_sum(a * a)))


def _indicator_positive(t: torch.Tensor) -> torch.Tensor:
    """[t > 0] for t >= 0 or any float t, exactly, in ops XNNPACK delegates (no comparison kernel there)."""
    return torch.clamp(torch.ceil(t), 0.0, 1.0)


def conv_grad(lrn: PaperLRN, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of sum(LRN(clamp(relu(x))) * grad) with respect to the conv's output x, in closed form
    (`LayerVJP`'s formulas for this chain; the native runner's `Lrn::backward` computes the same): with
    a = clamp(relu(x), 0, m) and d = gamma + alpha window(a^2),
      g_a = g d^-1/2 - alpha a window(g a d^-3/2)          (2 alpha beta = alpha for beta 1/2)
      g_conv = g_a [x > 0] [x <= m]."""
    a = _lrn_input(lrn, x)
    inv = _lrn_denominator(lrn, a)
    g_a = grad * inv - _times_alpha(lrn, a * lrn.window_sum(grad * a * (inv * inv * inv)))
    g = g_a * _indicator_positive(x)
    if lrn.input_max is not None:
        g = g * (1.0 - _indicator_positive(x - float(lrn.input_max)))
    return g


def strip_constants(layer: nn.Module) -> dict[str, int | float]:
    """The constants of what the native runner computes between the strip programs (lrn.cpp: the LRN
    with beta 1/2, and the backward through it, the clamp and ReLU), which the strip release program carries as
    constant methods: the LRN's size, alpha and gamma, and its input clamp m (0: none)."""
    _, lrn = _parts(layer)
    return {"lrn_size": int(lrn.size), "lrn_alpha": float(lrn.alpha), "lrn_gamma": float(lrn.gamma),
            "lrn_input_max": 0.0 if lrn.input_max is None else float(lrn.input_max)}


class GemmReleaseProgram(nn.Module):
    """layer(images) [* mask] + noise with weight and bias as inputs, every large op XNNPACK-delegable.

    `strip=True` is the native runner's form: the input is a strip of rows already zero-padded with the
    conv's halo, there is neither noise nor mask, and the outputs are the LRN's input a = clamp(relu(conv))
    and the conv's output itself (which the gradient's masks read; XNNPACK has written it anyway). The runner
    applies the LRN (`strip_constants`) and adds the noise it draws while the strip is still in cache.
    """

    def __init__(self, layer: nn.Module, masked: bool = False, strip: bool = False):
        super().__init__()
        if masked and strip:
            raise ValueError("a strip program takes no mask: the native runner releases unmasked layers")
        self.conv, self.lrn = _parts(layer)
        self.masked, self.strip = masked, strip

    def forward(self, images: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.strip:
            noise, mask, (weight, bias) = None, None, rest
        else:
            noise, rest = rest[0], rest[1:]
            mask, (weight, bias) = (rest[0], rest[1:]) if self.masked else (None, rest)
        cols, size = columns(self.conv, images, padded=self.strip)
        x = _conv(cols, weight, bias).reshape(images.shape[0], weight.shape[0], *size)
        a = _lrn_input(self.lrn, x)
        if self.strip:
            return a, x
        out = a * _lrn_denominator(self.lrn, a)
        if mask is not None:
            out = out * mask
        return out if noise is None else out + noise


class GemmWeightGrad(nn.Module):
    """d/d(weight, bias) of sum(layer(images) * grad): the conv's gradient (`conv_grad`) times the columns,
      (d weight | d bias) = sum over the batch of g_conv (O, H W) @ columns^T (H W, K + 1).
    A masked release's gradient arrives masked already (the runtimes multiply it), so no mask input here.
    `strip=True`: the images are a zero-padded strip of rows and `grad` the conv's gradient over the strip's
    rows, which the native runner computes from the release program's output and the server's gradient; the
    weight and bias inputs are then unused, kept so that both strip programs bind the same inputs (the runner
    sums the strips' gradients, as it sums a batch's samples).
    """

    def __init__(self, layer: nn.Module, strip: bool = False):
        super().__init__()
        self.conv, self.lrn = _parts(layer)
        self.strip = strip

    def forward(self, images: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cols, _ = columns(self.conv, images, padded=self.strip)
        g = grad if self.strip else conv_grad(self.lrn, _conv(cols, weight, bias).reshape(grad.shape), grad)
        n, o = grad.shape[:2]
        full = torch.bmm(g.reshape(n, o, -1), cols.transpose(1, 2)).sum(dim=0)  # (O, K + 1)
        kh, kw = self.conv.kernel_size
        d_weight = full[:, :-1].reshape(o, kh, kw, -1).permute(0, 3, 1, 2)
        return d_weight, full[:, -1]
