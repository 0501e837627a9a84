"""The server's mirror average measured on the same trained servers: each run embedded once and averaged with the
mirror image's (results/pretrain-hold/mirror_pairs.md).

The tables compare runs trained with and without --mirror-average, whose training differs by chance (each device's
noise secret comes from the OS); here only the embedding differs. For each finished split run, LFW-158's test images
(the run's own split) and View 1's DevTest pairs are released as device 0 releases them (research/evaluation/run.py:
its layer, the mechanism with the evaluator's own noise, the same draws both ways, and the run's wire encoding), then
embedded by the run's server tail once and with the mirror average; the LFW-158 rows classify with the server's
head. Needs the runs' server checkpoints, which stay on the machine that made them (not committed):

    python -m research.mirror_pairs --data ../shared/data/lfw --out results/pretrain-hold \
        results/pretrain-hold/runs/runsh-first-recipe-hold{,-seed1,-seed2,-mirror,-mirror-seed1,-mirror-seed2} \
        results/pretrain-views/runs/runsh-views16-student150-hold{,-seed1,-seed2,-mirror,-mirror-seed1,-mirror-seed2}
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from splitface.common.models import ModelSpec, build_classifier
from splitface.common.options import add_data_root_arg, load_selection
from splitface.device.trainer import to_input
from splitface.server.checkpoint import load_checkpoint
from research.evaluation.run import evaluate_run, run_embedder
from research.results import write_report


def lfw158_accuracy(run_dir: Path, lfw_root: Path, mirror_average: bool) -> float:
    """The server head's accuracy on the run's LFW-158 test images, released and embedded as `run_embedder` does."""
    embed, results = run_embedder(run_dir, wire_encoding(results_of(run_dir)), mirror_average)
    config = results["config"]
    spec = ModelSpec.from_dict(config["model"])
    data = load_selection(lfw_root, config["data"])   # the run's own split of LFW-158 (its --seed draws it)
    images = to_input(data.test.load(spec.input_size, config.get("crop", 160))).numpy()
    classifier = build_classifier(spec, len(data.class_names))
    classifier.load_state_dict(load_checkpoint(run_dir / "server" / "checkpoint.pt")["trainer"]["classifier"])
    with torch.no_grad():
        logits = classifier.eval()(torch.from_numpy(np.concatenate([embed(images[i:i + 256])
                                                                    for i in range(0, len(images), 256)])))
    return float((logits.argmax(1).numpy() == data.test.labels).mean())


def results_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def wire_encoding(results: dict) -> str | None:
    """The encoding the run's devices sent their releases in (None: float32, as they are)."""
    encoding = results["config"].get("encodings", {}).get("activations", "f32")
    return None if encoding == "f32" else encoding


def row(run_dir: Path, lfw_root: Path) -> dict:
    results = results_of(run_dir)
    out = {"run": run_dir.name, "recorded_test_acc": results["epochs"][-1]["test_acc"]}
    for mirror_average, key in ((False, "once"), (True, "mirror")):
        report = evaluate_run(run_dir, lfw_root, encoding=wire_encoding(results), mirror_average=mirror_average)
        out[key] = {"lfw158_test_accuracy": lfw158_accuracy(run_dir, lfw_root, mirror_average),
                    "view1_accuracy": report["view1_accuracy"], "roc_auc": report["roc_auc"],
                    "tar_at_far_1e-2": report["tar_at_far_1e-2"]}
    return out


def report(rows: list[dict]) -> str:
    lines = ["Each run's server embedding each release once and averaging it with the mirror image's (the same "
             "servers, the same releases: the evaluator's noise, the runs' wire encoding). LFW-158: the server "
             "head on the main job's test images; its `recorded` figure is the run's own, with the devices' noise "
             "(and the run's own embedding). Reduced configuration: iresnet_small at 64 px.", "",
             "| run | LFW-158 recorded | LFW-158 once | LFW-158 mirror | difference | View 1 once | View 1 mirror | "
             "difference |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        once, mirror = r["once"], r["mirror"]
        lines.append(f"| {r['run']} | {r['recorded_test_acc']:.3f} | {once['lfw158_test_accuracy']:.3f} | "
                     f"{mirror['lfw158_test_accuracy']:.3f} | "
                     f"{mirror['lfw158_test_accuracy'] - once['lfw158_test_accuracy']:+.3f} | "
                     f"{once['view1_accuracy']:.3f} | {mirror['view1_accuracy']:.3f} | "
                     f"{mirror['view1_accuracy'] - once['view1_accuracy']:+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="finished splitface-research demo runs, with their checkpoints")
    add_data_root_arg(p, required=True, help="LFW root (with View 1's pairs files)")
    p.add_argument("--out", type=Path, required=True, help="writes mirror_pairs.json and mirror_pairs.md there")
    args = p.parse_args(argv)
    rows = [row(run_dir, args.data) for run_dir in args.runs]
    write_report(args.out / "mirror_pairs.json", rows, args.out / "mirror_pairs.md", report(rows))


if __name__ == "__main__":
    main()
