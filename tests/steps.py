"""The device layer (conv + ReLU + LRN) held to float64 eager PyTorch: one evaluation (`check_release`, the
parity tests), or training step by step along a run's own trajectory (`check_trajectory`).

Why not compare two training runs' losses: two runs that differ only in float32 rounding (another backend's
summation order, another thread count, oneDNN's and MKL's AVX2 or AVX-512 kernels in the server) drift apart
once the server trains on what they sent: its step at lr 0.05 with momentum feeds every difference back into
the next batch's gradient, and nothing bounds that growth (measured with the Java device's 64 faces: 1e-7 in the
releases became 4e-4 in the fourth step's loss and 3e-2 in the seventh's). A tolerance on that is a margin that
passed on some machines, not a bound.

What can be bounded is each step given what the server actually replied (teacher forcing): the server's gradient
is an input of the device's step like the images, so step k is a function of (the device's weights before it,
the images, the server's gradient) alone, and its float32 result differs from the float64 one by that step's
rounding, nothing amplified across steps. Per step:

* the release equals the float64 layer at the device's weights before the step within `release_tolerance`, an
  a-priori bound for float32 in any summation order: the conv's K products and bias within gamma_(K+1) S
  (S = |b| + sum |w x|), through ReLU (exact) and the LRN, whose Lipschitz constant `lrn_lipschitz` bounds what
  that does to the output, plus the LRN's own rounding relative to its output (`LRN_RELATIVE`);
* the weights after the step equal the float64 SGD step from the device's weights before it, with the float64
  gradient, within `SgdReplay`'s tolerance: the device's float32 gradient within GRAD_RTOL (relative to its
  largest element) of the float64 one, earlier steps' errors carried in the momentum buffer (each damped by the
  momentum per step), and the float32 stores of the buffer and the weights.

GRAD_RTOL is not derived here but assumed: it is the per-evaluation tolerance every backend is verified to
(splitface/export/verify.py at export, on random and real faces; the parity tests in test_android_core.py and
test_native.py). No a-priori bound gets near it for these gradients: each is a sum of n = N H W = 65,536
products whose signs cancel (sum |terms| is about 200 times the largest gradient on the test faces), so the
order-free worst case gamma_n sum |terms| would allow 0.8 of the largest gradient. What it takes is blocked or
multi-accumulator sums: eager PyTorch's float32 gradient is 6e-6 of the largest off float64 on AVX-512 and 9e-6
on AVX2 (oneDNN's jit kernels), but 6e-4 on oneDNN's pre-AVX2 path (DNNL_MAX_CPU_ISA=SSE41), where export
verification, which compares the programs with float32 eager, refuses them, and 1.4e-3 on an Intel Xeon with AMX
at one thread for a batch of 16 (PyTorch's own conv: 1e-8), so test_runtimes.py holds the torch backend's steps
with oneDNN off.

Neither check depends on the ISA, the thread count or the server's arithmetic. The weights come from the device
itself (Cli's "weights_out", or the engine's parameters), and the release check ties them to what was sent.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.models.lrn import PaperLRN
from splitface.device.runtimes.parity import GRAD_RTOL

U = 2.0 ** -24   # float32's unit roundoff


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a float32 dot product of n terms is within gamma_n sum |terms|, in any
    order, with or without fused multiply-adds."""
    return n * U / (1 - n * U)


def lrn_lipschitz(lrn: PaperLRN) -> float:
    """Largest row sum of |d out_i / d a_j| of a_i / (gamma + alpha sum_band a_j^2)^beta for a >= 0: with D the
    base, d out_i / d a_i = D^-beta (1 - 2 beta alpha a_i^2 / D) lies within max(1, |1 - 2 beta|) D^-beta, and
    |d out_i / d a_j| = 2 alpha beta a_i a_j D^(-beta-1) <= beta D^-beta for each of the size - 1 others; D >= gamma.
    (3 / sqrt(2) for the paper's constants.)"""
    return lrn.gamma ** -lrn.beta * (max(1.0, abs(1 - 2 * lrn.beta)) + (lrn.size - 1) * lrn.beta)


# The LRN's own float32 rounding, relative to its output: its base D (size squares, their sum, alpha times it,
# gamma plus it: positive terms, within gamma_(size + 2) relative) enters as D^-beta, i.e. beta times that; the
# power's own error, at most 2^-17 relative: libm's and Java's pow are within an ulp or two, and XNNPACK's rsqrt
# (the gemm and strip programs' D^-1/2) is a hardware estimate (12 bits on AVX2, 14 on AVX-512, not bit-identical
# between Intel and AMD) after one Newton step (about 2^-21), or, in newer XNNPACK, the integer bit-trick estimate
# (3.5 % off) after two (1.5 e^2 each: 1.9e-3, then 5.2e-6 < 2^-17); and the product a D^-beta, u.
def lrn_relative(lrn: PaperLRN) -> float:
    return lrn.beta * gamma(lrn.size + 2) + 2.0 ** -17 + U


