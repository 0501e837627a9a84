"""Tensor codec: {dtype, shape, data[, scale]} with little-endian bytes.

Encoding hands msgpack a memoryview of the array (no copy before packing); decoding
wraps the received bytes with np.frombuffer (no copy for f32). f16 and i8 trade
precision for bytes on the wire without changing the message layout; both carry a
per-tensor scale (i8: max/127; f16: a power of two that keeps tiny gradients normal).
i8c is i8 with a scale per image and channel (the first two axes), float32 in `scales`:
gradients at the split differ by orders of magnitude between channels, and one scale
for the whole tensor rounds all but the largest channels' to zero (docs/wire.md).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from splitface.protocol.errors import ErrorCode, ProtocolError, brief

WIRE_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "i8": np.dtype("i1"),
    "i8c": np.dtype("i1"),
}
SCALES_DTYPE = np.dtype("<f4")   # i8c's `scales`: one float32 per (image, channel)
I8C_MIN_RANK = 3                 # a tensor of fewer axes asked for as i8c goes as i8
ENCODINGS = tuple(WIRE_DTYPES)
MAX_RANK = 8
# Largest dimension, and largest product of the non-zero dimensions: what a 32-bit index (a JVM array)
# addresses. Without the second bound a zero-size tensor such as [0, 2^62] passes the byte count and
# then cannot be built (numpy refuses shapes whose non-zero dimensions overflow its index type).
MAX_DIM = 2**31 - 1


# the largest binary16 value v with v * 2^113 (the scale of a peak in [2^127, 2^128)) still a finite float32
F16_TOP_BELOW_F32_MAX = 32752.0


def encode_tensor(array: np.ndarray, encoding: str = "f32", scale: float | None = None,
                  dither: np.random.Generator | None = None) -> dict[str, Any]:
    """Wire form of a float array in the given encoding (`i8c` on fewer than 3 axes goes as `i8`: SPEC.md 5.10).

    `scale` (i8 only): a public step fixed in advance, for values that are already integers in that step (the
    discrete Gaussian's release): they travel as those integers, exactly, or the call refuses.
    `dither` (i8 and i8c): round each value down or up at random, up with probability its distance from the step
    below, so that the decoded value's expectation is the value itself (SPEC.md section 4: stochastic
    rounding). Nearest rounding zeroes every value under half a step, always the same ones: a bias that
    gradients, summed over many steps, accumulate; dithered rounding's error averages out instead."""
    if encoding not in WIRE_DTYPES:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {ENCODINGS}")
    if scale is not None and encoding != "i8":
        raise ValueError(f"a fixed scale is for i8 integers, not {encoding}")
    if dither is not None and (encoding not in ("i8", "i8c") or scale is not None):
        raise ValueError("stochastic rounding is for i8 and i8c with their peaks' scales, not for "
                         + (encoding if encoding != "i8" else "integers at a fixed scale"))
    a = np.asarray(array)
    if encoding == "i8c" and a.ndim < I8C_MIN_RANK:
        encoding = "i8"   # SPEC.md section 5.10: a scale per value would outweigh the value
    shape = [int(d) for d in a.shape]
    out: dict[str, Any] = {"dtype": encoding, "shape": shape}
    if scale is not None:
        out["data"], out["scale"] = _bytes_view(_integers_at(a.astype(np.float32, copy=False), scale)), float(scale)
    elif encoding == "i8":
        a = a.astype(np.float32, copy=False)
        scale = float(_peak_scales(np.asarray(_peak(a))))
        steps = a / np.float32(scale)   # float32 / float32, as the nearest rule (SPEC.md section 4)
        rounded = np.rint(steps) if dither is None else np.floor(steps + dither.random(a.shape, np.float32))
        q = np.clip(rounded, -127, 127).astype(np.int8)
        out["data"] = _bytes_view(q)
        out["scale"] = scale
    elif encoding == "i8c":
        out["data"], out["scales"] = _per_channel_i8(a.astype(np.float32, copy=False), dither)
    elif encoding == "f16":
        # A power-of-two scale puts the largest value in [2^14, 2^15): gradients (~1e-8 here)
        # stay in f16's normal range instead of flushing to subnormals or zero; exact to undo.
        a = a.astype(np.float32, copy=False)
        peak = _peak(a)
        exponent = math.frexp(peak)[1] if peak > 0 else 0
        scale = math.ldexp(1.0, max(exponent - 15, -126)) if peak > 0 else 1.0
        scaled = a / np.float32(scale)
        if exponent == 128:
            # within half an f16 step of float32's largest value: rounding up would decode to infinity
            scaled = np.clip(scaled, -F16_TOP_BELOW_F32_MAX, F16_TOP_BELOW_F32_MAX)
        out["data"] = _bytes_view(scaled.astype(WIRE_DTYPES["f16"]))
        out["scale"] = scale
    else:
        wire = np.ascontiguousarray(a, dtype=WIRE_DTYPES[encoding])
        out["data"] = _bytes_view(wire)
    return out


