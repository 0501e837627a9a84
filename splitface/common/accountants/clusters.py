"""Identity-level privacy of PrivacyFace's cluster releases, composed with dp_accounting.

The neighbouring relation is PrivacyFace's: two clients' sets of class centres that differ in one
centre (one identity's centre replaced by any other unit vector), everything else equal. Each DPLC
query is a Gaussian mechanism on an average whose replace-one L2 sensitivity is
Delta = sqrt(2 (1 - cos 2 rho)) / |S| with noise std sigma (splitface/common/dplc.py), i.e. one
Gaussian of noise multiplier z = sigma / Delta = sqrt(2 ln(1.25 / delta_q)) / epsilon_q, whatever |S|
and rho. dp_accounting's GaussianDpEvent(z) under its default relation is exactly that pair of output
distributions (means a distance 1 apart, std z), so it is the right event for our Delta.

Composition, charged whatever was released (a charge that depended on what was released would itself
leak): a DPLC call runs Q queries and one identity's centre may sit in any of them, so a call is Q
Gaussians; a client that runs DPLC in M rounds composes M calls (its centres move between rounds,
each round's release is a fresh mechanism on them: adaptive composition). No amplification by
sampling is claimed. Not covered (as in the paper): the cap's choice, |S| and the T test are computed
without noise.

`ClusterAccountant` keeps the books a federated run needs (DPLC calls per client) behind the accountants'
common interface; `identity_epsilon` is the composition itself, for callers that count calls themselves.
"""
from __future__ import annotations

import math

import dp_accounting
import numpy as np

from splitface.common.dplc import DPLCConfig

from splitface.common.accountants.base import Accountant, rdp_epsilon
from splitface.common.accountants.user_level import pld_epsilon


def query_noise_multiplier(epsilon: float, delta: float) -> float:
    """sigma / Delta of one DPLC query: sqrt(2 ln(1.25 / delta)) / epsilon (0 when epsilon is inf)."""
    if not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    return 0.0 if math.isinf(epsilon) else math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def dplc_event(config: DPLCConfig, rounds: int) -> dp_accounting.DpEvent:
    """M rounds of one DPLC call of Q queries each, as one dp_accounting event."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    z = query_noise_multiplier(config.epsilon, config.delta)
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), config.queries * rounds)


def identity_epsilon(config: DPLCConfig, rounds: int, delta: float) -> dict[str, float | int | None]:
    """The composed identity-level epsilon at `delta` after `rounds` DPLC calls: PLD (reported) and RDP (an
    upper bound, a check), with the per-query nominal (epsilon, delta) and the PLD epsilon of one query at
    its own delta (below the nominal one: the classic Gaussian bound is loose). None where not private."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    z = query_noise_multiplier(config.epsilon, config.delta)
    releases = config.queries * rounds
    if z == 0:
        return {"epsilon": None, "epsilon_rdp": None, "delta": None, "noise_multiplier": 0.0,
                "releases": releases, "query_epsilon": None, "query_delta": config.delta, "query_epsilon_pld": None}
    event = dplc_event(config, rounds)
    return {"epsilon": pld_epsilon(event, delta), "epsilon_rdp": rdp_epsilon(event, delta), "delta": delta,
            "noise_multiplier": z, "releases": releases, "query_epsilon": config.epsilon,
            "query_delta": config.delta,
            "query_epsilon_pld": pld_epsilon(dp_accounting.GaussianDpEvent(z), config.delta)}


class ClusterAccountant(Accountant):
    """PrivacyFace's releases so far: the number of DPLC calls of each client (its whole state). An identity
    is in one client, so the worst identity is in the client with the most calls."""
    name = "clusters"

    def __init__(self, config: DPLCConfig, clients: int) -> None:
        self.config = config
        self.calls = np.zeros(clients, dtype=np.int64)

    def record(self, client: int) -> None:
        """One DPLC call (Q queries) of `client`."""
        self.calls[client] += 1

    def epsilon(self, delta: float) -> dict[str, float | int | None]:
        """`identity_epsilon` for the client with the most calls."""
        return identity_epsilon(self.config, int(self.calls.max()), delta)

    def get_epsilon(self, delta: float) -> float:
        """The worst identity's PLD epsilon at `delta` (inf where DPLC adds no noise)."""
        if not self.calls.max():
            return 0.0
        epsilon = self.epsilon(delta)["epsilon"]
        return math.inf if epsilon is None else epsilon

    def state_dict(self) -> list[int]:
        return [int(n) for n in self.calls]

    def load_state_dict(self, state: list[int]) -> None:
        self.calls = np.asarray(state, dtype=np.int64)
