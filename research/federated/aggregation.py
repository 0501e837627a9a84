"""The server's side of a round: check and bound each upload, sum, add Gaussian noise, and adapt the clip norm.

Every contribution is re-clipped here with the device's own `clip_delta` (a no-op for an honest
device), so the sensitivity the accountant assumes holds even for an upload that lies about its norm.
With Poisson sampling the number of participants is itself private, so a private round divides the
noised sum by the expected number of clients (the fixed-denominator estimator), never the actual one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from splitface.device.federated import ClientResult, clip_delta


def check_update(delta: Mapping[str, torch.Tensor], template: Mapping[str, torch.Tensor]) -> None:
    """Refuse an upload whose names, shapes or values do not fit the model (it would corrupt the global model)."""
    if set(delta) != set(template):
        raise ValueError(f"update names differ from the model's: missing {sorted(set(template) - set(delta))[:3]}, "
                         f"unexpected {sorted(set(delta) - set(template))[:3]}")
    for name, value in delta.items():
        if value.shape != template[name].shape:
            raise ValueError(f"update {name}: shape {tuple(value.shape)}, the model's is {tuple(template[name].shape)}")
        if not torch.isfinite(value).all():
            raise ValueError(f"update {name} has non-finite values")


@dataclass
class RoundSum:
    mean: dict[str, torch.Tensor]  # the (noised) average update
    participants: int
    within_clip: int  # participants whose update's norm was at most the clip norm (not released if private)


def aggregate(results: Sequence[ClientResult], template: Mapping[str, torch.Tensor], clip_norm: float,
              noise_std: float, denominator: float, generator: torch.Generator) -> RoundSum:
    """sum(clip(delta_i, C)) + N(0, noise_std^2 I), divided by `denominator` (all in float64, then float32)."""
    if not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    total = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in template.items()}
    within = 0
    for result in results:
        check_update(result.delta, template)
        clipped, norm = clip_delta(result.delta, clip_norm)
        within += int(result.norm <= clip_norm and norm <= clip_norm)
        for k, v in clipped.items():
            total[k] += v.double()
    if noise_std > 0:
        for k in sorted(total):
            total[k] += torch.normal(0.0, noise_std, total[k].shape, generator=generator, dtype=torch.float64)
    mean = {k: (v / denominator).to(template[k].dtype) for k, v in total.items()}
    return RoundSum(mean, len(results), within)


def adapt_clip_norm(clip_norm: float, within_clip: int, expected_clients: float, target_quantile: float,
                    clip_lr: float, count_noise_std: float, generator: torch.Generator) -> tuple[float, float]:
    """Andrew et al. 2021's geometric update C <- C exp(-lr (b - gamma)), with b the noised fraction of
    clients within the clip norm; returns (new clip norm, b)."""
    noise = float(torch.normal(0.0, count_noise_std, (1,), generator=generator, dtype=torch.float64)) \
        if count_noise_std > 0 else 0.0
    fraction = (within_clip + noise) / expected_clients
    return clip_norm * math.exp(-clip_lr * (fraction - target_quantile)), fraction


def poisson_sample(num_clients: int, sampling_rate: float, seed: int, round_number: int) -> np.ndarray:
    """The virtual clients taking part in a round: each independently with probability q, drawn from
    (seed, round) alone so that a resumed run samples exactly what the uninterrupted one would."""
    rng = np.random.default_rng([seed, round_number, 1])
    return np.flatnonzero(rng.random(num_clients) < sampling_rate)
