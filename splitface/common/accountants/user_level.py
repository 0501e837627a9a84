"""User-level privacy accounting for Poisson-sampled rounds (dp_accounting: PLD, with RDP as a cross-check).

Each round is one Poisson-sampled Gaussian mechanism on the sum of the sampled virtual clients'
clipped updates; a user is in exactly one virtual client, so adding or removing a user changes at most
one clipped contribution: the guarantee is user-level (add/remove neighbours).

Adaptive clipping (Andrew et al. 2021) also releases a noised count of clients whose update was within
the clip norm. The bits have sensitivity 1/2 once centred, so a count noise of std sigma_b is a Gaussian
mechanism of multiplier 2*sigma_b, released on the same sample: the two together are exactly one
Gaussian mechanism of multiplier (z_delta^-2 + (2 sigma_b)^-2)^-1/2. The DP strategies pick z_delta so that
this total equals the requested z, so the accountant's z already includes the clipping's cost.
"""
from __future__ import annotations

import logging
import math
from itertools import groupby

import dp_accounting
from dp_accounting import pld

from splitface.common.accountants.base import Accountant, rdp_epsilon



class _ExcludedOrders(logging.Filter):
    """dp_accounting warns, every round, when an RDP order's series does not converge (low orders at large
    sampling rates); it excludes that order, which can only loosen the RDP cross-check, never the PLD epsilon
    reported. The warning is dropped so that a run's per-round progress stays readable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_ExcludedOrders())


def combined_noise(z_delta: float, count_noise_std: float) -> float:
    """The single-Gaussian multiplier equal to releasing the update (z_delta) and the clip count (sigma_b)."""
    return (z_delta ** -2 + (2 * count_noise_std) ** -2) ** -0.5


def update_noise(z_total: float, count_noise_std: float) -> float:
    """Andrew et al.'s z_delta: the update's multiplier that keeps the total at z_total with the count released."""
    if 2 * count_noise_std <= z_total:
        raise ValueError(f"the clip count's noise std {count_noise_std} must exceed z/2 = {z_total / 2} "
                         f"(otherwise the count alone costs more than the whole budget)")
    return (z_total ** -2 - (2 * count_noise_std) ** -2) ** -0.5


class UserLevelAccountant(Accountant):
    """The rounds run so far, as (sampling rate, noise multiplier) pairs: its whole state, JSON-safe."""
    name = "user_level"

    def __init__(self, rounds: list[tuple[float, float]] | None = None) -> None:
        self.rounds: list[tuple[float, float]] = [(float(q), float(z)) for q, z in rounds or []]

    def record(self, sampling_rate: float, noise_multiplier: float) -> None:
        if not 0 < sampling_rate <= 1 or not noise_multiplier > 0:
            raise ValueError(f"need 0 < q <= 1 and z > 0, got q={sampling_rate}, z={noise_multiplier}")
        self.rounds.append((float(sampling_rate), float(noise_multiplier)))

    def state_dict(self) -> list[list[float]]:
        return [[q, z] for q, z in self.rounds]

    state = state_dict  # the name federated checkpoints were written with

    def load_state_dict(self, state: list[list[float]]) -> None:
        self.rounds = [(float(q), float(z)) for q, z in state]

    def event(self) -> dp_accounting.DpEvent:
        """The whole run as one dp_accounting event (runs of equal rounds self-composed)."""
        parts = [dp_accounting.SelfComposedDpEvent(
                     dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), len(list(run)))
                 for (q, z), run in groupby(self.rounds)]
        return dp_accounting.ComposedDpEvent(parts)

    def epsilon(self, delta: float) -> dict[str, float | None]:
        """User-level epsilon at `delta` by PLD (the figure reported) and RDP (an upper bound, as a check)."""
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if not self.rounds:
            return {"epsilon": 0.0, "epsilon_rdp": 0.0}
        return {"epsilon": pld_epsilon(self.event(), delta), "epsilon_rdp": rdp_epsilon(self.event(), delta)}

    def get_epsilon(self, delta: float) -> float:
        """The user-level PLD epsilon at `delta`."""
        return self.epsilon(delta)["epsilon"]


def pld_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    """PLD epsilon with a discretization at most 1/100 of the epsilon it finds (a coarse grid overstates a small
    epsilon: at 1e-3 a true 2e-4 reads 1.7e-3)."""
    interval = 1e-3
    while True:
        epsilon = float(pld.PLDAccountant(value_discretization_interval=interval).compose(event).get_epsilon(delta))
        if interval <= max(epsilon / 100, 1e-7):
            return epsilon
        interval = max(epsilon / 1000, 1e-7)


def default_delta(num_users: int) -> float:
    """delta = 1 / N^1.1: below 1/N, as a user-level guarantee over N users needs."""
    return 1.0 / num_users ** 1.1


def extrapolate(sampling_rate: float, noise_multiplier: float, rounds: int, users: int,
                target_users: int) -> dict[str, float]:
    """The seed's extrapolation: the same rounds and sampling rate with `target_users` users and the noise
    multiplier scaled by target_users / users, so the noise on the average update (z*C / users per
    round) is the one measured. Returns z, users per round, delta and epsilon for that population."""
    scale = target_users / users
    z = noise_multiplier * scale
    delta = default_delta(target_users)
    accountant = UserLevelAccountant([(sampling_rate, z)] * rounds)
    return {"noise_multiplier": z, "users": target_users, "delta": delta, **accountant.epsilon(delta)}


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
