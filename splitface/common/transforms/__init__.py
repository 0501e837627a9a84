"""Release transforms: what the device does to its output before anything leaves the phone.

Each transform is a pair of stages that `splitface.common.models.split_backbone` puts at the cut: one
appended to the device part, its mirror prepended to the server part, so device + server is
still one model (as with `release_pool`). The name and parameters travel in `ModelSpec`
(`release`, `bottleneck_*`, `dct_*`, `mask_*`), which both sides compare in HELLO.

- `bottleneck`: the device runs the backbone up to the split, then a 1x1 conv to
  `bottleneck_channels` (stride `bottleneck_stride`) and tanh; the server upsamples and maps back.
- `dct`: the device runs no backbone stage: it releases the image's 8x8 block DCT, upsampled so
  that the frequency maps have the split's spatial size; the server maps them with a conv to the
  split's channels and continues after the split (the backbone's stages up to the split are unused).
- `mask` (FaceMAE): the device runs no backbone stage: it releases the image with a random `mask_ratio` of
  its `mask_patch`-sized patches zeroed (drawn per image and release, like `dct_keep`'s subset); the server
  fills them in with a masked autoencoder pre-trained on public faces (`research/facemae.py`), maps the
  reconstruction to the split's channels and continues after the split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from splitface.common.transforms.bottleneck import Bottleneck, Expand
from splitface.common.transforms.dct import (BLOCK, BlockDCT, FrequencyStem, coefficient_range, mirror_release,
                                             random_keep_mask)
from splitface.common.transforms.mask import ImageRelease, MaskedReconstruction, patch_grid, random_patch_mask

if TYPE_CHECKING:
    from splitface.common.models.spec import ModelSpec

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class Transform:
    """`device(spec, split_shape)` and `server(spec, split_shape)` build the two stages; `replaces_device`:
    the device stage takes the image itself, instead of the backbone's output at the split."""
    device: Callable[["ModelSpec", Shape], nn.Module]
    server: Callable[["ModelSpec", Shape], nn.Module]
    replaces_device: bool
    check: Callable[["ModelSpec"], None]  # refuse a spec whose keys for this transform are out of range
    # the release of the left-right mirror image, from the release (post-processing, exact); None: not known
    mirror: Callable[["ModelSpec", torch.Tensor], torch.Tensor] | None = None


def check_bottleneck(spec: "ModelSpec") -> None:
    if min(spec.bottleneck_channels, spec.bottleneck_stride) < 1:
        raise ValueError("bottleneck_channels and bottleneck_stride must be >= 1")


def check_dct(spec: "ModelSpec") -> None:
    if not 0 <= spec.dct_drop < 64:
        raise ValueError(f"dct_drop must be in [0, 64), got {spec.dct_drop}")
    if not 0 <= spec.dct_keep <= dct_channels(spec) or (spec.dct_keep and spec.release != "dct"):
        raise ValueError(f"dct_keep must be 0 or, with release 'dct', at most {dct_channels(spec)}; "
                         f"got {spec.dct_keep}")
    if spec.dct_stem_blocks < 0 or (spec.dct_stem_blocks and spec.release != "dct"):
        raise ValueError(f"dct_stem_blocks must be 0 or, with release 'dct', a positive number of blocks; "
                         f"got {spec.dct_stem_blocks}")


def check_mask(spec: "ModelSpec") -> None:
    if not 0.0 <= spec.mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {spec.mask_ratio}")
    if spec.mask_patch < 2 or spec.mask_patch & (spec.mask_patch - 1) or spec.input_size % spec.mask_patch:
        raise ValueError(f"mask_patch must be a power of two >= 2 dividing input_size {spec.input_size}, "
                         f"got {spec.mask_patch}")


def dct_upsample(spec: "ModelSpec", split_shape: Shape) -> int:
    """The upsampling that gives frequency maps of the split's spatial size: S u / 8 = H."""
    _, h, w = split_shape
    if h != w or (BLOCK * h) % spec.input_size:
        raise ValueError(f"dct: the split's output ({h}x{w}) must be square and (8 x its size) a multiple "
                         f"of the input size {spec.input_size}")
    u = BLOCK * h // spec.input_size
    if u < 1:
        raise ValueError(f"dct: the split's {h}x{w} maps are smaller than the {spec.input_size // BLOCK}x"
                         f"{spec.input_size // BLOCK} blocks of the image; split earlier")
    return u


