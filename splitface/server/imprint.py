"""Weight imprinting for the server-head classifier on a pre-trained tail.

A fresh linear head on a strong start (the distilled public backbone) learns slowly: its random rows know no
class, so for the first epoch the tail is fine-tuned against noise and drifts from what it knew. Imprinting
(Qi et al., "Low-Shot Learning with Imprinted Weights", CVPR 2018) sets each class's row to the mean direction of
that class's embeddings instead: a nearest-class-mean classifier from the first step. For the first N steps the
rows are the running means of every embedding seen so far; after that they are trained like any other weight,
from where the means left them.

Optionally the tail's weights wait too while the head is imprinted (`hold_tail`): the head is a nearest-class-mean
classifier of the start's features when the tail starts to move (as in linear probing, then fine-tuning: Kumar et
al., ICLR 2022). Trained against a head that the means keep rewriting, the tail drifts in the first epoch and
has to recover. Its batch norms still follow the private batches' statistics, as in any training step.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The cosine logit scale of an imprinted row: logits are about SCALE x cos(embedding, class mean). The scale does
# not change which class wins, only how sure the head is. 16 keeps the imprinted head sure but not saturated on the
# distilled student's embeddings (checked by hand on LFW-158's training images, where 24-32 gave a slightly lower
# cross-entropy; not a committed result). Not tuned on test accuracy.
SCALE = 16.0


class Imprinter:
    """Running class means of the L2-normalised embeddings, written into `head`'s rows while `active(steps)`."""

    def __init__(self, head: nn.Linear, steps: int, hold_tail: bool = False):
        """`hold_tail`: the tail takes no step while imprinting either (its gradients are computed, for the
        guard's checks, and dropped)."""
        if steps < 0:
            raise ValueError(f"imprint steps must be >= 0, got {steps}")
        if hold_tail and not steps:
            raise ValueError("holding the tail while imprinting needs imprint steps")
        self.head, self.steps, self.hold_tail = head, steps, hold_tail
        classes, dim = head.weight.shape
        device = head.weight.device
        self.sums = torch.zeros(classes, dim, device=device)
        self.counts = torch.zeros(classes, device=device)
        self.norm_sum = torch.zeros((), device=device)   # of the raw embeddings' norms: the rows' 1 / norm

    def active(self, steps: int) -> bool:
        return steps < self.steps

    def holds_tail(self, steps: int) -> bool:
        return self.hold_tail and self.active(steps)

    def hold_head(self, steps: int) -> None:
        """The head is set by the means while imprinting (no gradient, so no momentum carried out of it), and
        trained afterwards."""
        self.head.requires_grad_(not self.active(steps))

    @torch.no_grad()
    def add(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Fold a batch into the means and rewrite the rows of every class seen so far."""
        e = embeddings.detach().float()
        self.sums.index_add_(0, labels, F.normalize(e, dim=1))
        self.counts += torch.bincount(labels, minlength=len(self.counts)).to(self.counts)
        self.norm_sum += e.norm(dim=1).sum()
        seen = self.counts > 0
        mean_norm = self.norm_sum / self.counts.sum()
        self.head.weight[seen] = (SCALE / mean_norm) * F.normalize(self.sums[seen], dim=1).to(self.head.weight)
        self.head.bias[seen] = 0

    def state_dict(self) -> dict[str, Any]:
        """The schedule and, for a run that imprints, the running sums (a failed step is undone from them)."""
        state: dict[str, Any] = {"steps": self.steps, "hold_tail": self.hold_tail}
        if self.steps:
            state |= {"sums": self.sums.clone(), "counts": self.counts.clone(), "norm_sum": self.norm_sum.clone()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run keeps the schedule it started with, whatever the restarted server was given."""
        self.steps, self.hold_tail = state["steps"], state.get("hold_tail", False)   # (older checkpoints: none)
        if self.steps:
            self.sums.copy_(state["sums"])
            self.counts.copy_(state["counts"])
            self.norm_sum.copy_(state["norm_sum"])
