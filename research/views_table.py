"""Function matching against the first recipe, side by side on one machine (results/pretrain-views/).

research/views.py distils on K views of each public face with the teacher's embedding of each view; the first
recipe regresses a shifted, flipped image onto the teacher's embedding of the clean one. Rows, for each recipe
(--recipes: the first, K views, K views with a longer plain student or noise-aware start; and, to see where the
main job loses, `-quiet`: run.sh's release without its noise, `-hold`: fine-tuning with the server's tail held
while its head is imprinted, `-mirror`: the server's test embeddings averaged with the mirror image's, `-mirror-train`:
trained on that average too):
- student: the tables' plain student (TABLE_START's --student-epochs, run.sh's when the tables began, unless the
  recipe names others) and the noise-aware start made from it (run.sh's release and server stage, TABLE_START's
  --noise-aware-epochs unless the recipe names others; function matching in both stages, or in neither), each on
  View 1, frozen on LFW-158 (research/pretrain_table.py's probe) and against the teacher (`pretrain fit`: the
  cosine loss on its own public faces and on View 1's images, which it never saw), both against the targets it
  learned from and against the same targets for every recipe (the teacher at 150 px and at 64 px); a noise-aware
  start also frozen without its noise;
- split-finetune: run.sh itself from each start, at seeds 0, 1 and 2.

The teacher's row is dlib at the students' input. Reduced configuration (2 CPU cores): iresnet_small at 64 px.
Resumable: starts come from the cache (built on first use: about 70 minutes each plain student, 20 each
noise-aware start, on 2 cores), recorded runs are read back (--force makes them again). The committed
table: the default recipes, then `--recipes 16:150` (whose plain student took about 2.7 hours to distil), then
`--recipes 16:150-quiet 16:150:150 16:150-hold 16:150-quiet-hold 16:150:150-hold`, then
`--recipes 16:150-hold-mirror 16:150:150-hold-mirror`. results/pretrain-hold/: `--out results/pretrain-hold
--recipes first first-hold first-hold-mirror`.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from splitface.common.data import load_lfw
from splitface.common.models import DEFAULT_SPLIT
from splitface.common.options import add_data_root_arg, add_model_args, model_spec
from splitface.device.privacy.mechanisms import NoNoise
from splitface.device.privacy.options import add_privacy_args, release_mechanism
from research.demo import parser as demo_parser, start_recipes
from research.audit.recognizer import DlibResNet
from research.distill import (CROP, TEACHER_SIZE, default_cache, distilled_start, evaluate_student, fit_teacher_size,
                              load_student, teacher_fit)
from research.evaluation.verification import evaluate_embedder
from research.pretrain_table import (ROOT, SEEDS, TABLE_START, finetune_row, frozen_probe, run_sh_array, seed_means,
                                     stage_without_mirror, student_embedder, student_row, table, teacher_row)
from research.results import write_summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, required=True, help="LFW root (with View 1's pairs files)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "pretrain-views")
    p.add_argument("--recipes", nargs="+", type=recipe_flags, metavar="RECIPE",
                   default=[recipe_flags("first"), recipe_flags("8")],
                   help="`first` (the first recipe), K (function matching on K views in both distillations), "
                        "K:E (the same with the plain student distilled for E epochs; run.sh's are 60) or K:E:N "
                        "(and the noise-aware start for N; run.sh's are 60), then optionally -quiet (run.sh's "
                        "release without its noise), -hold (--imprint-hold-tail) and -mirror (--mirror-average). "
                        "Rows of recipes already in "
                        "--out's summary.json and not named here are kept as they are")
    p.add_argument("--cache", type=Path, default=default_cache(), help="teacher embeddings and distilled starts")
    p.add_argument("--force", action="store_true", help="train and evaluate every fine-tuning run again")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite --out's table.md from its summary.json, building and running nothing")
    args = p.parse_args(argv)
    if args.report_only:
        rows = read_rows(args.out)
        write_summary(args.out, rows, report(rows))
        return
    args.model = "iresnet_small"
    args.out.mkdir(parents=True, exist_ok=True)
    start, release, wire = list(TABLE_START), run_sh_array("DEFAULT_RELEASE"), run_sh_array("DEFAULT_WIRE")
    stage = stage_without_mirror()
    options = argparse.ArgumentParser(add_help=False)
    add_privacy_args(options)
    add_model_args(options, args.model)
    def released(*flags: str) -> argparse.Namespace:   # run.sh's release, as a recipe's flags change it
        return options.parse_known_args(["--model", args.model, *release, *stage, *flags])[0]
    data = load_lfw(args.data, min_images=10, seed=0)   # the main job's LFW-158 split (demo's defaults)

    args.recipes = list(dict(args.recipes).items())   # each recipe once, in the order first named
    kept = [r for r in read_rows(args.out) if r["role"] != "teacher" and r.get("recipe") not in dict(args.recipes)]
    teacher = evaluate_embedder(DlibResNet(TEACHER_SIZE).embed, args.data, 64, CROP, flip=True)
    rows = [{**teacher_row(args.data, 64, args.cache, data), "view1_flip": flipped(teacher)}]
    for name, flags in args.recipes:
        recipes = start_recipes(demo_parser().parse_known_args([*start, *flags])[0])
        known = released(*flags)
        # the same release without its noise (the clip kept): how much of the start's loss is the noise's
        quiet = release_mechanism(released(*flags, "--noise-multiplier", "0"))
        noisy = release_mechanism(known)
        for spec, split, mechanism, without in ((model_spec(options.parse_known_args(["--model", args.model])[0]),
                                                 DEFAULT_SPLIT, NoNoise(), None),
                                                (model_spec(known), known.split, noisy,
                                                 quiet if noisy.describe() != quiet.describe() else None)):
            path = distilled_start(spec, split, mechanism, args.data, args.cache, recipes=recipes)
            probe = frozen_probe(student_embedder(path, spec, split, mechanism), data)
            if without is not None:
                probe["lfw158_frozen_without_noise"] = frozen_probe(student_embedder(path, spec, split, without), data)
            student = load_student(path, split, mechanism, spec)
            by_input = {size: teacher_fit(student, args.data, args.cache, teacher_size=size)
                        for size in sorted({TEACHER_SIZE, spec.input_size})}
            same = {str(size): {k: f[k] for k in ("public_cosine_loss", "view1_cosine_loss")}
                    for size, f in by_input.items()}
            rows.append({**student_row(path, probe), "recipe": name, **by_input[fit_teacher_size(path)],
                         "fit_by_teacher_input": same,
                         "view1_flip": flipped(evaluate_student(student, args.data, flip=True))})
        run = f"runsh-{name}"
        for seed in SEEDS:
            demo_args = [*start, *release, *stage, *wire, *flags, *(["--seed", str(seed)] if seed else [])]
            rows.append({**finetune_row(run if not seed else f"{run}-seed{seed}", demo_args, args), "recipe": name})
    rows = [rows[0], *sorted([*kept, *rows[1:]], key=lambda r: recipe_order(r["recipe"]))]
    write_summary(args.out, rows, report(rows))


def report(rows: list[dict]) -> str:
    """The table, the fit and flip lines and the seed means, from the rows (the teacher's first)."""
    compared = {f"runsh-{name}": describe(name) for name in dict.fromkeys(r["recipe"] for r in rows[1:])}
    return ("Reduced configuration: iresnet_small (width 16) at 64 px; LFW View 1 DevTest pairs (1,000); fine-tuning "
            "on LFW-158 as run.sh does (2 devices, 3 epochs). Every recipe distilled on this machine, with run.sh's "
            "epochs when the table began (60 and 60) unless its name gives the plain student's (`viewsK-studentE`) "
            "or the noise-aware start's (`-noiseawareN`); `-quiet`: run.sh's release without its noise, in the start "
            "and in fine-tuning; `-hold`: "
            "fine-tuning with the server's tail held while its head is imprinted (`--imprint-hold-tail`); `-mirror`: "
            "the server's test embeddings averaged with the mirror image's (`--mirror-average`; View 1 after "
            "fine-tuning too); `-mirror-train`: the server trained on that average too (`--mirror-train`). A "
            "recipe's plain student is listed with it, though recipes may share one (the same file).\n\n"
            + table(rows) + "\n"
            + fits(rows) + flips(rows) + without_noise(rows) + seed_means(rows, compared))


# a recipe's suffixes, in their one order: the same in its --recipes item and in its name
SUFFIXES = r"(-quiet)?(-hold)?(-mirror(-train)?)?"


def recipe_flags(text: str) -> tuple[str, list[str]]:
    """A --recipes item as (its name, the demo flags it adds to run.sh's start and release)."""
    match = re.fullmatch(r"(?:(first)|([1-9][0-9]*)(?::([1-9][0-9]*)(?::([1-9][0-9]*))?)?)" + SUFFIXES, text)
    if match is None:
        raise argparse.ArgumentTypeError(f"a recipe is `first`, K, K:E or K:E:N (views, plain student's epochs, "
                                         f"noise-aware start's epochs), then optionally -quiet, -hold and -mirror "
                                         f"(or -mirror-train), not {text!r}")
    first, views, epochs, noisy, quiet, hold, mirror, train = match.groups()
    flags, name = ([], "first-recipe") if first else (["--student-views", views, "--noise-aware-views", views],
                                                       f"views{views}")
    if epochs is not None:
        flags, name = [*flags, "--student-epochs", epochs], f"{name}-student{epochs}"
    if noisy is not None:
        flags, name = [*flags, "--noise-aware-epochs", noisy], f"{name}-noiseaware{noisy}"
    if quiet:
        flags, name = [*flags, "--noise-multiplier", "0"], f"{name}-quiet"
    if hold:
        flags, name = [*flags, "--imprint-hold-tail"], f"{name}-hold"
    if mirror:
        flags, name = [*flags, "--mirror-average"], f"{name}-mirror"
    if train:
        flags, name = [*flags, "--mirror-train"], f"{name}-train"
    return name, flags


def recipe_order(name: str) -> tuple[int, int, int, bool, bool, bool, bool]:
    """A recipe's name (recipe_flags) as (views, the plain student's epochs, the noise-aware start's; 0: run.sh's,
    whether the release is without its noise, whether the server's tail is held while its head is imprinted,
    whether its test embeddings are averaged with the mirror image's, whether it trained on that average), views 0
    for the first recipe: the first, then by views, then by epochs, the release's noise before none, without the held
    tail before with it, and without the mirror before with it, tested on it before trained on it too."""
    match = re.fullmatch(r"(?:first-recipe|views([0-9]+)(?:-student([0-9]+))?(?:-noiseaware([0-9]+))?)" + SUFFIXES, name)
    if match is None:
        raise ValueError(f"not a recipe's name: {name!r}")
    views, epochs, noisy, quiet, hold, mirror, train = match.groups()
    return (int(views or 0), int(epochs or 0), int(noisy or 0), bool(quiet), bool(hold), bool(mirror), bool(train))


def describe(name: str) -> str:
    """A recipe's name (recipe_flags) in words."""
    views, epochs, noisy, quiet, hold, mirror, train = recipe_order(name)
    return ((f"function matching on {views} views in both distillations" if views
             else "the first recipe (clean targets)")
            + (f", the plain student distilled for {epochs} epochs" if epochs else "")
            + (f", the noise-aware start for {noisy} epochs" if noisy else "")
            + (", the release without its noise (noise multiplier 0; the clip kept) in the start and fine-tuning"
               if quiet else "")
            + (", the server's tail held while its head is imprinted (--imprint-hold-tail)" if hold else "")
            + (", each test release's embedding averaged with its mirror image's (--mirror-average)" if mirror else "")
            + (", and trained on that average (--mirror-train)" if train else ""))


def read_rows(out: Path) -> list[dict]:
    """The rows an earlier run wrote to `out`/summary.json (none if there is none)."""
    summary = out / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else []


def flipped(report: dict) -> dict:
    """The View 1 figures of a report made with test-time flipping."""
    return {k: report[k] for k in ("view1_accuracy", "view1_std", "roc_auc", "tar_at_far_1e-2")}


def flips(rows: list[dict]) -> str:
    """A line per start and the teacher: View 1 with test-time flipping (evaluate_embedder's `flip`: each face
    embedded with its mirror image), beside the row's single embedding."""
    def line(r: dict) -> str:
        f = r["view1_flip"]
        return (f"{f['view1_accuracy']:.3f} ± {f['view1_std']:.3f} (AUC {f['roc_auc']:.3f}, TAR @ FAR 1e-2 "
                f"{f['tar_at_far_1e-2']:.3f}) against {r['view1_accuracy']:.3f} without")
    named = [(f"teacher (dlib at {r['input']})" if r["role"] == "teacher" else f"{r['recipe']}, {r['release']}", r)
             for r in once(rows) if "view1_flip" in r]
    if not named:
        return ""
    return ("View 1 with test-time flipping (each face's unit embedding summed with its mirror image's; two "
            "embeddings a face, so a device would release each face twice):\n"
            + "".join(f"- {name}: {line(r)}\n" for name, r in named) + "\n")


def once(rows: list[dict]) -> list[dict]:
    """The rows with each start's file once (recipes that share a plain student list it each), the first kept."""
    seen: set[str] = set()
    kept = []
    for r in rows:
        if r.get("file") not in seen:
            kept.append(r)
        if "file" in r:
            seen.add(r["file"])
    return kept


def without_noise(rows: list[dict]) -> str:
    """A line per noise-aware start measured so: frozen on LFW-158 with its release's noise, without it (the clip
    kept) and the plain student's, so that the start's loss splits into the noise's share and the rest's (the
    transform, and the server's stage that reads it)."""
    def probe(r: dict) -> str:
        return f"{r['lfw158_class_mean_accuracy']:.3f} / {r['lfw158_logistic_accuracy']:.3f}"
    plain = {r["recipe"]: r for r in rows if r["role"] == "student" and r["release"].startswith("none")}
    lines = [f"- {r['recipe']}, {r['release']}: {probe(r)} with its noise, {probe(r['lfw158_frozen_without_noise'])} "
             f"without; the plain student {probe(plain[r['recipe']])}\n"
             for r in once(rows) if "lfw158_frozen_without_noise" in r]
    if not lines:
        return ""
    return ("Frozen on LFW-158 (class mean / logistic), the noise-aware start with its release's noise and without "
            "it (the same file and clip, noise multiplier 0):\n" + "".join(lines) + "\n")


def fits(rows: list[dict]) -> str:
    """A line per start: its cosine loss against the teacher on its own public faces and on View 1's images, against
    the targets it learned from and against each recipe's (the teacher at 150 px and at the student's 64 px, both
    centred on the clean public faces' mean), so that the recipes are compared on the same targets."""
    def same(r: dict) -> str:
        return "; ".join(f"teacher at {size} px {f['public_cosine_loss']:.3f} / {f['view1_cosine_loss']:.3f}"
                         for size, f in r.get("fit_by_teacher_input", {}).items())
    return "".join(f"- {r['recipe']}, {r['release']}: teacher fit (cosine loss, the teacher at "
                   f"{r['teacher_input']} px) {r['public_cosine_loss']:.3f} on "
                   f"{r['public_sample']} of its public faces, {r['view1_cosine_loss']:.3f} on View 1's "
                   f"{r['view1_images']} images. The same targets for every recipe (public / View 1): {same(r)}\n"
                   for r in once(rows) if r["role"] == "student") + "\n"


if __name__ == "__main__":
    main()
