"""A run's mechanism rebuilt from its published description (`describe()`), for evaluation and the audit.

Its own module because it needs every mechanism, the discrete one included, which builds on mechanisms.py."""
from __future__ import annotations

from splitface.device.privacy.discrete import DiscreteGaussianMechanism
from splitface.device.privacy.mechanisms import Mechanism, NoNoise, PerActivationGaussian, PerImageGaussian


def from_description(described: dict) -> Mechanism:
    """The mechanism a `describe()` came from: a device's privacy setting is published with the app,
    so an auditor (or the curious server) may rebuild it from a run's results."""
    name = described["name"]
    if name == PerActivationGaussian.name:
        return PerActivationGaussian(described["epsilon_per_activation"], described["delta"], described["sensitivity"])
    if name == PerImageGaussian.name:
        return PerImageGaussian(described["clip_norm"], described["noise_multiplier"],
                                described.get("frequency_gamma", 0.0))
    if name == NoNoise.name:
        return NoNoise()
    if name == DiscreteGaussianMechanism.name:
        return DiscreteGaussianMechanism(described["clip_norm"], described["noise_multiplier"], described["step"])
    raise ValueError(f"unknown mechanism {name!r}")
