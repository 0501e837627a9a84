"""The distilled public start, measured: the teacher, each student, and split fine-tuning on LFW-158 from it.

Rows (results/pretrain/summary.json, table.md):
- teacher: dlib's ResNet on View 1's DevTest pairs, at the students' input (64 px from the 160 px centre crop)
  and at the input it was distilled from (150 px);
- student: each distilled backbone (`--init distilled` builds them: research/distill.py), its embedding on
  View 1 as a device releases it (with the release's noise, for a noise-aware start), and frozen on LFW-158 (the
  main job's noise-aware start distilled for 10, 30 and TABLE_START's --noise-aware-epochs, the last also with run.sh's
  server stage for the release, DEFAULT_SERVER_STAGE, from the 30- and the 60-epoch plain student); the plain
  student at twice the width (how much of the gap to the teacher is the student's size); and the plain student
  distilled for 60 epochs (TABLE_START's --student-epochs), at its width and at twice it;
- split-finetune: `splitface-research demo` on LFW-158 (the main job's data: people with >= 10 images) from the
  distilled start, with the main job's release and wire (run.sh), server head and device head; the same from
  scratch (the old start), and from the distilled start with the paper's plain conv1 release; then run.sh's
  start (the server head imprinted with its classes' mean embeddings, the body at lr 0.01) with the main job's
  release, conv1, and the distilled frontier's most private point (the bottleneck at z 0.02), beside the first
  recipe's; all of these from noise-aware starts distilled for 10 epochs. Last, run.sh itself: the main job's
  release from its noise-aware start distilled for TABLE_START's --noise-aware-epochs (and for 30), with the DCT's
  server stage as its conv alone and as run.sh has it (DEFAULT_SERVER_STAGE, without the mirror average that
  run.sh added later: `stage_without_mirror`; results/pretrain-hold/ measures it). LFW-158 test
  accuracy, and View 1 of the fine-tuned model (`splitface-research evaluate`; LFW-158 holds 43 of the DevTest
  pairs' people, so some pairs show people the run trained on: the row says how many).

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
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from splitface.common.data import DataSplit, FaceSet, load_lfw
from splitface.common.models import DEFAULT_SPLIT, ModelSpec, resolve_spec
from splitface.common.options import add_data_root_arg, add_model_arg, add_model_args, model_spec
from splitface.device.privacy.mechanisms import Mechanism, NoNoise
from splitface.device.privacy.options import add_privacy_args, release_mechanism
from research.demo import parser as demo_parser, run_recorded, start_recipes
from research.distill import (CROP, EVALUATION_SEED, NOISE_AWARE_RECIPE, PLAIN_RECIPE, Recipe, TeacherCache,
                             default_cache, distilled_start, load_student)
from research.evaluation.verification import unit_rows, verification_report, view1_pairs
from research.evaluation.run import last_of
from research.results import write_summary

ROOT = Path(__file__).resolve().parents[1]


HOLD = "--imprint-hold-tail"
MIRROR = "--mirror-average"
MIRROR_TRAIN = "--mirror-train"


# run.sh's DEFAULT_START as it was when the tables' rows were measured: before it held the server's tail while
# imprinting and before it started from the 16-view student, so that those rows keep their flags; the tables'
# recipes add to it (results/pretrain-views/ and results/pretrain-hold/: `-hold`, `K:E:N`)
TABLE_START = ("--init", "distilled", "--student-epochs", "60", "--noise-aware-epochs", "60", "--head-lr-scale", "10",
               "--imprint-epochs", "1", "--lr", "0.01")


def stage_without_mirror() -> list[str]:
    """run.sh's DEFAULT_SERVER_STAGE as it was before its server averaged each test release's embedding with its
    mirror image's, or trained on that average: the rows measured then keep their flags (results/pretrain-hold/
    measures both: `-mirror`, `-mirror-train`)."""
    return [a for a in run_sh_array("DEFAULT_SERVER_STAGE") if a not in (MIRROR, MIRROR_TRAIN)]


def run_sh_array(name: str) -> list[str]:
    """One of run.sh's default argument arrays (DEFAULT_RELEASE, DEFAULT_WIRE): the main job's settings, read
    from the one place they are declared."""
    line = next(l for l in (ROOT / "run.sh").read_text().splitlines() if l.startswith(f"{name}=("))
    return shlex.split(line.removeprefix(f"{name}=(").removesuffix(")"))


def frozen_probe(embed: Callable[[FaceSet], np.ndarray], data: DataSplit) -> dict:
    """The embedding, frozen, on LFW-158's test images (the main job's split): by the nearest class mean of the
    training images' embeddings (cosine, about their mean: dlib's share a large common part) and by a logistic
    regression fitted on them. What a fine-tuning run starts from, before any step."""
    from sklearn.linear_model import LogisticRegression

    train, test = embed(data.train), embed(data.test)
    centre = train.mean(0)
    train, test = train - centre, test - centre
    labels = data.train.labels
    means = unit_rows(np.stack([unit_rows(train)[labels == c].mean(0) for c in range(len(data.class_names))]))
    nearest = float(((unit_rows(test) @ means.T).argmax(1) == data.test.labels).mean())
    logistic = LogisticRegression(C=10, max_iter=3000).fit(train, labels).score(test, data.test.labels)
    return {"lfw158_class_mean_accuracy": round(nearest, 4), "lfw158_logistic_accuracy": round(float(logistic), 4)}


def student_embedder(path: Path, spec: ModelSpec, split: str, mechanism: Mechanism) -> Callable[[FaceSet], np.ndarray]:
    """A distilled start's embedding of each image as a device releases it (with the release's noise, drawn
    under the evaluator's seed), as research/distill.py's View 1 score takes it."""
    import torch

    student = load_student(path, split, mechanism, spec)   # each part with its release stages, as a run loads them
    noise = torch.Generator().manual_seed(EVALUATION_SEED)

    def embed(faces: FaceSet) -> np.ndarray:
        x = torch.from_numpy(faces.load(spec.input_size, CROP).astype(np.float32) / 255)
        with torch.no_grad():
            return torch.cat([student(x[i:i + 256], noise) for i in range(0, len(x), 256)]).numpy()
    return embed


def with_epochs(demo_args: list[str], flag: str, epochs: int | None) -> list[str]:
    """`demo_args` with a start's epochs flag (--noise-aware-epochs, --student-epochs) set to `epochs` at the end,
    or dropped (None: a run from the plain student, which no noise-aware start feeds; or from the recipe's
    student)."""
    kept = [a for i, a in enumerate(demo_args) if a != flag and (i == 0 or demo_args[i - 1] != flag)]
    return kept if epochs is None else [*kept, flag, str(epochs)]


def init_from(start: list[str], path: Path) -> list[str]:
    """run.sh's start with its --init naming a file: a start that `--init distilled` would not pick."""
    i = start.index("--init")
    return [*start[:i], "--init", str(path), *start[i + 2:]]


