"""The one federated round loop, its tasks and backends; the methods are strategies (strategies.py).

Round r: the strategy picks the round's clients from (seed, r) alone and gives each a task; the backend
runs the tasks; the strategy applies the answers to the global model (for DP-FedEmb and DP-FedAvg:
bound and sum the updates, add noise z*C, step the server optimizer, adapt the clip norm, record the
round with the accountant) and returns the round's row. With an `out` folder the loop then writes the
checkpoint (global backbone, the strategy's state, round number, history) atomically. A run killed
anywhere resumes from the last checkpoint: a round whose checkpoint was not written is run again from
the same state with the same seeds, and a written one is never run again, so no round is applied twice.

The round logic does not know where updates come from: a backend takes the round's tasks and returns
one answer per task (`run_task`: the task's own `run`), or None for a client that did not answer (left
out of the sum). The backends: `in_process` (default), `ray_backend` (ray_backend.py: the same function
as Ray tasks) and `WebsocketBackend` (websocket.py: `ClientTask`s in device processes, over the
protocol's round messages).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from splitface.device.federated import LocalConfig
from splitface.common.models import ModelSpec, build_backbone

from splitface.server.checkpoint import load_checkpoint, save_checkpoint
from research.federated.population import Population, check_partition, virtual_clients
from research.federated.strategies import strategy_for
from research.federated.tasks import Backend, in_process

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


class SimulatedCrash(SystemExit):
    """A deliberate stop mid-round (tests of exactly-once rounds); the process exits with CRASH_EXIT_CODE."""


class FederatedRun:
    """The server's state of one run, and the loop over its rounds; `config.method` picks the strategy
    (strategies.py) that configures each round, aggregates its answers and keeps the method's own state.
    Attributes the loop does not have (the accountant, the clip norm, the heads, ...) are the strategy's.
    `out`: where each round is checkpointed (None: nowhere, the run is not resumable)."""

    def __init__(self, config: Any, spec: ModelSpec, population: Population, init_state: dict[str, torch.Tensor],
                 out: Path | None = None, backend: Backend = in_process) -> None:
        self.config, self.spec, self.population, self.backend = config, spec, population, backend
        self.out = None if out is None else Path(out)
        self.strategy = strategy_for(config)
        self.clients = virtual_clients(len(population.users), config.users_per_client, config.seed)
        check_partition(self.clients, len(population.users))
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            self.backbone = build_backbone(spec)
            self.backbone.load_state_dict(init_state)
            self.strategy.setup(self)
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self._resume()

    def __getattr__(self, name: str) -> Any:
        strategy = self.__dict__.get("strategy")
        if strategy is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(strategy, name)

    @property
    def checkpoint_path(self) -> Path | None:
        return None if self.out is None else self.out / "checkpoint.pt"

    def _identity(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "spec": self.spec.to_dict(),
                "users": len(self.population.users), "images": len(self.population.labels)}

    def _resume(self) -> None:
        state = None if self.out is None else load_checkpoint(self.checkpoint_path)
        if state is None:
            return
        if state["identity"] != self._identity():
            raise ValueError(f"{self.checkpoint_path} is from a different run ({state['identity']}); "
                             f"use another --out or delete it")
        self.backbone.load_state_dict(state["backbone"])
        self.strategy.load_state_dict(state)
        self.round, self.history = state["round"], state["history"]

    def _save(self) -> None:
        if self.out is not None:
            save_checkpoint(self.checkpoint_path, {
                "identity": self._identity(), "round": self.round, "backbone": self.backbone.state_dict(),
                **self.strategy.state_dict(), "history": self.history})

    def privacy(self) -> dict[str, Any]:
        """The (epsilon, delta) spent so far, as the method counts it (None where it is not private)."""
        return self.strategy.privacy(self)

    def run_round(self) -> dict[str, Any]:
        """One round on the in-memory state (not yet checkpointed)."""
        r = self.round + 1
        started = time.time()
        backbone_state = {k: v.detach().clone() for k, v in self.backbone.state_dict().items()}
        tasks = self.strategy.configure_round(self, r, backbone_state)
        answers = self.backend(tasks)
        if len(answers) != len(tasks):
            raise RuntimeError(f"the backend answered {len(answers)} of {len(tasks)} tasks (None marks a missing one)")
        row = self.strategy.aggregate_round(self, r, tasks, answers)
        self.round = r
        return {"round": r, **row, "wall_s": time.time() - started}

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
            row.update(self.strategy.round_privacy(self))
            if evaluate is not None and eval_every and self.round % eval_every == 0:
                row.update(evaluate(self.backbone))
            self.history.append(row)
            self._save()
            log(self.strategy.progress(self, row))
        return self.history