def payload_bytes(shape: tuple[int, ...] | list[int], encoding: str) -> int:
    """Bytes of a tensor's values (and i8c's scales) on the wire, without its map's framing: what an encoding
    costs at a shape too large to encode (a full-size model's release)."""
    values = math.prod(shape) * WIRE_DTYPES[encoding].itemsize
    if encoding == "i8c" and len(shape) >= I8C_MIN_RANK:
        return values + shape[0] * shape[1] * SCALES_DTYPE.itemsize
    return values


def _per_channel_i8(a: np.ndarray, dither: np.random.Generator | None) -> tuple[memoryview, memoryview]:
    """i8c's int8 values and float32 scales: each (image, channel) group as i8 encodes a tensor, max/127."""
    groups = a.reshape(a.shape[0], a.shape[1], math.prod(a.shape[2:]))
    with np.errstate(invalid="ignore"):
        peaks = np.abs(groups).max(axis=2, initial=0.0).astype(np.float64)
    scales = _peak_scales(peaks).astype(SCALES_DTYPE)
    steps = groups / scales[:, :, None]
    rounded = np.rint(steps) if dither is None else np.floor(steps + dither.random(steps.shape, np.float32))
    q = np.clip(rounded, -127, 127).astype(np.int8)
    return _bytes_view(q), _bytes_view(scales)


def _peak_scales(peaks: np.ndarray) -> np.ndarray:
    """i8's and i8c's scale rule (SPEC.md section 4), in float64: max / 127; 1.0 where the peak is 0, not finite, or
    so small that its float32 scale is 0 (its values all round to 0); and the float32 just below where 127 steps of
    the float32 scale would overflow float32 (a peak within a rounding of float32's largest value: decoded, it
    would be infinite, which the receiver refuses)."""
    with np.errstate(invalid="ignore", over="ignore"):
        scales = peaks / 127.0
        scales = np.where(np.isfinite(scales) & (scales.astype(np.float32) > 0), scales, 1.0)
        single = scales.astype(np.float32)
        over = ~np.isfinite(np.float32(127) * single)
    return np.where(over, np.nextafter(single, np.float32(0)).astype(np.float64), scales)


