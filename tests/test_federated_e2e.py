"""Federated runs end to end through `splitface-research federated` (slow: LFW decoding, View 1 scoring): the
documented command's output; `splitface-server serve` takes the same run options; an experiment starts from the
distilled start on the federated public set."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from splitface.common.models import ModelSpec, build_backbone
from splitface.common.models.weights import save_backbone
from research.distill import Recipe
from research.federated import FederatedConfig
from research.federated.__main__ import parser, run
from research.federated.experiment import load_shared, run_federated

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


def test_serve_takes_the_same_run_options_and_refuses_bad_ones(lfw, init_file, tmp_path, capsys):
    """The hosting server (`python -m research.federated.served`: serve's options and --federated-*) declares the
    experiment's options once with the federated CLI (a
    run started by one resumes under the other: test_federated_ws's kill test); a bad run fails before serving.
    (Exactly-once rounds across a killed process: test_federated_ws, in-process: test_federated.py.)"""
    from research.federated import served
    from research.federated.options import SERVE_PREFIX, add_run_args, run_args
    run = cli_args(lfw, init_file, tmp_path, "--method", "dp-fedemb", "--noise-multiplier", "1.0")
    del run[run.index("--threads"):run.index("--threads") + 2]  # serve's own option
    prefixed = [f"--{SERVE_PREFIX}{a[2:]}" if a.startswith("--") else a for a in run]
    serve = argparse.ArgumentParser()
    add_run_args(serve, SERVE_PREFIX)
    theirs, ours = vars(run_args(serve.parse_args(prefixed), SERVE_PREFIX)), vars(parser().parse_args(run))
    assert theirs == {k: ours[k] for k in theirs} and {"noise_multiplier", "quorum", "out"} <= set(theirs)
    base = ["--num-classes", "2", "--tokens", str(tmp_path / "tokens.json"), "--port", "0"]
    for bad, message in ((["--federated-noise-multiplier", "0"], "noise"),
                         (["--federated-method", "centralized"], "centralized")):
        with pytest.raises(SystemExit) as exit_info:
            served.main([*base, *prefixed, *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_an_experiment_starts_from_the_distilled_start(lfw, tmp_path):
    """`start="distilled"` (research/federated_table.py --start distilled): the start is distilled on the federated public
    set (a tiny one here: one epoch on 16 faces, cached in tmp_path), every run begins from its weights, no public
    split is pre-trained, and a private round trains from there."""
    tiny = Recipe(epochs=1, batch_size=8)
    build = {"cache_dir": tmp_path / "cache", "recipes": (tiny, tiny), "limit": 16, "progress": False}
    unused = tmp_path / "public_backbone.pt"
    shared = load_shared(TINY, lfw, unused, 1, max_users=12, view1_limit=20, start="distilled", distill_args=build,
                         log=lambda _: None)
    assert not unused.exists()   # the public-split pre-training never ran
    assert shared.start["start"] == "distilled" and shared.start["public_faces"]["public_set"] == "federated"
    assert shared.start["public_faces"]["images"] == 16 and "per_person" not in shared.start["public_faces"]
    saved = torch.load(shared.start["file"], weights_only=True)["state"]
    assert saved.keys() == shared.init_state.keys()
    assert all(torch.equal(v, saved[k]) for k, v in shared.init_state.items())
    config = FederatedConfig(method="dp-fedemb", rounds=1, users_per_client=3, clients_per_round=4, local_epochs=1,
                             batch_size=4, noise_multiplier=0.1, seed=0)
    row = run_federated(shared, config, tmp_path / "run", log=lambda _: None)
    assert row["start"] == "distilled" and row["rounds"] == 1 and 0 <= row["view1_accuracy"] <= 1
    assert row["history"][0]["clients"] == 4   # sampling rate 1: every virtual client trained from the start
