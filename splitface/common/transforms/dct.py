"""The frequency-domain release (PPFR-FD, DCTDP, PartialFace): block DCT of the image on the device.

The device optionally upsamples the image (bilinear), cuts it into 8x8 blocks and applies the
orthonormal 2-D DCT-II to each block, as one fixed convolution (64 basis filters per colour,
stride 8, grouped by colour) so that it exports to ExecuTorch and ONNX like any conv. Each
(colour, frequency) pair is a channel at (S'/8) x (S'/8). The lowest `drop` frequencies of each
colour in zig-zag order (the DC first) carry most of what a face looks like and are never
computed, so they are absent from the release, not masked. The device runs no learned layer.

PartialFace's random subset (`keep`): each image releases only `keep` of the remaining channels,
chosen per image from the release's keyed noise generator; the others are zeroed so the shape
stays fixed. Without noise the zeros show the server which channels were dropped (not their
values); with the per-image mechanism, noise is added to every channel after the mask.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 8


def dct_matrix(n: int = BLOCK) -> torch.Tensor:
    """Orthonormal DCT-II: D[k, i] = a_k cos(pi (2i + 1) k / 2n); D @ D.T = I."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


def zigzag(n: int = BLOCK) -> list[tuple[int, int]]:
    """(row, col) frequencies in JPEG zig-zag order, lowest first: (0, 0), (0, 1), (1, 0), (2, 0), ..."""
    return sorted(((u, v) for u in range(n) for v in range(n)),
                  key=lambda uv: (uv[0] + uv[1], uv[0] if (uv[0] + uv[1]) % 2 else uv[1]))


def dct_basis(drop: int = 1) -> torch.Tensor:
    """(64 - drop, 1, 8, 8) filters: filter f gives coefficient zigzag[drop + f] of a block."""
    d = dct_matrix()
    return torch.stack([torch.outer(d[u], d[v]) for u, v in zigzag()[drop:]]).unsqueeze(1).float()


def coefficient_range(drop: int = 1) -> tuple[float, float]:
    """The range of every released coefficient of an image with pixels in [0, 1]: a coefficient is sum b p over
    its block, lowest with the pixels at 1 where its basis b is negative, highest where it is positive (float64,
    exact up to rounding; bilinear upsampling mixes pixels convexly and keeps them in [0, 1])."""
    d = dct_matrix()
    filters = [torch.outer(d[u], d[v]) for u, v in zigzag()[drop:]]
    return (min(float(f.clamp(max=0).sum()) for f in filters), max(float(f.clamp(min=0).sum()) for f in filters))


def frequency_weights(drop: int, gamma: float) -> torch.Tensor:
    """(3 (64 - drop), 1, 1) per-channel weights ((1 + u + v) / (1 + u0 + v0))^gamma of the released frequencies,
    colour-major like BlockDCT's channels; (u0, v0) is the lowest released frequency, whose weight is 1.

    The per-image mechanism noises the release scaled by these (PerImageGaussian.frequency_gamma), so frequency
    (u, v) gets noise z C / w: high frequencies, which carry little of a face's energy, less; low ones more. A
    fixed power law in place of DCTDP's learned allocation: on LFW faces at 64 px (drop 4, upsampled 2x), the
    coefficients' RMS falls roughly as (1 + u + v)^-4.9, so gamma near 5 gives every frequency about the same
    signal-to-noise ratio and gamma 0 is the uniform noise of the plain mechanism.
    """
    released = zigzag()[drop:]
    u0, v0 = released[0]
    w = torch.tensor([((1.0 + u + v) / (1.0 + u0 + v0)) ** gamma for u, v in released], dtype=torch.float32)
    return w.repeat(3).reshape(-1, 1, 1)


class BlockDCT(nn.Module):
    """Device side: image (N, 3, S, S) -> (N, 3 (64 - drop), S u / 8, S u / 8), colour-major channels."""

    basis: torch.Tensor

    def __init__(self, upsample: int = 1, drop: int = 1) -> None:
        super().__init__()
        if upsample < 1 or not 0 <= drop < BLOCK * BLOCK:
            raise ValueError(f"need upsample >= 1 and 0 <= drop < 64, got {upsample=}, {drop=}")
        self.upsample, self.drop = upsample, drop
        # A fixed definition, not state: kept out of the state dict (weights files, snapshots).
        self.register_buffer("basis", dct_basis(drop).repeat(3, 1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upsample > 1:
            x = F.interpolate(x, scale_factor=self.upsample, mode="bilinear", align_corners=False)
        return F.conv2d(x, self.basis, stride=BLOCK, groups=3)

    def extra_repr(self) -> str:
        return f"upsample={self.upsample}, drop={self.drop}"


def mirror_signs(drop: int) -> torch.Tensor:
    """(3 (64 - drop), 1, 1): (-1)^v for each released frequency (u, v), colour-major as BlockDCT's channels.
    Mirroring a block left-right reverses its columns, and the cosine of column frequency v is even or odd about
    the block's centre as v is."""
    return torch.tensor([(-1.0) ** v for _, v in zigzag()[drop:]]).repeat(3).reshape(-1, 1, 1)


def mirror_release(x: torch.Tensor, drop: int) -> torch.Tensor:
    """The block DCT of the left-right mirror image, from the block DCT of the image (N, C, H, W): the blocks in
    reverse order, each frequency's sign per mirror_signs. Exact up to rounding for whole 8x8 blocks, upsampled or
    not (bilinear upsampling is symmetric). Noise that is independent across values, symmetric about 0 and of a law
    that depends only on the frequency (not the block) keeps its law, as does a per-image clip of the norm."""
    return x.flip(-1) * mirror_signs(drop).to(x)


def random_keep_mask(n: int, channels: int, keep: int, generator: torch.Generator) -> torch.Tensor:
    """(n, channels, 1, 1) of 0/1 with `keep` ones per row, drawn independently per image."""
    chosen = torch.rand(n, channels, generator=generator).argsort(dim=1)[:, :keep]
    return torch.zeros(n, channels).scatter_(1, chosen, 1.0).reshape(n, channels, 1, 1)


class FrequencyStem(nn.Module):
    """Server side: frequency channels -> the split's (C, H, W) (conv3x3 + BN + ReLU, then `blocks` residual
    blocks at that shape), then the tail.

    BN is on the server, where mixing a batch is harmless; it also evens out the very different
    scales of low and high frequencies. The stage stands in for every device stage up to the cut (the
    device runs none), which one conv does poorly: the blocks give it depth, at the server's cost only.
    """

    def __init__(self, in_channels: int, out_channels: int, blocks: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=1e-5)
        self.act = nn.ReLU()
        if blocks:   # absent at 0, so that the stage's weights keep their names in files saved before blocks
            self.blocks = nn.Sequential(*(StemBlock(out_channels) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.conv(x)))
        return self.blocks(x) if hasattr(self, "blocks") else x


class StemBlock(nn.Module):
    """A residual block at a fixed shape, as arcface's IResNet blocks are (BN, conv, BN, PReLU, conv, BN, plus
    the input). Its own here: the transforms sit below the models, which import them."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels, eps=1e-5), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels, eps=1e-5), nn.PReLU(channels),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels, eps=1e-5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)
