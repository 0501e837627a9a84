"""What the device does to an activation tensor before it leaves the phone, and the DpEvent
that describes one such release to the accountant.

Convention (dp_accounting, NeighboringRelation.REPLACE_ONE): ``GaussianDpEvent(z)`` is the
Gaussian mechanism on a function whose outputs lie in an L2 ball of radius r, with noise std
z * r; replacing one record moves the output by up to 2r. Every release is expressed as
``GaussianDpEvent(std / r)``.
"""
from __future__ import annotations

import hashlib
import math

import torch
from dp_accounting import dp_event

# The source paper's per-activation bound. It is valid only when the LRN inputs lie in [0, 1]
# (PaperLRN(input_max=1)): then b <= a / sqrt(2 + a^2) <= 1/sqrt(3) < 1/sqrt(2).
PAPER_LRN_SENSITIVITY = 1 / math.sqrt(2)


def classic_gaussian_sigma(epsilon: float, delta: float) -> float:
    """sqrt(2 ln(1.25/delta)) / epsilon: the classic Gaussian mechanism's noise per unit of sensitivity.

    Dwork & Roth, Thm A.1; the proof needs epsilon < 1. It is kept because the source paper uses
    it; the accountant reports the true epsilon of the noise actually added, whatever epsilon was
    asked for here.
    """
    if not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon=}, {delta=}")
    return math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def noise_generator(secret: int, *key: int | str) -> torch.Generator:
    """A CPU generator seeded by blake2b(secret, release key) to 64 bits.

    Deriving the noise from the release key means a re-sent or replayed batch carries the SAME
    noise, so it is the same release rather than a fresh sample the server could average. The
    secret never leaves the device; without it the server cannot predict the noise.
    """
    material = ":".join([repr(int(secret)), *(repr(k) for k in key)]).encode()
    seed = int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little")
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _noise_like(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # Drawn on the generator's (CPU) device, so the same key gives the same noise everywhere.
    return torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)


