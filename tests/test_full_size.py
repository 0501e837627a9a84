"""research/full_size.py (issue #31) end to end at --tiny size on the CPU: the GPU run is the same code at full size.

A tiny pack of real LFW faces (4 of LFW-158's people, their original JPEG bytes) and the wheels the CUDA machine
lacks (for CPython 3.12, checked installable there by a pip dry run); then the run from that pack alone: the
split loop of both reduced models (`splitface-research demo`, a server process and 2 devices in 2 processes) with
exactly-once from the server's checkpoint, and split against unsplit. The paper's setting is left out here
(--paper-epochs 0: it is two more runs of the same split loop, a minute on 2 cores)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from splitface.sim.simulator import device_ranges

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "full_size.py"
LOOP_KEYS = {"model", "input_size", "devices", "processes", "batch_size", "steps", "steps_planned", "lost",
             "double_applied", "mismatched_devices", "exactly_once", "samples_per_s", "server_compute_samples_per_s",
             "accelerator", "device_ms_per_batch", "round_trip_ms_per_batch", "loss_first", "loss_last",
             "loss_curve", "checkpoints", "wall_s"}


def test_devices_are_dealt_to_processes_in_contiguous_ranges():
    assert device_ranges(16, 16) == [(k, k + 1) for k in range(16)]
    assert device_ranges(5, 2) == [(0, 2), (2, 5)]
    assert device_ranges(3, 1) == [(0, 3)]


@pytest.mark.slow
def test_full_size_tiny_runs_end_to_end_on_real_faces(lfw, tmp_path):
    pack, out, work = tmp_path / "pack", tmp_path / "out", tmp_path / "work"
    subprocess.run([sys.executable, str(SCRIPT), "pack", "--tiny", "--data", str(lfw), "--pack", str(pack)],
                   cwd=ROOT, check=True, timeout=180, capture_output=True)
    manifest = json.loads((pack / "pack.json").read_text())
    assert manifest["people"] == 4 and manifest["images"] == len(list((pack / "lfw" / "images").glob("*/*.jpg")))
    wheels = sorted(manifest["wheels"])
    assert [w.split("-")[0] for w in wheels] == ["dp_accounting", "websockets"]
    assert "cp312" in wheels[1] and manifest["travelling_tree_bytes"] < 64 * 2 ** 20

    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--tiny", "--pack", str(pack), "--out", str(out),
                           "--work", str(work), "--paper-epochs", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "full_size.json").read_text())
    assert {"date", "machine", "config", "wire", "split_loop", "split_vs_unsplit", "paper_setting", "ok",
            "load_before", "load_after", "bootstrap"} <= set(report)
    assert report["ok"] and report["bootstrap"]["missing"] == []   # here everything is installed
    assert [r["model"] for r in report["split_loop"]] == ["vgg_face_small", "iresnet_small"]
    for row in report["split_loop"]:
        assert LOOP_KEYS <= set(row), row.get("error")
        assert row["devices"] == row["processes"] == 2 and row["accelerator"]["device"] == "cpu"
        # every batch applied exactly once: none lost, none twice, the server's steps = the devices' = planned
        assert row["exactly_once"] and row["lost"] == row["double_applied"] == 0 and not row["mismatched_devices"]
        assert row["steps"] == row["device_batches"] == row["steps_planned"] > 0
        assert row["samples_per_s"] > 0 and math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"])
    for row in report["split_vs_unsplit"]:
        (ref,) = row["references"]   # on a CPU the server runs fp32: one reference
        assert ref["max_abs_loss_diff"] <= 1e-5 and ref["max_abs_weight_diff"] <= 1e-5
        assert ref["max_abs_weight_update"] > 1e-4   # the steps did move the weights
    assert report["paper_setting"]["runs"] == [] and report["paper_setting"]["notes"] == ["skipped: --paper-epochs 0"]
    text = (out / "full_size.txt").read_text()
    assert "All batches applied exactly once: yes." in text and "| vgg_face_small | 64 | 2 | 16 |" in text
    assert (out / "loss_curves.png").stat().st_size > 0
