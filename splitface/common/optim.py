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
    # the classifier's lr over the body's: a fresh head on a pre-trained body (a distilled start) learns at the
    # usual fine-tuning ratio instead of at the body's small rate; 1 keeps one parameter group
    head_lr_scale: float = 1.0


def sgd_with_head(params: Iterable[torch.nn.Parameter], head: Iterable[torch.nn.Parameter],
                  config: TrainConfig) -> torch.optim.SGD:
    """SGD over `params` (every trained parameter, in the caller's order), those of `head` (the classifier) at
    `config.head_lr_scale` times the lr."""
    params, head_ids = list(params), {id(p) for p in head}
    if config.head_lr_scale == 1.0:
        return make_sgd(params, config.lr, config.momentum, config.weight_decay)
    groups = [{"params": [p for p in params if id(p) not in head_ids]},
              {"params": [p for p in params if id(p) in head_ids], "lr": config.lr * config.head_lr_scale}]
    return torch.optim.SGD([g for g in groups if g["params"]], lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


def make_sgd(params: Iterable[torch.nn.Parameter], lr: float = 0.01, momentum: float = 0.9,
             weight_decay: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum, weight_decay=weight_decay)


def exponential_decay(optimizer: torch.optim.Optimizer, rate: float = 0.1,
                      decay_steps: int = 1000) -> torch.optim.lr_scheduler.LambdaLR:
    """lr_t = lr_0 * rate ** (t / decay_steps), stepped once per batch (TensorFlow's exponential_decay)."""
    if decay_steps <= 0:
        raise ValueError("decay_steps must be positive")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: rate ** (step / decay_steps))
