"""Federated rounds with the in-process backend: sampling, local training, aggregation, the server
optimizer, accounting and an atomic checkpoint per round.

Round r: Poisson-sample virtual clients (from (seed, r) only), run `train_client` for each (the
backend), bound and sum their updates, add noise z*C, step the server optimizer (SGD with momentum
and a server learning rate, the average update as the negative gradient), adapt the clip norm, record
the round with the accountant, then write the checkpoint (global model, optimizer, clip norm,
accountant, round number) atomically. A run killed anywhere resumes from the last checkpoint: a round
whose checkpoint was not written is run again from the same state with the same seeds, and a written
one is never run again, so no round is applied twice.

The round logic does not know where updates come from: a backend takes the round's `ClientTask`s and
returns one `ClientResult` per task, or None for a client that did not answer (left out of the sum). The
backends: `in_process` (default), `ray_backend` (ray_backend.py: the same function as Ray tasks) and
`WebsocketBackend` (websocket.py: the same function in device processes, over the protocol's round messages).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from splitface.device.federated import ClientResult, LocalConfig, train_client
from splitface.device.federated.local_round import HEAD_PREFIX
from splitface.common.models import ModelSpec, build_backbone, build_classifier

from splitface.server.checkpoint import load_checkpoint, save_checkpoint
from splitface.common.accountants.user_level import UserLevelAccountant, combined_noise, default_delta, update_noise
from research.federated.aggregation import adapt_clip_norm, aggregate, poisson_sample
from research.federated.population import Population, check_partition, virtual_clients

METHODS = ("fedavg", "fedemb", "dp-fedavg", "dp-fedemb")
CRASH_EXIT_CODE = 75


@dataclass(frozen=True)
class FederatedConfig:
    """One federated run. `clients_per_round` is the expected number of virtual clients a round samples."""
    method: str = "dp-fedemb"
    rounds: int = 10
    users_per_client: int = 4
    clients_per_round: float = 10.0
    local_epochs: int = 2
    batch_size: int = 8
    client_lr: float = 0.01
    head_lr_scale: float = 10.0
    server_lr: float = 1.0
    server_momentum: float = 0.9
    noise_multiplier: float = 0.0  # z: the total, adaptive clipping's count included
    clip_norm: float = 0.05  # C (the starting value with adaptive clipping): about the median update at lr 0.01
    target_quantile: float | None = None  # adaptive clipping's gamma; None: fixed clip norm
    clip_lr: float = 0.2
    count_noise_std: float | None = None  # sigma_b; None: max(expected clients / 20 (Andrew et al.), 2z)
    delta: float | None = None  # None: 1 / users^1.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, not {self.method!r}")
        if self.rounds < 1 or self.users_per_client < 1 or not self.clients_per_round > 0:
            raise ValueError("rounds, users_per_client and clients_per_round must be positive")
        if not self.clip_norm > 0 or not self.server_lr > 0 or not 0 <= self.server_momentum < 1:
            raise ValueError("clip_norm and server_lr must be > 0, server_momentum in [0, 1)")
        if self.private and not self.noise_multiplier > 0:
            raise ValueError(f"{self.method} needs noise_multiplier > 0")
        if not self.private and (self.noise_multiplier or self.target_quantile is not None):
            raise ValueError(f"{self.method} is not private: no noise multiplier or adaptive clipping")
        if self.target_quantile is not None and not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile}")

    @property
    def private(self) -> bool:
        return self.method.startswith("dp-")

    @property
    def global_head(self) -> bool:
        return self.method in ("fedavg", "dp-fedavg")

    def local(self, clip_norm: float) -> LocalConfig:
        return LocalConfig(self.local_epochs, self.batch_size, self.client_lr, self.head_lr_scale,
                           clip_norm=clip_norm if self.private else math.inf)


@dataclass
class ClientTask:
    """Everything one client needs for a round: what ROUND_START and MODEL carry, plus its own data (which a
    device process holds itself)."""
    round: int
    client: int  # the virtual client's index
    spec: ModelSpec
    backbone_state: dict[str, torch.Tensor]
    images: np.ndarray
    labels: np.ndarray
    config: LocalConfig
    seed: int
    head_state: dict[str, torch.Tensor] | None


# One result per task, in task order; None: that client did not answer in time (left out of the round).
Backend = Callable[[Sequence[ClientTask]], list[ClientResult | None]]


def run_task(task: ClientTask) -> ClientResult:
    """The client's work for one task: the function every backend runs (here, in a Ray worker, on a device)."""
    return train_client(task.spec, task.backbone_state, task.images, task.labels, task.config, task.seed,
                        task.head_state)


