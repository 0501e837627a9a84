"""The device's training engine: its layer (and, with the device head, its classifier), its
optimiser, and snapshots of its state for each batch the server may still roll back.

Device state changes only when a batch's BACKWARD arrives (`commit`), so a batch that must
be re-sent after a dropped connection is never applied twice on the device either.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .models import ModelSpec, build_backbone, build_classifier, split_backbone
from .optim import exponential_decay, make_sgd


@dataclass
class DeviceTrainConfig:
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_decay: float = 0.1
    decay_steps: int = 1000
    seed: int = 0


def to_input(images: np.ndarray) -> torch.Tensor:
    """uint8 NCHW images -> float in [0, 1], the scale the device layer's privacy analysis assumes."""
    return torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)


class DeviceEngine:
    def __init__(self, spec: ModelSpec, split: str, head: str, num_classes: int,
                 config: DeviceTrainConfig | None = None):
        if head not in ("server", "device"):
            raise ValueError(f"head must be 'server' or 'device', not {head!r}")
        self.spec, self.split, self.head, self.num_classes = spec, split, head, num_classes
        self.config = config or DeviceTrainConfig()
        torch.manual_seed(self.config.seed)
        self.layer, _ = split_backbone(build_backbone(spec), split)
        self.classifier = build_classifier(spec, num_classes) if head == "device" else None
        params = list(self.layer.parameters()) + (list(self.classifier.parameters()) if self.classifier else [])
        self.optimizer = make_sgd(params, self.config.lr, self.config.momentum, self.config.weight_decay)
        self.scheduler = exponential_decay(self.optimizer, self.config.lr_decay, self.config.decay_steps)
        self.committed = 0                      # last batch id applied on the device
        self.snapshots: dict[int, dict[str, Any]] = {0: self._state()}
        self._activations: torch.Tensor | None = None

    # ---- one batch ---------------------------------------------------------------------
    def forward(self, images: np.ndarray) -> np.ndarray:
        """Activations to send; the graph is kept for `commit`."""
        self.layer.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._activations = self.layer(to_input(images))
        return self._activations.detach().numpy()

    def head_step(self, embeddings: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float, int]:
        """Device head: loss on the device's own labels; returns (embedding gradient, loss, correct).

        The classifier's gradient waits in .grad until `commit`; a recomputation overwrites it.
        """
        assert self.classifier is not None
        self.classifier.train()
        for p in self.classifier.parameters():
            p.grad = None
        e = torch.from_numpy(np.array(embeddings, dtype=np.float32)).requires_grad_(True)
        y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        logits = self.classifier(e)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        return e.grad.numpy(), loss.item(), int((logits.argmax(1) == y).sum())

    def commit(self, batch_id: int, activation_grad: np.ndarray) -> None:
        """Apply the server's gradient: backward through the layer, one optimiser step, snapshot."""
        if self._activations is None:
            raise RuntimeError("commit without a forward")
        self._activations.backward(torch.from_numpy(np.array(activation_grad, dtype=np.float32)))
        self.optimizer.step()
        self.scheduler.step()
        self._activations = None
        self.committed = batch_id
        self.snapshots[batch_id] = self._state()

    @torch.no_grad()
    def activations(self, images: np.ndarray) -> np.ndarray:
        """Evaluation forward: no graph, no state change."""
        self.layer.eval()
        return self.layer(to_input(images)).numpy()

    @torch.no_grad()
    def classify(self, embeddings: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        assert self.classifier is not None
        self.classifier.eval()
        logits = self.classifier(torch.from_numpy(np.array(embeddings, dtype=np.float32)))
        y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        return float(F.cross_entropy(logits, y)), int((logits.argmax(1) == y).sum())

    # ---- snapshots for server rollbacks ------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return copy.deepcopy({
            "layer": self.layer.state_dict(),
            "classifier": self.classifier.state_dict() if self.classifier else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        })

    def forget_before(self, durable_through: int) -> None:
        """The server's checkpoint covers `durable_through`: older snapshots can never be needed."""
        for k in [k for k in self.snapshots if k < min(durable_through, self.committed)]:
            del self.snapshots[k]

    def rollback(self, batch_id: int) -> None:
        """Return to the state right after `batch_id` (the server restarted from its checkpoint)."""
        if batch_id not in self.snapshots:
            raise RuntimeError(f"cannot roll back to batch {batch_id}: no snapshot (have {sorted(self.snapshots)})")
        state = self.snapshots[batch_id]
        self.layer.load_state_dict(state["layer"])
        if self.classifier is not None:
            self.classifier.load_state_dict(state["classifier"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.committed = batch_id
        self._activations = None
        for k in [k for k in self.snapshots if k > batch_id]:
            del self.snapshots[k]
