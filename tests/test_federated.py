"""Federated engine (issue 13): accounting, clipping, the user partition, determinism and exactly-once
rounds, on real LFW faces with a tiny IResNet (16 px) so each test takes about a second."""
from __future__ import annotations

import dataclasses
import math

import dp_accounting
import numpy as np
import pytest
import torch

from splitface.device.federated import LocalConfig, clip_delta, delta_norm, train_client
from splitface.device.federated.local_round import HEAD_PREFIX
from splitface.common.models import ModelSpec, build_backbone
from research.federated import FederatedConfig, FederatedRun, check_partition, load_population, virtual_clients
from splitface.common.accountants.user_level import UserLevelAccountant, extrapolate
from splitface.common.accountants.user_level import combined_noise, update_noise
from research.federated.aggregation import aggregate, check_update, poisson_sample
from research.federated.rounds import SimulatedCrash

TINY = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=16, dropout=0.0)
CONFIG = FederatedConfig(method="dp-fedemb", rounds=3, users_per_client=3, clients_per_round=2.0, local_epochs=1,
                         batch_size=4, client_lr=0.05, noise_multiplier=1.0, clip_norm=0.5, seed=0)


@pytest.fixture(scope="module")
def population(lfw):
    return load_population(lfw, TINY.input_size, max_users=12, seed=0)


@pytest.fixture(scope="module")
def init_state():
    torch.manual_seed(0)
    return build_backbone(TINY).state_dict()


def state_of(run: FederatedRun) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in run.backbone.state_dict().items()}


# --- accounting -------------------------------------------------------------------------------------------

def test_accountant_matches_dp_accounting_for_a_known_schedule():
    schedule = [(0.1, 1.0)] * 3 + [(0.05, 2.0)] * 2
    ours = UserLevelAccountant(schedule).epsilon(1e-5)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    rdp = dp_accounting.rdp.RdpAccountant()
    for q, z in schedule:  # round by round, as the rounds ran
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        pld.compose(event)
        rdp.compose(event)
    assert ours["epsilon"] == pytest.approx(pld.get_epsilon(1e-5), rel=1e-3)
    assert ours["epsilon_rdp"] >= ours["epsilon"]  # RDP is the looser bound
    assert ours["epsilon_rdp"] == pytest.approx(rdp.get_epsilon(1e-5), rel=0.05)


def test_accountant_without_sampling_is_the_exact_gaussian_mechanism():
    # T full-participation rounds of multiplier z compose to one Gaussian of multiplier z / sqrt(T)
    exact = dp_accounting.get_epsilon_gaussian(2.0 / math.sqrt(4), 1e-5)
    assert UserLevelAccountant([(1.0, 2.0)] * 4).epsilon(1e-5)["epsilon"] == pytest.approx(exact, rel=1e-2)


def test_adaptive_clipping_cost_is_in_the_accounted_multiplier():
    z_update = update_noise(1.0, 2.5)
    assert z_update > 1.0  # the update gets less noise because the count takes part of the budget
    assert combined_noise(z_update, 2.5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="count"):
        update_noise(1.0, 0.4)


def test_extrapolation_keeps_the_noise_on_the_average_update():
    row = extrapolate(0.1, 1.0, 10, 1000, 100_000)
    assert row["noise_multiplier"] == pytest.approx(100.0)
    assert row["epsilon"] < UserLevelAccountant([(0.1, 1.0)] * 10).epsilon(row["delta"])["epsilon"]


# --- clipping -------------------------------------------------------------------------------------------

def test_clipping_bounds_every_contribution():
    g = torch.Generator().manual_seed(0)
    template = {"a": torch.zeros(50), "b": torch.zeros(3, 7)}
    for scale in (1e-3, 1.0, 1e3, 1e6):
        delta = {k: torch.randn(v.shape, generator=g) * scale for k, v in template.items()}
        clipped, norm = clip_delta(delta, 0.5)
        assert delta_norm(clipped) <= 0.5 and norm == pytest.approx(delta_norm(delta))
    # the server re-clips: an upload that lies about its norm is still bounded
    from splitface.device.federated import ClientResult
    liar = ClientResult({k: torch.full(v.shape, 1e4) for k, v in template.items()}, norm=0.1, examples=2, loss=0.0)
    mean = aggregate([liar], template, clip_norm=0.5, noise_std=0.0, denominator=1.0, generator=g).mean
    assert delta_norm(mean) <= 0.5 + 1e-6


def test_client_update_is_clipped_on_the_device(population, init_state):
    images, labels = population.of_users(np.array([0, 1, 2]))
    result = train_client(TINY, init_state, images, labels, LocalConfig(batch_size=4, lr=0.5, clip_norm=0.01), seed=1)
    assert result.norm > 0.01 and delta_norm(result.delta) <= 0.01
    # FedEmb: only the backbone leaves (no head); with a global head, the head's change leaves too
    assert set(result.delta) == {k for k, _ in build_backbone(TINY).named_parameters()}
    head = {"weight": torch.zeros(12, 16), "bias": torch.zeros(12)}
    with_head = train_client(TINY, init_state, images, labels, LocalConfig(batch_size=4), seed=1, head_state=head)
    assert {k for k in with_head.delta if k.startswith(HEAD_PREFIX)} == {"head.weight", "head.bias"}


