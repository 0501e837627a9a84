"""The FaceMAE release (Wang et al. 2022): the device releases its image with most patches masked out,
and the server fills them in with a masked autoencoder trained on public faces.

Device side: the image is cut into `patch` x `patch` patches and a random `ratio` of them (0.75: 48
of the 64 patches of a 64 px face at patch 8) is zeroed; the visible rest leaves the device as it is.
The patches are drawn per image and per release from the device's keyed generator
(`random_patch_mask`, called through `release_mask` like the DCT's channel subset), so a re-sent batch
repeats its mask and a new release draws a new one. The device stage itself is a fixed, parameter-free
module (`ImageRelease`: the image bounded to [0, 1]); the mask is an input multiplied after it, so an
exported program takes the mask as a tensor and draws nothing itself.

What crosses the wire: only the visible patches, with a bitmask of their positions (the packed FORWARD of
SPEC.md section 5.12, `splitface.protocol.patches`, made by the device's ClientSession from this dense release); the
server's session unpacks it to the masked image with zeros in place. The positions show the server which
patches were visible, which it needs to reconstruct; they reveal nothing of the hidden pixels.

Server side (`MaskedReconstruction`): a small convolutional MAE that sees the masked image and the
mask it infers from the zeros, predicts every pixel and keeps the visible ones as received (as MAE's
reconstructions do); then a stem to the split's channels, and the backbone's tail continues. The MAE is
pre-trained on public faces (`splitface-research facemae`, with the instance-relation-matching loss)
and kept frozen while recognition trains on its reconstructions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.transforms.dct import FrequencyStem


def patch_grid(size: int, patch: int) -> int:
    """Patches along each side; refused where the patches do not tile the image."""
    if patch < 1 or size % patch:
        raise ValueError(f"mask: patch size {patch} must divide the input size {size}")
    return size // patch


def visible_patches(size: int, patch: int, ratio: float) -> int:
    """How many patches each release shows: (1 - ratio) of the grid, rounded, at least one."""
    return max(1, round(patch_grid(size, patch) ** 2 * (1.0 - ratio)))


def random_patch_mask(n: int, size: int, patch: int, ratio: float, generator: torch.Generator) -> torch.Tensor:
    """(n, 1, size, size) of 0/1: exactly `visible_patches` patches of ones per image, drawn independently."""
    g = patch_grid(size, patch)
    keep = visible_patches(size, patch, ratio)
    chosen = torch.rand(n, g * g, generator=generator).argsort(dim=1)[:, :keep]
    grid = torch.zeros(n, g * g).scatter_(1, chosen, 1.0).reshape(n, 1, g, g)
    return grid.repeat_interleave(patch, dim=2).repeat_interleave(patch, dim=3)


class ImageRelease(nn.Module):
    """Device side: the image itself, bounded to [0, 1] (the range the server's guard and MAE assume);
    the patch mask is multiplied after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(0.0, 1.0)


def infer_mask(released: torch.Tensor, patch: int) -> torch.Tensor:
    """(n, 1, S, S) 0/1: the patches of a release that hold anything (a visible patch of exact zeros, a
    black square, reads as masked; the MAE then predicts it)."""
    present = F.max_pool2d(released.abs().amax(dim=1, keepdim=True), patch) > 0
    return F.interpolate(present.float(), scale_factor=patch, mode="nearest")


class ConvMAE(nn.Module):
    """A small convolutional masked autoencoder at the patch grid: masked image + mask -> full image.

    Down to the grid (one cell per patch) with strided convs, a few 3x3 convs there so that a hidden
    patch sees its visible neighbours (dilated: the receptive field spans the face), and back up with
    skip connections; sigmoid output in [0, 1]. Conv and ReLU only, no normalisation: the server keeps it
    frozen, and its output must not depend on the batch or on train/eval mode.
    """

    def __init__(self, patch: int = 8, width: int = 16) -> None:
        super().__init__()
        if patch < 2 or patch & (patch - 1):
            raise ValueError(f"ConvMAE needs a power-of-two patch size >= 2, got {patch}")
        self.patch = patch
        levels = patch.bit_length() - 1    # stride-2 steps down to the grid
        widths = [min(width * 2 ** i, 4 * width) for i in range(levels + 1)]
        self.inp = nn.Sequential(nn.Conv2d(4, widths[0], 3, padding=1), nn.ReLU())
        self.down = nn.ModuleList(nn.Sequential(nn.Conv2d(widths[i], widths[i + 1], 3, stride=2, padding=1), nn.ReLU())
                                  for i in range(levels))
        w = widths[-1]
        self.context = nn.Sequential(*(m for d in (1, 2, 4, 1) for m in
                                       (nn.Conv2d(w, w, 3, padding=d, dilation=d), nn.ReLU())))
        self.up = nn.ModuleList(nn.Sequential(nn.Conv2d(widths[i + 1] + widths[i], widths[i], 3, padding=1), nn.ReLU())
                                for i in reversed(range(levels)))
        self.out = nn.Conv2d(widths[0], 3, 3, padding=1)

    def forward(self, masked: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The full prediction (visible patches too); `reconstruct` pastes the visible pixels back."""
        h = self.inp(torch.cat([masked, mask], dim=1))
        skips = [h]
        for down in self.down:
            h = down(h)
            skips.append(h)
        h = self.context(h)
        for up, skip in zip(self.up, reversed(skips[:-1])):
            h = up(torch.cat([F.interpolate(h, scale_factor=2, mode="nearest"), skip], dim=1))
        return torch.sigmoid(self.out(h))

    def reconstruct(self, released: torch.Tensor) -> torch.Tensor:
        """A release (masked image, zeros where hidden) -> the image with its hidden patches filled in."""
        mask = infer_mask(released, self.patch)
        return released * mask + self(released, mask) * (1 - mask)


class MaskedReconstruction(nn.Module):
    """Server side: reconstruct the image (frozen MAE), then conv3x3 + BN + ReLU to the split's channels."""

    def __init__(self, patch: int, out_channels: int) -> None:
        super().__init__()
        self.mae = ConvMAE(patch)
        self.mae.requires_grad_(False)   # pre-trained on public faces; recognition trains the stem and the tail
        self.stem = FrequencyStem(3, out_channels)

    def forward(self, released: torch.Tensor) -> torch.Tensor:
        return self.stem(self.mae.reconstruct(released))
