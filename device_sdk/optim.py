"""The source paper's optimiser, shared by the device and the edge server so both decay alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class TrainConfig:
    """SGD with exponential decay: the source paper's defaults (lr 0.01, momentum 0.9, decay by 0.1)."""
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_decay: float = 0.1
    decay_steps: int = 1000
    seed: int = 0


def make_sgd(params: Iterable[torch.nn.Parameter], lr: float = 0.01, momentum: float = 0.9,
             weight_decay: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum, weight_decay=weight_decay)


def exponential_decay(optimizer: torch.optim.Optimizer, rate: float = 0.1,
                      decay_steps: int = 1000) -> torch.optim.lr_scheduler.LambdaLR:
    """lr_t = lr_0 * rate ** (t / decay_steps), stepped once per batch (TensorFlow's exponential_decay)."""
    if decay_steps <= 0:
        raise ValueError("decay_steps must be positive")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: rate ** (step / decay_steps))
