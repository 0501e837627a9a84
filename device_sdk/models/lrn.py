"""Local response normalization exactly as the source paper defines it.

    b_i = a_i / (gamma + alpha * sum_{j=i-u//2}^{i+u//2} a_j^2) ** beta

with the channel window clamped at the edges. ``nn.LocalResponseNorm`` is not
used because it divides ``alpha`` by the window size (and calls gamma ``k``),
so the paper's alpha=1 would silently become 1/5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PaperLRN(nn.Module):
    """Cross-channel LRN with the paper's constants (u=5, alpha=1, beta=.5, gamma=2).

    The windowed sum of squares is a fixed banded 1x1 convolution rather than
    padding + pooling, because ExecuTorch/ONNX export of the device layer lacks
    ``F.pad``/``avg_pool3d``; a plain conv exports everywhere. With ReLU inputs
    and these defaults the output is in [0, 1) (a / sqrt(2 + a^2 + ...) < 1),
    which bounds what the device sends.
    """

    band: torch.Tensor

    def __init__(
        self,
        channels: int,
        size: int = 5,
        alpha: float = 1.0,
        beta: float = 0.5,
        gamma: float = 2.0,
    ) -> None:
        super().__init__()
        if channels < 1 or size < 1:
            raise ValueError(f"channels and size must be >= 1, got {channels=}, {size=}")
        self.channels = channels
        self.size = size
        self.alpha = alpha
        self.beta = beta
        self.gamma = gamma
        idx = torch.arange(channels)
        band = ((idx[:, None] - idx[None, :]).abs() <= size // 2).float()
        # A buffer, not a parameter: it is part of the definition, never trained,
        # but must follow .to(device) / .double() / export. No per-call dtype cast,
        # so the exported graph stays conv/mul/add/pow/div.
        self.register_buffer("band", band.reshape(channels, channels, 1, 1))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        window_sum = F.conv2d(a * a, self.band)
        return a / torch.pow(self.gamma + self.alpha * window_sum, self.beta)

    def extra_repr(self) -> str:
        return (
            f"{self.channels}, size={self.size}, alpha={self.alpha}, "
            f"beta={self.beta}, gamma={self.gamma}"
        )
