"""Federated runs end to end through `python -m edge_server.federated` (slow: real processes, LFW decoding,
View 1 scoring): the documented command's output, and exactly-once rounds across a process that dies."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from device_sdk.models import ModelSpec, build_backbone
from device_sdk.models.weights import load_into, save_backbone
from edge_server.checkpoint import load_checkpoint
from edge_server.federated import FederatedRun, load_population
from edge_server.federated.__main__ import config_from, parser, run
from edge_server.federated.engine import CRASH_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelSpec("iresnet", 16, width=4, depth=18, embedding_size=16, dropout=0.0)


@pytest.fixture(scope="module")
def init_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("public") / "backbone.pt"
    torch.manual_seed(0)
    save_backbone(path, TINY, build_backbone(TINY))
    return path


def cli_args(lfw: Path, init: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(lfw), "--model", json.dumps(TINY.to_dict()), "--init", str(init), "--out", str(out),
            "--max-users", "12", "--users-per-client", "3", "--clients-per-round", "2", "--batch-size", "4",
            "--local-epochs", "1",
            "--view1-limit", "40", "--threads", "1", *extra]


@pytest.mark.slow
def test_small_experiment_end_to_end(lfw, init_file, tmp_path, capsys):
    row = run(cli_args(lfw, init_file, tmp_path, "--method", "dp-fedemb", "--rounds", "2", "--noise-multiplier",
                        "1.0", "--target-quantile", "0.5", "--eval-every", "1"))
    printed = capsys.readouterr().out
    assert "round 1/2" in printed and "round 2/2" in printed and "user-level epsilon" in printed
    saved = json.loads((tmp_path / "result.json").read_text())
    for key in ("method", "noise_multiplier", "rounds", "users_per_round", "epsilon", "delta", "view1_accuracy",
                "view1_std", "roc_auc", "tar_at_far_1e-2"):
        assert key in saved
    assert saved["method"] == "dp-fedemb" and saved["epsilon"] > 0 and saved["adaptive_clipping"]
    assert 0 <= saved["view1_accuracy"] <= 1 and row["epsilon"] == saved["epsilon"]
    assert [h["round"] for h in saved["history"]] == [1, 2] and saved["history"][0]["view1_accuracy"] is not None


@pytest.mark.slow
def test_rounds_are_applied_exactly_once_across_a_killed_process(lfw, init_file, tmp_path):
    extra = ("--method", "dp-fedemb", "--rounds", "3", "--noise-multiplier", "1.0")
    command = [sys.executable, "-m", "edge_server.federated", *cli_args(lfw, init_file, tmp_path, *extra)]
    crashed = subprocess.run([*command, "--crash-in-round", "2"], cwd=ROOT, capture_output=True, text=True)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-2000:]
    assert load_checkpoint(tmp_path / "checkpoint.pt")["round"] == 1
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming after round 1" in resumed.stdout
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state["round"] == 3 and [h["round"] for h in state["history"]] == [1, 2, 3]
    # the same run never interrupted, in this process
    args = parser().parse_args(cli_args(lfw, init_file, tmp_path / "whole", *extra))
    init = build_backbone(TINY)
    load_into(init, init_file, TINY)
    whole = FederatedRun(config_from(args), TINY, load_population(lfw, TINY.input_size, max_users=12, seed=0),
                         init.state_dict(), tmp_path / "whole")
    whole.run(log=lambda _: None)
    assert all(torch.equal(v, state["backbone"][k]) for k, v in whole.backbone.state_dict().items())
    assert state["accountant"] == whole.accountant.state()
