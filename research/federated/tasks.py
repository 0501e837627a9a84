"""What a round hands a backend: the tasks (one client's work each), the function every backend runs, and
the seeds they are drawn with. Apart from the loop (rounds.py) so that the strategies, the loop and the
backends all build on it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from splitface.device.federated import ClientResult, LocalConfig, train_client
from splitface.common.models import ModelSpec


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

    def run(self) -> ClientResult:
        return train_client(self.spec, self.backbone_state, self.images, self.labels, self.config, self.seed,
                            self.head_state)


# One result per task, in task order; None: that client did not answer in time (left out of the round).
Backend = Callable[[Sequence[ClientTask]], list[ClientResult | None]]


def run_task(task: Any) -> Any:
    """The client's work for one task (`task.run()`): the function every backend runs (here, in a Ray worker, on
    a device)."""
    return task.run()


def in_process(tasks: Sequence[Any]) -> list[Any]:
    """The default backend: the clients one after another in this process, no sockets."""
    return [run_task(t) for t in tasks]


def derived_seed(seed: int, round_number: int, stream: int, index: int = 0) -> int:
    """A seed from (run seed, round, stream, index) alone: stream 0 = client `index`'s training, 1 = the
    server's noise. No seed depends on what ran before, so a resumed round draws what the first try drew."""
    return int(np.random.SeedSequence([seed, round_number, stream, index]).generate_state(1)[0])
