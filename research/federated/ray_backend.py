"""The Ray backend (`--backend ray`): the round's clients as Ray tasks, on a local Ray instance or a cluster.

Each task (any method's) runs `tasks.run_task`, the in-process backend's function, with the same arguments and
seeds, and the results come back in task order, so the round logic sees exactly what the in-process backend gives it.
The caller starts Ray (`splitface.sim.ray_placement.ray_session`, or its own `ray.init(...)`); the Ray workers need
this project importable (it is installed in the environment, or shipped with a runtime_env).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

from research.federated.tasks import run_task


@functools.cache
def _remote() -> Any:
    import ray  # optional extra: `pip install splitface[ray]`

    return ray.remote(num_cpus=1)(run_task)


def ray_backend(tasks: Sequence[Any]) -> list[Any]:
    """All clients of the round at once on Ray's workers (one CPU each); their results in task order."""
    import ray

    if not tasks:
        return []
    if not ray.is_initialized():
        raise RuntimeError("the Ray backend needs Ray started first (ray_session(None) for a local instance, or "
                           "ray.init(address='auto') on a cluster)")
    remote = _remote()
    return list(ray.get([remote.remote(task) for task in tasks]))
