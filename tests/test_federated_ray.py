"""The Ray backend (slow: Ray's start-up): the same clients as Ray tasks on a local Ray instance give the same
global model as the in-process backend with the same seed, bit for bit (every client on one torch thread)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from splitface.common.models import ModelSpec, build_backbone
from research.federated import FederatedConfig, FederatedRun, load_population
from research.federated.ray_backend import ray_backend
from splitface.sim.ray_placement import ray_session

pytest.importorskip("ray", reason="the Ray backend needs the `ray` extra (pip install splitface[ray])")

TINY = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=16, dropout=0.0)
CONFIG = FederatedConfig(method="dp-fedemb", rounds=2, users_per_client=3, clients_per_round=2.0, local_epochs=1,
                         batch_size=4, client_lr=0.05, noise_multiplier=1.0, clip_norm=0.5, seed=0)


@pytest.fixture(scope="module")
def local_ray():
    with ray_session(None, num_cpus=2, log_to_driver=False):   # the clients at the priority the command gives them
        yield


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dp-fedemb", "fedavg"])
def test_ray_backend_equals_in_process(local_ray, lfw, tmp_path, method):
    population = load_population(lfw, TINY.input_size, max_users=12, seed=0)
    torch.manual_seed(0)
    init = build_backbone(TINY).state_dict()
    config = CONFIG if method == "dp-fedemb" else dataclasses.replace(CONFIG, method=method, noise_multiplier=0.0)
    on_ray = FederatedRun(config, TINY, population, init, tmp_path / "ray", ray_backend)
    on_ray.run(log=lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each Ray worker (num_cpus=1) uses
    try:
        here = FederatedRun(config, TINY, population, init, tmp_path / "here")
        here.run(log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    assert [row["clients"] for row in on_ray.history] == [row["clients"] for row in here.history]
    assert sum(row["clients"] for row in here.history) > 0
    a, b = on_ray.backbone.state_dict(), here.backbone.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    if on_ray.head is not None:
        assert torch.equal(on_ray.head.weight, here.head.weight)


@pytest.mark.slow
def test_a_private_head_method_on_ray_equals_in_process(local_ray, lfw, tmp_path):
    """The one round loop runs the private-head strategies on any backend that runs tasks: FedGC's clients as Ray
    tasks give the in-process run's backbone and corrected heads bit for bit."""
    from splitface.device.federated.private_head import HeadConfig
    from research.federated.methods import MethodConfig
    population = load_population(lfw, TINY.input_size, max_users=8, seed=0)
    torch.manual_seed(0)
    init = build_backbone(TINY).state_dict()
    config = MethodConfig("fedgc", rounds=2, users_per_client=2, clients_per_round=2,
                          head=HeadConfig(epochs=1, batch_size=4), fedgc_scale=4.0)
    on_ray = FederatedRun(config, TINY, population, init, tmp_path / "ray", ray_backend)
    on_ray.run(log=lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = FederatedRun(config, TINY, population, init)
        here.run(log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    a, b = on_ray.backbone.state_dict(), here.backbone.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(on_ray.heads) == set(here.heads) and all(torch.equal(on_ray.heads[c], here.heads[c]) for c in here.heads)
