"""Pre-train the whole backbone on a public set, in one process (public faces need no split).

Its device layer is then the public, frozen layer devices can use (each release then depends
only on its own image), and its tail the starting point for fine-tuning on private data.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from splitface.common.data import DataSplit
from splitface.device.trainer import to_input
from splitface.common.models import ModelSpec, build_backbone, build_classifier
from splitface.common.models.weights import save_backbone
from splitface.common.optim import exponential_decay, make_sgd


def pretrain(spec: ModelSpec, data: DataSplit, out: Path, epochs: int = 10, lr: float = 0.1, batch_size: int = 64,
             seed: int = 0, crop: int = 160, progress: bool = True) -> dict[str, Any]:
    torch.manual_seed(seed)
    backbone, classifier = build_backbone(spec), build_classifier(spec, len(data.class_names))
    train_x, test_x = data.train.load(spec.input_size, crop, progress), data.test.load(spec.input_size, crop, progress)
    train_y, test_y = torch.from_numpy(data.train.labels), torch.from_numpy(data.test.labels)
    steps = epochs * -(-len(train_y) // batch_size)
    optimizer = make_sgd(list(backbone.parameters()) + list(classifier.parameters()), lr, 0.9, 5e-4)
    scheduler = exponential_decay(optimizer, 0.1, steps)
    rng = np.random.default_rng(seed)
    history = []
    started = time.time()
    for epoch in tqdm(range(epochs), desc="pretrain", disable=not progress):
        backbone.train(), classifier.train()
        order = rng.permutation(len(train_y))
        loss_sum, correct = 0.0, 0
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            logits = classifier(backbone(to_input(train_x[idx])))
            loss = F.cross_entropy(logits, train_y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(1) == train_y[idx]).sum())
        backbone.eval(), classifier.eval()
        with torch.no_grad():
            test_acc = float((classifier(backbone(to_input(test_x))).argmax(1) == test_y).float().mean())
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / len(train_y), "train_acc": correct / len(train_y),
                        "test_acc": test_acc, "wall_s": time.time() - started})
    meta = {"identities": len(data.class_names), "train_images": len(train_y), "test_images": len(test_y),
            "epochs": epochs, "lr": lr, "seed": seed, "history": history}
    save_backbone(out, spec, backbone, meta)
    return meta
