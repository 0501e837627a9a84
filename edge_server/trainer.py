"""The shared server part of the network: the tail after the split, and the server-head classifier.

Every device feeds this one model. Calls are made one at a time by the server shell
(it holds the model lock), so the trainer itself keeps no locks.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from device_sdk.models import ModelSpec, build_backbone, build_classifier, split_backbone
from device_sdk.models.weights import load_into
from device_sdk.optim import TrainConfig, exponential_decay, make_sgd


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ServerTrainer:
    def __init__(self, spec: ModelSpec, split: str, num_classes: int, config: TrainConfig | None = None,
                 device: str | None = None, init: Path | None = None, train_only: str = "all"):
        """`init`: start the tail from a saved (e.g. public pre-trained) backbone; `train_only="classifier"`
        freezes the tail and trains only the output layer (the source paper's fine-tuning setting)."""
        if train_only not in ("all", "classifier"):
            raise ValueError(f"train_only must be 'all' or 'classifier', not {train_only!r}")
        self.spec, self.split, self.num_classes, self.train_only = spec, split, num_classes, train_only
        self.config = config or TrainConfig()
        torch.manual_seed(self.config.seed)
        _, tail = split_backbone(build_backbone(spec), split)
        if init is not None:
            load_into(tail, init, spec)
        self.device = pick_device(device)
        self.tail = tail.to(self.device)
        self.classifier = build_classifier(spec, num_classes).to(self.device)
        trained = list(self.classifier.parameters())
        if train_only == "all":
            trained += list(self.tail.parameters())
        else:
            self.tail.requires_grad_(False)
        self.optimizer = make_sgd(trained, self.config.lr, self.config.momentum, self.config.weight_decay)
        self.scheduler = exponential_decay(self.optimizer, self.config.lr_decay, self.config.decay_steps)
        self.steps = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _autocast(self):
        # bf16 on a GPU for throughput; exact fp32 on the CPU.
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """Wrap the message's read-only buffer without a copy; nothing here writes to it."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.as_tensor(array, dtype=torch.float32).to(self.device)

    def _input(self, activations: np.ndarray) -> torch.Tensor:
        return self._tensor(activations).requires_grad_(True)

    def _step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1

    def train_server_head(self, activations: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float, int]:
        """One step on a labelled batch; returns (gradient wrt activations, loss, correct predictions)."""
        self._train_mode(True)
        self.optimizer.zero_grad(set_to_none=True)
        x = self._input(activations)
        y = torch.as_tensor(labels, device=self.device)
        with self._autocast():
            logits = self.classifier(self.tail(x))
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        self._step()
        n_correct = int((logits.argmax(1) == y).sum())
        return _numpy(x.grad), loss.item(), n_correct

    def evaluate(self, activations: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        self._train_mode(False)
        with torch.no_grad(), self._autocast():
            logits = self.classifier(self.tail(self._tensor(activations)))
        y = torch.as_tensor(labels, device=self.device)
        return float(F.cross_entropy(logits.float(), y)), int((logits.argmax(1) == y).sum())

    def embed(self, activations: np.ndarray, train: bool) -> np.ndarray:
        """Device head: embeddings for the device's classifier; in training the graph waits for `train_tail`."""
        self._train_mode(train)
        if not train:
            with torch.no_grad(), self._autocast():
                return _numpy(self.tail(self._tensor(activations)).float())
        self.optimizer.zero_grad(set_to_none=True)
        x = self._input(activations)
        with self._autocast():
            embeddings = self.tail(x).float()
        self._pending = (x, embeddings)
        return _numpy(embeddings.detach())

    def train_tail(self, embedding_grad: np.ndarray) -> np.ndarray:
        """Device head: backward from the device's embedding gradient, step; gradient wrt activations."""
        if self._pending is None:
            raise RuntimeError("train_tail without a pending embed")
        x, embeddings = self._pending
        self._pending = None
        embeddings.backward(self._tensor(embedding_grad))
        self._step()
        return _numpy(x.grad)

    def drop_pending(self) -> None:
        self._pending = None

    def _train_mode(self, train: bool) -> None:
        self.tail.train(train and self.train_only == "all")  # a frozen tail keeps its BN statistics too
        self.classifier.train(train)

    def state_dict(self) -> dict[str, Any]:
        return {"tail": self.tail.state_dict(), "classifier": self.classifier.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "steps": self.steps,
                "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tail.load_state_dict(state["tail"])
        self.classifier.load_state_dict(state["classifier"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
        torch.set_rng_state(state["rng"])


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()