def mask_stem(spec: "ModelSpec", split_shape: Shape) -> MaskedReconstruction:
    """The server's stage of `mask`: the reconstruction is an image, so the split must keep its size."""
    channels, h, w = split_shape
    patch_grid(spec.input_size, spec.mask_patch)
    if (h, w) != (spec.input_size, spec.input_size):
        raise ValueError(f"mask: the server maps the reconstructed {spec.input_size} px image to the split's output, "
                         f"which must keep that size (got {h}x{w}); split earlier (e.g. conv1)")
    return MaskedReconstruction(spec.mask_patch, channels)


def dct_channels(spec: "ModelSpec") -> int:
    """Frequency channels the device computes: 3 colours x (64 - dct_drop)."""
    return 3 * (BLOCK * BLOCK - spec.dct_drop)


TRANSFORMS: dict[str, Transform] = {
    "bottleneck": Transform(
        device=lambda spec, shape: Bottleneck(shape[0], spec.bottleneck_channels, spec.bottleneck_stride),
        server=lambda spec, shape: Expand(spec.bottleneck_channels, shape[0], spec.bottleneck_stride),
        replaces_device=False, check=check_bottleneck),
    "dct": Transform(
        device=lambda spec, shape: BlockDCT(dct_upsample(spec, shape), spec.dct_drop),
        server=lambda spec, shape: FrequencyStem(dct_channels(spec), shape[0], spec.dct_stem_blocks),
        replaces_device=True, check=check_dct,
        mirror=lambda spec, x: mirror_release(x, spec.dct_drop)),
    "mask": Transform(
        device=lambda spec, shape: ImageRelease(),
        server=mask_stem,
        replaces_device=True, check=check_mask,
        mirror=lambda spec, x: x.flip(-1)),   # patches on a grid that divides the image: the mask's law is symmetric
}
RELEASES = ("none", *TRANSFORMS)
MIRRORED = tuple(name for name, t in TRANSFORMS.items() if t.mirror is not None)


def release_mirror(spec: "ModelSpec") -> Callable[[torch.Tensor], torch.Tensor]:
    """The server's map from a batch of releases (N, C, H, W) to the releases of the mirrored images: for a release
    that is the image itself (`mask`) or its block DCT (`dct`), noise and all. A learned device layer's output has
    no such map (its filters are not symmetric): ValueError."""
    transform = TRANSFORMS.get(spec.release)
    if transform is None or transform.mirror is None:   # (release_pool combines with no transform)
        raise ValueError(f"the server knows the mirror image's release only for the releases {MIRRORED}, not for "
                         f"release {spec.release!r}")
    mirror = transform.mirror
    return lambda x: mirror(spec, x)


def mirror_averaged(embed: Callable[[torch.Tensor], torch.Tensor],
                    mirror: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
    """`embed(x)` of releases `x`; with `mirror` (release_mirror's map), the mean of it and of `embed` on the mirror
    images' releases, in float32 (also under bf16 autocast): test-time flipping at no further release. One pass over
    both halves, so that in training the batch norms see the pair as one batch and update their running statistics
    once a step, as the server's guard on them assumes (trainer._clip_statistics)."""
    if mirror is None:
        return embed(x)
    both = embed(torch.cat([x, mirror(x)])).float()
    return (both[:len(x)] + both[len(x):]) / 2


def transform_range(spec: "ModelSpec") -> tuple[float, float]:
    """The range of an honest release by a transform, before any noise: what the server may expect of it (tanh's
    (-1, 1); the image's block DCT of pixels in [0, 1]; the image itself with patches zeroed)."""
    if spec.release == "bottleneck":
        return -1.0, 1.0
    if spec.release == "dct":
        return coefficient_range(spec.dct_drop)
    if spec.release == "mask":
        return 0.0, 1.0
    raise ValueError(f"no transform {spec.release!r}")


def release_mask(spec: "ModelSpec", n: int, release_shape: Shape, generator: torch.Generator) -> torch.Tensor | None:
    """The device's per-image random choice, or None: multiply the release by it. `dct` with dct_keep > 0:
    (n, C, 1, 1), a channel subset; `mask`: (n, 1, S, S), the visible patches."""
    if spec.release == "mask":
        return random_patch_mask(n, release_shape[-1], spec.mask_patch, spec.mask_ratio, generator)
    if spec.release != "dct" or not spec.dct_keep:
        return None
    return random_keep_mask(n, release_shape[0], spec.dct_keep, generator)
