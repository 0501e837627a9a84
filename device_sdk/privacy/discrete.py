"""The exact noise option: the discrete Gaussian on the int8-quantised release, integers end to end.

A floating-point Gaussian sampler's output is not a Gaussian: its low bits depend on the value it
was added to, and an observer can read the noiseless value from them (Mironov 2012). The exact
option avoids floating point after one step:

1. quantise: q = clamp(round(x / scale), q_min, q_max), with a public scale fixed before any data is
   seen (the protocol's own i8 encoding derives its scale from the tensor's peak, which leaks; this
   release does not use it). This is the only floating-point step and it happens before the noise;
2. add Z ~ N_Z(0, sigma^2) to every integer, sampled exactly by Canonne, Kamath & Steinke 2020 (CKS20,
   "The Discrete Gaussian for Differential Privacy", Algorithms 1-3): rational Bernoulli(exp(-gamma))
   trials, a discrete Laplace proposal and rejection, all in integer arithmetic on exact uniform
   integers from the ChaCha20 stream (`fastnoise.NoiseStream`), vectorised over the release;
3. clamp q + Z to int8's [-127, 127] (post-processing: the guarantee is unchanged) and send the bytes
   with the public scale as an `i8` tensor (protocol/SPEC.md section 4: value = q * scale).

Guarantee (sensitivity in quantised units): if replacing one image moves the integer vector q by at
most Delta in L2, adding independent N_Z(0, sigma^2) to each coordinate is rho-zCDP with
rho = Delta^2 / (2 sigma^2): CKS20 show that the Renyi divergence between two discrete Gaussians
shifted by an integer is at most that of the continuous ones, and Renyi divergence adds over
independent coordinates. (epsilon, delta) follows from CKS20's conversion from concentrated DP
(their Proposition 12 / Corollary 13), implemented in `epsilon_from_zcdp`. dp_accounting has no
discrete Gaussian: `dp_event` states the release as the continuous Gaussian with the same ratio,
which is valid for Renyi (RDP) accounting only, not for the PLD accountant's exact continuous curve.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
from dp_accounting import dp_event as dpe

from .fastnoise import NoiseStream

INT8_MAX = 127  # the protocol's i8 range is [-127, 127]
MAX_DENOMINATOR = 2**56  # keeps every Bernoulli bound (denominator x its loop index) below 2^62
MAX_LOOP = 64  # the K of Algorithm 1 reaches k with probability <= 1/(k-1)!: 64 is never reached


# ---- exact samplers (CKS20), vectorised over lanes --------------------------------------------

def bernoulli_exp_at_most_one(num: np.ndarray, den: int, stream: NoiseStream) -> np.ndarray:
    """Per lane, a Bernoulli(exp(-num/den)) with 0 <= num <= den (CKS20 Algorithm 1, gamma <= 1): K counts
    up while Bernoulli(gamma / K) succeeds; the result is whether the first failure came at an odd K."""
    if den == 1 and bool((num == 1).all()):  # exp(-1): Bernoulli(1/1) always succeeds, so start at K = 2
        out = np.empty(len(num), dtype=bool)
        lanes, k = np.arange(len(num)), 2
    else:  # K = 1 over every lane without index arrays (most lanes stop here)
        out = stream.uniform_below(den, len(num)) >= num  # failed at K = 1 (odd): True
        lanes, k = np.flatnonzero(~out), 2
    while lanes.size:
        if k > MAX_LOOP:
            raise RuntimeError("Bernoulli(exp(-gamma)) ran past its loop bound (probability < 1e-80)")
        success = stream.uniform_below(den * k, lanes.size) < num[lanes]  # Bernoulli(num / (den k))
        out[lanes[~success]] = k % 2 == 1
        lanes = lanes[success]
        k += 1
    return out


def bernoulli_exp(whole: np.ndarray, rem: np.ndarray, den: int, stream: NoiseStream) -> np.ndarray:
    """Per lane, a Bernoulli(exp(-(whole + rem/den))): `whole` Bernoulli(exp(-1)) trials, then one of
    exp(-rem/den), all needing to succeed (CKS20 Algorithm 1, gamma > 1)."""
    ok = np.ones(len(whole), dtype=bool)
    lanes = np.flatnonzero(whole > 0)
    done = 0
    while lanes.size:
        trial = bernoulli_exp_at_most_one(np.ones(lanes.size, dtype=np.int64), 1, stream)
        ok[lanes[~trial]] = False
        done += 1
        lanes = lanes[trial & (whole[lanes] > done)]
    lanes = np.flatnonzero(ok)
    ok[lanes] = bernoulli_exp_at_most_one(rem[lanes], den, stream)
    return ok


def discrete_laplace(n: int, t: int, stream: NoiseStream) -> np.ndarray:
    """n samples of the discrete Laplace with P(y) proportional to exp(-|y| / t) (CKS20 Algorithm 2, s = 1)."""
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        u = stream.uniform_below(t, todo.size)
        keep = np.flatnonzero(bernoulli_exp_at_most_one(u, t, stream))  # accept U with probability exp(-U/t)
        v = np.zeros(keep.size, dtype=np.int64)  # geometric: Bernoulli(exp(-1)) successes before a failure
        alive = np.arange(keep.size)
        while alive.size:
            more = bernoulli_exp_at_most_one(np.ones(alive.size, dtype=np.int64), 1, stream)
            alive = alive[more]
            v[alive] += 1
        x = u[keep] + t * v
        negative = stream.bits(keep.size)
        good = ~(negative & (x == 0))  # -0 is rejected, or 0 would be drawn twice as often
        out[todo[keep[good]]] = np.where(negative[good], -x[good], x[good])
        done = np.zeros(todo.size, dtype=bool)
        done[keep[good]] = True
        todo = todo[~done]
    return out


class DiscreteGaussian:
    """N_Z(0, sigma2): P(z) proportional to exp(-z^2 / (2 sigma2)) on the integers; sigma2 a positive rational."""

    def __init__(self, sigma2: Fraction | int | str) -> None:
        self.sigma2 = Fraction(sigma2)
        if self.sigma2 <= 0:
            raise ValueError(f"sigma2 must be > 0, got {self.sigma2}")
        p, q = self.sigma2.numerator, self.sigma2.denominator
        self.t = math.isqrt(p // q) + 1  # floor(sigma) + 1, the proposal's scale (CKS20 Algorithm 3)
        self.den = 2 * p * q * self.t**2  # gamma = (|y| t q - p)^2 / den
        if self.den > MAX_DENOMINATOR:
            raise ValueError(f"sigma2 = {self.sigma2} needs {self.den.bit_length()}-bit integers; use a sigma2 with "
                             "a smaller denominator or below about 2^26 (sigma ~ 8000 quantisation steps)")

    def sample(self, n: int, stream: NoiseStream) -> np.ndarray:
        """n independent exact samples (int64). Integer arithmetic only."""
        p, q, t = self.sigma2.numerator, self.sigma2.denominator, self.t
        out = np.empty(n, dtype=np.int64)
        todo = np.arange(n)
        safe = (math.isqrt(2**62) - p) // (t * q)  # |y| up to this keeps (|y| t q - p)^2 inside int64
        while todo.size:
            y = discrete_laplace(todo.size, t, stream)
            a = np.abs(y)
            whole = np.empty(a.size, dtype=np.int64)
            rem = np.empty(a.size, dtype=np.int64)
            small = a <= safe
            num = (a[small] * (t * q) - p) ** 2
            whole[small], rem[small] = np.divmod(num, self.den)
            for i in np.flatnonzero(~small):  # a proposal far in the tail (rare): the same quotient in Python ints
                whole[i], rem[i] = divmod((int(a[i]) * t * q - p) ** 2, self.den)
            accept = bernoulli_exp(whole, rem, self.den, stream)  # exp(-(|y| - sigma2/t)^2 / (2 sigma2))
            out[todo[accept]] = y[accept]
            todo = todo[~accept]
        return out

    def pmf(self, support: np.ndarray) -> np.ndarray:
        """The exact law on `support` (float64), normalised over |z| <= 60 sigma (the rest is < 1e-700)."""
        sigma2 = float(self.sigma2)
        z = np.arange(-math.ceil(60 * math.sqrt(sigma2)), math.ceil(60 * math.sqrt(sigma2)) + 1)
        norm = np.exp(-z.astype(np.float64) ** 2 / (2 * sigma2)).sum()
        return np.exp(-np.asarray(support, dtype=np.float64) ** 2 / (2 * sigma2)) / norm

    def variance(self) -> float:
        """Exact variance (below sigma2, by a margin that vanishes as sigma grows)."""
        sigma2 = float(self.sigma2)
        z = np.arange(-math.ceil(60 * math.sqrt(sigma2)), math.ceil(60 * math.sqrt(sigma2)) + 1)
        return float((z.astype(np.float64) ** 2 * self.pmf(z)).sum())


# ---- the release and its guarantee --------------------------------------------------------------

def quantise(x: torch.Tensor, scale: float, q_min: int, q_max: int) -> np.ndarray:
    """clamp(round(x / scale), q_min, q_max) as int64: the last floating-point step of the release."""
    if not (scale > 0 and math.isfinite(scale)) or not -INT8_MAX <= q_min <= q_max <= INT8_MAX:
        raise ValueError(f"need scale > 0 and -127 <= q_min <= q_max <= 127, got {scale=}, {q_min=}, {q_max=}")
    q = torch.round(x.detach().to(torch.float64) / scale).clamp_(q_min, q_max)
    return q.to(torch.int64).numpy()


def box_sensitivity_sq(numel: int, q_min: int, q_max: int) -> int:
    """Delta^2 in quantised units when every coordinate lies in [q_min, q_max]: replacing the image may move
    each of the `numel` integers by up to q_max - q_min."""
    return numel * (q_max - q_min) ** 2


def zcdp_rho(sensitivity_sq: int, sigma2: Fraction) -> Fraction:
    """rho = Delta^2 / (2 sigma^2) of adding N_Z(0, sigma2) to each integer coordinate (exact rational)."""
    return Fraction(sensitivity_sq) / (2 * Fraction(sigma2))


def epsilon_from_zcdp(rho: float, delta: float) -> float:
    """The smallest epsilon with delta >= min over alpha > 1 of exp((alpha - 1)(alpha rho - epsilon)) / (alpha - 1)
    * (1 - 1/alpha)^alpha (CKS20 Proposition 12 / Corollary 13), found by bisection; never above Bun & Steinke's
    rho + 2 sqrt(rho log(1/delta))."""
    if not rho > 0 or not 0 < delta < 1:
        raise ValueError(f"need rho > 0 and 0 < delta < 1, got {rho=}, {delta=}")
    alphas = 1 + np.logspace(-6, 7, 4000)

    def log_delta(eps: float) -> float:
        a = alphas
        return float(np.min((a - 1) * (a * rho - eps) - np.log(a - 1) + a * np.log1p(-1 / a)))

    lo, hi = 0.0, rho + 2 * math.sqrt(rho * math.log(1 / delta))
    if log_delta(lo) <= math.log(delta):
        return 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if log_delta(mid) <= math.log(delta) else (mid, hi)
    return hi


class DiscreteGaussianRelease:
    """Quantise with a public scale, add exact discrete Gaussian noise, clamp to int8: the exact mechanism.

    `sigma` and the sensitivity are in quantisation steps. `sensitivity_sq` is Delta^2 for one image's
    whole release (`box_sensitivity_sq` when only the range is known; a smaller integer bound where clipping
    gives one)."""

    name = "discrete_gaussian"

    def __init__(self, scale: float, q_min: int, q_max: int, sigma2: Fraction | int | str, sensitivity_sq: int) -> None:
        if sensitivity_sq < 1:
            raise ValueError(f"sensitivity_sq must be a positive integer, got {sensitivity_sq}")
        self.scale, self.q_min, self.q_max = float(scale), int(q_min), int(q_max)
        quantise(torch.zeros(1), self.scale, self.q_min, self.q_max)  # validates the range
        self.noise = DiscreteGaussian(sigma2)
        self.sensitivity_sq = int(sensitivity_sq)

    def release(self, x: torch.Tensor, stream: NoiseStream) -> np.ndarray:
        """The int8 values to send (their value is q * scale). No float after `quantise`."""
        q = quantise(x, self.scale, self.q_min, self.q_max)
        noisy = q.reshape(-1) + self.noise.sample(q.size, stream)
        return np.clip(noisy, -INT8_MAX, INT8_MAX).astype(np.int8).reshape(q.shape)

    def wire(self, released: np.ndarray) -> dict:
        """The release as the protocol's i8 tensor (SPEC.md section 4) with the public scale."""
        if released.dtype != np.int8:
            raise ValueError(f"expected int8 values, got {released.dtype}")
        return {"dtype": "i8", "shape": list(released.shape), "data": released.tobytes(), "scale": self.scale}

    def rho(self) -> Fraction:
        return zcdp_rho(self.sensitivity_sq, self.noise.sigma2)

    def epsilon(self, delta: float) -> float:
        return epsilon_from_zcdp(float(self.rho()), delta)

    def dp_event(self) -> dpe.GaussianDpEvent:
        """One image's release in the accountant's convention (REPLACE_ONE, a shift of 2r against noise z r):
        z = 2 sigma / Delta. The same Renyi curve as the discrete Gaussian's bound: use with RDP accounting."""
        return dpe.GaussianDpEvent(2 * math.sqrt(float(self.noise.sigma2) / self.sensitivity_sq))

    def describe(self) -> dict:
        return {"name": self.name, "scale": self.scale, "q_min": self.q_min, "q_max": self.q_max,
                "sigma2_steps": str(self.noise.sigma2), "sensitivity_sq_steps": self.sensitivity_sq}
