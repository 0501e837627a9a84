"""One client's local training for a round: the function every launcher calls.

DP-FedEmb (Xu et al. 2022): the client trains the backbone together with a freshly initialised local
head over its own users' classes (the head gets its own learning rate: `head_lr_scale`), and uploads
only the backbone's change; the head never leaves. FedAvg-style training instead passes a global head
(`head_state`) over all classes, whose change is uploaded with the backbone's. Either way the upload
is clipped here, before it leaves the device.

Inputs and outputs are plain tensors and arrays so that an in-process call, a Ray task or a device
process answering a round message all run exactly this code. Deterministic given `seed`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitface.device.trainer import to_input
from splitface.common.models import ModelSpec, build_backbone
from splitface.device.federated.update import Delta, clip_delta

HEAD_PREFIX = "head."


@dataclass(frozen=True)
class LocalConfig:
    """How a client trains in one round."""
    epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05
    head_lr_scale: float = 10.0  # the head's lr is lr * head_lr_scale (a fresh head must catch up fast)
    momentum: float = 0.0
    weight_decay: float = 0.0
    flip: bool = True  # random horizontal flips
    clip_norm: float = math.inf  # L2 bound on the uploaded update (inf: not clipped)

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 2:
            raise ValueError(f"epochs must be >= 1 and batch_size >= 2, got {self.epochs}, {self.batch_size}")
        if not (self.lr > 0 and self.head_lr_scale > 0 and self.clip_norm > 0):
            raise ValueError("lr, head_lr_scale and clip_norm must be > 0")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError("momentum must be in [0, 1) and weight_decay >= 0")


@dataclass
class ClientResult:
    """What leaves the client: the clipped update and the few numbers the server's rules need."""
    delta: Delta  # backbone parameter changes (+ "head.*" with a global head), clipped to clip_norm
    norm: float  # the update's L2 norm before clipping (its bit `norm <= C` drives adaptive clipping)
    examples: int
    loss: float  # mean training loss over the round's local steps


def _inputs(images: np.ndarray, idx: np.ndarray, flip: bool, rng: np.random.Generator) -> torch.Tensor:
    """The batch's images as model input, each mirrored left-right with probability 1/2 when `flip`."""
    x = to_input(images[idx])
    if flip:
        mirrored = torch.from_numpy(rng.random(len(idx)) < 0.5)
        x = torch.where(mirrored[:, None, None, None], x.flip(3), x)
    return x


def _batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A shuffled epoch in batches; a trailing batch of one joins the previous one (batch norm needs two)."""
    order = rng.permutation(n)
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) == 1:
        batches[-2:] = [np.concatenate(batches[-2:])]
    return batches


def _fresh_head(dim: int, classes: int, generator: torch.Generator) -> nn.Linear:
    with torch.random.fork_rng():
        head = nn.Linear(dim, classes)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.01, generator=generator)
        head.bias.zero_()
    return head


def _module_from_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    module.load_state_dict({k: v.detach().clone() for k, v in state.items()}, assign=True)
    return module


def train_client(spec: ModelSpec, backbone_state: Mapping[str, torch.Tensor], images: np.ndarray,
                 labels: np.ndarray, config: LocalConfig, seed: int,
                 head_state: Mapping[str, torch.Tensor] | None = None) -> ClientResult:
    """Train from the global weights on this client's data; return the clipped update.

    images: uint8 (N, 3, S, S); labels: class ids. Without `head_state` the labels only group images
    by person (a local head over this client's own classes is made here and dropped afterwards); with
    it they index the global head's classes.
    """
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[1:] != (3, spec.input_size, spec.input_size):
        raise ValueError(f"images must be uint8 (N, 3, {spec.input_size}, {spec.input_size}), "
                         f"got {images.dtype} {images.shape}")
    if labels.shape != (len(images),) or len(images) < 2:
        raise ValueError(f"need >= 2 images with one label each, got {len(images)} images, labels {labels.shape}")
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    with torch.random.fork_rng():  # building draws initial weights; they are overwritten, the caller's RNG kept
        backbone = build_backbone(spec)
        head = None if head_state is None else nn.Linear(*head_state["weight"].shape[::-1])
    backbone = _module_from_state(backbone, backbone_state).train()
    if head_state is None:
        _, targets = np.unique(labels, return_inverse=True)  # this client's own classes, 0..m-1
        head = _fresh_head(spec.embedding_dim, int(targets.max()) + 1, generator)
    else:
        head = _module_from_state(head, head_state)
        targets = labels
        if targets.min() < 0 or targets.max() >= head.out_features:
            raise ValueError(f"labels must index the global head's {head.out_features} classes")
    y = torch.from_numpy(targets.astype(np.int64))
    start = {k: p.detach().clone() for k, p in backbone.named_parameters()}
    head_start = {k: p.detach().clone() for k, p in head.named_parameters()}
    optimizer = torch.optim.SGD([{"params": list(backbone.parameters())},
                                 {"params": list(head.parameters()), "lr": config.lr * config.head_lr_scale}],
                                lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    losses = []
    for _ in range(config.epochs):
        for idx in _batches(len(images), config.batch_size, rng):
            x = _inputs(images, idx, config.flip, rng)
            loss = F.cross_entropy(head(backbone(x)), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    delta = {k: p.detach() - start[k] for k, p in backbone.named_parameters()}
    if head_state is not None:
        delta.update({HEAD_PREFIX + k: p.detach() - head_start[k] for k, p in head.named_parameters()})
    clipped, norm = clip_delta(delta, config.clip_norm)
    return ClientResult(clipped, norm, len(images), float(np.mean(losses)))
