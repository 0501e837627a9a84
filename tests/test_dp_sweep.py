"""The epsilon sweep, reduced to CI size: real processes, its table and figures; then the privacy
audit (`splitface-research audit`) plays the curious server against the sweep's recorded runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitface.device.privacy.planner import release_schedule

pytestmark = pytest.mark.slow  # real processes or real-face training: the full tier


def test_reduced_sweep_runs_end_to_end(tmp_path, lfw):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "research.dp_sweep", "--data", str(lfw), "--out", str(out),
           "--settings", "scratch", "--epsilons", "0.05", "inf", "--epochs", "1", "--device-head-epsilons", "inf",
           "--record-max", "128", "--demo-args=--min-images 20 --max-identities 5 --devices 1 --batch-size 32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["mechanism"], r["head"]) for r in rows] == [("per-activation", "server"), ("per-activation", "server"),
                                                          ("per-activation", "device")]
    noisy, clean, device_head = rows
    # the paper's epsilon = 0.05 per value is, per image, the accountant's figure for one release of a 16x64x64
    # conv1 tensor (one epoch: each image released once), and void since the layer trained without DP
    assert noisy["epsilon_image"] == pytest.approx(release_schedule(0.05, 1e-5, 16 * 64 * 64, 1)[0], rel=1e-6)
    assert noisy["epsilon_image"] > 1 and noisy["guarantee_void"]
    assert clean["epsilon_image"] == device_head["epsilon_image"] == float("inf")
    table = (out / "table.md").read_text()
    assert "5 identities" in table and "void: layer trained without DP" in table and "device head" in table
    for figure in ("fig_training_scratch.png", "fig_activations.png"):
        assert (out / figure).stat().st_size > 10_000

    audit = tmp_path / "audit"
    runs = [str(out / "runs" / r["name"]) for r in rows]
    cmd = [sys.executable, "-m", "research.audit.cli", *runs, "--data", str(lfw), "--out", str(audit),
           "--public-images", "128", "--decoder-epochs", "1", "--recognizers", "eigenfaces", "--matcher-epochs", "1",
           "--cache", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    noisy, clean, device_head = (json.loads((audit / f"{r['name']}.json").read_text()) for r in rows)
    assert clean["recorded_releases"] == noisy["recorded_releases"] == device_head["recorded_releases"] == 128
    assert clean["device_layer"].startswith("surrogate")
    # the audit reads each run's own accountant
    assert [a["epsilon_image_accountant"] for a in (noisy, clean, device_head)] == [r["epsilon_image"] for r in rows]
    # one epoch at the devices' small learning rate: the seeded initial layer is a good surrogate, and
    # without noise the linear inversion finds each release's source image among 128
    ridge = clean["attacks"]["reconstruction_ridge"]
    assert ridge["linkage_pixels"] > 0.5 and ridge["psnr_db"] > 18
    assert ridge["recognizers"]["eigenfaces"]["risk@1_clean_upper_bound"] > 2 * ridge["recognizers"]["eigenfaces"]["risk@1_chance"]
    assert noisy["attacks"]["reconstruction_ridge"]["linkage_pixels"] < 0.05   # noise std ~68 per value
    assert clean["attacks"]["label_leakage"]["share_of_recorded_labels_that_are_true"] == 1.0
    # dlib's identity matching is tested on its own (test_identity_matching.py); here it runs with eigenfaces,
    # whose clean bound marks every identity figure uninformative
    matching = clean["attacks"]["identity_matching"]
    assert matching["recognizer"] == "eigenfaces" and matching["risk@1_chance"] > 0
    assert "uninformative" in (audit / "table.md").read_text()
    # membership: every recorded training image against the attacker's own photos; the device head's server
    # holds no classifier to threshold
    membership = clean["attacks"]["membership_inference"]
    assert membership["members"] == 128 and membership["non_members"] > 0
    assert "skipped" in device_head["attacks"]["membership_inference"]
    # device head: no label is sent, but the embedding gradients it gets back give the labels away (their
    # direction tells same from different identity within a batch)
    leakage = device_head["attacks"]["label_leakage"]
    assert not leakage["labels_sent"] and leakage["samples"] == 128 and leakage["same_identity_pairs"] > 0
    assert leakage["direction_auc"] > 0.9
    summary = json.loads((audit / "summary.json").read_text())
    assert [s["run"] for s in summary] == [r["name"] for r in rows]
    assert all(not s["informative"] and s["identity_r1"] >= s["identity_matching_r1"] for s in summary)
    for figure in ("privacy_utility.png", "reconstructions.png"):
        assert (audit / figure).stat().st_size > 10_000

    # resumed where the recordings are gone (they are never committed: a clean clone has only the reports), the
    # audit reads its reports back, re-audits nothing, and still writes its summary of every run
    import shutil
    reports = {p: p.stat().st_mtime_ns for p in audit.glob("*.json") if p.name != "summary.json"}
    for run in runs:
        shutil.rmtree(Path(run) / "server" / "recordings")
    proc = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p: p.stat().st_mtime_ns for p in reports} == reports
    assert [s["run"] for s in json.loads((audit / "summary.json").read_text())] == [r["name"] for r in rows]


def test_audit_refuses_a_run_without_recordings(tmp_path, lfw):
    (tmp_path / "run").mkdir()
    proc = subprocess.run([sys.executable, "-m", "research.audit.cli", str(tmp_path / "run"), "--data", str(lfw),
                           "--out", str(tmp_path / "audit")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not a finished splitface-research demo run" in proc.stderr
