"""ArcFace-style IResNet backbone (after insightface arcface_torch ``iresnet.py``).

Blocks, widths, downsampling and the BN -> dropout -> flatten -> fc -> BN1d head
follow arcface_torch. One deliberate deviation: the stem stage "conv1" is
conv3x3(3, width, stride 1, pad 1, with bias) + ReLU + PaperLRN(width) instead
of conv + BN + PReLU. The stem is the device layer, and it must be

* a per-image function: BatchNorm mixes statistics across a batch (and its
  running statistics would leak training-set information to the device), and
* bounded: LRN keeps ReLU activations in [0, 1), which the privacy analysis of
  what the phone transmits relies on.

The stem conv keeps a bias because no BN follows it to absorb one. Convs use
kaiming-normal init (arcface uses N(0, 0.1)); everything else matches.

Batch norm accepts every batch size the protocol allows, N = 1 included (see `AnyBatchNorm`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.models.lrn import PaperLRN

LAYERS: dict[int, tuple[int, int, int, int]] = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 14, 3),
    100: (3, 13, 30, 3),
}


class AnyBatchNorm:
    """Batch norm that trains on a batch holding one value per channel (N = 1 after the fc, or N = 1
    on a 1x1 map), where torch's batch norm raises: a device whose share leaves a last batch of one
    must not fail.

    The choice: such a batch is normalised with the running statistics, which it leaves unchanged
    (eval-mode behaviour for that batch only; the affine weights still get their gradients). One
    value has no variance to estimate, and folding it into the running statistics with a zero
    variance would corrupt them. Every larger batch behaves exactly as torch's batch norm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.numel() == x.shape[1]:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


class BatchNorm1d(AnyBatchNorm, nn.BatchNorm1d):
    """`nn.BatchNorm1d` that accepts N = 1 (see `AnyBatchNorm`); same state-dict keys."""


class BatchNorm2d(AnyBatchNorm, nn.BatchNorm2d):
    """`nn.BatchNorm2d` that accepts one value per channel (see `AnyBatchNorm`); same state-dict keys."""


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class IBasicBlock(nn.Module):
    """Pre-activation-style residual block of arcface_torch (BN first, PReLU, no final ReLU)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.bn1 = BatchNorm2d(inplanes, eps=1e-5)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = BatchNorm2d(planes, eps=1e-5)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = BatchNorm2d(planes, eps=1e-5)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn1(x)
        out = self.conv1(out)
        out = self.bn2(out)
        out = self.prelu(out)
        out = self.conv2(out)
        out = self.bn3(out)
        return out + identity


def _make_layer(inplanes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
    downsample = None
    if stride != 1 or inplanes != planes:
        downsample = nn.Sequential(conv1x1(inplanes, planes, stride), BatchNorm2d(planes, eps=1e-5))
    layers = [IBasicBlock(inplanes, planes, stride, downsample)]
    layers += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
    return nn.Sequential(*layers)


class IResNetHead(nn.Module):
    """The arcface "features" head, kept as one stage so the embedding is its output."""

    def __init__(self, channels: int, spatial: int, embedding_size: int, dropout: float) -> None:
        super().__init__()
        self.bn2 = BatchNorm2d(channels, eps=1e-5)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(channels * spatial * spatial, embedding_size)
        self.features = BatchNorm1d(embedding_size, eps=1e-5)
        # As in arcface_torch: the embedding BN has a fixed unit scale (only its shift trains).
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn2(x)
        x = self.dropout(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return self.features(x)


def iresnet_stages(
    input_size: int = 112,
    depth: int = 50,
    width: int = 64,
    embedding_size: int = 512,
    dropout: float = 0.0,
) -> "OrderedDict[str, nn.Module]":
    """Ordered stages conv1, layer1..layer4, features."""
    if depth not in LAYERS:
        raise ValueError(f"iresnet depth must be one of {sorted(LAYERS)}, got {depth}")
    if input_size < 16 or input_size % 16:
        raise ValueError(f"iresnet input_size must be a positive multiple of 16, got {input_size}")
    return OrderedDict(iter_iresnet_stages(input_size, depth, width, embedding_size, dropout))


def iter_iresnet_stages(input_size: int, depth: int, width: int, embedding_size: int,
                        dropout: float) -> Iterator[tuple[str, nn.Module]]:
    """The stages one at a time, each built only when asked for (a device builds its own, not the server's)."""
    yield "conv1", nn.Sequential(
        nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=True),
        nn.ReLU(),
        PaperLRN(width, size=5, alpha=1.0, beta=0.5, gamma=2.0),
    )
    inplanes = width
    for i, (blocks, mult) in enumerate(zip(LAYERS[depth], (1, 2, 4, 8)), start=1):
        planes = width * mult
        yield f"layer{i}", _make_layer(inplanes, planes, blocks, stride=2)
        inplanes = planes
    yield "features", IResNetHead(inplanes, input_size // 16, embedding_size, dropout)
