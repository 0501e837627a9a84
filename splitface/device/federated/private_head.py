"""A client round with a persistent private head: what FedPE, FedGC and PrivacyFace clients run.

Unlike DP-FedEmb's throw-away head (client.py), here each client keeps its class centres W_k across
rounds. It trains the backbone and W_k with a margin softmax over its own people; a PrivacyFace client
adds the other clients' sanitised clusters to the denominator (consensus.py, Eq. 5); a fixed-head
client never updates W_k (the fixed random head baseline). The backbone's change is returned for
averaging; W_k is returned too, and what leaves the device depends on the method: nothing of it
(FedPE, fixed head), all of it (FedGC, for the server's correction), or DPLC clusters of it
(PrivacyFace; the caller runs `dplc.dplc` on the returned head).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from splitface.device.trainer import to_input
from splitface.common.models import ModelSpec, build_backbone
from splitface.device.federated.local_round import _batches, _inputs, _module_from_state
from splitface.device.federated.consensus import consensus_loss
from splitface.common.dplc import scaled_rho
from splitface.device.federated.update import Delta


@dataclass(frozen=True)
class HeadConfig:
    """Local training of backbone + private head: margin softmax `kind` with scale s and margin m."""
    epochs: int = 2
    batch_size: int = 8
    lr: float = 0.01
    head_lr_scale: float = 10.0
    kind: str = "cosface"
    scale: float = 32.0
    margin: float = 0.35
    rho: float = field(default_factory=lambda: scaled_rho(128))  # the consensus term's cap radius (DPLC's rho)
    train_head: bool = True  # False: the fixed random head baseline
    flip: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 2 or not self.lr > 0 or not self.head_lr_scale > 0:
            raise ValueError("epochs >= 1, batch_size >= 2, lr > 0 and head_lr_scale > 0 are needed")


@dataclass
class HeadResult:
    delta: Delta  # the backbone's change
    head: torch.Tensor  # the client's class centres after the round (C_k, d)
    examples: int
    loss: float


@torch.no_grad()
def class_means(spec: ModelSpec, backbone_state: Mapping[str, torch.Tensor], images: np.ndarray,
                labels: np.ndarray) -> torch.Tensor:
    """Each local class's mean normalised embedding (classes in sorted label order): a head's first value."""
    with torch.random.fork_rng():
        backbone = build_backbone(spec)
    backbone = _module_from_state(backbone, backbone_state).eval()
    embeddings = torch.nn.functional.normalize(backbone(to_input(images)), dim=1)
    _, targets = np.unique(labels, return_inverse=True)
    return torch.stack([embeddings[torch.from_numpy(targets == c)].mean(0) for c in range(int(targets.max()) + 1)])


def train_private_head(spec: ModelSpec, backbone_state: Mapping[str, torch.Tensor], head: torch.Tensor,
                       images: np.ndarray, labels: np.ndarray, config: HeadConfig, seed: int,
                       clusters: torch.Tensor | None = None) -> HeadResult:
    """One round from the global backbone and this client's head (rows: its classes in sorted label order)."""
    _, targets = np.unique(labels, return_inverse=True)
    if head.ndim != 2 or head.shape != (int(targets.max()) + 1, spec.embedding_dim):
        raise ValueError(f"head must be ({int(targets.max()) + 1}, {spec.embedding_dim}), got {tuple(head.shape)}")
    if len(images) < 2 or len(images) != len(labels):
        raise ValueError(f"need >= 2 images with one label each, got {len(images)} and {len(labels)}")
    rng = np.random.default_rng(seed)
    with torch.random.fork_rng():
        backbone = build_backbone(spec)
    backbone = _module_from_state(backbone, backbone_state).train()
    weight = torch.nn.Parameter(head.detach().clone().float(), requires_grad=config.train_head)
    start = {k: p.detach().clone() for k, p in backbone.named_parameters()}
    groups = [{"params": list(backbone.parameters())}]
    if config.train_head:
        groups.append({"params": [weight], "lr": config.lr * config.head_lr_scale})
    optimizer = torch.optim.SGD(groups, lr=config.lr)
    y = torch.from_numpy(targets.astype(np.int64))
    losses = []
    for _ in range(config.epochs):
        for idx in _batches(len(images), config.batch_size, rng):
            x = _inputs(images, idx, config.flip, rng)
            loss = consensus_loss(backbone(x), weight, y[idx], clusters, config.rho, config.scale, config.margin,
                                  config.kind)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    delta = {k: p.detach() - start[k] for k, p in backbone.named_parameters()}
    return HeadResult(delta, weight.detach().clone(), len(images), float(np.mean(losses)))
