"""The distilled public start, measured: the teacher, each student, and split fine-tuning on LFW-158 from it.

Rows (results/pretrain/summary.json, table.md):
- teacher: dlib's ResNet on View 1's DevTest pairs, at the students' input (64 px from the 160 px centre crop)
  and at the input it was distilled from (150 px);
- student: each distilled backbone (`--init distilled` builds them: research/distill.py), its embedding on
  View 1 as a device releases it (with the release's noise, for a noise-aware start);
- split-finetune: `splitface-research demo` on LFW-158 (the main job's data: people with >= 10 images) from the
  distilled start, with the main job's release and wire (run.sh), server head and device head; the same from
  scratch (the old start), and from the distilled start with the paper's plain conv1 release. LFW-158 test
  accuracy, and View 1 of the fine-tuned model (`splitface-research evaluate`; LFW-158 holds 43 of the
  DevTest pairs' people, so some pairs show people the run trained on: the row says how many).

Reduced configuration (2 CPU cores): iresnet_small at 64 px, the main job's 3 epochs and 2 devices. Resumable:
runs and evaluations already made are read back (--force makes them again). The full-size configuration is
the same command with --model iresnet50 (112 px; the distillation then takes hours on a CPU: run it on a GPU).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from splitface.common.models import resolve_spec
from splitface.common.options import add_data_root_arg, add_model_arg, add_model_args, model_spec
from splitface.device.privacy.options import add_privacy_args, release_mechanism
from research.demo import run_recorded
from research.distill import CROP, TeacherCache, default_cache, distilled_start
from research.evaluation.verification import verification_report, view1_pairs
from research.results import write_summary

ROOT = Path(__file__).resolve().parents[1]


def run_sh_array(name: str) -> list[str]:
    """One of run.sh's default argument arrays (DEFAULT_RELEASE, DEFAULT_WIRE): the main job's settings, read
    from the one place they are declared."""
    line = next(l for l in (ROOT / "run.sh").read_text().splitlines() if l.startswith(f"{name}=("))
    return shlex.split(line.removeprefix(f"{name}=(").removesuffix(")"))


def teacher_row(lfw: Path, size: int, cache: Path) -> dict:
    pairs = view1_pairs(lfw, "test")
    started = time.time()
    embeddings = TeacherCache(cache, size).embed(pairs.faces.paths)
    report = verification_report(embeddings[pairs.a], embeddings[pairs.b], pairs.same)
    return {"role": "teacher", "model": "dlib ResNet v1 (face-recognition-models)", "start": "dlib's own training",
            "release": "-", "input": f"{size}x{size} from the {CROP} px centre crop", **report,
            "seconds": round(time.time() - started, 1)}


def student_row(path: Path) -> dict:
    import torch

    meta = torch.load(path, map_location="cpu", weights_only=True)["meta"]
    student = meta["student"]
    spec = student["spec"]
    return {"role": "student", "model": f"{spec['family']}-{spec['depth']} width {spec['width']}",
            "start": "distilled" if student["init"] == "seeded" else "distilled, noise-aware (from the plain student)",
            "release": release_name(spec, student["split"], student["release_mechanism"]),
            "input": student["input"], **meta["view1"], "file": path.name, "epochs": meta["recipe"]["epochs"],
            "public_people": meta["public_faces"]["people"], "public_images": meta["public_faces"]["images"],
            "seconds": meta["seconds"]}


def release_name(spec: dict, split: str, mechanism: dict) -> str:
    if spec["release"] == "none":
        name = f"none ({split})"
    elif spec["release"] == "dct":
        name = f"dct drop {spec['dct_drop']} ({split})"
    else:
        name = f"{spec['release']} ({split})"
    if mechanism["name"] != "none":
        extra = f", gamma {mechanism['frequency_gamma']:g}" if mechanism.get("frequency_gamma") else ""
        name += f" + {mechanism['name']} C {mechanism.get('clip_norm', '-')}, z {mechanism.get('noise_multiplier', '-')}{extra}"
    return name


def finetune_row(name: str, demo_args: list[str], args: argparse.Namespace) -> dict:
    run_dir = args.out / "runs" / name
    results = run_recorded(run_dir, ["--data", str(args.data), "--model", args.model, *demo_args], args.force)
    view1 = run_dir / "view1.json"
    if not view1.exists() or args.force:
        subprocess.run([sys.executable, "-m", "research", "evaluate", str(run_dir), "--data", str(args.data)],
                       check=True)
    report = json.loads(view1.read_text())
    config, last = results["config"], results["epochs"][-1]
    device = results["devices"][0]
    start = demo_args[demo_args.index("--init") + 1] if "--init" in demo_args else "scratch"
    if "--lr" in demo_args:
        start += f", lr {demo_args[demo_args.index('--lr') + 1]}"
    if "--head-lr-scale" in demo_args:
        start += f", head lr x{demo_args[demo_args.index('--head-lr-scale') + 1]}"
    return {"role": "split-finetune", "run": name, "model": f"{config['model']['family']}-{config['model']['depth']} "
            f"width {config['model']['width']}", "start": start,
            "release": release_name(config["model"], config["split"], device["privacy"]["mechanism"]),
            "head": config["head"], "input": f"{config['model']['input_size']}x{config['model']['input_size']}",
            "epochs": len(results["epochs"]), "lfw158_test_accuracy": last["test_acc"],
            "view1_accuracy": report["view1_accuracy"], "view1_std": report["view1_std"],
            "roc_auc": report["roc_auc"], "tar_at_far_1e-2": report["tar_at_far_1e-2"], "pairs": report["pairs"],
            "pairs_with_seen_people": report["pairs_with_seen_people"], "demo_args": demo_args}


def table(rows: list[dict]) -> str:
    lines = ["| role | model | start | release | head | input | epochs (distil or fine-tune) | View 1 acc (10-fold) | ROC AUC | "
             "TAR @ FAR 1e-2 | LFW-158 test acc |", "|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        seen = r.get("pairs_with_seen_people")
        mark = f" ({seen} pairs seen)" if seen else ""
        test = f"{r['lfw158_test_accuracy']:.3f}" if "lfw158_test_accuracy" in r else "-"
        lines.append(f"| {r['role']} | {r['model']} | {r['start']} | {r['release']} | {r.get('head', '-')} | "
                     f"{r['input']} | {r.get('epochs', '-')} | {r['view1_accuracy']:.3f} ± {r['view1_std']:.3f}{mark} | {r['roc_auc']:.3f} | "
                     f"{r['tar_at_far_1e-2']:.3f} | {test} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, required=True, help="LFW root (with View 1's pairs files)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "pretrain")
    add_model_arg(p, "iresnet_small")
    p.add_argument("--cache", type=Path, default=default_cache(), help="teacher embeddings and distilled starts")
    p.add_argument("--demo-args", default="", help="more splitface-research demo arguments for every fine-tuning run")
    p.add_argument("--force", action="store_true", help="train and evaluate every fine-tuning run again")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start, release, wire = run_sh_array("DEFAULT_START"), run_sh_array("DEFAULT_RELEASE"), run_sh_array("DEFAULT_WIRE")
    extra = args.demo_args.split()

    rows = [teacher_row(args.data, 64, args.cache), teacher_row(args.data, 150, args.cache)]
    # the distilled starts the fine-tuning runs use: the plain student, and the main job's noise-aware start
    privacy = argparse.ArgumentParser(add_help=False)
    add_privacy_args(privacy)
    add_model_args(privacy, args.model)
    for flags in ([], release):
        known, _ = privacy.parse_known_args(["--model", args.model, *flags])
        path = distilled_start(model_spec(known), known.split, release_mechanism(known), args.data, args.cache)
        rows.append(student_row(path))
    # the main job (run.sh's start, release and wire), its device-head twin, the old start from seeded weights with
    # the old recipe, and the distilled start with the paper's conv1 release
    runs = [("distilled-main-release-server-head", [*start, *release, *wire]),
            ("distilled-main-release-device-head", [*start, "--head", "device", *release, *wire]),
            ("scratch-main-release-server-head", [*release, *wire]),
            ("distilled-conv1-server-head", [*start, *wire]),
            # a gentler fine-tune: the body at a fifth of the demo's server lr (0.05), the head still at 10x it
            ("distilled-main-release-server-head-lr0.01", [*start, *release, *wire, "--lr", "0.01"]),
            ("distilled-conv1-server-head-lr0.01", [*start, *wire, "--lr", "0.01"]),
            # longer: at 3 epochs the main release's test accuracy still climbs (0.46, 0.65, 0.72)
            ("distilled-main-release-server-head-8-epochs", [*start, *release, *wire, "--epochs", "8"])]
    rows += [finetune_row(name, [*demo_args, *extra], args) for name, demo_args in runs]
    spec = resolve_spec(args.model)
    text = (f"Reduced configuration: {args.model} ({spec.family}, width {spec.width}) at {spec.input_size} px; LFW "
            f"View 1 DevTest pairs (1,000); fine-tuning on LFW-158 as the main job does (2 devices, 3 epochs unless "
            f"the epochs column says otherwise).\n\n"
            + table(rows))
    write_summary(args.out, rows, text)


if __name__ == "__main__":
    main()
