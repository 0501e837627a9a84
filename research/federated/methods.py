"""Private-head federated methods, in process: FedPE, the fixed random head, FedGC and PrivacyFace.

Every client (a virtual client of k people, `population.virtual_clients`) keeps its own head W_k
across rounds (`splitface.device.federated.private_head`). A round samples `clients_per_round` clients
uniformly without replacement, trains each from the global backbone and averages the backbone changes
(plain FedAvg: nothing is clipped or noised, so the backbone updates carry no guarantee; only
PrivacyFace's cluster releases are accounted). What each method adds (the fixed head, FedGC's
correction, PrivacyFace's relay of DPLC clusters) is its strategy (strategies.py); the loop is the
one every federated method runs (rounds.FederatedRun). This module holds their configuration and the
linkage attacks on the heads a server holds: enough for a reduced comparison, not a deployment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from splitface.common.dplc import DPLCConfig
from splitface.device.federated.private_head import HeadConfig, class_means
from splitface.common.models import ModelSpec

from research.evaluation.verification import embed_in_batches
from research.federated.rounds import FederatedRun
from research.federated.evaluate import recalibrate_bn
from research.federated.population import Population

METHODS = ("fedpe", "fixed-head", "fedgc", "privacyface")


@dataclass(frozen=True)
class MethodConfig:
    method: str
    rounds: int = 8
    users_per_client: int = 4
    clients_per_round: int = 10
    head: HeadConfig = field(default_factory=HeadConfig)
    server_lr: float = 1.0
    fedgc_lambda: float = 20.0  # the paper's best
    fedgc_scale: float = 1.0
    dplc: DPLCConfig = field(default_factory=DPLCConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, not {self.method!r}")
        if self.rounds < 1 or self.users_per_client < 1 or self.clients_per_round < 1 or not self.server_lr > 0:
            raise ValueError("rounds, users_per_client, clients_per_round and server_lr must be positive")
        if (self.method == "fixed-head") == self.head.train_head:
            raise ValueError("fixed-head (and only it) needs head.train_head = False")
        if self.method == "privacyface" and self.head.rho != self.dplc.rho:
            raise ValueError(f"the loss's cap radius (head.rho {self.head.rho}) must be the released clusters' "
                             f"(dplc.rho {self.dplc.rho})")


class PrivateHeadRun(FederatedRun):
    """A private-head run: the one round loop (rounds.FederatedRun) with the method's strategy, in process and
    not checkpointed. `heads`, `clusters`, `dplc_calls` (and `privacy()`) are the strategy's state."""

    def __init__(self, config: MethodConfig, spec: ModelSpec, population: Population,
                 init_state: dict[str, torch.Tensor]) -> None:
        super().__init__(config, spec, population, init_state)

    def _first_head(self, c: int, images: np.ndarray, labels: np.ndarray) -> torch.Tensor:
        """Client c's first head (its classes' means under the current backbone, or fixed-head's random one)."""
        head = self.strategy.first_head(self, c, images, labels)
        return class_means(self.spec, self.backbone.state_dict(), images, labels) if head is None else head

    def _received(self, c: int) -> torch.Tensor | None:
        return self.strategy.received(c)

    def run(self, log: Callable[[str], None] = print) -> list[dict[str, Any]]:  # type: ignore[override]
        return super().run(log=log)


@torch.no_grad()
def class_embedding_linkage(run: PrivateHeadRun, public_images: np.ndarray) -> dict[str, float]:
    """What a server holding the heads learns: for each held class embedding (row i of client c's head is the
    person clients[c][i]), is the private photo whose embedding (the run's backbone, batch norm re-estimated on
    public images) is nearest to it a photo of that person? Returns the top-1 rate over all held rows, chance
    (the average share of the photos that are the row's person's) and the rows counted."""
    model = recalibrate_bn(run.backbone, public_images)
    photos = F.normalize(torch.from_numpy(embed_in_batches(lambda x: model(torch.from_numpy(x)).numpy(),
                                                           run.population.images)), dim=1)
    hits, chance, rows = 0, 0.0, 0
    for c, head in run.heads.items():
        users = np.unique(run.population.of_users(run.clients[c])[1])
        nearest = (F.normalize(head.float(), dim=1) @ photos.T).argmax(dim=1).numpy()
        hits += int((run.population.labels[nearest] == users).sum())
        chance += float(sum((run.population.labels == u).mean() for u in users))
        rows += len(users)
    return {"linkage_top1": hits / rows, "linkage_chance": chance / rows, "linkage_rows": rows}


@torch.no_grad()
def inverted_class_embedding_linkage(run: PrivateHeadRun, public_images: np.ndarray,
                                     recognize: Callable[[np.ndarray], np.ndarray],
                                     photo_vectors: np.ndarray) -> dict[str, float]:
    """The stronger attack on uploaded heads: the server (holding the backbone) fits the audit's ridge inversion
    from public faces' embeddings to the faces (`audit.inversion.tuned_inversion`, no private data), turns every
    held class embedding into a 32 px face, and asks a recognizer (`recognize`: images in [0, 1] -> vectors; the
    audit's is dlib) which private photo it is nearest to (`photo_vectors`: that recognizer on
    `run.population.images`, in order). Returns the top-1 rate that the photo is the row's person, chance as in
    `class_embedding_linkage`, and the inversion's own linkage on held-out public faces (its quality)."""
    from research.audit.inversion import tuned_inversion
    from research.audit.metrics import cosine
    if len(photo_vectors) != len(run.population.images):
        raise ValueError(f"{len(photo_vectors)} photo vectors for {len(run.population.images)} photos")
    model = recalibrate_bn(run.backbone, public_images)
    public = F.normalize(torch.from_numpy(embed_in_batches(lambda x: model(torch.from_numpy(x)).numpy(),
                                                           public_images)), dim=1).numpy()
    inversion, chosen = tuned_inversion(public[:, :, None, None], public_images.astype(np.float32) / 255,
                                        pools=(1,))
    rows = [(c, F.normalize(head.float(), dim=1).numpy()) for c, head in run.heads.items()]
    faces = inversion.reconstruct(np.concatenate([h for _, h in rows])[:, :, None, None])
    nearest = cosine(recognize(faces), photo_vectors).argmax(axis=1)
    users = np.concatenate([np.unique(run.population.of_users(run.clients[c])[1]) for c, _ in rows])
    chance = float(np.mean([(run.population.labels == u).mean() for u in users]))
    return {"inverted_linkage_top1": float((run.population.labels[nearest] == users).mean()),
            "inverted_linkage_chance": chance, "inverted_linkage_rows": len(users),
            "inversion_public_holdout_linkage": chosen["public_holdout_linkage"]}
