"""`splitface-device sim --placement ray`: the simulated devices as Ray actors, on a local Ray instance or a cluster.

Each actor runs `run_simulation` for its own devices (`only_devices`: one by default), each device with the index,
share and seeds it has in a run of all of them, over the same websocket protocol to the same server; their results
come back to the caller and are merged by `merge_results`, the one merge `splitface-research demo --device-processes` uses,
into the results.json a local run writes. So a device's batches are the same wherever it runs.

Every actor loads its own share from `data`'s paths: on a cluster, every node needs the data at the same path,
this project installed (or importable by the same PYTHONPATH), and a route to the server's URL (a server on
loopback is reachable from the local Ray instance only). The privacy state files (`state_dir`) and exported
programs (`artifacts`) are written on the node that runs the device; the results and the devices' final layers
come back and are written here. The caller starts Ray (`ray_session`, or its own `ray.init(...)`), as for the
federated Ray backend.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import socket
from typing import Any, Iterator, NamedTuple

import torch

from splitface.common.data import DataSplit
from splitface.sim.simulator import SimConfig, device_ranges, merge_results, run_simulation, write_results


class ActorRun(NamedTuple):
    """What an actor sends back: its devices' results and final layers, and where and at what priority they ran."""
    results: dict[str, Any]
    layers: dict[str, dict[str, torch.Tensor]]
    node: str
    niceness: int


class DeviceActor:
    """One Ray actor's devices: `run_simulation` in the actor's own process, with `threads` torch threads."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def run(self, config: SimConfig, data: DataSplit, tokens: dict[str, str]) -> ActorRun:
        results, layers = asyncio.run(run_simulation(config, data, tokens))
        return ActorRun(results, layers, socket.gethostname(), os.nice(0))


@contextlib.contextmanager
def ray_session(address: str | None, **init: Any) -> Iterator[None]:
    """Ray for workers that are devices or clients (this placement, the federated Ray backend, their tests): the
    caller's own if it has started it (`init` then does nothing); else joined at `address` ('auto', or a cluster's
    HOST:PORT) or, with None, a new local instance with `init`'s options (num_cpus, log_to_driver, ...), shut down
    afterwards."""
    try:
        import ray
    except ImportError as exc:
        raise SystemExit("Ray is not installed: pip install 'splitface[ray]'") from exc
    if ray.is_initialized():
        yield
        return
    # Ray starts its workers at niceness 15 (its own processes stay responsive); here the workers are the devices,
    # which should compete for the CPU as local processes do: on this loaded 2-core machine they ran 3-8x slower
    # per batch at 15 (results/ray_sim/), and the tests' actors starved beside the other test worker. A cluster's
    # own setting holds there (RAY_worker_niceness=0 ray start ...). "local": a new instance even where RAY_ADDRESS
    # or a `ray start` on this machine would be joined (which refuses a _system_config).
    options = {"include_dashboard": False, **init, "address": "local" if address is None else address}
    if address is None:
        options["_system_config"] = {"worker_niceness": 0}
    ray.init(**options)
    try:
        yield
    finally:
        ray.shutdown()


def cpus_per_actor(actors: int, cpus: float) -> float:
    """Ray's CPU share for each actor: all of them fit at once (64 actors on 2 cores get 1/32 each, not 2 at a time
    and the rest queued behind them), at most one core each; rounded down to Ray's resource step (1e-4)."""
    return min(1.0, math.floor(cpus / actors * 1e4) / 1e4)


def simulate_on_ray(config: SimConfig, data: DataSplit, tokens: dict[str, str], devices_per_actor: int = 1,
                    threads: int = 0) -> dict[str, Any]:
    """Run `config.devices_here()` as Ray actors of `devices_per_actor` devices each, all at once; write (to
    `config.results`) and return the merged results. `threads`: torch threads per actor (0: its whole cores, at
    least one)."""
    import ray  # optional extra: `pip install splitface[ray]`

    if not ray.is_initialized():
        raise RuntimeError("the Ray placement needs Ray started first (ray_session(None) for a local instance, or "
                           "ray.init(address='auto') on a cluster)")
    if devices_per_actor < 1:
        raise ValueError(f"devices_per_actor must be at least 1, not {devices_per_actor}")
    here = config.devices_here()
    parts = [(here.start + a, here.start + b)
             for a, b in device_ranges(len(here), math.ceil(len(here) / devices_per_actor))]
    cpus = cpus_per_actor(len(parts), ray.cluster_resources().get("CPU", 1.0))
    if cpus <= 0:
        raise ValueError(f"{len(parts)} actors do not fit on the cluster's {ray.cluster_resources().get('CPU')} CPUs "
                         f"at Ray's smallest share (1e-4 CPU): give more devices per actor")
    actor = ray.remote(num_cpus=cpus)(DeviceActor)
    actors = [actor.remote(threads or max(1, int(cpus))) for _ in parts]
    shared_data, shared_tokens = ray.put(data), ray.put(tokens)
    try:
        runs = [a.run.remote(dataclasses.replace(config, only_devices=part, progress=False), shared_data,
                             shared_tokens) for a, part in zip(actors, parts)]
        done = ray.get(runs)
    finally:
        for a in actors:
            ray.kill(a)
    merged = merge_results([run.results for run in done], placement="ray", actors=len(parts), cpus_per_actor=cpus,
                           nodes=sorted({run.node for run in done}), niceness=sorted({run.niceness for run in done}))
    merged["config"]["only_devices"] = list(config.only_devices) if config.only_devices else None
    write_results(config.results, merged, {k: v for run in done for k, v in run.layers.items()})
    return merged
