"""Federated runs end to end through `python -m edge_server.federated` (slow: LFW decoding, View 1 scoring): the
documented command's output; `splitface-server serve` takes the same run options."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from device_sdk.models import ModelSpec, build_backbone
from device_sdk.models.weights import save_backbone
from edge_server.federated.__main__ import parser, run

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
    """`splitface-server serve --federated-*` declares the experiment's options once with the federated CLI (a
    run started by one resumes under the other: test_federated_ws's kill test); a bad run fails before serving.
    (Exactly-once rounds across a killed process: test_federated_ws, in-process: test_federated.py.)"""
    from edge_server import cli
    from edge_server.federated.options import SERVE_PREFIX, add_run_args, run_args
    run = cli_args(lfw, init_file, tmp_path, "--method", "dp-fedemb", "--noise-multiplier", "1.0")
    del run[run.index("--threads"):run.index("--threads") + 2]  # serve's own option
    prefixed = [f"--{SERVE_PREFIX}{a[2:]}" if a.startswith("--") else a for a in run]
    serve = argparse.ArgumentParser()
    add_run_args(serve, SERVE_PREFIX)
    theirs, ours = vars(run_args(serve.parse_args(prefixed), SERVE_PREFIX)), vars(parser().parse_args(run))
    assert theirs == {k: ours[k] for k in theirs} and {"noise_multiplier", "quorum", "out"} <= set(theirs)
    base = ["serve", "--num-classes", "2", "--tokens", str(tmp_path / "tokens.json"), "--port", "0"]
    for bad, message in ((["--federated-noise-multiplier", "0"], "noise"),
                         (["--federated-method", "centralized"], "centralized")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*base, *prefixed, *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
