"""A device layer's training checked step by step along its own trajectory, against float64 eager PyTorch.

Why not compare two runs' losses: two runs that differ only in float32 rounding (another backend's summation
order, another thread count, oneDNN's and MKL's AVX2 or AVX-512 kernels in the server, XNNPACK's rsqrt estimate)
drift apart once the server trains on what they sent: its step at lr 0.05 with momentum feeds every difference
back into the next batch's gradient, and nothing bounds that growth (measured with the Java device's 64 faces:
1e-7 in the releases became 4e-4 in the fourth step's loss and 3e-2 in the seventh's). A tolerance on it is a
margin that passed on some machines, not a bound.

What can be bounded is each step given what the server actually replied (teacher forcing): the server's
activations gradient is an input of the device's step like the images, so the device's step k is a function of
(its weights before the step, the images, the server's gradient) alone, and its float32 result differs from the
float64 one by that step's rounding only, nothing amplified across steps. Two checks per step k:

* the release the server received equals the float64 layer at the device's weights before step k, within
  RELEASE_ATOL: the per-evaluation tolerance every backend is verified to (export/verify.py; a float32 conv of
  K = 27 products plus the bias is within gamma_28 = 28 u of S = |b| + sum |w x| (u = 2^-24, any order, FMA or
  not): 1.7e-6 S, about 1e-5 here with S <= 3 and the LRN's Lipschitz constant 3/sqrt(2) (`lrn_lipschitz`);
  XNNPACK's rsqrt in the LRN, a hardware estimate (12 bits on AVX2, 14 on AVX-512, not bit-identical between
  Intel and AMD) or a portable one, refined by Newton steps to about 2^-21 relative, adds less than 1e-6 on
  outputs below 1: all well inside 1e-4);
* the weights after step k equal the float64 SGD step from the device's weights before it, with the float64
  gradient there. The device's float32 gradient is within GRAD_RTOL (relative to its largest element) of the
  float64 one (export/verify.py again: a sum of n = N H W = 65,536 products whose rounding errors grow like
  sqrt(n) u ~ 1.5e-5 relative to sum |terms| in any order); the momentum buffer carries the earlier steps' errors,
  each damped by momentum per step, and the float32 stores of the buffer and the weights round by u each
  (`step_tolerance`).

Neither check depends on the ISA, the thread count or the server's arithmetic. The weights come from the device
itself (Cli's "weights_out", or the engine's parameters), and the first check ties them to what was sent.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from device_sdk.models.lrn import PaperLRN
from export.verify import GRAD_RTOL, RELEASE_ATOL

U = 2.0 ** -24   # float32's unit roundoff


def lrn_lipschitz(lrn: PaperLRN) -> float:
    """Largest row sum of |d out_i / d a_j| of a / (gamma + alpha sum_band a^2)^beta, a >= 0: with D the
    denominator's base, d out_i / d a_i = D^-beta (1 - 2 beta alpha a_i^2 / D) lies within max(1, |1 - 2 beta|)
    D^-beta, and |d out_i / d a_j| = 2 alpha beta a_i a_j D^(-beta-1) <= beta D^-beta; D >= gamma."""
    return lrn.gamma ** -lrn.beta * (max(1.0, abs(1 - 2 * lrn.beta)) + (lrn.size - 1) * lrn.beta)


class Float64Layer:
    """`layer` (conv + ReLU + LRN) in float64, evaluated at given weights (in the order of its parameters)."""

    def __init__(self, layer: nn.Module):
        self.layer = copy.deepcopy(layer).double()
        self.names = [n for n, _ in self.layer.named_parameters()]

    def release(self, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.func.functional_call(self.layer, dict(zip(self.names, [w.double() for w in weights])),
                                              (x.double(),))

    def grads(self, weights: list[torch.Tensor], x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        """d sum(layer(x) * grad) / d weights."""
        leaves = [w.double().clone().requires_grad_(True) for w in weights]
        out = torch.func.functional_call(self.layer, dict(zip(self.names, leaves)), (x.double(),))
        return list(torch.autograd.grad((out * grad.double()).sum(), leaves))


class SgdReplay:
    """torch.optim.SGD's momentum step (no dampening, no Nesterov, no weight decay: what device_sdk/optim.py and
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
        self.carried = [m * c + GRAD_RTOL * float(g.abs().max()) + U * float(b.abs().max())
                        for c, g, b in zip(self.carried, grads, self.buffers)]
        after = [w.double() - lr * b for w, b in zip(weights, self.buffers)]
        # w - lr b in float32: lr times the buffer's error, plus the roundings of lr b and of the difference
        tolerance = [lr * c + U * (lr * (float(b.abs().max()) + c) + float(a.abs().max()))
                     for c, b, a in zip(self.carried, self.buffers, after)]
        return after, tolerance


def check_release(layer: Float64Layer, weights: list[torch.Tensor], x: torch.Tensor, received: np.ndarray,
                  what: str) -> float:
    """The release the server received against the float64 layer at `weights`; its largest error."""
    want = layer.release(weights, x).numpy()
    err = float(np.abs(received.reshape(want.shape).astype(np.float64) - want).max())
    assert err <= RELEASE_ATOL, f"{what}: release off by {err:.3g} from float64 at the device's weights " \
                                f"(tolerance {RELEASE_ATOL})"
    return err


def check_step(after: list[torch.Tensor], want: list[torch.Tensor], tolerance: list[float], what: str) -> float:
    """The device's weights after a step against the float64 replay; the largest error as a share of its tolerance."""
    worst = 0.0
    for a, w, tol in zip(after, want, tolerance):
        err = float((a.double() - w).abs().max())
        assert err <= tol, f"{what}: weights off by {err:.3g} from the float64 step (tolerance {tol:.3g})"
        worst = max(worst, err / tol)
    return worst


def lr_at(lr0: float, rate: float, decay_steps: int, step: int) -> float:
    """device_sdk.optim.exponential_decay's learning rate before step `step` (0-based)."""
    return lr0 * rate ** (step / decay_steps)


def check_trajectory(layer: nn.Module, weights: list[torch.Tensor], steps, momentum: float, what: str) -> None:
    """`steps`: per step in order, (x: the images as the layer takes them, the release the server received less any
    noise the device added, the gradient the server sent back, the step's learning rate, the device's weights after
    the step); `weights`: the device's weights before the first. Each step is checked as the module docstring says,
    and must move the weights by more than 10 times its tolerance, so that the check tells a step from none."""
    f64 = Float64Layer(layer)
    sgd = SgdReplay(momentum)
    for k, (x, received, grad, lr, after) in enumerate(steps, 1):
        check_release(f64, weights, x, received, f"{what}, step {k}")
        grads = f64.grads(weights, x, torch.as_tensor(np.asarray(grad)).reshape(np.shape(received)))
        want, tolerance = sgd.step(weights, grads, lr)
        check_step(after, want, tolerance, f"{what}, step {k}")
        moved = max(float((a.double() - w.double()).abs().max()) / t for a, w, t in zip(after, weights, tolerance))
        assert moved > 10, f"{what}, step {k}: the weights moved by only {moved:.3g} times the step's tolerance"
        weights = after
