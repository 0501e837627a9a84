"""The exact noise option (`--noise discrete`): the discrete Gaussian on the int8-quantised release,
integers end to end.

A floating-point Gaussian sampler's output is not a Gaussian: its low bits depend on the value it
was added to, and an observer can read the noiseless value from them (Mironov 2012). The exact
option avoids floating point after one step:

1. quantise and clip: each image's release becomes integers q = round(x / step) in quantisation steps
   of a public `step` fixed before any data is seen (the protocol's own i8 encoding derives its scale
   from the tensor's peak, which leaks; this release does not use it), scaled down so that its L2
   norm is at most B = floor(C / step) steps, checked exactly in integers. This is the only
   floating-point step and it happens before the noise;
2. add Z ~ N_Z(0, sigma^2) to every integer, sigma = z B steps, sampled exactly by Canonne, Kamath &
   Steinke 2020 (CKS20, "The Discrete Gaussian for Differential Privacy", Algorithms 1-3): rational
   Bernoulli(exp(-gamma)) trials, a discrete Laplace proposal and rejection, all in integer arithmetic
   on exact uniform integers from the ChaCha20 stream (`fastnoise.NoiseStream`, keyed per release from
   the device's secret, which came from the OS CSPRNG), vectorised over the release;
3. clamp q + Z to int8's [-127, 127] (post-processing: the guarantee is unchanged); the value of an
   integer is q * step, decoded as the protocol's `i8` tensor decodes it (splitface/protocol/SPEC.md section 4).

Guarantee (sensitivity in quantised units): replacing one image moves its integer vector by at most
Delta = 2B in L2, and adding independent N_Z(0, sigma^2) to each coordinate is rho-zCDP with
rho = Delta^2 / (2 sigma^2) = 2 / z^2: CKS20 show that the Renyi divergence between two discrete
Gaussians shifted by an integer is at most that of the continuous ones, and Renyi divergence adds over
independent coordinates. The release is recorded as dp_accounting's `ZCDpEvent(rho)`; composition and
the conversion to (epsilon, delta) are dp_accounting's RDP accountant's (`accountant.epsilon_of`).
The continuous Gaussian's exact PLD curve is not proven for the discrete one, so it is never used here.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
from dp_accounting import dp_event as dpe

from splitface.device.privacy.fastnoise import KEY_BYTES, NoiseStream
from splitface.device.privacy.mechanisms import Mechanism

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

def clip_quantise(x: torch.Tensor, step: float, bound: int, max_rounds: int = 64) -> np.ndarray:
    """Each image's values in quantisation steps, as int64 of shape (N, numel), with an L2 norm of at most
    `bound` steps, verified exactly in integers. Rounded after scaling the image down to the bound; where
    rounding pushed the norm past it (it adds about numel / 12 to the squared norm), scaled down again by
    the ratio it overshot and rounded again, until it fits (truncation towards zero if `max_rounds` did not
    suffice). The last floating-point step of the release."""
    if not (step > 0 and math.isfinite(step)) or bound < 1:
        raise ValueError(f"need step > 0 and bound >= 1, got {step=}, {bound=}")
    v = x.detach().to(torch.float64).reshape(len(x), -1) / step
    if not bool(torch.isfinite(v).all()):
        raise ValueError("the release holds non-finite values")
    factor = (bound / v.norm(dim=1).clamp_min(1e-300)).clamp(max=1.0)
    q = torch.round(v * factor[:, None]).to(torch.int64).numpy()
    for _ in range(max_rounds):
        squares = squared_norms(q)
        over = np.flatnonzero(squares > bound * bound)
        if not over.size:
            break
        rows = torch.from_numpy(over)
        factor[rows] *= bound / torch.from_numpy(squares[over]).double().sqrt() * (1 - 1e-6)
        q[over] = torch.round(v[rows] * factor[rows, None]).to(torch.int64).numpy()
    over = np.flatnonzero(squared_norms(q) > bound * bound)
    if over.size:  # |trunc(a)| <= |a| in every coordinate, and the scaled rows have a norm below the bound
        rows = torch.from_numpy(over)
        q[over] = torch.trunc(v[rows] * factor[rows, None]).to(torch.int64).numpy()
    if bool((squared_norms(q) > bound * bound).any()):
        raise RuntimeError("an image's quantised norm exceeds its bound")  # unreachable: the guarantee rests on it
    return q


def squared_norms(q: np.ndarray) -> np.ndarray:
    """Exact squared L2 norm of each row of an integer array (int64: exact while each row's square sum < 2^63)."""
    return np.einsum("ij,ij->i", q, q)


def zcdp_rho(sensitivity_sq: int, sigma2: Fraction) -> Fraction:
    """rho = Delta^2 / (2 sigma^2) of adding N_Z(0, sigma2) to each integer coordinate (exact rational)."""
    return Fraction(sensitivity_sq) / (2 * Fraction(sigma2))


class DiscreteGaussianMechanism(Mechanism):
    """Per-image clip to C, quantise to a public step, add exact discrete Gaussian noise (sigma = z C in value
    units, z B in steps), clamp to int8: the exact counterpart of `PerImageGaussian(C, z)`, rho = 2 / z^2.

    step: the public quantisation step (default C / 127: an image whose whole norm sits in one value fills
    int8's range). It must leave B = floor(C / step) >= 1 steps. `release` is the device's path (a key per
    release); `privatize` is for whoever simulates the device with a generator (an auditor)."""

    name = "discrete_gaussian"

    def __init__(self, clip_norm: float, noise_multiplier: float, step: float | None = None) -> None:
        if not clip_norm > 0 or not noise_multiplier > 0:
            raise ValueError(f"the discrete Gaussian needs clip_norm > 0 and noise_multiplier > 0, got "
                             f"{clip_norm=}, {noise_multiplier=}")
        self.clip_norm, self.noise_multiplier = float(clip_norm), float(noise_multiplier)
        self.step = float(step) if step is not None else self.clip_norm / INT8_MAX
        if not (self.step > 0 and math.isfinite(self.step)):
            raise ValueError(f"the quantisation step must be > 0, got {step}")
        self.bound = math.floor(self.clip_norm / self.step)
        if self.bound < 1:
            raise ValueError(f"step {self.step:g} is coarser than the clip norm {self.clip_norm:g}: no integer fits")
        # sigma^2 in steps^2 as an exact rational: z as written in decimal, times B
        self.noise = DiscreteGaussian((Fraction(repr(self.noise_multiplier)) * self.bound) ** 2)
        self.sensitivity_sq = (2 * self.bound) ** 2  # replace one image: two vectors of norm <= B

    def release(self, activations: torch.Tensor, key: bytes) -> np.ndarray:
        """The int8 integers to send (their value is q * step). No float after `clip_quantise`."""
        q = clip_quantise(activations, self.step, self.bound)
        noisy = q.reshape(-1) + self.noise.sample(q.size, NoiseStream(key))
        return np.clip(noisy, -INT8_MAX, INT8_MAX).astype(np.int8).reshape(activations.shape)

    def values(self, released: np.ndarray) -> torch.Tensor:
        """The float32 values of released integers, as an `i8` tensor with scale `step` decodes: float32(q) *
        float32(step), in float32."""
        if released.dtype != np.int8:
            raise ValueError(f"expected int8 values, got {released.dtype}")
        return torch.from_numpy(released.astype(np.float32) * np.float32(self.step))

    def privatize(self, activations: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The released values, with a gradient that passes straight through the clip and the rounding (the
        layer learns as if the release were its output); the key is drawn from `generator`."""
        key = torch.randint(0, 256, (KEY_BYTES,), generator=generator, dtype=torch.uint8).numpy().tobytes()
        return self.straight_through(activations, self.release(activations, key))

    def straight_through(self, activations: torch.Tensor, released: np.ndarray) -> torch.Tensor:
        """`values(released)` in the forward pass, the identity for the gradient (adds exactly 0.0)."""
        return self.values(released) + (activations - activations.detach())

    def rho(self) -> Fraction:
        return zcdp_rho(self.sensitivity_sq, self.noise.sigma2)

    def image_event(self, numel: int) -> dpe.ZCDpEvent:
        """One image's release: rho-zCDP, composed by dp_accounting's RDP accountant."""
        return dpe.ZCDpEvent(float(self.rho()))

    def value_noise_std(self) -> float:
        """The noise std plus one public step: rounding to the step moves a value by up to half of one (and the
        server's bound is many of these, so an honest release never reaches it)."""
        return float(self.describe()["noise_std"]) + self.step

    def describe(self) -> dict:
        return {"name": self.name, "clip_norm": self.clip_norm, "noise_multiplier": self.noise_multiplier,
                "step": self.step, "bound_steps": self.bound, "sigma2_steps": str(self.noise.sigma2),
                "rho": float(self.rho()), "noise_std": math.sqrt(float(self.noise.sigma2)) * self.step}