class Mechanism:
    """A per-release privatizer: (N, ...) activations -> (N, ...) released values."""

    name: str = "mechanism"

    def privatize(self, activations: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Differentiable w.r.t. ``activations`` (noise is additive, clipping a rescale)."""
        raise NotImplementedError

    def image_event(self, numel: int) -> dp_event.DpEvent:
        """ONE release of ONE image's whole tensor of ``numel`` values (REPLACE_ONE)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """JSON-able parameters, including the noise std actually added."""
        raise NotImplementedError

    def iid_gaussian_std(self) -> float | None:
        """The std of the i.i.d. N(0, std^2) noise this mechanism adds to every value, with nothing else done to
        them (no clip, no scaling): what a runtime may draw itself under the release's key. None otherwise."""
        return None

    def value_noise_std(self) -> float:
        """The largest noise std on any one released value: what a server's release-aware bound must leave room
        for (`splitface-server serve --release-noise-std`). Every noise here is i.i.d. per value at this std or,
        with frequency_gamma, at z C / w_f <= z C (the weights w_f are >= 1)."""
        return float(self.describe()["noise_std"])

    @property
    def adds_noise(self) -> bool:
        """Whether a release draws noise (a release made again on other values must then draw afresh)."""
        return self.describe()["noise_std"] > 0


class PerActivationGaussian(Mechanism):
    """The source paper's mechanism: classic Gaussian noise calibrated to ONE activation value.

    Every value lies in [0, sensitivity) (with LRN inputs clamped to [0, 1]), so one value is a
    ball of radius sensitivity/2 and the noise std = sensitivity * sigma gives z = 2 sigma. But an
    image releases all its values at once, and replacing the image may move every one of them by
    up to ``sensitivity``: the tensor moves by up to sensitivity * sqrt(numel) in L2, which is the
    honest per-image event, z = 2 sigma / sqrt(numel).
    """

    name = "per_activation"

    def __init__(self, epsilon: float, delta: float, sensitivity: float = PAPER_LRN_SENSITIVITY) -> None:
        if not sensitivity > 0:
            raise ValueError(f"sensitivity must be > 0, got {sensitivity}")
        self.epsilon, self.delta, self.sensitivity = float(epsilon), float(delta), float(sensitivity)
        self.sigma = classic_gaussian_sigma(epsilon, delta)
        self.std = self.sensitivity * self.sigma

    def privatize(self, activations: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return activations + self.additive_noise(activations.shape, generator)

    def additive_noise(self, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The noise `privatize` adds; exported device programs take it as an input."""
        return self.std * torch.randn(shape, generator=generator)

    def iid_gaussian_std(self) -> float:
        return self.std

    def activation_event(self) -> dp_event.DpEvent:
        """One value on its own (what the paper's epsilon describes)."""
        return dp_event.GaussianDpEvent(2 * self.sigma)

    def image_event(self, numel: int) -> dp_event.DpEvent:
        if numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        return dp_event.GaussianDpEvent(2 * self.sigma / math.sqrt(numel))

    def describe(self) -> dict:
        return {"name": self.name, "epsilon_per_activation": self.epsilon, "delta": self.delta,
                "sensitivity": self.sensitivity, "sigma": self.sigma, "noise_std": self.std}


class PerImageGaussian(Mechanism):
    """Clip each image's whole tensor to L2 norm C, add N(0, (z C)^2) per value: GaussianDpEvent(z).

    frequency_gamma > 0 (a `dct` release only; DCTDP-style noise per frequency): the release is first scaled per
    frequency channel by w_f (transforms/dct.py `frequency_weights`), clipped and noised there, and scaled back, so
    frequency f gets noise z C / w_f. The guarantee is the same GaussianDpEvent(z): the weighted release is what is
    clipped and noised, and un-weighting it is post-processing. The device calls `privatize` through
    `splitface.device.trainer.privatize`, which supplies the weights.
    """

    name = "per_image"

    def __init__(self, clip_norm: float, noise_multiplier: float, frequency_gamma: float = 0.0) -> None:
        if not clip_norm > 0 or noise_multiplier < 0:
            raise ValueError(f"need clip_norm > 0 and noise_multiplier >= 0, got {clip_norm=}, {noise_multiplier=}")
        if not (frequency_gamma >= 0 and math.isfinite(frequency_gamma)):
            raise ValueError(f"frequency_gamma must be finite and >= 0, got {frequency_gamma}")
        self.clip_norm, self.noise_multiplier = float(clip_norm), float(noise_multiplier)
        self.frequency_gamma = float(frequency_gamma)
        self.std = self.noise_multiplier * self.clip_norm

    def clip(self, activations: torch.Tensor) -> torch.Tensor:
        """Scale image i by min(1, C / ||a_i||); a zero tensor stays zero (no 0/0)."""
        norms = activations.flatten(1).norm(dim=1)
        scale = (self.clip_norm / norms.clamp_min(1e-12)).clamp(max=1.0)
        return activations * scale.reshape(-1, *([1] * (activations.dim() - 1)))

    def privatize(self, activations: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.clip(activations) + self.std * _noise_like(activations, generator)

    def image_event(self, numel: int) -> dp_event.DpEvent:
        return dp_event.GaussianDpEvent(self.noise_multiplier)

    def describe(self) -> dict:
        described = {"name": self.name, "clip_norm": self.clip_norm, "noise_multiplier": self.noise_multiplier,
                     "noise_std": self.std}
        if self.frequency_gamma:
            described["frequency_gamma"] = self.frequency_gamma
        return described


class NoNoise(Mechanism):
    """Sends activations as they are; the accountant records epsilon = inf for every release."""

    name = "none"

    def privatize(self, activations: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return activations

    def additive_noise(self, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        return torch.zeros(shape)

    def iid_gaussian_std(self) -> float:
        return 0.0

    def image_event(self, numel: int) -> dp_event.DpEvent:
        return dp_event.GaussianDpEvent(0.0)

    def describe(self) -> dict:
        return {"name": self.name, "noise_std": 0.0}


MECHANISMS = ("none", "per-activation", "per-image")  # the names a device's options choose from


def build_mechanism(name: str, *, epsilon: float | None = None, delta: float = 1e-5, clip_norm: float = 1.0,
                    noise_multiplier: float | None = None, frequency_gamma: float = 0.0) -> Mechanism:
    """The mechanism called `name` (one of MECHANISMS) from explicit parameters; a missing one is an error."""
    if frequency_gamma and name != "per-image":
        raise ValueError("--frequency-gamma shapes the per-image mechanism's noise: give --mechanism per-image")
    if name == "per-activation":
        if epsilon is None:
            raise ValueError("--mechanism per-activation needs --epsilon")
        return PerActivationGaussian(epsilon, delta)
    if name == "per-image":
        if noise_multiplier is None:
            raise ValueError("--mechanism per-image needs --noise-multiplier or --target-epsilon")
        return PerImageGaussian(clip_norm, noise_multiplier, frequency_gamma)
    if name == "none":
        return NoNoise()
    raise ValueError(f"unknown mechanism {name!r} (one of {', '.join(MECHANISMS)})")
