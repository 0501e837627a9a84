"""View 1 verification of a federated (or centralized) backbone.

Clients train in train mode, so the global model's batch-norm statistics are never aggregated (they
would be a release of their own that is not clipped); before scoring, the server re-estimates them on
public images, which costs no privacy. Every method in the table is scored this way.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from splitface.device.trainer import to_input

from research.evaluation.verification import Pairs, embed_in_batches, verification_report, view1_pairs


@torch.no_grad()
def recalibrate_bn(backbone: nn.Module, images: np.ndarray, batch_size: int = 64) -> nn.Module:
    """A copy of `backbone` whose batch-norm running statistics are the plain average over `images`."""
    model = copy.deepcopy(backbone)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    model.train()
    for i in range(0, len(images) - 1, batch_size):
        model(to_input(images[i:i + batch_size]))
    return model.eval()


class View1Evaluator:
    """DevTest pairs decoded once; scores any backbone after recalibrating its batch norm on public images."""

    def __init__(self, lfw_root: str | Path | None, size: int, public_images: np.ndarray, crop: int = 160,
                 limit: int | None = None) -> None:
        self.pairs: Pairs = view1_pairs(lfw_root, "test", limit)
        self.images = self.pairs.faces.load(size, crop)
        self.public_images = public_images
        self.limit = limit

    def __call__(self, backbone: nn.Module) -> dict:
        model = recalibrate_bn(backbone, self.public_images)
        with torch.no_grad():
            embeddings = embed_in_batches(lambda x: model(torch.from_numpy(x)).numpy(), self.images)
        report = verification_report(embeddings[self.pairs.a], embeddings[self.pairs.b], self.pairs.same)
        return {k: report[k] for k in ("view1_accuracy", "view1_std", "roc_auc", "tar_at_far_1e-2", "pairs")}

