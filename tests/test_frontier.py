"""The privacy frontier's command at CI size: real processes train two points (the undefended one and
the PartialFace-style DCT subset), View 1 scores them, the audit attacks them, and the summary has
every key the frontier promises. Run again, it resumes: nothing is trained or audited twice."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

KEYS = {"transform", "params", "test_accuracy", "relative_accuracy", "view1_accuracy", "pixel_linkage",
        "pixel_linkage_chance", "identity_r1", "identity_r1_chance", "recognizer_clean_r1", "attack",
        "per_image_epsilon", "device_ms", "wire_bytes"}


def test_frontier_runs_small_and_resumes(tmp_path, lfw):
    out = tmp_path / "frontier"
    cmd = [sys.executable, str(ROOT / "bench" / "frontier.py"), "--data", str(lfw), "--out", str(out),
           "--only", "dct-drop4-keep36", "--epochs", "1", "--record-max", "16", "--view1-limit", "100",
           "--demo-args=--threads 1 --max-identities 5 --devices 1 --batch-size 16",
           f"--audit-args=--recognizers eigenfaces --public-images 100 --decoder-epochs 1 --matcher-epochs 2 "
           f"--cache {tmp_path / 'cache'}"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["transform"], r["params"]) for r in rows] == [("none", {}), ("dct", {"drop": 4, "keep": 36})]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert 0 <= r["identity_r1"] <= 1 and 0 < r["identity_r1_chance"] < 1 and 0.3 < r["view1_accuracy"] <= 1
        assert r["view1_pairs"] == 100
    undefended, dct = rows
    assert undefended["relative_accuracy"] == 1.0 and undefended["wire_bytes"] >= 16 * 64 * 64 * 4
    assert dct["wire_bytes"] >= 3 * 60 * 16 * 16 * 4   # the 8x8 DCT of the 2x upsampled image, less 4 of 64 per colour
    assert (out / "frontier.png").stat().st_size > 10_000 and "identity R@1" in (out / "table.md").read_text()

    remade = {"summary.json", "best.json"}   # the summaries are written again from the kept reports
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("**/*.json") if p.name not in remade}
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "trained in" not in second.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps   # results, View 1 and audit reports kept


def test_the_full_size_configuration_runs_a_few_steps(tmp_path, lfw):
    """IResNet-50 at 112 px, the documented full-size command, on two people for one short epoch."""
    out = tmp_path / "full"
    cmd = [sys.executable, str(ROOT / "bench" / "frontier.py"), "--data", str(lfw), "--out", str(out),
           "--model", "iresnet50", "--only", "none", "--epochs", "1", "--record-max", "8", "--view1-limit", "20",
           "--demo-args=--threads 2 --max-identities 2 --devices 1 --batch-size 8",
           f"--audit-args=--recognizers eigenfaces --public-images 64 --decoder-epochs 1 --matcher-epochs 1 "
           f"--cache {tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads((out / "summary.json").read_text())
    results = json.loads((out / "runs" / "none" / "results.json").read_text())
    assert results["config"]["model"]["depth"] == 50 and results["config"]["model"]["input_size"] == 112
    assert row["wire_bytes"] >= 64 * 112 * 112 * 4 and 0 <= row["identity_r1"] <= 1


def test_the_main_job_releases_the_frontiers_best_point():
    """run.sh's default release is the point bench/frontier.py chose (results/frontier/best.json)."""
    best = json.loads((ROOT / "results" / "frontier" / "best.json").read_text())
    line = next(l for l in (ROOT / "run.sh").read_text().splitlines() if l.startswith("DEFAULT_RELEASE="))
    assert line == f"DEFAULT_RELEASE=({' '.join(best['demo_args'])})"
