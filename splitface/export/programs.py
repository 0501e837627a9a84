"""The device layer as the three programs a phone runs, written as plain torch modules.

- `ReleaseProgram`: released = layer(images) + noise, or layer(images) * mask + noise for a
  transform that hides part of each release (the dct release's per-image channel subset). The
  noise and the mask are inputs because the runtimes have no random kernels and because the
  device's privacy code (accountant, budget guard, keyed noise) must decide them. The weights are
  inputs too when the layer trains (the forward program then always uses the current weights), or
  constants for a frozen layer.
- `TrainingProgram`: the surrogate loss sum(released * server_grad), whose parameter gradient
  is the vector-Jacobian product the device needs. ExecuTorch turns it into a joint
  forward-backward program.
- `LayerVJP`: the same weight gradient written out with forward ops only (conv, mul, pow),
  weights as inputs, for ONNX Runtime, which has no training ops in its inference build.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.models.lrn import PaperLRN


def param_names(layer: nn.Module) -> list[str]:
    return [name for name, _ in layer.named_parameters()]


LEAVES = (nn.Conv2d, nn.ReLU, PaperLRN, nn.Tanh)


def layer_parts(layer: nn.Module) -> list[nn.Module]:
    """The layer's leaf modules in order, if it is a chain of what `LayerVJP` covers: plain convs, ReLU,
    the paper's LRN and tanh (conv1 + ReLU + LRN, optionally followed by the bottleneck's conv + tanh)."""
    leaves = [m for m in layer.modules() if not list(m.children())]
    if not leaves or not all(isinstance(m, LEAVES) for m in leaves):
        raise ValueError("export covers a device layer made of " + ", ".join(t.__name__ for t in LEAVES)
                         + "; found " + " + ".join(type(m).__name__ for m in leaves))
    for conv in (m for m in leaves if isinstance(m, nn.Conv2d)):
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError("export needs plain convs (groups 1, numeric zero padding)")
    return leaves


def training_refusal(layer: nn.Module) -> str | None:
    """Why no training program can be exported for `layer`, or None when one can (or nothing trains).

    Both backward programs cover the chain `LayerVJP` writes out by hand; a device part with other
    modules (IResNet's `layer1`: batch norm, PReLU, residual adds) gets release programs only, and the
    runtimes refuse to train it instead of computing a wrong gradient.
    """
    if not param_names(layer):
        return None
    try:
        layer_parts(layer)
    except ValueError as exc:
        return str(exc)
    return None


class ReleaseProgram(nn.Module):
    def __init__(self, layer: nn.Module, weights_as_inputs: bool, masked: bool = False):
        super().__init__()
        self.layer, self.weights_as_inputs, self.names = layer, weights_as_inputs, param_names(layer)
        self.masked = masked

    def forward(self, images: torch.Tensor, noise: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mask, weights = (rest[0], rest[1:]) if self.masked else (None, rest)
        if self.weights_as_inputs:
            activations = torch.func.functional_call(self.layer, dict(zip(self.names, weights)), (images,))
        else:
            activations = self.layer(images)
        # The mask comes before the noise: the noise covers every value, released or zeroed.
        return (activations if mask is None else activations * mask) + noise


class TrainingProgram(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        released = self.layer(images) + noise
        # Only the loss may carry a gradient out of a joint program; the release is returned detached.
        return (released * grad).sum(), released.detach()


class LayerVJP(nn.Module):
    """d/d(weights) of sum(layer(images) * grad), by hand: the ONNX backward program.

    The forward pass keeps each leaf's input x; the backward pass walks the leaves in reverse with g,
    the gradient wrt a leaf's output:
      conv:  dL/dW = conv of x with g (batch and channels swapped, stride as dilation), dL/db = sum of g,
             dL/dx = conv_transpose(g, W) (skipped for the first conv: its input is the image);
      ReLU:  g [x > 0];   tanh: g (1 - tanh(x)^2);
      LRN:   with a = clamp(x, 0, m), s = W(a^2) (W: the u-channel window sum, its own transpose),
             d = gamma + alpha s, out = a d^-beta:
             dL/da = g d^-beta - 2 a alpha beta W(g a d^(-beta-1)), times [0 <= x <= m] under a clamp.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.leaves = layer_parts(layer)

    def forward(self, images: torch.Tensor, grad: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = iter(weights)
        steps = []  # (leaf, its input, its weight, its bias)
        x = images
        for leaf in self.leaves:
            weight = bias = None
            if isinstance(leaf, nn.Conv2d):
                weight = next(params)
                bias = next(params) if leaf.bias is not None else None
            steps.append((leaf, x, weight, bias))
            x = self._forward(leaf, x, weight, bias)
        g, grads = grad, []
        for i, (leaf, x, weight, bias) in reversed(list(enumerate(steps))):
            if isinstance(leaf, nn.Conv2d):
                grads = [self._conv_weight_grad(leaf, x, g, weight), *([g.sum(dim=(0, 2, 3))] if bias is not None else []),
                         *grads]
                if i > 0:
                    g = self._conv_input_grad(leaf, x, g, weight)
            elif isinstance(leaf, nn.ReLU):
                g = g * (x > 0).to(g.dtype)
            elif isinstance(leaf, nn.Tanh):
                y = torch.tanh(x)
                g = g * (1 - y * y)
            else:
                g = self._lrn_grad(leaf, x, g)
        return tuple(grads)

    @staticmethod
    def _forward(leaf: nn.Module, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(leaf, nn.Conv2d):
            return F.conv2d(x, weight, bias, leaf.stride, leaf.padding, leaf.dilation)
        return leaf(x)

    @staticmethod
    def _conv_weight_grad(conv: nn.Conv2d, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        grad_w = F.conv2d(x.transpose(0, 1), g.transpose(0, 1), padding=conv.padding,
                          dilation=conv.stride).transpose(0, 1)
        return grad_w[:, :, :weight.shape[2], :weight.shape[3]]

    @staticmethod
    def _conv_input_grad(conv: nn.Conv2d, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The rows/columns of x that no output reached (a stride that does not divide) get output_padding.
        extra = [x.shape[2 + d] - ((g.shape[2 + d] - 1) * conv.stride[d] - 2 * conv.padding[d]
                                   + conv.dilation[d] * (weight.shape[2 + d] - 1) + 1) for d in (0, 1)]
        return F.conv_transpose2d(g, weight, None, conv.stride, conv.padding, tuple(extra), 1, conv.dilation)

    @staticmethod
    def _lrn_grad(lrn: PaperLRN, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        a = x
        if lrn.input_max is not None:
            a = torch.clamp(x, min=0.0, max=float(lrn.input_max))
        d = lrn.gamma + lrn.alpha * lrn.window_sum(a * a)
        inner = lrn.window_sum(g * a * torch.pow(d, -lrn.beta - 1))
        grad_a = g * torch.pow(d, -lrn.beta) - 2 * lrn.alpha * lrn.beta * a * inner
        if lrn.input_max is not None:
            grad_a = grad_a * ((x >= 0) & (x <= lrn.input_max)).to(grad_a.dtype)
        return grad_a
