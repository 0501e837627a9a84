"""dlib's face-recognition ResNet (`dlib_face_recognition_resnet_model_v1.dat`) as a PyTorch module.

dlib runs the network on one core without BLAS (the `dlib-bin` wheel): about 0.15 s a face here. The same
weights in PyTorch embed a batch on every core. The network is dlib's `anet_type`
(tools/python/src/face_recognition.cpp in dlib's source), read layer by layer from the wheel's file in
dlib's own serialization format (dlib/serialize.h, dlib/dnn/layers.h, dlib/cuda/tensor.h):

- integers: a control byte (low nibble: byte count, 0x80: negative), then that many little-endian bytes;
- strings: an integer length, then the bytes; a layer starts with its version string (`con_4`, ...);
- floats (scalars only): an integer mantissa and an integer exponent, mantissa * 2**exponent;
- tensors: version 2, then (num_samples, k, nr, nc), then raw little-endian float32.

What dlib does that PyTorch does not by default, and this module copies: strided convolutions and pools
have no padding; a residual sum of two tensors of different sizes has the larger size, the smaller one
zero-filled past its end (dlib's `tt::add`), which happens at every down-sampling block that widens the
channels, and spatially where such a block meets an even size (8 -> 3 against the pool's 4, 4 -> 1 against 2);
the input is (RGB - per-channel mean) / 256. The file must hold exactly the layers of dlib's network
(LAYERS). tests/test_dlib_resnet.py checks the port against dlib's own network on real LFW chips."""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# every layer of dlib_face_recognition_resnet_model_v1.dat, by version string: its 29 convolutions, each followed
# by an affine layer (batch norm folded), 14 residual blocks, 4 of them down-sampling, the stem's max pool and
# the final global average
LAYERS = {"input_rgb_image_sized": 1, "con_4": 29, "affine_": 29, "relu_": 29, "max_pool_2": 1, "avg_pool_2": 5,
          "add_prev_": 14, "fc_2": 1}


class DlibFormatError(ValueError):
    """The file is not the network this module ports (a different dlib model, or a damaged file)."""