def teacher_row(lfw: Path, size: int, cache: Path, data: DataSplit | None = None) -> dict:
    """dlib on View 1, and with `data` also frozen on LFW-158 (frozen_probe)."""
    pairs = view1_pairs(lfw, "test")
    started = time.time()
    teacher = TeacherCache(cache, size)
    probe = frozen_probe(lambda faces: teacher.embed(faces.paths), data) if data is not None else {}
    embeddings = teacher.embed(pairs.faces.paths)
    report = verification_report(embeddings[pairs.a], embeddings[pairs.b], pairs.same)
    return {"role": "teacher", "model": "dlib ResNet v1 (face-recognition-models)", "start": "dlib's own training",
            "release": "-", "input": f"{size}x{size} from the {CROP} px centre crop", **report, **probe,
            "seconds": round(time.time() - started, 1)}


def student_row(path: Path, probe: dict) -> dict:
    import torch

    meta = torch.load(path, map_location="cpu", weights_only=True)["meta"]
    student = meta["student"]
    spec = student["spec"]
    start = "distilled"
    if student["init"] != "seeded":   # a noise-aware start: from which plain student (beside it in the cache)
        init = path.parent / Path(student["init"]).name
        plain = torch.load(init, map_location="cpu", weights_only=True)["meta"]["recipe"]["epochs"]
        start = f"distilled, noise-aware (from the plain student of {plain} epochs)"
    if meta["recipe"].get("views"):   # (files built before the option record none)
        start += f", function matching on {meta['recipe']['views']} views"
    return {"role": "student", "model": f"{spec['family']}-{spec['depth']} width {spec['width']}", "start": start,
            "release": release_name(spec, student["split"], student["release_mechanism"]),
            "input": student["input"], **meta["view1"], "file": path.name, "epochs": meta["recipe"]["epochs"],
            "train_cosine_loss": round(meta["history"][-1]["cosine"], 4),   # the last epoch's, on augmented images
            "public_people": meta["public_faces"]["people"], "public_images": meta["public_faces"]["images"],
            "seconds": meta["seconds"],   # files built before resumed runs counted their earlier legs: this leg only
            "epoch_seconds": round(sum(h["epoch_s"] for h in meta["history"]), 1),   # every epoch, every leg
            **probe}