def in_process(tasks: Sequence[ClientTask]) -> list[ClientResult | None]:
    """The default backend: the clients one after another in this process, no sockets."""
    return [run_task(t) for t in tasks]


def derived_seed(seed: int, round_number: int, stream: int, index: int = 0) -> int:
    """A seed from (run seed, round, stream, index) alone: stream 0 = client `index`'s training, 1 = the
    server's noise. No seed depends on what ran before, so a resumed round draws what the first try drew."""
    return int(np.random.SeedSequence([seed, round_number, stream, index]).generate_state(1)[0])


class SimulatedCrash(SystemExit):
    """A deliberate stop mid-round (tests of exactly-once rounds); the process exits with CRASH_EXIT_CODE."""


class FederatedRun:
    """The server's state of one run, and the loop over its rounds."""

    def __init__(self, config: FederatedConfig, spec: ModelSpec, population: Population,
                 init_state: dict[str, torch.Tensor], out: Path, backend: Backend = in_process) -> None:
        self.config, self.spec, self.population, self.out, self.backend = config, spec, population, Path(out), backend
        self.clients = virtual_clients(len(population.users), config.users_per_client, config.seed)
        check_partition(self.clients, len(population.users))
        self.sampling_rate = min(1.0, config.clients_per_round / len(self.clients))
        self.delta = config.delta or default_delta(len(population.users))
        # Andrew et al.'s expected clients / 20, but at least 2z (then the count costs z_update ~3% more noise).
        self.count_noise_std = config.count_noise_std or max(config.clients_per_round / 20,
                                                             2 * config.noise_multiplier)
        if config.private and config.target_quantile is not None:
            self.z_update = update_noise(config.noise_multiplier, self.count_noise_std)
        else:
            self.z_update = config.noise_multiplier
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            self.backbone = build_backbone(spec)
            self.head = build_classifier(spec, len(population.users)) if config.global_head else None
        self.backbone.load_state_dict(init_state)
        self.optimizer = torch.optim.SGD(self._parameters().values(), lr=config.server_lr,
                                         momentum=config.server_momentum)
        self.round = 0
        self.clip_norm = config.clip_norm
        self.accountant = UserLevelAccountant()
        self.history: list[dict[str, Any]] = []
        self._resume()

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def _parameters(self) -> dict[str, nn.Parameter]:
        params = dict(self.backbone.named_parameters())
        if self.head is not None:
            params.update({HEAD_PREFIX + k: p for k, p in self.head.named_parameters()})
        return params

    def _identity(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "spec": self.spec.to_dict(),
                "users": len(self.population.users), "images": len(self.population.labels)}

    def _resume(self) -> None:
        state = load_checkpoint(self.checkpoint_path)
        if state is None:
            return
        if state["identity"] != self._identity():
            raise ValueError(f"{self.checkpoint_path} is from a different run ({state['identity']}); "
                             f"use another --out or delete it")
        self.backbone.load_state_dict(state["backbone"])
        if self.head is not None:
            self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.round, self.clip_norm, self.history = state["round"], state["clip_norm"], state["history"]
        self.accountant = UserLevelAccountant(state["accountant"])

    def _save(self) -> None:
        save_checkpoint(self.checkpoint_path, {
            "identity": self._identity(), "round": self.round, "backbone": self.backbone.state_dict(),
            "head": None if self.head is None else self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
            "clip_norm": self.clip_norm, "accountant": self.accountant.state(), "history": self.history})

    def privacy(self) -> dict[str, Any]:
        """User-level (epsilon, delta) spent so far (None where the run is not private)."""
        if not self.config.private:
            return {"epsilon": None, "epsilon_rdp": None, "delta": None}
        return {**self.accountant.epsilon(self.delta), "delta": self.delta}

    def run_round(self) -> dict[str, Any]:
        """One round on the in-memory state (not yet checkpointed)."""
        config, r = self.config, self.round + 1
        started = time.time()
        sampled = poisson_sample(len(self.clients), self.sampling_rate, config.seed, r)
        backbone_state = {k: v.detach().clone() for k, v in self.backbone.state_dict().items()}
        head_state = None if self.head is None else {k: v.detach().clone() for k, v in self.head.state_dict().items()}
        tasks = []
        for c in sampled:
            images, labels = self.population.of_users(self.clients[c])
            tasks.append(ClientTask(r, int(c), self.spec, backbone_state, images, labels, config.local(self.clip_norm),
                                    derived_seed(config.seed, r, 0, int(c)), head_state))
        answers = self.backend(tasks)
        if len(answers) != len(tasks):
            raise RuntimeError(f"the backend answered {len(answers)} of {len(tasks)} tasks (None marks a missing one)")
        joined = [c for c, a in zip(sampled, answers) if a is not None]
        results = [a for a in answers if a is not None]
        params = self._parameters()
        generator = torch.Generator().manual_seed(derived_seed(config.seed, r, 1))
        if config.private:
            round_sum = aggregate(results, params, self.clip_norm, self.z_update * self.clip_norm,
                                  config.clients_per_round, generator)
        else:
            round_sum = aggregate(results, params, math.inf, 0.0, max(1, len(results)), generator)
        if config.private or results:  # a non-private round nobody joined changes nothing
            for name, p in params.items():
                p.grad = -round_sum.mean[name]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        clip_used, fraction = self.clip_norm, None
        if config.private:
            if config.target_quantile is not None:
                self.clip_norm, fraction = adapt_clip_norm(self.clip_norm, round_sum.within_clip,
                                                           config.clients_per_round, config.target_quantile,
                                                           config.clip_lr, self.count_noise_std, generator)
            self.accountant.record(self.sampling_rate,
                                   combined_noise(self.z_update, self.count_noise_std)
                                   if config.target_quantile is not None else self.z_update)
        self.round = r
        return {"round": r, "sampled": len(sampled), "clients": len(results),
                "users": int(sum(len(self.clients[c]) for c in joined)),
                "images": int(sum(x.examples for x in results)),
                "loss": float(np.mean([x.loss for x in results])) if results else None,
                "median_norm": float(np.median([x.norm for x in results])) if results else None,
                "clip_norm": clip_used if config.private else None, "within_clip_noised": fraction,
                "wall_s": time.time() - started}

    def run(self, evaluate: Callable[[nn.Module], dict] | None = None, eval_every: int = 0,
            crash_in_round: int | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
        """Rounds from the last checkpoint to config.rounds, scored by `evaluate` every `eval_every` rounds.
        `crash_in_round`: stop (exit the process) in that
        round, after its update is applied in memory but before its checkpoint (for tests)."""
        if self.round:
            log(f"resuming after round {self.round} (checkpoint {self.checkpoint_path})")
        while self.round < self.config.rounds:
            row = self.run_round()
            if crash_in_round == self.round:
                log(f"simulated crash in round {self.round} (update applied in memory, not checkpointed)")
                raise SimulatedCrash(CRASH_EXIT_CODE)
            row.update(self.privacy())
            if evaluate is not None and eval_every and self.round % eval_every == 0:
                row.update(evaluate(self.backbone))
            self.history.append(row)
            self._save()
            acc = f" view1 {row['view1_accuracy']:.3f}" if "view1_accuracy" in row else ""
            eps = f" eps {row['epsilon']:.3g}" if row.get("epsilon") is not None else ""
            log(f"round {self.round}/{self.config.rounds}: {row['clients']} of {row['sampled']} sampled clients, "
                f"{row['users']} users, "
                f"loss {row['loss'] if row['loss'] is None else round(row['loss'], 3)}{eps}{acc} "
                f"({row['wall_s']:.1f} s)")
        return self.history