class _Reader:
    """A cursor over dlib's serialization of one network."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def integer(self) -> int:
        if self.at >= len(self.data):
            raise DlibFormatError("truncated: an integer past the end")
        control = self.data[self.at]
        size, negative = control & 0x0F, bool(control & 0x80)
        if not 1 <= size <= 8 or self.at + 1 + size > len(self.data):
            raise DlibFormatError(f"bad integer at byte {self.at}")
        value = int.from_bytes(self.data[self.at + 1:self.at + 1 + size], "little")
        self.at += 1 + size
        return -value if negative else value

    def real(self) -> float:
        mantissa, exponent = self.integer(), self.integer()
        if exponent >= 32000:   # float_details' inf, -inf, nan
            raise DlibFormatError(f"non-finite scalar before byte {self.at}")
        return float(np.ldexp(float(mantissa), exponent))

    def string(self) -> str:
        n = self.integer()
        text = self.data[self.at:self.at + n].decode("ascii")
        self.at += n
        return text

    def shape(self, version: int) -> tuple[int, int, int, int]:
        if self.integer() != version:
            raise DlibFormatError(f"unexpected tensor version before byte {self.at}")
        return tuple(self.integer() for _ in range(4))   # type: ignore[return-value]

    def tensor(self) -> np.ndarray:
        shape = self.shape(2)
        n = math.prod(shape)
        if min(shape) < 0 or self.at + 4 * n > len(self.data):
            raise DlibFormatError(f"truncated: a tensor of {n} floats at byte {self.at} runs past the end")
        values = np.frombuffer(self.data, "<f4", n, self.at).astype(np.float32).reshape(shape)
        self.at += 4 * n
        return values

    def next_layer(self) -> str:
        """Skip the wrappers (dlib's add_layer bookkeeping) up to the next layer's version string."""
        pattern = re.compile(rb"\x01([\x01-\x20])(" + b"|".join(re.escape(n.encode()) for n in LAYERS) + rb")")
        while (m := pattern.search(self.data, self.at)) is not None:
            if m.group(1)[0] == len(m.group(2)):
                self.at = m.start()
                return self.string()
            self.at = m.start() + 1
        return ""


@dataclass
class _Conv:
    weight: np.ndarray      # (out, in, kh, kw)
    bias: np.ndarray
    stride: int
    padding: int


@dataclass
class _Network:
    mean_rgb: tuple[float, float, float]
    size: int
    convs: list[_Conv] = field(default_factory=list)
    affines: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    pools: list[tuple[str, int, int, int]] = field(default_factory=list)   # (kind, window, stride, padding)
    fc: np.ndarray | None = None      # (inputs, outputs): dlib computes x @ W


def read_network(path: Path) -> _Network:
    """Every parameter of the file's network, in the order dlib wrote them (input side first)."""
    try:
        return _read_network(_Reader(Path(path).read_bytes()))
    except (DlibFormatError, UnicodeDecodeError) as exc:
        raise DlibFormatError(f"{path}: not dlib's face-recognition ResNet ({exc})") from exc


def _read_network(r: _Reader) -> _Network:
    net: _Network | None = None
    seen: Counter[str] = Counter()
    while name := r.next_layer():
        seen[name] += 1
        if name == "input_rgb_image_sized":
            mean = (r.real(), r.real(), r.real())
            rows, cols = r.integer(), r.integer()
            if rows != cols:
                raise DlibFormatError(f"non-square input {rows} x {cols}")
            net = _Network(mean, rows)
        elif net is None:
            raise DlibFormatError(f"layer {name} before the input layer")
        elif name == "con_4":
            params = r.tensor().ravel()
            filters, kh, kw, stride_y, stride_x, pad_y, pad_x = (r.integer() for _ in range(7))
            out, cin, fh, fw = r.shape(1)
            if (out, fh, fw, stride_y, pad_y) != (filters, kh, kw, stride_x, pad_x) or kh != kw:
                raise DlibFormatError(f"unexpected convolution {filters} x {kh} x {kw} / {stride_y}, {stride_x}")
            n = out * cin * kh * kw
            if len(params) != n + out:
                raise DlibFormatError(f"a convolution of {len(params)} parameters, not {n + out}")
            net.convs.append(_Conv(params[:n].reshape(out, cin, kh, kw), params[n:n + out], stride_y, pad_y))
        elif name == "affine_":
            params = r.tensor().ravel()
            half = len(params) // 2
            if not net.convs or half != len(net.convs[-1].bias) or len(params) != 2 * half:
                raise DlibFormatError(f"an affine layer of {len(params)} parameters after its convolution")
            net.affines.append((params[:half], params[half:]))
        elif name in ("max_pool_2", "avg_pool_2"):
            window, window_x, stride, stride_x, pad, pad_x = (r.integer() for _ in range(6))
            if (window, stride, pad) != (window_x, stride_x, pad_x):
                raise DlibFormatError(f"non-square pooling in {name}")
            net.pools.append((name[:3], window, stride, pad))
        elif name == "fc_2":
            outputs, inputs = r.integer(), r.integer()
            params = r.tensor().ravel()
            if len(params) != inputs * outputs:   # fc_no_bias: weights only
                raise DlibFormatError(f"a fully connected layer of {len(params)} parameters, not {inputs * outputs}")
            net.fc = params.reshape(inputs, outputs)
    if dict(seen) != LAYERS:
        raise DlibFormatError(f"layers {dict(seen)}, not {LAYERS}")
    return net


def dlib_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dlib's residual sum: the larger of each dimension, each tensor zero-filled past its own end."""
    size = [max(x, y) for x, y in zip(a.shape, b.shape)]

    def grown(t: torch.Tensor) -> torch.Tensor:
        pad = []
        for have, want in zip(reversed(t.shape[1:]), reversed(size[1:])):
            pad += [0, want - have]
        return F.pad(t, pad) if any(pad) else t

    return grown(a) + grown(b)


class _Affine(nn.Module):
    def __init__(self, gamma: np.ndarray, beta: np.ndarray):
        super().__init__()
        self.register_buffer("gamma", torch.from_numpy(gamma.copy()).view(1, -1, 1, 1))
        self.register_buffer("beta", torch.from_numpy(beta.copy()).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma + self.beta


def _conv(c: _Conv) -> nn.Conv2d:
    out, cin, k, _ = c.weight.shape
    conv = nn.Conv2d(cin, out, k, c.stride, c.padding)
    conv.weight.data.copy_(torch.from_numpy(c.weight))
    conv.bias.data.copy_(torch.from_numpy(c.bias))
    return conv.requires_grad_(False)


class _Block(nn.Module):
    """conv, affine, relu, conv, affine; added to the input (average-pooled where the block strides); relu."""

    def __init__(self, convs: list[_Conv], affines: list[tuple[np.ndarray, np.ndarray]], down: tuple | None):
        super().__init__()
        self.conv1, self.conv2 = _conv(convs[0]), _conv(convs[1])
        self.bn1, self.bn2 = _Affine(*affines[0]), _Affine(*affines[1])
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        if self.down is not None:
            _, window, stride, pad = self.down
            x = F.avg_pool2d(x, window, stride, pad)
        return F.relu(dlib_add(y, x))


class DlibFaceNet(nn.Module):
    """(N, 3, 150, 150) RGB in [0, 255] (dlib's aligned chips) -> (N, 128) face descriptors, as dlib's
    `compute_face_descriptor` gives them (not normalised)."""

    def __init__(self, path: Path):
        super().__init__()
        net = read_network(path)
        # the stem (conv, affine, relu, max pool), then blocks of two convolutions each, an average pool for each
        # block that strides, the last pool global
        strided = sum(c.stride != 1 for c in net.convs[1::2])
        if [p[0] for p in net.pools] != ["max"] + ["avg"] * (len(net.pools) - 1) or net.pools[-1][1] != 0 \
                or strided != len(net.pools) - 2:
            raise DlibFormatError(f"{path}: not dlib's face-recognition ResNet (its pools: {net.pools})")
        self.size = net.size
        self.register_buffer("mean", torch.tensor(net.mean_rgb, dtype=torch.float32).view(1, 3, 1, 1))
        self.stem = nn.Sequential(_conv(net.convs[0]), _Affine(*net.affines[0]), nn.ReLU())
        _, window, stride, pad = net.pools[0]
        self.pool = nn.MaxPool2d(window, stride, pad)
        downs = iter(net.pools[1:-1])
        blocks = []
        for i in range(1, len(net.convs), 2):
            down = next(downs) if net.convs[i].stride != 1 else None
            blocks.append(_Block(net.convs[i:i + 2], net.affines[i:i + 2], down))
        self.blocks = nn.Sequential(*blocks)
        self.register_buffer("fc", torch.from_numpy(net.fc.copy()))
        self.eval()

    @torch.no_grad()
    def forward(self, chips: torch.Tensor) -> torch.Tensor:
        if tuple(chips.shape[1:]) != (3, self.size, self.size):
            raise ValueError(f"dlib's network takes (N, 3, {self.size}, {self.size}) chips, not {tuple(chips.shape)}")
        x = (chips.float() - self.mean) / 256.0
        x = self.blocks(self.pool(self.stem(x)))
        return x.mean(dim=(2, 3)) @ self.fc
