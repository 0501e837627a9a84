"""The epsilon sweep, reduced to CI size: real processes, its table and figures."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_reduced_sweep_runs_end_to_end(tmp_path, lfw):
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "bench" / "dp_sweep.py"), "--data", str(lfw), "--out", str(out),
           "--settings", "scratch", "--epsilons", "10", "inf", "--epochs", "1",
           "--demo-args=--min-images 20 --max-identities 10 --devices 1 --batch-size 32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "summary.json").read_text())
    assert [r["mechanism"] for r in rows] == ["per-activation", "per-activation"]
    noisy, clean = rows
    assert noisy["epsilon_image"] > 1000 and noisy["guarantee_void"]   # the paper's eps=10 per value, per image
    assert clean["epsilon_image"] == float("inf")
    table = (out / "table.md").read_text()
    assert "10 identities" in table and "void: layer trained without DP" in table
    for figure in ("fig_training_scratch.png", "fig_activations.png"):
        assert (out / figure).stat().st_size > 10_000
