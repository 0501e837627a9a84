"""The one federated loop's strategies and the accountants' one interface."""
import math
import re
from pathlib import Path

import dp_accounting
import pytest
import torch
from dp_accounting.privacy_accountant import NeighboringRelation

from splitface.common.accountants import ACCOUNTANTS, Accountant, create_accountant, rdp_epsilon
from splitface.common.accountants.clusters import ClusterAccountant
from splitface.common.accountants.ledger import PrivacyAccountant
from splitface.common.accountants.user_level import UserLevelAccountant
from splitface.common.dplc import DPLCConfig
from research.federated import methods, rounds
from research.federated.strategies import STRATEGIES, strategy_for

ROOT = Path(__file__).resolve().parents[1]


def test_every_method_is_one_strategy_of_the_one_loop():
    assert set(STRATEGIES) == set(rounds.METHODS) | set(methods.METHODS)
    assert len(STRATEGIES) == 8
    assert issubclass(methods.PrivateHeadRun, rounds.FederatedRun)
    for name in rounds.METHODS:
        kw = {"noise_multiplier": 1.0} if name.startswith("dp-") else {}
        assert type(strategy_for(rounds.FederatedConfig(method=name, **kw))).name == name
    with pytest.raises(ValueError, match="cannot run"):
        STRATEGIES["fedavg"](rounds.FederatedConfig(method="fedemb"))


def test_the_accountants_answer_one_interface():
    assert set(ACCOUNTANTS) == {"ledger", "user_level", "clusters"}
    ledger = create_accountant("ledger", 1e-5)
    user = create_accountant("user_level")
    clusters = create_accountant("clusters", DPLCConfig(epsilon=1.0, queries=2), 3)
    assert (type(ledger), type(user), type(clusters)) == (PrivacyAccountant, UserLevelAccountant, ClusterAccountant)
    for acc in (ledger, user, clusters):
        assert isinstance(acc, Accountant) and acc.get_epsilon(1e-5) == 0.0
    ledger.record("r0", [0, 1], [7, 7], dp_accounting.GaussianDpEvent(2.0))
    user.record(0.1, 1.0)
    clusters.record(2)
    for acc, kind in ((ledger, "ledger"), (user, "user_level"), (clusters, "clusters")):
        assert 0 < acc.get_epsilon(1e-5) < math.inf
        restored = create_accountant(kind, *((1e-5,) if kind == "ledger" else
                                            (DPLCConfig(epsilon=1.0, queries=2), 3) if kind == "clusters" else ()))
        restored.load_state_dict(acc.state_dict())
        assert restored.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    assert ledger.get_epsilon(1e-5) == ledger.max_epsilon_identity()
    assert user.get_epsilon(1e-5) == user.epsilon(1e-5)["epsilon"]
    assert ledger.get_epsilon(1e-3) < ledger.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="one of"):
        create_accountant("moments")


def test_one_rdp_epsilon():
    defined = [p for p in (ROOT / "splitface").rglob("*.py") if re.search(r"^def rdp_epsilon\b", p.read_text(), re.M)]
    defined += [p for p in (ROOT / "research").rglob("*.py") if re.search(r"^def rdp_epsilon\b", p.read_text(), re.M)]
    assert [p.relative_to(ROOT).as_posix() for p in defined] == ["splitface/common/accountants/base.py"]
    z, delta = 2.0, 1e-5
    # REPLACE_ONE G(z) is ADD_OR_REMOVE G(z / 2); a noiseless release has no finite epsilon
    assert rdp_epsilon(dp_accounting.GaussianDpEvent(z), delta, NeighboringRelation.REPLACE_ONE) == \
        rdp_epsilon(dp_accounting.GaussianDpEvent(z / 2), delta)
    assert rdp_epsilon(dp_accounting.GaussianDpEvent(0.0), delta) == math.inf
    # RDP bounds PLD from above (the user-level cross-check)
    user = UserLevelAccountant([(0.2, 1.0)] * 5)
    figures = user.epsilon(1e-3)
    assert figures["epsilon"] <= figures["epsilon_rdp"] == rdp_epsilon(user.event(), 1e-3)


@pytest.mark.slow
def test_a_private_head_run_resumes_from_its_checkpoint(lfw, tmp_path):
    """A private-head method through the loop's checkpoints: a run stopped in round 2 before its checkpoint, resumed,
    equals the uninterrupted two rounds bit for bit (heads, released clusters, DPLC calls, backbone)."""
    from splitface.common.models import ModelSpec, build_backbone
    from splitface.device.federated.private_head import HeadConfig
    from research.federated.population import load_population
    spec = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=16, dropout=0.0)
    population = load_population(lfw, spec.input_size, max_users=8, seed=0)
    torch.manual_seed(0)
    init = build_backbone(spec).state_dict()
    config = methods.MethodConfig("privacyface", rounds=2, users_per_client=2, clients_per_round=2,
                                  head=HeadConfig(epochs=1, batch_size=4, rho=0.3),
                                  dplc=DPLCConfig(rho=0.3, min_members=1, queries=2, epsilon=1.0))
    whole = rounds.FederatedRun(config, spec, population, init)
    whole.run(log=lambda _: None)
    crashed = rounds.FederatedRun(config, spec, population, init, tmp_path)
    with pytest.raises(rounds.SimulatedCrash):  # round 2 applied in memory, never checkpointed
        crashed.run(crash_in_round=2, log=lambda _: None)
    resumed = rounds.FederatedRun(config, spec, population, init, tmp_path)
    assert resumed.round == 1
    resumed.run(log=lambda _: None)
    assert set(resumed.heads) == set(whole.heads) and all(torch.equal(resumed.heads[c], whole.heads[c])
                                                          for c in whole.heads)
    assert all((resumed.clusters[c] == whole.clusters[c]).all() for c in whole.clusters)
    assert resumed.dplc_calls.tolist() == whole.dplc_calls.tolist()
    assert all(torch.equal(a, b) for a, b in zip(resumed.backbone.state_dict().values(),
                                                 whole.backbone.state_dict().values()))
    assert resumed.privacy() == whole.privacy()

