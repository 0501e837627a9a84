"""The packed form of a patch-masked release (SPEC.md section 5.12): only the patches that hold anything,
plus a per-image bitmask of where they go.

FaceMAE's device (`--release mask`) zeroes 75% of its image's patches. Sent dense, those zeros cost as many
bytes as the image; packed, a FORWARD carries `activations` as the `[T, C, P, P]` stack of the non-zero
patches (all images, image by image, each image's in row-major grid order) and `visible` =
`{"grid": [GH, GW], "bits": bin}`, bit `g` of image `n` (byte `n * ceil(GH*GW/8) + g // 8`, bit `g % 8`,
least significant first) set where patch `g` travels.

Packing is decided on the *encoded* bytes: a patch is left out exactly when its wire bytes are all zero, and
the packed tensor keeps the dense tensor's dtype and scale (the zeros do not change a peak). So the receiver's
zero-filled unpacking is bit for bit the dense tensor it would have decoded, in f32, f16 and i8 alike, and a
re-sent release packs to the same bytes. A bitmask rather than a list of indices: 8 bytes per image for a
64-patch grid, canonical order for free, and no duplicate or unordered positions to refuse.

The checks here need no session (message level, `messages.decode`); the unpacked shape they compute is
compared with the server's activation shape before anything of that size is allocated (`unpack`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from splitface.protocol.errors import ErrorCode, ProtocolError
from splitface.protocol.tensor import MAX_DIM, WIRE_DTYPES

VISIBLE_KEYS = ("grid", "bits")
# bits set in each byte value (popcount table: counts a bitmask without unpacking it to 8x its size)
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def is_visible_field(v: Any) -> bool:
    """`visible`'s structure: a map of exactly `grid` (two ints in 1..2^31-1) and `bits` (bin). Bad: bad_message."""
    if not isinstance(v, dict) or set(v) != set(VISIBLE_KEYS):
        return False
    grid, bits = v["grid"], v["bits"]
    return (isinstance(grid, list) and len(grid) == 2
            and all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_DIM for d in grid)
            and isinstance(bits, (bytes, bytearray, memoryview)))


def bytes_per_image(grid: tuple[int, int] | list[int]) -> int:
    """Bitmask bytes of one image: one bit per patch of the grid, rounded up to whole bytes."""
    return (grid[0] * grid[1] + 7) // 8


def check_packed(patches: np.ndarray, visible: dict[str, Any]) -> tuple[int, ...]:
    """The dense shape `[N, C, GH*P, GW*P]` a valid packed release unpacks to; raises bad_tensor when the patches and
    the bitmask disagree (rank, square patches, bitmask length, positions past the grid, count) or the dense
    tensor would break SPEC.md section 4's bounds. Costs O(message size); allocates nothing of the dense size."""
    def bad(why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_TENSOR, f"activations (packed): {why}")

    if patches.ndim != 4 or patches.shape[2] != patches.shape[3] or patches.shape[2] < 1:
        raise bad(f"patches must be [T, C, P, P] with P >= 1, got {list(patches.shape)}")
    t, c, p, _ = patches.shape
    gh, gw = visible["grid"]
    per_image = bytes_per_image((gh, gw))
    bits = np.frombuffer(visible["bits"], dtype=np.uint8)
    if len(bits) == 0 or len(bits) % per_image:
        raise bad(f"visible.bits has {len(bits)} bytes: not a positive multiple of {per_image} "
                  f"(one bit per patch of the {gh} x {gw} grid, per image)")
    n = len(bits) // per_image
    rows = bits.reshape(n, per_image)
    spare = per_image * 8 - gh * gw
    if spare and (rows[:, -1] >> (8 - spare)).any():
        raise bad(f"visible.bits sets a position past the {gh} x {gw} grid (its last byte's top {spare} bits "
                  f"must be 0)")
    sent = int(_POPCOUNT[bits].sum(dtype=np.int64))
    if sent != t:
        raise bad(f"visible.bits marks {sent} patches but activations carries {t}")
    shape = (n, c, gh * p, gw * p)
    if any(d > MAX_DIM for d in shape) or math.prod(d for d in shape if d) > MAX_DIM:
        raise bad(f"unpacks to {list(shape)}, beyond the tensor bounds (each dimension and the product of the "
                  f"non-zero ones at most {MAX_DIM})")
    return shape


def unpack(patches: np.ndarray, visible: dict[str, Any], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(dense float32 `shape` with zeros where no patch travelled, visible bool `[N, GH, GW]`); `shape` is
    `check_packed`'s, already compared with what the receiver expects."""
    n, c, h, w = shape
    gh, gw = visible["grid"]
    p = h // gh
    rows = np.frombuffer(visible["bits"], dtype=np.uint8).reshape(n, -1)
    mask = np.unpackbits(rows, axis=1, bitorder="little")[:, :gh * gw].astype(bool).reshape(n, gh, gw)
    grid = np.zeros((n, gh, gw, c, p, p), dtype=np.float32)
    grid[mask] = patches
    return np.ascontiguousarray(grid.transpose(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)), mask


def pack(wire: dict[str, Any], patch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(packed wire tensor, `visible`) of an encoded dense `[N, C, H, W]` tensor (`encode_tensor`'s map): the
    patches whose encoded bytes are not all zero, same dtype and scale (i8c: each patch its image's scales, `[T, C]`,
    so that it decodes as the dense tensor does). Refuses (ValueError) a shape the patch
    size does not tile: a sender bug, not a wire error."""
    shape = wire["shape"]
    if len(shape) != 4 or patch < 1 or shape[2] % patch or shape[3] % patch:
        raise ValueError(f"packing needs [N, C, H, W] with H and W multiples of the patch size {patch}, got {shape}")
    n, c, h, w = shape
    gh, gw = h // patch, w // patch
    item = WIRE_DTYPES[wire["dtype"]].itemsize
    raw = np.frombuffer(wire["data"], dtype=np.uint8).reshape(n, c, gh, patch, gw, patch * item)
    by_patch = raw.transpose(0, 2, 4, 1, 3, 5)                      # [N, GH, GW, C, P, P * itemsize]
    mask = by_patch.reshape(n, gh, gw, -1).any(axis=3)
    data = np.ascontiguousarray(by_patch[mask]).tobytes()
    packed = {"dtype": wire["dtype"], "shape": [int(mask.sum()), c, patch, patch], "data": data}
    if "scale" in wire:
        packed["scale"] = wire["scale"]
    if "scales" in wire:
        per_patch = np.repeat(np.frombuffer(wire["scales"], np.uint8).reshape(n, -1), mask.sum(axis=(1, 2)), axis=0)
        packed["scales"] = per_patch.tobytes()
    per_image = bytes_per_image((gh, gw))
    bits = np.packbits(mask.reshape(n, gh * gw), axis=1, bitorder="little")
    assert bits.shape == (n, per_image)
    return packed, {"grid": [gh, gw], "bits": bits.tobytes()}