def release_name(spec: dict, split: str, mechanism: dict) -> str:
    if spec["release"] == "none":
        name = f"none ({split})"
    elif spec["release"] == "dct":
        name = f"dct drop {spec['dct_drop']} ({split})"
        if spec.get("dct_stem_blocks"):   # (runs recorded before the option have none)
            name += f", server stage conv + {spec['dct_stem_blocks']} blocks"
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
    if not view1.exists() or args.force:   # embedded as its server embedded at test time (evaluate's default)
        subprocess.run([sys.executable, "-m", "research", "evaluate", str(run_dir), "--data", str(args.data)],
                       check=True)
    report = json.loads(view1.read_text())
    config, last = results["config"], results["epochs"][-1]
    device = results["devices"][0]
    return {"role": "split-finetune", "run": name, "model": f"{config['model']['family']}-{config['model']['depth']} "
            f"width {config['model']['width']}", "start": finetune_start(demo_args),
            "release": release_name(config["model"], config["split"], device["privacy"]["mechanism"]),
            "head": config["head"], "input": f"{config['model']['input_size']}x{config['model']['input_size']}",
            "epochs": len(results["epochs"]), "lfw158_test_accuracy": last["test_acc"],
            "view1_accuracy": report["view1_accuracy"], "view1_std": report["view1_std"],
            "roc_auc": report["roc_auc"], "tar_at_far_1e-2": report["tar_at_far_1e-2"], "pairs": report["pairs"],
            "pairs_with_seen_people": report["pairs_with_seen_people"], "demo_args": demo_args}


def finetune_start(demo_args: list[str]) -> str:
    """A fine-tuning run's start and server recipe in words, each flag by its last value (a flag after run.sh's
    overrides it, as argparse reads them)."""
    def value(option: str) -> str | None:
        at = [i for i, a in enumerate(demo_args) if a == option]
        return demo_args[at[-1] + 1] if at else None

    start = value("--init") or "scratch"
    if start not in ("distilled", "scratch"):
        start = f"distilled ({Path(start).name})"
    for option, words in (("--student-epochs", " (student: {} epochs)"),
                          ("--noise-aware-epochs", " (noise-aware start: {} epochs)"),
                          ("--student-views", " (student: function matching on {} views)"),
                          ("--noise-aware-views", " (noise-aware start: function matching on {} views)"),
                          ("--imprint-epochs", ", head imprinted over {} epoch"), ("--lr", ", lr {}"),
                          ("--head-lr-scale", ", head lr x{}"), ("--seed", ", seed {}")):
        if value(option) is not None:
            start += words.format(value(option))
    if last_of(demo_args, HOLD):
        start += ", tail held while imprinting"
    if last_of(demo_args, MIRROR):
        start += ", test embeddings averaged with the mirror image's"
        if last_of(demo_args, MIRROR_TRAIN):
            start += ", trained on that average"
    return start


SEEDS = (0, 1, 2)
STUDENT_60 = ["--student-epochs", "60"]   # the plain student at twice its recipe's epochs


