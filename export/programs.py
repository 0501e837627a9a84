"""The device layer as the three programs a phone runs, written as plain torch modules.

- `ReleaseProgram`: released = layer(images) + noise. The noise is an input because the
  runtimes have no random kernels and because the device's privacy code (accountant, budget
  guard, keyed noise) must decide it. The weights are inputs too when the layer trains (the
  forward program then always uses the current weights), or constants for a frozen layer.
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

from device_sdk.models.lrn import PaperLRN


def param_names(layer: nn.Module) -> list[str]:
    return [name for name, _ in layer.named_parameters()]


def layer_parts(layer: nn.Module) -> tuple[nn.Conv2d, PaperLRN]:
    """The conv and the LRN of a device layer that is exactly conv + ReLU + LRN (what `LayerVJP` covers)."""
    kinds = [m for m in layer.modules() if not list(m.children())]
    if [type(m) for m in kinds] != [nn.Conv2d, nn.ReLU, PaperLRN]:
        raise ValueError("export covers a device layer of exactly conv + ReLU + PaperLRN, found "
                         + " + ".join(type(m).__name__ for m in kinds))
    conv, _, lrn = kinds
    if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError("export needs a plain conv (groups 1, numeric zero padding)")
    return conv, lrn


class ReleaseProgram(nn.Module):
    def __init__(self, layer: nn.Module, weights_as_inputs: bool):
        super().__init__()
        self.layer, self.weights_as_inputs, self.names = layer, weights_as_inputs, param_names(layer)

    def forward(self, images: torch.Tensor, noise: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        if self.weights_as_inputs:
            activations = torch.func.functional_call(self.layer, dict(zip(self.names, weights)), (images,))
        else:
            activations = self.layer(images)
        return activations + noise


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

    With z = conv(x), a = clamp(relu(z), 0, m), s = band * a^2, d = gamma + alpha s, out = a d^-beta:
      dL/da = g d^-beta - 2 a alpha beta band^T (g a d^(-beta-1)),   dL/dz = dL/da [0 < z] [z <= m],
      dL/dW = conv of the inputs with dL/dz (batch and channels swapped),  dL/db = sum of dL/dz.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.conv, self.lrn = layer_parts(layer)
        self.has_bias = self.conv.bias is not None

    def forward(self, images: torch.Tensor, grad: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        conv, lrn = self.conv, self.lrn
        weight, bias = weights[0], (weights[1] if self.has_bias else None)
        z = F.conv2d(images, weight, bias, conv.stride, conv.padding, conv.dilation)
        a = torch.relu(z)
        passes = z > 0
        if lrn.input_max is not None:
            passes = passes & (z <= lrn.input_max)
            a = torch.clamp(a, max=float(lrn.input_max))
        d = lrn.gamma + lrn.alpha * F.conv2d(a * a, lrn.band)
        inner = F.conv2d(grad * a * torch.pow(d, -lrn.beta - 1), lrn.band.transpose(0, 1))
        grad_a = grad * torch.pow(d, -lrn.beta) - 2 * lrn.alpha * lrn.beta * a * inner
        grad_z = grad_a * passes.to(grad_a.dtype)
        grad_w = F.conv2d(images.transpose(0, 1), grad_z.transpose(0, 1), padding=conv.padding,
                          dilation=conv.stride).transpose(0, 1)
        grad_w = grad_w[:, :, :weight.shape[2], :weight.shape[3]]
        if self.has_bias:
            return grad_w, grad_z.sum(dim=(0, 2, 3))
        return (grad_w,)
