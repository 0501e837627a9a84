"""Differentially private local clustering (DPLC): PrivacyFace's release of a client's class centres.

PrivacyFace (Meng et al., "Improving Federated Learning Face Recognition via Privacy-Agnostic
Clusters", ICLR 2022; Algorithm 1). A client's private head holds one class centre per identity. Its
centres never leave; instead, up to Q times, the client finds the spherical cap of angular radius rho
(centred on one of its centres) that covers the most remaining centres, and if it covers at least T of
them releases their average with Gaussian noise, normalised; the covered centres are then removed.

Why that noise: all members of a cap of radius rho lie within angle 2 rho of each other, so two unit
vectors in it are at most sqrt(2 - 2 cos 2 rho) apart. Replacing one centre of the cluster S moves the
average by at most Delta = sqrt(2 (1 - cos 2 rho)) / |S| (rho <= pi / 2), and the classic Gaussian
mechanism sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon gives the paper's
    sigma = 2 / (|S| epsilon) * sqrt((1 - cos 2 rho) ln(1.25 / delta)).
The noise multiplier sigma / Delta = sqrt(2 ln(1.25 / delta)) / epsilon does not depend on |S| or rho:
that is what the accountant composes (splitface/common/accountants/clusters.py). What the
analysis does not cover (the paper's, kept here): the choice of cap, |S| and whether |S| >= T are
computed from the centres without noise.

Defaults, for this toolkit (IResNet-small at 64 px: 128-d embeddings; clients of a handful of people):
- rho: the paper's 1.3 rad is for 512-d. Random unit vectors have cosines of spread 1/sqrt(d), so a cap
  keeps its meaning when cos(rho) * sqrt(d) is kept: `scaled_rho(128)` = arccos(cos 1.3 * sqrt(512/128))
  = 1.006 rad.
- T (`min_members`): the paper's 512 cannot be met by a client with 4 people; 2 is the smallest T for
  which a release averages more than one person. With T above the client's number of people nothing is
  released (the result says so).
- Q (`queries`): 2, the most clusters of >= 2 members a 4-person client can have.
- epsilon 1, delta 1e-5 per query (the paper's per-query setting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PAPER_RHO, PAPER_DIM = 1.3, 512


def scaled_rho(dim: int, rho: float = PAPER_RHO, from_dim: int = PAPER_DIM) -> float:
    """The cap radius in `dim` dimensions with the same cos(rho) * sqrt(dim) as `rho` in `from_dim`."""
    if dim < 1 or from_dim < 1:
        raise ValueError(f"dimensions must be >= 1, got {dim} and {from_dim}")
    return math.acos(min(1.0, math.cos(rho) * math.sqrt(from_dim / dim)))


@dataclass(frozen=True)
class DPLCConfig:
    """One DPLC call: cap radius rho (radians), threshold T, at most Q queries, each (epsilon, delta)-DP."""
    rho: float = field(default_factory=lambda: scaled_rho(128))
    min_members: int = 2
    queries: int = 2
    epsilon: float = 1.0  # per query; math.inf releases the clusters without noise (a non-private reference)
    delta: float = 1e-5  # per query

    def __post_init__(self) -> None:
        if not 0 < self.rho <= math.pi / 2:
            raise ValueError(f"rho must be in (0, pi/2] (the sensitivity bound needs 2 rho <= pi), got {self.rho}")
        if self.min_members < 1 or self.queries < 1:
            raise ValueError(f"min_members and queries must be >= 1, got {self.min_members}, {self.queries}")
        if not self.epsilon > 0 or not 0 < self.delta < 1:
            raise ValueError(f"need epsilon > 0 and 0 < delta < 1, got {self.epsilon}, {self.delta}")


def mean_sensitivity(rho: float, size: int) -> float:
    """L2 sensitivity of the average of `size` unit vectors in a cap of radius rho (one replaced)."""
    if size < 1:
        raise ValueError(f"a cluster has >= 1 member, got {size}")
    return math.sqrt(2.0 * (1.0 - math.cos(2.0 * rho))) / size


def dplc_sigma(size: int, epsilon: float, delta: float, rho: float) -> float:
    """The paper's noise std: 2 / (|S| eps) * sqrt((1 - cos 2 rho) ln(1.25 / delta)); 0 when eps is inf."""
    if size < 1 or not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"need size >= 1, epsilon > 0, 0 < delta < 1; got {size}, {epsilon}, {delta}")
    if math.isinf(epsilon):
        return 0.0
    return 2.0 / (size * epsilon) * math.sqrt((1.0 - math.cos(2.0 * rho)) * math.log(1.25 / delta))


@dataclass
class DPLCResult:
    """`clusters` is all that leaves the device; the rest stays local (diagnostics)."""
    clusters: np.ndarray  # (n, d) float32 unit vectors, n <= Q; n == 0: nothing released
    sizes: list[int]  # |S| of each released cluster (not released)
    sigmas: list[float]  # the noise std each got
    covered: int  # centres inside a released cluster
    reason: str  # why it stopped: "queries" (Q used), "threshold" (best cap < T), "exhausted" (no centres left)

    @property
    def released(self) -> bool:
        return len(self.clusters) > 0


def normalise_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if not np.all(norms > 0) or not np.all(np.isfinite(x)):
        raise ValueError("class centres must be finite and non-zero")
    return x / norms


def dplc(centres: np.ndarray, config: DPLCConfig, rng: np.random.Generator) -> DPLCResult:
    """Algorithm 1 on one client's class centres (C, d), any norm (they are normalised here).

    Greedy: each query takes the centre whose cap (angle <= rho) covers the most remaining centres
    (ties: the lowest index), stops if that is fewer than T, else releases
    normalise(mean(S) + N(0, sigma^2 I)) and removes S.
    """
    centres = np.asarray(centres, dtype=np.float64)
    if centres.ndim != 2 or len(centres) == 0:
        raise ValueError(f"centres must be a non-empty (classes, dim) matrix, got shape {centres.shape}")
    unit = normalise_rows(centres)
    inside = unit @ unit.T >= math.cos(config.rho) - 1e-12  # inside[i, j]: centre j in the cap around i
    remaining = np.ones(len(unit), dtype=bool)
    clusters, sizes, sigmas, reason = [], [], [], "queries"
    for _ in range(config.queries):
        if not remaining.any():
            reason = "exhausted"
            break
        counts = np.where(remaining, (inside & remaining[None, :]).sum(axis=1), -1)
        best = int(np.argmax(counts))
        if counts[best] < config.min_members:
            reason = "threshold"
            break
        members = inside[best] & remaining
        size = int(members.sum())
        sigma = dplc_sigma(size, config.epsilon, config.delta, config.rho)
        noisy = unit[members].mean(axis=0) + rng.normal(0.0, sigma, unit.shape[1])
        clusters.append(noisy / np.linalg.norm(noisy))
        sizes.append(size)
        sigmas.append(sigma)
        remaining &= ~members
    released = np.asarray(clusters, dtype=np.float32).reshape(len(clusters), unit.shape[1])
    return DPLCResult(released, sizes, sigmas, int(sum(sizes)), reason)
