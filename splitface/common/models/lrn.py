"""Local response normalization exactly as the source paper defines it.

    b_i = a_i / (gamma + alpha * sum_{j=i-u//2}^{i+u//2} a_j^2) ** beta

with the channel window clamped at the edges. ``nn.LocalResponseNorm`` is not
used because it divides ``alpha`` by the window size (and calls gamma ``k``),
so the paper's alpha=1 would silently become 1/5.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class PaperLRN(nn.Module):
    """Cross-channel LRN with the paper's constants (u=5, alpha=1, beta=.5, gamma=2).

    The windowed sum of squares is computed at its real cost, u taps per value
    (`window_sum`): the squares with u//2 zero channels concatenated at each end,
    summed over u shifted channel slices. Every runtime executes that form, since
    cat, slice and add export to ExecuTorch's portable kernels, XNNPACK and ONNX,
    and their backward passes too. Not ``avg_pool3d`` (no ExecuTorch portable
    kernel), not ``F.pad`` (its backward becomes a negative pad that ExecuTorch
    1.5.1 rejects), not a banded C x C 1x1 convolution (C/u times the work: 2.3x
    the MACs of VGG-Face's conv1 itself). With ReLU inputs and these defaults the
    output is in [0, 1) (a / sqrt(2 + a^2 + ...) < 1), which bounds what the
    device sends.

    ``input_max`` (off by default) clamps the inputs to [0, input_max] first. The source paper's
    per-activation sensitivity 1/sqrt(2) assumes inputs in [0, 1]; without a clamp nothing makes
    that true (conv1 + ReLU outputs are unbounded), so the DP mode sets ``input_max=1``.
    """

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

    def window_sum(self, t: torch.Tensor) -> torch.Tensor:
        """sum_{j=i-u//2}^{i+u//2} t_j over the channels (dim 1) of NCHW `t`, the window clamped at the edges.

        The window is symmetric, so this is also its own transpose (the LRN's backward uses it as such).
        """
        r = self.size // 2
        if r == 0:
            return t
        zeros = t.new_zeros((t.shape[0], r, *t.shape[2:]))
        padded = torch.cat([zeros, t, zeros], dim=1)
        c = t.shape[1]
        total = padded[:, 0:c]
        for k in range(1, 2 * r + 1):
            total = total + padded[:, k:k + c]
        return total

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.input_max is not None:
            # Also clamp below at 0 so the bound holds whatever precedes the LRN (a no-op after ReLU).
            a = torch.clamp(a, min=0.0, max=float(self.input_max))
        return a / torch.pow(self.gamma + self.alpha * self.window_sum(a * a), self.beta)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Files saved before the 5-tap form carry the banded 1x1 kernel as a buffer "band": a constant of the
        # definition, not state, so it is dropped rather than refused.
        state_dict.pop(prefix + "band", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