def _integers_at(a: np.ndarray, scale: float) -> np.ndarray:
    """The int8 integers q with float32(q) * float32(scale) == a exactly (how an i8 tensor decodes)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the i8 scale must be finite and > 0, got {scale}")
    step = np.float32(scale)
    q = np.rint(a / step)
    if a.size and not (np.abs(q).max() <= 127 and np.array_equal(q.astype(np.float32) * step, a)):
        raise ValueError(f"values are not int8 integers in steps of {scale:g}: they would not decode exactly")
    return q.astype(np.int8)


def _peak(a: np.ndarray) -> float:
    peak = float(np.max(np.abs(a))) if a.size else 0.0
    return peak if math.isfinite(peak) else 0.0


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B")


def decode_tensor(obj: Any, *, field: str = "tensor", finite: bool = True) -> np.ndarray:
    """Float32 array from a wire tensor; raises ProtocolError(BAD_TENSOR) on any mismatch, never another error.

    Checks follow SPEC.md section 4 in order. `finite` refuses NaN and infinity; message decoding
    always asks for it (no message may carry a non-finite value). Whether finite values are plausible
    for a model (e.g. 3e38 activations) is the receiver's business, not the codec's.
    The returned f32 array is read-only: a view of the message bytes, or an aligned copy where the bytes
    are not at a multiple of 4 (a view inside a larger message, see messages.decode).
    """
    def bad(why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_TENSOR, f"{field}: {why}")

    if not isinstance(obj, dict):
        raise bad(f"expected a map, got {type(obj).__name__}")
    dtype_name, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
        raise bad(f"dtype {brief(dtype_name)} is not one of {list(ENCODINGS)}")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)):
        raise bad(f"shape must be a list of at most {MAX_RANK} ints in 0..{MAX_DIM}, got {brief(shape)}")
    if math.prod(d for d in shape if d) > MAX_DIM:
        raise bad(f"shape {shape} is too large: its non-zero dimensions multiply to more than {MAX_DIM}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad("data must be bin")
    extra = set(obj) - {"dtype", "shape", "data", "scale", "scales"}
    if extra:
        raise bad(f"unexpected keys {brief(sorted(map(str, extra)))}")
    dtype = WIRE_DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise bad(f"{len(data)} bytes do not match dtype {dtype_name} x shape {shape} ({expected} bytes)")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if "scales" in obj and dtype_name != "i8c":
        raise bad(f"{dtype_name} takes no `scales` (only i8c does)")
    if dtype_name in ("i8", "f16"):
        scale = obj.get("scale")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not (math.isfinite(scale) and scale > 0):
            raise bad(f"{dtype_name} needs a finite positive scale, got {brief(scale)}")
        # Applied as a float32: a scale near or beyond float32's range gives inf, refused below.
        with np.errstate(over="ignore", invalid="ignore"):
            array = array.astype(np.float32) * np.float32(scale)
    elif dtype_name == "i8c":
        if "scale" in obj:
            raise bad("i8c takes `scales`, not a `scale`")
        with np.errstate(over="ignore", invalid="ignore"):
            array = array.astype(np.float32) * _channel_scales(obj.get("scales"), shape, bad)
    elif "scale" in obj:
        raise bad("f32 takes no scale")
    elif not array.flags.aligned:
        # A view of the message (messages.decode) sits where the wire puts it, often not at a multiple of 4 bytes:
        # numpy copes, but torch and BLAS take the floats' address as it is, so such a tensor is copied.
        array = array.copy()
        array.flags.writeable = False
    if finite and array.size and not all_finite(array):
        raise bad("contains NaN or infinity")
    return array


def _channel_scales(scales: Any, shape: list[int], bad: Callable[[str], ProtocolError]) -> np.ndarray:
    """i8c's scales, checked (SPEC.md section 4), shaped to multiply the [N, C, ...] values they scale."""
    if len(shape) < I8C_MIN_RANK:
        raise bad(f"i8c needs at least {I8C_MIN_RANK} axes (image, channel, values), got shape {shape}")
    groups = shape[0] * shape[1]
    if not isinstance(scales, (bytes, bytearray, memoryview)) or len(scales) != groups * SCALES_DTYPE.itemsize:
        raise bad(f"i8c needs `scales`: bin of {groups} float32 (one per image and channel of shape {shape}), "
                  f"got {brief(scales) if not isinstance(scales, (bytes, bytearray, memoryview)) else f'{len(scales)} bytes'}")
    values = np.frombuffer(scales, SCALES_DTYPE)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise bad("i8c scales must be finite and > 0")
    return values.reshape(shape[0], shape[1], *([1] * (len(shape) - 2)))


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or infinity, without np.isfinite's temporary bool array when it does not.

    A sum is finite only if every term is (a NaN or an infinity makes it NaN or infinite); a non-finite sum
    may also be an overflow of finite values, so then the exact check decides."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(array, axis=None)
    return bool(np.isfinite(total)) or bool(np.isfinite(array).all())