def test_bad_updates_are_refused():
    template = {"a": torch.zeros(4)}
    with pytest.raises(ValueError, match="non-finite"):
        check_update({"a": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, template)
    with pytest.raises(ValueError, match="shape"):
        check_update({"a": torch.zeros(5)}, template)
    with pytest.raises(ValueError, match="names"):
        check_update({"b": torch.zeros(4)}, template)


# --- users and virtual clients ---------------------------------------------------------------------------

def test_each_user_is_in_exactly_one_virtual_client():
    clients = virtual_clients(103, 4, seed=3)
    members = np.concatenate(clients)
    assert sorted(members.tolist()) == list(range(103)) and max(len(c) for c in clients) == 4
    with pytest.raises(ValueError, match="more than one virtual client"):
        check_partition([np.array([0, 1]), np.array([1, 2])], 3)
    with pytest.raises(ValueError, match="no virtual client"):
        check_partition([np.array([0, 1])], 3)


def test_private_users_are_disjoint_from_public_and_devtest(population, lfw):
    """Also with --single-photo-users (DevTrain's one-photo people added), which only methods without a global
    class head take."""
    from splitface.common.data import dev_people, find_lfw_root
    from research.federated.population import check_single_photo, private_faces, public_split
    base = find_lfw_root(lfw)
    users = set(population.users)
    everyone = private_faces(lfw, single_photo=True)
    counts = np.bincount(everyone.labels)
    train, test, public = dev_people(base, "train"), dev_people(base, "test"), set(public_split(lfw).class_names)
    for group in (users, set(everyone.class_names)):
        assert group <= train and not group & test and not group & public
    assert all((population.labels == u).sum() >= 2 for u in range(len(users)))
    assert users < set(everyone.class_names) and 0 < (counts == 1).sum() < len(counts)
    check_single_photo("dp-fedemb")
    for method in ("dp-fedavg", "fedavg", "centralized"):
        with pytest.raises(ValueError, match="global class"):
            check_single_photo(method)


def test_poisson_sampling_depends_on_seed_and_round_only():
    a = poisson_sample(1000, 0.1, seed=0, round_number=5)
    assert np.array_equal(a, poisson_sample(1000, 0.1, seed=0, round_number=5))
    assert not np.array_equal(a, poisson_sample(1000, 0.1, seed=0, round_number=6))
    assert 60 < len(a) < 140


# --- rounds ------------------------------------------------------------------------------------------------

def test_same_seed_gives_the_same_global_model(population, init_state, tmp_path):
    # non-private (no accounting to wait for); the DP noise's determinism is covered by the crash test below
    config = dataclasses.replace(CONFIG, method="fedemb", noise_multiplier=0.0, rounds=2)
    runs = [FederatedRun(config, TINY, population, init_state, tmp_path / name) for name in ("a", "b")]
    for run in runs:
        run.run(log=lambda _: None)
    a, b = (state_of(run) for run in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], init_state[k]) for k in a)  # it trained
    other = FederatedRun(dataclasses.replace(config, seed=1), TINY, population, init_state, tmp_path / "c")
    other.run(log=lambda _: None)
    assert not all(torch.equal(a[k], v) for k, v in state_of(other).items())


def test_rounds_are_applied_exactly_once_across_a_crash(population, init_state, tmp_path):
    config = dataclasses.replace(CONFIG, rounds=2, target_quantile=0.5)  # the clip norm is state too
    whole = FederatedRun(config, TINY, population, init_state, tmp_path / "whole")
    whole.run(log=lambda _: None)
    crashed = FederatedRun(config, TINY, population, init_state, tmp_path / "crashed")
    with pytest.raises(SimulatedCrash):  # round 2 applied in memory, its checkpoint never written
        crashed.run(crash_in_round=2, log=lambda _: None)
    resumed = FederatedRun(config, TINY, population, init_state, tmp_path / "crashed")
    assert resumed.round == 1
    resumed.run(log=lambda _: None)
    assert [row["round"] for row in resumed.history] == [1, 2]
    assert len(resumed.accountant.rounds) == 2 and resumed.clip_norm == whole.clip_norm
    a, b = state_of(whole), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.privacy() == whole.privacy()
    done = FederatedRun(config, TINY, population, init_state, tmp_path / "crashed")  # a finished run runs nothing
    assert done.round == 2 and done.run(log=lambda _: None) == resumed.history


def test_a_checkpoint_from_another_run_is_refused(population, init_state, tmp_path):
    FederatedRun(dataclasses.replace(CONFIG, rounds=1), TINY, population, init_state, tmp_path).run(log=lambda _: None)
    with pytest.raises(ValueError, match="different run"):
        FederatedRun(dataclasses.replace(CONFIG, rounds=1, noise_multiplier=2.0), TINY, population, init_state,
                     tmp_path)


def test_dp_fedavg_aggregates_a_global_head(population, init_state, tmp_path):
    run = FederatedRun(dataclasses.replace(CONFIG, method="dp-fedavg", rounds=1), TINY, population, init_state,
                       tmp_path)
    before = run.head.weight.detach().clone()
    run.run(log=lambda _: None)
    assert run.head.weight.shape == (12, 16) and not torch.equal(before, run.head.weight)
    assert run.privacy()["epsilon"] > 0


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="noise_multiplier"):
        FederatedConfig(method="dp-fedemb", noise_multiplier=0.0)
    with pytest.raises(ValueError, match="not private"):
        FederatedConfig(method="fedemb", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="method"):
        FederatedConfig(method="fedsgd")
