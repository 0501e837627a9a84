"""Local response normalization exactly as the source paper defines it.

    b_i = a_i / (gamma + alpha * sum_{j=i-u//2}^{i+u//2} a_j^2) ** beta

with the channel window clamped at the edges. ``nn.LocalResponseNorm`` is not
used because it divides ``alpha`` by the window size (and calls gamma ``k``),
so the paper's alpha=1 would silently become 1/5.
"""

from __future__ import annotations

import math

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

    ``input_max`` (off by default) clamps the inputs to [0, input_max] first. The source paper's
    per-activation sensitivity 1/sqrt(2) assumes inputs in [0, 1]; without a clamp nothing makes
    that true (conv1 + ReLU outputs are unbounded), so the DP mode sets ``input_max=1``.
    """

    band: torch.Tensor

    def __init__(
        self,
        channels: int,
        size: int = 5,
        alpha: float = 1.0,
        beta: float = 0.5,
        gamma: float = 2.0,
        input_max: float | None = None,
    ) -> None:
        super().__init__()
        if channels < 1 or size < 1:
            raise ValueError(f"channels and size must be >= 1, got {channels=}, {size=}")
        self.channels = channels
        self.size = size
        self.alpha = alpha
        self.beta = beta
        self.gamma = gamma
        if input_max is not None and not input_max > 0:
            raise ValueError(f"input_max must be > 0 or None, got {input_max}")
        self.input_max = input_max
        idx = torch.arange(channels)
        band = ((idx[:, None] - idx[None, :]).abs() <= size // 2).float()
        # A buffer, not a parameter: it is part of the definition, never trained,
        # but must follow .to(device) / .double() / export. No per-call dtype cast,
        # so the exported graph stays conv/mul/add/pow/div.
        self.register_buffer("band", band.reshape(channels, channels, 1, 1))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.input_max is not None:
            # Also clamp below at 0 so the bound holds whatever precedes the LRN (a no-op after ReLU).
            a = torch.clamp(a, min=0.0, max=float(self.input_max))
        window_sum = F.conv2d(a * a, self.band)
        return a / torch.pow(self.gamma + self.alpha * window_sum, self.beta)

    def output_bound(self) -> float:
        """Supremum of any output value for inputs >= 0 (math.inf if unbounded).

        The window always contains the value itself and the other terms only grow the
        denominator, so b <= f(a) = a / (gamma + alpha a^2)^beta; the bound is sup f over
        [0, input_max] (or [0, inf)). f'(a) has the sign of gamma + alpha (1 - 2 beta) a^2, so f
        increases for beta <= 1/2 and peaks at a* = sqrt(gamma / (alpha (2 beta - 1))) otherwise.
        "Sup" because it may be attained only in the limit (beta = 1/2, no clamp: 1/sqrt(alpha)).
        """
        g, al, be, amax = float(self.gamma), float(self.alpha), float(self.beta), self.input_max

        def f(a: float) -> float:
            return a / (g + al * a * a) ** be

        if al < 0 or g < 0 or (g == 0 and al == 0):
            return math.inf  # outside the LRN's meaningful range: no finite guarantee
        if be > 0.5 and al > 0:
            if g == 0:
                return math.inf  # a^(1 - 2 beta) blows up as a -> 0
            a_star = math.sqrt(g / (al * (2 * be - 1)))
            return f(a_star if amax is None else min(a_star, float(amax)))
        # beta <= 1/2 (or alpha == 0): f is non-decreasing.
        if amax is not None:
            return f(float(amax))
        if be == 0.5 and al > 0:
            return 1.0 / math.sqrt(al)
        return math.inf

    def extra_repr(self) -> str:
        return (
            f"{self.channels}, size={self.size}, alpha={self.alpha}, "
            f"beta={self.beta}, gamma={self.gamma}"
            + (f", input_max={self.input_max}" if self.input_max is not None else "")
        )
