"""Private-head federated methods, in process: FedPE, the fixed random head, FedGC and PrivacyFace.

Every client (a virtual client of k people, `population.virtual_clients`) keeps its own head W_k
across rounds (`splitface.device.federated.private_head`). A round: sample `clients_per_round` clients
uniformly without replacement (seeded by (seed, round)), train each from the global backbone, average
the backbone changes (plain FedAvg: nothing here is clipped or noised, so the backbone updates carry no
guarantee; only PrivacyFace's cluster releases are accounted), then per method:
- fedpe: nothing more (private heads, no correction; FedGC's baseline);
- fixed-head: as fedpe but every head is a random unit matrix never trained (the other baseline);
- fedgc: the server holds every head it has been sent and applies `fedgc.gradient_correction` to them
  all, returning each its corrected W_k;
- privacyface: after training, each client runs DPLC on its head; at the round's end its clusters replace
  its previous ones, and in later rounds a client trains with the consensus loss against every other
  client's latest clusters (a round's releases are relayed from the next round on).
A head starts as its classes' mean embeddings under the backbone of the client's first round (local
data only, no release), except fixed-head's. This is a separate loop from engine.FederatedRun (no
checkpoints, no DP on the backbone): enough for a reduced comparison, not a deployment.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from splitface.common.dplc import DPLCConfig, dplc
from splitface.device.federated.private_head import HeadConfig, class_means, train_private_head
from splitface.common.models import ModelSpec, build_backbone

from research.federated.aggregation import check_update
from research.evaluation.verification import embed_in_batches
from research.federated.rounds import derived_seed
from research.federated.evaluate import recalibrate_bn
from research.federated.fedgc import gradient_correction
from research.federated.population import Population, virtual_clients
from splitface.common.accountants.clusters import identity_epsilon

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


class PrivateHeadRun:
    """The server's state: the global backbone, the heads it holds (FedGC) or the clients keep, the clusters."""

    def __init__(self, config: MethodConfig, spec: ModelSpec, population: Population,
                 init_state: dict[str, torch.Tensor]) -> None:
        self.config, self.spec, self.population = config, spec, population
        self.clients = virtual_clients(len(population.users), config.users_per_client, config.seed)
        if config.clients_per_round > len(self.clients):
            raise ValueError(f"{config.clients_per_round} clients per round, only {len(self.clients)} clients")
        with torch.random.fork_rng():
            self.backbone = build_backbone(spec)
        self.backbone.load_state_dict(init_state)
        self.heads: dict[int, torch.Tensor] = {}
        self.clusters: dict[int, np.ndarray] = {}  # privacyface: each client's latest release
        self.dplc_calls = np.zeros(len(self.clients), dtype=np.int64)
        self.round = 0

    def _first_head(self, c: int, images: np.ndarray, labels: np.ndarray) -> torch.Tensor:
        if self.config.method == "fixed-head":
            g = torch.Generator().manual_seed(derived_seed(self.config.seed, 0, 4, c))
            return F.normalize(torch.randn(len(np.unique(labels)), self.spec.embedding_dim, generator=g), dim=1)
        return class_means(self.spec, self.backbone.state_dict(), images, labels)

    def _received(self, c: int) -> torch.Tensor | None:
        others = [v for k, v in self.clusters.items() if k != c and len(v)]
        return torch.from_numpy(np.concatenate(others)) if others else None

    def run_round(self) -> dict[str, Any]:
        config, r = self.config, self.round + 1
        started = time.time()
        rng = np.random.default_rng(derived_seed(config.seed, r, 2))
        sampled = np.sort(rng.choice(len(self.clients), config.clients_per_round, replace=False))
        state = {k: v.detach().clone() for k, v in self.backbone.state_dict().items()}
        template = dict(self.backbone.named_parameters())
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in template.items()}
        losses, images_seen, received = [], 0, []
        releases: dict[int, np.ndarray] = {}  # this round's clusters: relayed from the next round on
        for c in map(int, sampled):
            images, labels = self.population.of_users(self.clients[c])
            if c not in self.heads:
                self.heads[c] = self._first_head(c, images, labels)
            clusters = self._received(c) if config.method == "privacyface" else None
            received.append(0 if clusters is None else len(clusters))
            result = train_private_head(self.spec, state, self.heads[c], images, labels, config.head,
                                        derived_seed(config.seed, r, 0, c), clusters)
            check_update(result.delta, template)
            for k, v in result.delta.items():
                total[k] += v.double()
            self.heads[c] = result.head
            losses.append(result.loss)
            images_seen += result.examples
            if config.method == "privacyface":
                out = dplc(result.head.numpy(), config.dplc, np.random.default_rng(derived_seed(config.seed, r, 3, c)))
                releases[c] = out.clusters
                self.dplc_calls[c] += 1
        self.clusters.update(releases)
        with torch.no_grad():
            for k, p in template.items():
                p += (config.server_lr * total[k] / len(sampled)).to(p.dtype)
        if config.method == "fedgc":
            self.heads.update(gradient_correction(self.heads, lr=config.head.lr * config.head.head_lr_scale,
                                                  lam=config.fedgc_lambda, scale=config.fedgc_scale))
        self.round = r
        return {"round": r, "clients": len(sampled), "images": images_seen, "loss": float(np.mean(losses)),
                "clusters_released": sum(map(len, releases.values())) if config.method == "privacyface" else None,
                "clusters_received_mean": float(np.mean(received)) if config.method == "privacyface" else None,
                "wall_s": time.time() - started}

    def privacy(self) -> dict[str, Any]:
        """PrivacyFace's identity-level epsilon for the client with the most DPLC calls (an identity is in one
        client); the backbone averaging is not private in any method here."""
        if self.config.method != "privacyface" or not self.dplc_calls.max():
            return {"epsilon": None, "delta": None}
        return identity_epsilon(self.config.dplc, int(self.dplc_calls.max()), self.config.dplc.delta)

    def run(self, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
        history = []
        while self.round < self.config.rounds:
            row = self.run_round()
            history.append(row)
            extra = "" if row["clusters_released"] is None else \
                f", {row['clusters_released']} clusters released, {row['clusters_received_mean']:.1f} received"
            log(f"{self.config.method} round {row['round']}/{self.config.rounds}: loss {row['loss']:.3f}{extra} "
                f"({row['wall_s']:.1f} s)")
        return history


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
