"""The bottleneck release: a learned 1x1 conv to a few channels, bounded by tanh, on the device.

Fewer released values per image means the per-image mechanism (clip to C, add N(0, (zC)^2))
spreads the same noise over far fewer coordinates, and tanh gives every value a known range
(-1, 1), so the clip norm C has a meaningful scale. The server mirrors it: upsample by the
stride and a 1x1 conv back to the channel count its tail expects.
"""
from __future__ import annotations

from torch import nn


class Bottleneck(nn.Module):
    """Device side: (N, C, H, W) -> (N, channels, H/stride, W/stride), values in (-1, 1)."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride, bias=True)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.conv(x))


class Expand(nn.Module):
    """Server side: back to the split's (C, H, W), so the tail after the split runs unchanged."""

    def __init__(self, channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.upsample = nn.Upsample(scale_factor=stride, mode="nearest") if stride > 1 else nn.Identity()
        self.conv = nn.Conv2d(channels, out_channels, kernel_size=1, bias=True)

    def forward(self, x):
        return self.conv(self.upsample(x))
