"""The eight federated methods as strategies of the one round loop (`rounds.FederatedRun`).

The loop does what every method does the same way: the run's seeded global backbone, the virtual
clients, the round's tasks handed to a backend, the history, checkpoints and the resumption. A
strategy holds what differs, and the state the server keeps for it:
- `setup`: what the server holds beside the backbone (a global head and the server optimizer, the
  accountant, the clip norm; or the clients' heads and released clusters);
- `configure_round`: which clients take part (Poisson sampling for the DP family, a uniform draw
  without replacement for the private-head family) and the task each one runs;
- `aggregate_round`: how the answers change the global model (clipped, noised and stepped by a
  server optimizer; or a plain float64 average), plus what the server does after (FedGC's correction
  of every held head, PrivacyFace's relay of the round's cluster releases);
- `privacy`, `state_dict` / `load_state_dict`: the run's guarantee and the strategy's checkpointed state.

Each method's arithmetic is the one its former loop did, in the same order and from the same seeds,
so a run gives the same model bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.accountants.clusters import ClusterAccountant
from splitface.common.accountants.user_level import UserLevelAccountant, combined_noise, default_delta, update_noise
from splitface.common.dplc import DPLCConfig, dplc
from splitface.common.models import ModelSpec, build_classifier
from splitface.device.federated import ClientResult
from splitface.device.federated.local_round import HEAD_PREFIX
from splitface.device.federated.private_head import HeadConfig, HeadResult, class_means, train_private_head

from research.federated.aggregation import adapt_clip_norm, aggregate, check_update, poisson_sample
from research.federated.fedgc import gradient_correction
from research.federated.tasks import ClientTask, derived_seed

if TYPE_CHECKING:
    from research.federated.rounds import FederatedRun


class Strategy:
    """One federated method: the hooks `FederatedRun` calls, and the server state they keep."""
    name: ClassVar[str]

    def __init__(self, config: Any) -> None:
        self.config = config

    def setup(self, run: FederatedRun) -> None:
        """Build what the server holds beside the backbone. Called once, inside the run's RNG fork seeded with
        config.seed right after the backbone was built, so a global head's first weights come from that seed."""

    def configure_round(self, run: FederatedRun, r: int, backbone_state: dict[str, torch.Tensor]) -> list[Any]:
        """Round r's tasks, one per taking-part client in client order (`backbone_state`: the global weights)."""
        raise NotImplementedError

    def aggregate_round(self, run: FederatedRun, r: int, tasks: Sequence[Any], answers: Sequence[Any]) -> dict:
        """Apply the answers (None: a client that did not answer) to the global model; the round's row."""
        raise NotImplementedError

    def privacy(self, run: FederatedRun) -> dict[str, Any]:
        """The guarantee spent so far."""
        raise NotImplementedError

    def round_privacy(self, run: FederatedRun) -> dict[str, Any]:
        """What each round's row reports of privacy: the guarantee so far by default; nothing for the
        private-head family, whose identity-level epsilon is reported once for the run."""
        return self.privacy(run)

    def progress(self, run: FederatedRun, row: dict[str, Any]) -> str:
        """The round's log line."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the strategy (entries of the checkpoint's top-level dict)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# ---- user-level DP family: a global model stepped by a server optimizer ------------------------------------

class FedEmb(Strategy):
    """FedAvg of the backbone; each client trains a throw-away head over its own people (Xu et al. 2022's
    FedEmb). Poisson-sampled clients, the average update stepped by SGD with momentum on the server."""
    name = "fedemb"
    private: ClassVar[bool] = False
    global_head: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if config.private != self.private or config.global_head != self.global_head:
            raise ValueError(f"{type(self).__name__} cannot run the method {config.method!r}")

    def setup(self, run: FederatedRun) -> None:
        config, users = self.config, len(run.population.users)
        self.sampling_rate = min(1.0, config.clients_per_round / len(run.clients))
        self.delta = config.delta or default_delta(users)
        # Andrew et al.'s expected clients / 20, but at least 2z (then the count costs z_update ~3% more noise).
        self.count_noise_std = config.count_noise_std or max(config.clients_per_round / 20, 2 * config.noise_multiplier)
        if self.private and config.target_quantile is not None:
            self.z_update = update_noise(config.noise_multiplier, self.count_noise_std)
        else:
            self.z_update = config.noise_multiplier
        self.head = build_classifier(run.spec, users) if self.global_head else None
        self.optimizer = torch.optim.SGD(self.parameters(run).values(), lr=config.server_lr,
                                         momentum=config.server_momentum)
        self.clip_norm = config.clip_norm
        self.accountant = UserLevelAccountant()

    def parameters(self, run: FederatedRun) -> dict[str, nn.Parameter]:
        """The global model's parameters, named as the clients' updates name them."""
        params = dict(run.backbone.named_parameters())
        if self.head is not None:
            params.update({HEAD_PREFIX + k: p for k, p in self.head.named_parameters()})
        return params

    def configure_round(self, run: FederatedRun, r: int, backbone_state: dict[str, torch.Tensor]) -> list[ClientTask]:
        config = self.config
        sampled = poisson_sample(len(run.clients), self.sampling_rate, config.seed, r)
        head_state = None if self.head is None else {k: v.detach().clone() for k, v in self.head.state_dict().items()}
        tasks = []
        for c in sampled:
            images, labels = run.population.of_users(run.clients[c])
            tasks.append(ClientTask(r, int(c), run.spec, backbone_state, images, labels, config.local(self.clip_norm),
                                    derived_seed(config.seed, r, 0, int(c)), head_state))
        return tasks

    def aggregate_round(self, run: FederatedRun, r: int, tasks: Sequence[ClientTask],
                        answers: Sequence[ClientResult | None]) -> dict[str, Any]:
        config = self.config
        joined = [t.client for t, a in zip(tasks, answers) if a is not None]
        results = [a for a in answers if a is not None]
        params = self.parameters(run)
        generator = torch.Generator().manual_seed(derived_seed(config.seed, r, 1))
        if self.private:
            round_sum = aggregate(results, params, self.clip_norm, self.z_update * self.clip_norm,
                                  config.clients_per_round, generator)
        else:
            round_sum = aggregate(results, params, math.inf, 0.0, max(1, len(results)), generator)
        if self.private or results:  # a non-private round nobody joined changes nothing
            for name, p in params.items():
                p.grad = -round_sum.mean[name]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        clip_used, fraction = self.clip_norm, None
        if self.private:
            if config.target_quantile is not None:
                self.clip_norm, fraction = adapt_clip_norm(self.clip_norm, round_sum.within_clip,
                                                           config.clients_per_round, config.target_quantile,
                                                           config.clip_lr, self.count_noise_std, generator)
            self.accountant.record(self.sampling_rate,
                                   combined_noise(self.z_update, self.count_noise_std)
                                   if config.target_quantile is not None else self.z_update)
        return {"sampled": len(tasks), "clients": len(results),
                "users": int(sum(len(run.clients[c]) for c in joined)),
                "images": int(sum(x.examples for x in results)),
                "loss": float(np.mean([x.loss for x in results])) if results else None,
                "median_norm": float(np.median([x.norm for x in results])) if results else None,
                "clip_norm": clip_used if self.private else None, "within_clip_noised": fraction}

    def privacy(self, run: FederatedRun) -> dict[str, Any]:
        """User-level (epsilon, delta) spent so far (None where the run is not private)."""
        if not self.private:
            return {"epsilon": None, "epsilon_rdp": None, "delta": None}
        return {**self.accountant.epsilon(self.delta), "delta": self.delta}

    def progress(self, run: FederatedRun, row: dict[str, Any]) -> str:
        acc = f" view1 {row['view1_accuracy']:.3f}" if "view1_accuracy" in row else ""
        eps = f" eps {row['epsilon']:.3g}" if row.get("epsilon") is not None else ""
        return (f"round {row['round']}/{self.config.rounds}: {row['clients']} of {row['sampled']} sampled clients, "
                f"{row['users']} users, loss {row['loss'] if row['loss'] is None else round(row['loss'], 3)}{eps}{acc} "
                f"({row['wall_s']:.1f} s)")

    def state_dict(self) -> dict[str, Any]:
        return {"head": None if self.head is None else self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                "clip_norm": self.clip_norm, "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.head is not None:
            self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.clip_norm = state["clip_norm"]
        self.accountant = UserLevelAccountant(state["accountant"])


class FedAvg(FedEmb):
    """FedAvg of the backbone and one global head over every user (each client trains its users' rows)."""
    name = "fedavg"
    global_head = True


class DPFedEmb(FedEmb):
    """DP-FedEmb: FedEmb with each update clipped, the sum noised (user-level DP over Poisson-sampled rounds)
    and, optionally, the clip norm adapted to a quantile of the update norms (Andrew et al. 2021)."""
    name = "dp-fedemb"
    private = True


class DPFedAvg(DPFedEmb):
    """DP-FedAvg: DP-FedEmb's clipping and noise on FedAvg's global backbone and head."""
    name = "dp-fedavg"
    global_head = True


# ---- private-head family: each client keeps its own head; a plain average of the backbone ----------------

@dataclass
class PrivateHeadTask:
    """One client's round with its persistent head (None: its first round, the head starts from its data)."""
    round: int
    client: int
    spec: ModelSpec
    backbone_state: dict[str, torch.Tensor]
    images: np.ndarray
    labels: np.ndarray
    head: torch.Tensor | None
    config: HeadConfig
    seed: int
    clusters: torch.Tensor | None = None  # PrivacyFace: the other clients' released clusters
    dplc: DPLCConfig | None = None  # PrivacyFace: release DPLC clusters of the trained head
    dplc_seed: int = 0

    def run(self) -> PrivateHeadResult:
        head = self.head if self.head is not None else class_means(self.spec, self.backbone_state, self.images,
                                                                    self.labels)
        result = train_private_head(self.spec, self.backbone_state, head, self.images, self.labels, self.config,
                                    self.seed, self.clusters)
        released = None if self.dplc is None else \
            dplc(result.head.numpy(), self.dplc, np.random.default_rng(self.dplc_seed)).clusters
        return PrivateHeadResult(result, released)


@dataclass
class PrivateHeadResult:
    trained: HeadResult
    clusters: np.ndarray | None  # what PrivacyFace's client released this round


class FedPE(Strategy):
    """Private heads (each client's W_k stays on it), no correction: FedGC's baseline. Clients are drawn
    uniformly without replacement, the backbone changes averaged (no clipping, no noise, no guarantee). A head
    starts as its classes' mean embeddings under the backbone of the client's first round (local data only)."""
    name = "fedpe"

    def setup(self, run: FederatedRun) -> None:
        if self.config.clients_per_round > len(run.clients):
            raise ValueError(f"{self.config.clients_per_round} clients per round, only {len(run.clients)} clients")
        self.heads: dict[int, torch.Tensor] = {}
        self.clusters: dict[int, np.ndarray] = {}  # PrivacyFace: each client's latest release
        self.accountant = ClusterAccountant(self.config.dplc, len(run.clients))

    @property
    def dplc_calls(self) -> np.ndarray:
        return self.accountant.calls

    def first_head(self, run: FederatedRun, c: int, images: np.ndarray, labels: np.ndarray) -> torch.Tensor | None:
        """The head client c starts from (None: its classes' means, computed by the client itself)."""
        return None

    def received(self, c: int) -> torch.Tensor | None:
        """The clusters client c trains against (PrivacyFace)."""
        return None

    def releases(self) -> bool:
        return False

    def configure_round(self, run: FederatedRun, r: int, backbone_state: dict[str, torch.Tensor]) -> list:
        config = self.config
        rng = np.random.default_rng(derived_seed(config.seed, r, 2))
        sampled = np.sort(rng.choice(len(run.clients), config.clients_per_round, replace=False))
        tasks = []
        for c in map(int, sampled):
            images, labels = run.population.of_users(run.clients[c])
            head = self.heads[c] if c in self.heads else self.first_head(run, c, images, labels)
            tasks.append(PrivateHeadTask(r, c, run.spec, backbone_state, images, labels, head, config.head,
                                         derived_seed(config.seed, r, 0, c), self.received(c),
                                         config.dplc if self.releases() else None, derived_seed(config.seed, r, 3, c)))
        return tasks

    def aggregate_round(self, run: FederatedRun, r: int, tasks: Sequence[PrivateHeadTask],
                        answers: Sequence[PrivateHeadResult | None]) -> dict[str, Any]:
        config = self.config
        if any(a is None for a in answers):
            raise RuntimeError(f"{config.method} needs every sampled client's answer")
        template = dict(run.backbone.named_parameters())
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in template.items()}
        losses, images_seen = [], 0
        releases: dict[int, np.ndarray] = {}  # this round's clusters: relayed from the next round on
        for task, answer in zip(tasks, answers):
            result = answer.trained
            check_update(result.delta, template)
            for k, v in result.delta.items():
                total[k] += v.double()
            self.heads[task.client] = result.head
            losses.append(result.loss)
            images_seen += result.examples
            if answer.clusters is not None:
                releases[task.client] = answer.clusters
                self.accountant.record(task.client)
        self.clusters.update(releases)
        with torch.no_grad():
            for k, p in template.items():
                p += (config.server_lr * total[k] / len(tasks)).to(p.dtype)
        self.after_round()
        released = self.releases()
        return {"clients": len(tasks), "images": images_seen, "loss": float(np.mean(losses)),
                "clusters_released": sum(map(len, releases.values())) if released else None,
                "clusters_received_mean": float(np.mean([0 if t.clusters is None else len(t.clusters)
                                                         for t in tasks])) if released else None}

    def after_round(self) -> None:
        """What the server does with the heads once the backbone is averaged (FedGC)."""

    def privacy(self, run: FederatedRun) -> dict[str, Any]:
        """The backbone averaging is not private in any method of this family."""
        return {"epsilon": None, "delta": None}

    def round_privacy(self, run: FederatedRun) -> dict[str, Any]:
        return {}

    def progress(self, run: FederatedRun, row: dict[str, Any]) -> str:
        extra = "" if row["clusters_released"] is None else \
            f", {row['clusters_released']} clusters released, {row['clusters_received_mean']:.1f} received"
        return (f"{self.config.method} round {row['round']}/{self.config.rounds}: loss {row['loss']:.3f}{extra} "
                f"({row['wall_s']:.1f} s)")

    def state_dict(self) -> dict[str, Any]:
        return {"heads": dict(self.heads), "clusters": dict(self.clusters), "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.heads, self.clusters = dict(state["heads"]), dict(state["clusters"])
        self.accountant.load_state_dict(state["accountant"])


class FixedHead(FedPE):
    """FedPE with every head a random unit matrix that is never trained (the other baseline)."""
    name = "fixed-head"

    def first_head(self, run: FederatedRun, c: int, images: np.ndarray, labels: np.ndarray) -> torch.Tensor:
        g = torch.Generator().manual_seed(derived_seed(self.config.seed, 0, 4, c))
        return F.normalize(torch.randn(len(np.unique(labels)), run.spec.embedding_dim, generator=g), dim=1)


class FedGC(FedPE):
    """FedGC: the server holds every head it has been sent and corrects them all after each round
    (`fedgc.gradient_correction`), returning each client its corrected W_k."""
    name = "fedgc"

    def after_round(self) -> None:
        config = self.config
        self.heads.update(gradient_correction(self.heads, lr=config.head.lr * config.head.head_lr_scale,
                                              lam=config.fedgc_lambda, scale=config.fedgc_scale))


class PrivacyFace(FedPE):
    """PrivacyFace: after training, each client releases DPLC clusters of its head; at the round's end they
    replace its previous ones, and from the next round on every other client trains with the consensus loss
    against them. Its identity-level guarantee covers the releases (the backbone averaging has none)."""
    name = "privacyface"

    def received(self, c: int) -> torch.Tensor | None:
        others = [v for k, v in self.clusters.items() if k != c and len(v)]
        return torch.from_numpy(np.concatenate(others)) if others else None

    def releases(self) -> bool:
        return True

    def privacy(self, run: FederatedRun) -> dict[str, Any]:
        """Identity-level epsilon for the client with the most DPLC calls (an identity is in one client)."""
        if not self.dplc_calls.max():
            return {"epsilon": None, "delta": None}
        return self.accountant.epsilon(self.config.dplc.delta)


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (
    DPFedEmb, DPFedAvg, FedAvg, FedEmb, FedPE, FixedHead, FedGC, PrivacyFace)}


def strategy_for(config: Any) -> Strategy:
    """The strategy of `config.method` (a FederatedConfig's or a MethodConfig's), with that config."""
    if config.method not in STRATEGIES:
        raise ValueError(f"method must be one of {tuple(STRATEGIES)}, not {config.method!r}")
    return STRATEGIES[config.method](config)