def seed_means(rows: list[dict], compared: dict[str, str]) -> str:
    """A line per compared run: its LFW-158 test accuracy at each seed (rows `name`, `name-seed1`, ...) and their
    mean, with View 1's."""
    by_run = {r["run"]: r for r in rows if r["role"] == "split-finetune"}
    lines = []
    for name, what in compared.items():
        seeded = [by_run[name if s == 0 else f"{name}-seed{s}"] for s in SEEDS]
        tests, view1 = [r["lfw158_test_accuracy"] for r in seeded], [r["view1_accuracy"] for r in seeded]
        lines.append(f"- run.sh's recipe, {what} (`{name}`), seeds {', '.join(map(str, SEEDS))}: LFW-158 test "
                     f"accuracy {', '.join(f'{t:.3f}' for t in tests)} (mean {np.mean(tests):.3f}); View 1 "
                     f"{', '.join(f'{v:.3f}' for v in view1)} (mean {np.mean(view1):.3f})")
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    lines = ["| role | model | start | release | head | input | epochs (distil or fine-tune) | View 1 acc (10-fold) | ROC AUC | "
             "TAR @ FAR 1e-2 | LFW-158 test acc | LFW-158 frozen: class mean / logistic |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        seen = r.get("pairs_with_seen_people")
        mark = f" ({seen} pairs seen)" if seen else ""
        test = f"{r['lfw158_test_accuracy']:.3f}" if "lfw158_test_accuracy" in r else "-"
        frozen = (f"{r['lfw158_class_mean_accuracy']:.3f} / {r['lfw158_logistic_accuracy']:.3f}"
                  if "lfw158_class_mean_accuracy" in r else "-")
        lines.append(f"| {r['role']} | {r['model']} | {r['start']} | {r['release']} | {r.get('head', '-')} | "
                     f"{r['input']} | {r.get('epochs', '-')} | {r['view1_accuracy']:.3f} ± {r['view1_std']:.3f}{mark} | {r['roc_auc']:.3f} | "
                     f"{r['tar_at_far_1e-2']:.3f} | {test} | {frozen} |")
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
    start, release, wire = list(TABLE_START), run_sh_array("DEFAULT_RELEASE"), run_sh_array("DEFAULT_WIRE")
    stage = stage_without_mirror()
    extra = args.demo_args.split()
    long = demo_parser().parse_known_args(start)[0].noise_aware_epochs   # TABLE_START's noise-aware start, as read
    # run.sh's start comes from the plain student of 60 epochs; the rows recorded before it, from the recipe's 30
    start30 = with_epochs(start, "--student-epochs", None)

    data = load_lfw(args.data, min_images=10, seed=0)   # the main job's LFW-158 split (demo's defaults)
    rows = [teacher_row(args.data, 64, args.cache, data), teacher_row(args.data, 150, args.cache)]
    fresh_head = ["--init", "distilled", "--head-lr-scale", "10"]
    bottleneck = ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2",
                  "--mechanism", "per-image", "--clip-norm", "16", "--noise-multiplier", "0.02"]
    def student(spec: ModelSpec, split: str, mechanism: Mechanism, recipes: tuple[Recipe, Recipe]) -> Path:
        """The distilled start (built on first use), its row appended: View 1 and frozen on LFW-158."""
        path = distilled_start(spec, split, mechanism, args.data, args.cache, recipes=recipes)
        rows.append(student_row(path, frozen_probe(student_embedder(path, spec, split, mechanism), data)))
        return path

    # the distilled starts the fine-tuning runs use: the plain student, the main job's noise-aware start and the
    # bottleneck's
    privacy = argparse.ArgumentParser(add_help=False)
    add_privacy_args(privacy)
    add_model_args(privacy, args.model)
    # (the noise-aware ones distilled for 10 epochs, the first recipe; the main job's also for 30 and for run.sh's
    # --noise-aware-epochs, with the DCT's server stage at its default, the conv alone, and as run.sh has it)
    # (and run.sh's, from the plain student distilled for 60 epochs: STUDENT_60)
    starts = dict.fromkeys([((), None), (tuple(release), 10), (tuple(bottleneck), 10), (tuple(release), 30),
                            (tuple(release), long), ((*release, *stage), long),
                            ((*release, *stage, *STUDENT_60), long)])   # (each once, whatever run.sh's numbers)
    for flags, epochs in starts:
        known, _ = privacy.parse_known_args(["--model", args.model, *flags])
        spec, mechanism = model_spec(known), release_mechanism(known)
        # the flags name the student's epochs where they differ from the recipe's; the plain student: no noise-aware
        named = [*flags, "--noise-aware-epochs", str(epochs or NOISE_AWARE_RECIPE.epochs)]
        recipes = start_recipes(demo_parser().parse_known_args(named)[0])
        student(spec, known.split, mechanism, recipes)
    # capacity: the plain student's recipe at twice the width (about 3.4x the parameters and 4x the tail's
    # multiply-adds), for 20 epochs: how much of the gap to the teacher is the student's size (built on first use:
    # about an hour on 2 cores)
    wide = replace(resolve_spec(args.model), width=2 * resolve_spec(args.model).width)
    wide_path = student(wide, DEFAULT_SPLIT, NoNoise(), (replace(PLAIN_RECIPE, epochs=20), NOISE_AWARE_RECIPE))
    # time: the plain student at twice the recipe's epochs (its View 1 still rose at 30: 0.889, 0.898, 0.909 at 20,
    # 25 and 30), TABLE_START's --student-epochs 60 (built on first use: about 60 minutes on 2 cores)
    recipes60 = start_recipes(demo_parser().parse_known_args(STUDENT_60)[0])
    student(resolve_spec(args.model), DEFAULT_SPLIT, NoNoise(), recipes60)
    # both: the wider student for 60 epochs too (built on first use: about 2.5 hours on 2 cores; its View 1 during
    # that build: 0.911, 0.902 and 0.915 at epochs 20, 25 and 30)
    student(wide, DEFAULT_SPLIT, NoNoise(), recipes60)
    # the main job's release and wire with `fresh_head`, the first recipe from the distilled start (a fresh head at 10x
    # the lr), and its device-head twin; the old start from seeded weights with the old recipe; and the distilled
    # start with the paper's conv1 release
    # the runs from a noise-aware start made in 10 epochs (the first recipe) say so; runs from the plain student
    # carry no --noise-aware-epochs (none feeds them)
    first = lambda a: with_epochs(a, "--noise-aware-epochs", 10)   # noqa: E731
    plain = lambda a: with_epochs(a, "--noise-aware-epochs", None)   # noqa: E731
    runs = [("distilled-main-release-server-head", first([*fresh_head, *release, *wire])),
            ("distilled-main-release-device-head", first([*fresh_head, "--head", "device", *release, *wire])),
            ("scratch-main-release-server-head", [*release, *wire]),
            ("distilled-conv1-server-head", [*fresh_head, *wire]),
            # a gentler fine-tune: the body at a fifth of the demo's server lr (0.05), the head still at 10x it
            ("distilled-main-release-server-head-lr0.01", first([*fresh_head, *release, *wire, "--lr", "0.01"])),
            ("distilled-conv1-server-head-lr0.01", [*fresh_head, *wire, "--lr", "0.01"]),
            # longer: at 3 epochs the main release's test accuracy still climbs (0.46, 0.65, 0.72)
            ("distilled-main-release-server-head-8-epochs", first([*fresh_head, *release, *wire, "--epochs", "8"])),
            # the head imprinted with its classes' mean embeddings over the first epoch, then trained, the body at
            # the gentler lr (server/imprint.py); the main job's release, conv1, and the distilled frontier's most
            # private point (the bottleneck at z 0.02) with the first recipe and imprinted
            ("distilled-imprint-main-release-server-head", first([*start30, *release, *wire])),
            ("distilled-imprint-conv1-server-head", plain([*start30, *wire])),
            ("distilled-bottleneck-z0.02-server-head", first([*fresh_head, *bottleneck, *wire])),
            ("distilled-imprint-bottleneck-z0.02-server-head", first([*start30, *bottleneck, *wire])),
            # the wider student, fine-tuned the same way with the paper's conv1 release
            ("distilled-wide-imprint-conv1-server-head",
             plain([*init_from(start30, wide_path), *wire, "--model", json.dumps(wide.compact_dict())])),
            # run.sh's recipe before its server stage and student: the main job's release from its noise-aware
            # start distilled for longer (TABLE_START's --noise-aware-epochs), imprinted
            ("distilled-long-imprint-main-release-server-head", [*start30, *release, *wire]),
            ("distilled-imprint-main-release-server-head-start30",
             with_epochs([*start30, *release, *wire], "--noise-aware-epochs", 30)),
            # run.sh's server stage for the release (DEFAULT_SERVER_STAGE): residual blocks after the DCT
            # stage's conv; the rows above have the conv alone (no --dct-stem-blocks: its default)
            ("distilled-long-imprint-main-release-stem2-server-head", [*start30, *release, *stage, *wire]),
            # run.sh: the same from the plain student distilled for 60 epochs instead of 30 (View 1 0.920 against
            # 0.909; TABLE_START's --student-epochs)
            ("distilled-long-imprint-main-release-stem2-student60-server-head", [*start, *release, *stage, *wire])]
    # the last comparisons at two more seeds each (the data split, shuffles and head): one run of the main job
    # moves by up to about 0.04
    compared = {"distilled-long-imprint-main-release-server-head":
                    "the DCT's server stage as its conv alone, from the 30-epoch student",
                "distilled-long-imprint-main-release-stem2-server-head":
                    "with run.sh's server stage, from the 30-epoch student",
                "distilled-long-imprint-main-release-stem2-student60-server-head":
                    "as run.sh has it: its server stage, from the 60-epoch student"}
    runs += [(f"{name}-seed{seed}", [*demo_args, "--seed", str(seed)])
             for name, demo_args in runs if name in compared for seed in SEEDS[1:]]
    rows += [finetune_row(name, [*demo_args, *extra], args) for name, demo_args in runs]
    spec = resolve_spec(args.model)
    text = (f"Reduced configuration: {args.model} ({spec.family}, width {spec.width}) at {spec.input_size} px; LFW "
            f"View 1 DevTest pairs (1,000); fine-tuning on LFW-158 as the main job does (2 devices, 3 epochs unless "
            f"the epochs column says otherwise).\n\n"
            + table(rows) + "\n" + seed_means(rows, compared))
    write_summary(args.out, rows, text)


if __name__ == "__main__":
    main()