class Float64Layer:
    """A conv + ReLU + LRN device layer in float64, evaluated at given weights (in the order of its parameters)."""

    def __init__(self, layer: nn.Module):
        leaves = [m for m in layer.modules() if not list(m.children())]
        kinds = [type(m) for m in leaves]
        assert kinds == [nn.Conv2d, nn.ReLU, PaperLRN], f"the error analysis is for conv + ReLU + LRN, not {kinds}"
        self.layer = copy.deepcopy(layer).double()
        self.names = [n for n, _ in self.layer.named_parameters()]
        self.conv, _, self.lrn = [m for m in self.layer.modules() if not list(m.children())]
        assert self.conv.groups == 1 and self.conv.padding_mode == "zeros"
        self.weight_name = next(n for n in self.names if n.endswith("weight"))
        self.bias_name = next((n for n in self.names if n.endswith("bias")), None)

    def _call(self, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.layer, dict(zip(self.names, weights)), (x.double(),))

    def release(self, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._call([w.double() for w in weights], x)

    def grads(self, weights: list[torch.Tensor], x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        """d sum(layer(x) * grad) / d weights: autograd down to the conv's output, then the conv's weight gradient
        as one product with the image patches (float64 convolutions' own backward is slow)."""
        named = dict(zip(self.names, [w.double() for w in weights]))
        weight = named[self.weight_name]
        bias = named.get(self.bias_name)
        c = self.conv
        x = x.double()
        z = F.conv2d(x, weight, bias, c.stride, c.padding).requires_grad_(True)
        dz, = torch.autograd.grad((self.lrn(F.relu(z)) * grad.double()).sum(), z)
        patches = F.unfold(x, c.kernel_size, c.dilation, c.padding, c.stride)     # N, C kh kw, positions
        dz = dz.flatten(2)                                                         # N, O, positions
        grads = {self.weight_name: torch.einsum("nkp,nop->ok", patches, dz).reshape(weight.shape)}
        if bias is not None:
            grads[self.bias_name] = dz.sum((0, 2))
        return [grads[n] for n in self.names]

    def release_tolerance(self, weights: list[torch.Tensor], x: torch.Tensor, release: torch.Tensor) -> torch.Tensor:
        """How far a float32 evaluation of the layer at `weights` can be from `release` (the float64 one), per
        element: the conv's K products and bias within gamma_(K+1) S, S = |b| + sum |w| |x|, passed through ReLU
        (1-Lipschitz, as the optional clamp) and the LRN (`lrn_lipschitz`, over the largest S), then the LRN's own
        rounding relative to its output (`lrn_relative`)."""
        named = dict(zip(self.names, weights))
        weight = named[self.weight_name].double()
        bias = None if self.bias_name is None else named[self.bias_name].double()
        c = self.conv
        spread = F.conv2d(x.double().abs(), weight.abs(), None if bias is None else bias.abs(), c.stride, c.padding)
        k = weight[0].numel() + (bias is not None)
        return lrn_lipschitz(self.lrn) * gamma(k) * spread.max() + lrn_relative(self.lrn) * release.abs()


def check_release(layer: Float64Layer, weights: list[torch.Tensor], x: torch.Tensor, got: np.ndarray, what: str,
                  added: np.ndarray | None = None, want: torch.Tensor | None = None) -> float:
    """A release made in float32 against the float64 layer at `weights` (`want`, if already evaluated); its
    largest error as a share of the tolerance. `added`: noise the device added to the layer's output before this
    was taken off again (float64): the float32 sum rounded by u of its magnitude."""
    want = layer.release(weights, x) if want is None else want
    tolerance = layer.release_tolerance(weights, x, want)
    got64 = torch.from_numpy(np.asarray(got, np.float64).reshape(want.shape))
    if added is not None:
        tolerance = tolerance + U * (got64.abs() + torch.from_numpy(np.abs(np.asarray(added, np.float64))).reshape(want.shape))
    share = float(((got64 - want).abs() / tolerance).max())
    assert share <= 1, f"{what}: the release is off by {float((got64 - want).abs().max()):.3g} from float64 at the " \
                       f"device's weights, {share:.3g} times the float32 bound (up to {float(tolerance.max()):.3g})"
    return share


def check_grads(want: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    """Weight gradients made in float32 against float64 ones: GRAD_RTOL times each tensor's largest element."""
    for w, g in zip(want, got, strict=True):
        err, tolerance = float((g.double() - w).abs().max()), GRAD_RTOL * float(w.abs().max())
        assert err <= tolerance, f"{what}: a gradient is off by {err:.3g} from float64 (tolerance {tolerance:.3g})"


class SgdReplay:
    """torch.optim.SGD's momentum step (no dampening, no Nesterov, no weight decay: what splitface/common/optim.py and
    android_demo's Sgd do) replayed in float64 from the device's own weights, with the tolerance of each step."""

    def __init__(self, momentum: float):
        self.momentum = momentum
        self.buffers: list[torch.Tensor] | None = None   # float64 momentum buffers
        self.carried: list[float] | None = None          # bound on |device buffer - float64 buffer|, per tensor

    def step(self, weights: list[torch.Tensor], grads: list[torch.Tensor], lr: float
             ) -> tuple[list[torch.Tensor], list[float]]:
        """(the float64 weights after the step from `weights`, the tolerance of each tensor's elements)."""
        m = self.momentum
        if self.buffers is None:
            self.buffers, self.carried = [g.clone() for g in grads], [0.0] * len(grads)
        else:
            self.buffers = [m * b + g for b, g in zip(self.buffers, grads)]
        # The device's gradient is within GRAD_RTOL max|g| of g, and m b + g in float32 rounds twice (once if
        # fused) by u |buffer|; the earlier steps' errors come along times m.
        self.carried = [m * c + GRAD_RTOL * float(g.abs().max()) + 2 * U * float(b.abs().max())
                        for c, g, b in zip(self.carried, grads, self.buffers)]
        after = [w.double() - lr * b for w, b in zip(weights, self.buffers)]
        # w - lr b in float32: lr times the buffer's error, plus the roundings of lr b and of the difference
        tolerance = [lr * c + U * (lr * (float(b.abs().max()) + c) + float(a.abs().max()))
                     for c, b, a in zip(self.carried, self.buffers, after)]
        return after, tolerance


def check_step(after: list[torch.Tensor], want: list[torch.Tensor], tolerance: list[float], what: str) -> float:
    """The device's weights after a step against the float64 replay; the largest error as a share of its tolerance."""
    worst = 0.0
    for a, w, tol in zip(after, want, tolerance, strict=True):
        err = float((a.double() - w).abs().max())
        assert err <= tol, f"{what}: weights off by {err:.3g} from the float64 step (tolerance {tol:.3g})"
        worst = max(worst, err / tol)
    return worst


def lr_at(lr0: float, rate: float, decay_steps: int, step: int) -> float:
    """splitface.common.optim.exponential_decay's learning rate before step `step` (0-based)."""
    return lr0 * rate ** (step / decay_steps)


def check_trajectory(layer: nn.Module, weights: list[torch.Tensor], steps, momentum: float, what: str) -> None:
    """`steps`: per step in order, (x: the images as the layer takes them, the release the server received less
    any noise the device added, that noise or None, the gradient the server sent back, the step's learning rate,
    the device's weights after the step); `weights`: the device's weights before the first. Each step is checked
    as the module docstring says, and must move the weights by more than 10 times its tolerance and the release
    by more than its tolerance, so that the checks tell a step from none."""
    f64 = Float64Layer(layer)
    sgd = SgdReplay(momentum)
    before = None
    for k, (x, received, noise, grad, lr, after) in enumerate(steps, 1):
        now = f64.release(weights, x)
        check_release(f64, weights, x, received, f"{what}, step {k}", noise, now)
        if before is not None:   # the release at the weights of a step earlier would have been refused
            stale = f64.release(before, x)
            assert float((stale - now).abs().max()) > float(f64.release_tolerance(weights, x, now).max()), \
                f"{what}, step {k}: the step before moved the release by less than its tolerance"
        grads = f64.grads(weights, x, torch.as_tensor(np.asarray(grad)).reshape(np.shape(received)))
        want, tolerance = sgd.step(weights, grads, lr)
        check_step(after, want, tolerance, f"{what}, step {k}")
        moved = max(float((a.double() - w.double()).abs().max()) / t for a, w, t in zip(after, weights, tolerance))
        assert moved > 10, f"{what}, step {k}: the weights moved by only {moved:.3g} times the step's tolerance"
        before, weights = weights, after
