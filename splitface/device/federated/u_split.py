"""PrivacyFace in U-shaped split training: device heads that train against each other's sanitised clusters.

In U-shaped split training (device head, SPEC.md section 8) each device holds its own people and its own
head; the server holds the shared middle of the network. A device's softmax therefore never sees another
device's people as negatives. PrivacyFace's fix, on the device: every `exchange_every` batches the device
runs DPLC on its head's class centres (dplc.py), sends the release in a CLUSTERS message and gets back the
other devices' latest releases (the server only relays them, splitface/protocol/clusters.py); from then on its head
step is the consensus-aware loss (consensus.py) against them. Labels, the head and the raw centres never
leave the device; what does is the DPLC output alone, whose identity-level epsilon composes over the
device's `dplc_calls` (splitface/common/accountants/clusters.identity_epsilon, run by whoever
reports it: the device SDK does not import server code).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from splitface.protocol import messages as m

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer
from splitface.device.federated.consensus import consensus_loss, cosines
from splitface.common.dplc import DPLCConfig, DPLCResult, dplc


@dataclass(frozen=True)
class ConsensusHead:
    """The device head's margin softmax (consensus.py): scale s, margin m, kind; rho is the clusters' cap."""
    rho: float = field(default_factory=lambda: DPLCConfig().rho)
    scale: float = 32.0
    margin: float = 0.35
    kind: str = "cosface"


class ConsensusEngine(DeviceTrainer):
    """A device-head engine whose head step is the consensus-aware loss over the clusters it last received
    (none: the plain margin softmax); the classifier's weight rows are the class centres (its bias unused)."""

    def __init__(self, *args, head_loss: ConsensusHead | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.classifier is None:
            raise ValueError("the consensus-aware loss needs the device head")
        self.head_loss = head_loss or ConsensusHead()
        self.received: torch.Tensor | None = None  # the other devices' clusters, (P, d)
        self.dplc_calls = 0

    def head_step(self, embeddings: np.ndarray, labels: np.ndarray,
                  batch_id: int | None = None) -> tuple[np.ndarray, float, int]:
        self.classifier.train()
        for p in self.classifier.parameters():
            p.grad = None
        e = torch.from_numpy(np.array(embeddings, dtype=np.float32)).requires_grad_(True)
        y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        h = self.head_loss
        loss = consensus_loss(e, self.classifier.weight, y, self.received, h.rho, h.scale, h.margin, h.kind)
        loss.backward()
        with torch.no_grad():
            correct = int((cosines(e, self.classifier.weight).argmax(1) == y).sum())
        return e.grad.numpy(), loss.item(), correct

    def classify(self, embeddings: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        with torch.no_grad():
            cos = cosines(torch.from_numpy(np.array(embeddings, dtype=np.float32)), self.classifier.weight)
            y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
            return F.cross_entropy(self.head_loss.scale * cos, y).item(), int((cos.argmax(1) == y).sum())

    def release(self, config: DPLCConfig, rng: np.random.Generator) -> DPLCResult:
        """DPLC on the head's current class centres (counted: every call composes into the device's epsilon)."""
        if config.rho != self.head_loss.rho:
            raise ValueError(f"the loss's cap radius ({self.head_loss.rho}) must be the released clusters' ({config.rho})")
        self.dplc_calls += 1
        return dplc(self.classifier.weight.detach().numpy(), config, rng)


async def exchange_clusters(client: DeviceClient, engine: ConsensusEngine, config: DPLCConfig,
                            rng: np.random.Generator) -> DPLCResult:
    """Release this device's clusters and adopt the other devices' (between batches: none may be pending)."""
    result = engine.release(config, rng)
    reply = await client.request(client.session.clusters(result.clusters), {m.CLUSTERS}, None)
    engine.received = torch.from_numpy(np.array(reply["clusters"], dtype=np.float32)) if len(reply["clusters"]) else None
    return result


async def correct_head(client: DeviceClient, engine: ConsensusEngine) -> None:
    """FedGC on device heads (opt-in, SPEC.md section 8.2): upload the head's class embeddings, adopt the server's
    correction. The server then holds this device's class embeddings (docs/fedgc.md). Between batches only."""
    reply = await client.request(client.session.class_embeddings(engine.classifier.weight.detach().numpy()),
                                 {m.CLASS_EMBEDDINGS}, None)
    corrected = reply["class_embeddings"]
    if corrected.shape != tuple(engine.classifier.weight.shape):
        raise ValueError(f"the server returned a head of shape {corrected.shape}, "
                         f"not {tuple(engine.classifier.weight.shape)}")
    with torch.no_grad():
        engine.classifier.weight.copy_(torch.from_numpy(np.array(corrected, dtype=np.float32)))


async def train_u_split(client: DeviceClient, engine: ConsensusEngine, images: np.ndarray, labels: np.ndarray,
                        epochs: int, batch_size: int, exchange_every: int | None, config: DPLCConfig,
                        seed: int = 0, fedgc_every: int | None = None) -> list[float]:
    """Shuffled batches of this device's own photos (labels 0..C-1 of its people) through the U-shaped split;
    every `exchange_every` batches (None: never, the plain U-split baseline) a cluster exchange, and every
    `fedgc_every` batches (None: never; opt-in) a FedGC head correction. Returns the batch losses. The client
    must be connected; batch ids continue from the engine's last committed one."""
    if epochs < 1 or batch_size < 1 or any(e is not None and e < 1 for e in (exchange_every, fedgc_every)):
        raise ValueError(f"need epochs, batch_size, exchange_every, fedgc_every >= 1; got {epochs}, {batch_size}, "
                         f"{exchange_every}, {fedgc_every}")
    rng = np.random.default_rng(seed)
    losses, done = [], 0
    for _ in range(epochs):
        order = rng.permutation(len(images))
        for i in range(0, len(order), batch_size):
            if exchange_every is not None and done % exchange_every == 0 and done > 0:
                await exchange_clusters(client, engine, config, rng)
            if fedgc_every is not None and done % fedgc_every == 0 and done > 0:
                await correct_head(client, engine)
            idx = order[i:i + batch_size]
            result = await client.train_batch(engine.committed + 1, images[idx], labels[idx], idx)
            losses.append(result.loss)
            done += 1
    return losses
