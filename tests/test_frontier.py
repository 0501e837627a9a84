"""The privacy frontier's command: real processes train two points of its full-size configuration for a
few steps (the undefended one and the PartialFace-style DCT subset), View 1 scores them, the audit
attacks them, and the summary has every key the frontier promises. Run again, it resumes: nothing is
trained or audited twice. And the main job releases the point the frontier chose."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitface.common.models import ModelSpec
from research.demo import audited_point
from tests.conftest import ROOT


KEYS = {"transform", "params", "test_accuracy", "relative_accuracy", "view1_accuracy", "pixel_linkage",
        "pixel_linkage_chance", "identity_r1", "identity_r1_chance", "recognizer_clean_r1", "attack",
        "per_image_epsilon", "device_ms", "wire_bytes"}


@pytest.mark.slow
def test_frontier_runs_its_full_size_configuration_and_resumes(tmp_path, lfw):
    """The documented full-size command (IResNet-50 at 112 px) for a few steps, on two people and 20
    View 1 pairs: the undefended point and the PartialFace-style DCT subset, whose release (180 x 28 x 28)
    takes the attackers through odd sizes. Then the same command again, which must train, score and
    audit nothing twice."""
    out = tmp_path / "full"
    cmd = [sys.executable, "-m", "research.frontier", "--data", str(lfw), "--out", str(out),
           "--model", "iresnet50", "--only", "dct-drop4-keep36", "--epochs", "1", "--record-max", "8",
           "--view1-limit", "20", "--accuracy-seeds", "1",
           "--demo-args=--threads 2 --max-identities 2 --max-images 11 --devices 1 --batch-size 8",
           f"--audit-args=--recognizers eigenfaces --public-images 64 --decoder-epochs 1 --matcher-epochs 1 "
           f"--cache {tmp_path / 'cache'}"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["transform"], r["params"]) for r in rows] == [("none", {}), ("dct", {"drop": 4, "keep": 36})]
    results = json.loads((out / "runs" / "none" / "results.json").read_text())
    assert results["config"]["model"]["depth"] == 50 and results["config"]["model"]["input_size"] == 112
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert 0 <= r["identity_r1"] <= 1 and 0 < r["identity_r1_chance"] < 1 and r["view1_pairs"] == 20
    undefended, dct = rows
    assert undefended["relative_accuracy"] == 1.0 and undefended["wire_bytes"] >= 64 * 112 * 112 * 4
    assert dct["wire_bytes"] >= 3 * 60 * 28 * 28 * 4   # the 8x8 DCT of the 2x upsampled image, less 4 of 64 per colour
    assert (out / "frontier.png").stat().st_size > 10_000 and "identity R@1" in (out / "table.md").read_text()
    assert json.loads((out / "best.json").read_text())["run"] in {"none", "dct-drop4-keep36"}

    remade = {"summary.json", "best.json"}   # the summaries are written again from the kept reports
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("**/*.json") if p.name not in remade}
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "trained in" not in second.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps   # results, View 1 and audit reports kept


def test_the_main_job_releases_the_frontiers_best_point():
    """run.sh's default release is the point research/frontier.py chose (results/frontier/best.json); how the
    server reads it (--dct-stem-blocks, a point's server stage) is run.sh's DEFAULT_SERVER_STAGE, not the release."""
    best = json.loads((ROOT / "results" / "frontier" / "best.json").read_text())
    args = best["demo_args"]
    release = [a for i, a in enumerate(args) if "--dct-stem-blocks" not in (a, args[i - 1] if i else None)]
    line = next(l for l in (ROOT / "run.sh").read_text().splitlines() if l.startswith("DEFAULT_RELEASE="))
    assert line == f"DEFAULT_RELEASE=({' '.join(release)})"


def test_the_main_job_sends_the_encoding_its_wire_results_measured():
    """run.sh's DEFAULT_WIRE is what the device CLI takes and what results/wire-default-release compared with f32
    on this very release (i8c both ways)."""
    from splitface.protocol.tensor import ENCODINGS

    line = next(l for l in (ROOT / "run.sh").read_text().splitlines() if l.startswith("DEFAULT_WIRE="))
    words = line.removeprefix("DEFAULT_WIRE=(").removesuffix(")").split()
    wire = dict(zip(words[::2], words[1::2]))
    assert wire == {"--activation-encoding": "i8c", "--gradient-encoding": "i8c"} and "i8c" in ENCODINGS
    measured = json.loads((ROOT / "results" / "wire-default-release" / "summary.json").read_text())
    best = json.loads((ROOT / "results" / "frontier" / "best.json").read_text())
    assert {p["point"] for p in measured["points"]} >= {"f32", "i8c"}
    run_args = json.loads((ROOT / "results" / "wire-default-release" / "runs" / "i8c-seed0" / "demo_args.json").read_text())
    assert " ".join(best["demo_args"]) in " ".join(run_args)   # measured on the main job's release


def test_the_main_job_finds_its_audited_point_whatever_spec_fields_were_added_since():
    """The main job prints the frontier's audit figures for its release: a run whose model spec has fields the
    frontier's recorded run predates (at their defaults) is still the same release."""
    measured = json.loads((ROOT / "results" / "frontier" / "runs" / "dct-drop4" / "results.json").read_text())
    now = json.loads(json.dumps(measured))
    now["config"]["model"] = ModelSpec.from_dict(now["config"]["model"]).to_dict()   # every field, as runs write today
    frontier, row = audited_point(now)
    assert (frontier.name, row["run"]) == ("frontier", "dct-drop4")
    now["config"]["model"]["dct_drop"] = 2
    assert audited_point(now) is None


def test_a_run_from_a_distilled_start_is_not_the_scratch_runs_audited_point():
    """The same release from another start is another model: the audit of the run from seeded weights does not
    speak for it (the distilled frontier's rows do, matched by the start file's name, wherever its cache is)."""
    measured = json.loads((ROOT / "results" / "frontier" / "runs" / "dct-drop4" / "results.json").read_text())
    distilled = json.loads(json.dumps(measured))
    distilled["config"]["device_weights"] = "/home/someone/.cache/splitface/distilled/iresnet18-w16-64px-0123.pt"
    found = audited_point(distilled)
    assert found is None or found[0].name == "frontier-distilled"


def test_accuracies_are_seed_means_relative_to_the_references_mean_on_the_same_seeds():
    """A point trained at seeds 0-2 against a reference that has them too: means over the three; a point with
    seed 0 only is compared with the reference's seed 0 alone (not with its mean over seeds it lacks)."""
    from research import frontier

    reference = {0: (0.4, 0.70), 1: (0.6, 0.80), 2: (0.5, 0.75)}
    point = {0: (0.4, 0.70), 1: (0.3, 0.60), 2: (0.5, 0.65)}
    test, view1 = frontier.relative(point, reference)
    assert test == pytest.approx(0.4 / 0.5) and view1 == pytest.approx(0.65 / 0.75)
    assert frontier.relative({0: (0.2, 0.35)}, reference) == pytest.approx((0.5, 0.5))
    assert frontier.relative(reference, reference) == pytest.approx((1.0, 1.0))


def test_the_main_job_starts_as_a_measured_fine_tuning_row():
    """run.sh's DEFAULT_START, with its release and wire, is a split fine-tuning row of results/pretrain,
    pretrain-views or pretrain-hold at seeds 0-2 (the recipe's accuracy on LFW-158 is measured, not assumed): the
    same arguments as the demo reads them, whatever their order."""
    from research.demo import parser

    def read(argv: list[str]) -> tuple[dict, list[str]]:
        known, extra = parser().parse_known_args(argv)
        return {k: v for k, v in vars(known).items() if k != "seed"}, extra

    main_job = run_sh_flags()
    rows = [r for table in ("pretrain", "pretrain-views", "pretrain-hold")
            for r in json.loads((ROOT / "results" / table / "summary.json").read_text())]
    measured = [r for r in rows if r["role"] == "split-finetune" and read(r["demo_args"]) == read(main_job)]
    assert {parser().parse_known_args(r["demo_args"])[0].seed for r in measured} == {0, 1, 2}
    assert all(0 < r["lfw158_test_accuracy"] <= 1 for r in measured)


def test_the_main_job_says_where_its_audited_run_trained_the_server_otherwise():
    """The main job prints the audit of its release; what a server can recognise depends on how it trained, so a
    difference in the server's recipe is said beside the figures (here: the main job's release from the first
    distilled frontier's start, audited there with the first recipe, and run.sh's imprinted one)."""
    from research.demo import audit_line, parser

    audited = ROOT / "results" / "frontier-distilled" / "runs" / "dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2"
    results = json.loads((audited / "results.json").read_text())   # trained with the first recipe
    same, _ = parser().parse_known_args(["--head-lr-scale", "10"])
    assert "identity R@1" in audit_line(results, same) and "trained otherwise" not in audit_line(results, same)
    ours, _ = parser().parse_known_args(run_sh_flags())
    assert ("trained otherwise (lr 0.05 there, 0.01 here; imprint-epochs 0 there, 1 here; imprint-hold-tail 0 there, "
            "1 here; mirror-train 0 there, 1 here)") in audit_line(results, ours)
    held, _ = parser().parse_known_args(["--head-lr-scale", "10", "--imprint-epochs", "1", "--imprint-hold-tail"])
    assert "trained otherwise (imprint-epochs 0 there, 1 here; imprint-hold-tail 0 there, 1 here)" in audit_line(results, held)
    # a hold with nothing imprinted holds nothing: the server trained as the audited one did
    nothing_held, _ = parser().parse_known_args(["--head-lr-scale", "10", "--imprint-hold-tail"])
    assert "trained otherwise" not in audit_line(results, nothing_held)
    # training on the mirror average is the server's recipe too; asked for without the average, or for a release
    # without a mirror, it is not how the server trains (the demo drops it)
    release = json.loads((audited / "demo_args.json").read_text())   # the audited run's own flags
    mirrored, _ = parser().parse_known_args([*release, "--mirror-average", "--mirror-train"])
    assert "trained otherwise (mirror-train 0 there, 1 here)" in audit_line(results, mirrored)
    for flags in (["--no-mirror-average", "--mirror-train"], ["--release", "none", "--split", "conv1", "--mirror-average",
                                                            "--mirror-train"]):
        assert "trained otherwise" not in audit_line(results, parser().parse_known_args([*release, *flags])[0])


def test_the_main_job_prints_the_audit_of_its_own_release_and_start():
    """run.sh's run (results/main_job/distilled, from a clean clone) finds its release from its own start in the
    frontier trained as the main job trains, with no caveat: the audited figures are for this recipe."""
    from research.demo import audit_line, parser

    results = json.loads((ROOT / "results" / "main_job" / "distilled" / "results.json").read_text())
    frontier, row = audited_point(results)
    assert frontier.name == "frontier-distilled-student150-views16-noiseaware150-hold-mirror-train"
    assert row["transform"] == "dct" and row["params"]["stem_blocks"] == 2   # run.sh's server stage was audited
    ours, _ = parser().parse_known_args(run_sh_flags())
    line = audit_line(results, ours)
    assert f"{row['model_identity_r1']:.3f} from its models of releases" in line and "trained otherwise" not in line


def test_the_main_job_from_the_longer_16_view_start_prints_that_starts_audit():
    """run.sh with the 16-view, 150-epoch start's flags (results/pretrain-views' run) finds its release audited from
    that very start file, trained as it trained: the figures are that start's, with no caveat."""
    from research.demo import audit_line, parser

    run = ROOT / "results" / "pretrain-views" / "runs" / "runsh-views16-student150"
    results = json.loads((run / "results.json").read_text())
    frontier, row = audited_point(results)
    assert frontier.name == "frontier-distilled-student150-views16" and row["transform"] == "dct"
    audited = json.loads((frontier / "runs" / row["run"] / "results.json").read_text())["config"]["device_weights"]
    assert Path(audited).name == Path(results["config"]["device_weights"]).name
    ours, _ = parser().parse_known_args(json.loads((run / "demo_args.json").read_text()))
    line = audit_line(results, ours)
    assert f"{row['model_identity_r1']:.3f} from its models of releases" in line
    assert "trained otherwise" not in line and "another build" not in line


def test_the_main_job_from_its_own_build_of_the_start_prints_the_audit_of_the_same_recipe(tmp_path):
    """A user's build of the noise-aware start is named otherwise than the audited one (its key hashes the plain
    student's bytes, which a student trained again does not repeat): made from the plain student of the same name
    (a reproducible key) for the same epochs and views, the main job still prints the audit of that recipe and says it was
    another build's; from another plain student, for other epochs or on other views it finds none."""
    from research.demo import audit_line, parser

    results = json.loads((ROOT / "results" / "main_job" / "distilled" / "results.json").read_text())
    frontier, row = audited_point(results)
    plain = json.loads((frontier / "runs" / "none" / "results.json").read_text())["config"]["device_weights"]

    def rebuilt(init: str, epochs: int, views: int | None = None) -> dict:
        start = tmp_path / f"iresnet18-w16-64px-{len(list(tmp_path.iterdir())):016d}.pt"
        recipe = {"epochs": epochs} if views is None else {"epochs": epochs, "views": views}   # older files: none
        torch.save({"meta": {"student": {"init": init}, "recipe": recipe}}, start)
        run = json.loads(json.dumps(results))
        run["config"]["device_weights"] = str(start)
        return run

    ours, _ = parser().parse_known_args(run_sh_flags())
    epochs, views = ours.noise_aware_epochs, ours.noise_aware_views
    same = rebuilt(f"/home/someone/.cache/splitface/distilled/{Path(plain).name}", epochs, views)
    assert audited_point(same) == (frontier, row)
    line = audit_line(same, ours)
    assert f"{row['model_identity_r1']:.3f} from its models of releases" in line
    assert "another build of this noise-aware start" in line and f"{Path(same['config']['device_weights']).name} here" in line
    # the same build run without the held tail finds the same audit, and says that its server trained otherwise
    # (no frontier trained this start's server so)
    without, _ = parser().parse_known_args([*run_sh_flags(), "--no-imprint-hold-tail"])
    assert audited_point(same, args=without) == (frontier, row)
    line = audit_line(same, without)
    assert "trained otherwise (imprint-hold-tail 1 there, 0 here)" in line and "another build of this noise-aware start" in line
    for other in (rebuilt("/elsewhere/iresnet18-w16-64px-0123456789abcdef.pt", epochs, views),
                  rebuilt(plain, epochs + 1, views), rebuilt("seeded", epochs, views),
                  rebuilt(plain, epochs, views + 8), rebuilt(plain, epochs)):   # the last: a file that records no views
        assert audited_point(other) is None
        assert audit_line(other, ours).startswith("privacy: this release setting has not been audited")


def test_a_run_finds_the_frontier_whose_server_trained_as_it_did():
    """The same release from the same start is audited in several frontiers, one for each way the server trained:
    the undefended point from the recipe's plain student (with the first recipe and imprinted), from run.sh's
    plain student (imprinted, with the server's tail held and without), and the main job's release from two builds
    of run.sh's noise-aware start (held and not). Each run finds the frontier trained as it was, with no caveat
    on the server's recipe; without its arguments, its own start file's first in FRONTIERS (the main job's
    first). The undefended row audited before the audit's copy of a trained device part began from the published
    start, and the DCT row audited before the audit attacked the mirror image's release, say their figures may
    understate; the rows audited since do not."""
    from research.demo import audit_line, parser

    main_release = "dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2-stem_blocks2"
    held, not_held = "frontier-distilled-imprinted-student60-hold", "frontier-distilled-imprinted-student60"
    for name, point, without_args in (("frontier-distilled-imprinted", "none", "frontier-distilled-imprinted"),
                                      (not_held, "none", held), (held, "none", held),
                                      (not_held, main_release, not_held), (held, main_release, held)):
        run = ROOT / "results" / name / "runs" / point
        results = json.loads((run / "results.json").read_text())
        args, _ = parser().parse_known_args(json.loads((run / "demo_args.json").read_text()))
        frontier, row = audited_point(results, args=args)
        assert (frontier.name, row["run"]) == (name, point)
        line = audit_line(results, args)
        assert "trained otherwise" not in line
        assert ("began from seeded weights" in line) == (name != held and point == "none")   # conv1's part trains
        assert ("also attacked the mirror image's release" in line) == (name != held and point == main_release)
        assert ("may understate" in line) == (name != held)
        assert audited_point(results)[0].name == without_args


def run_sh_flags() -> list[str]:
    """The main job's flags: run.sh's start, release, server stage and wire."""
    from research.pretrain_table import run_sh_array

    return [*run_sh_array("DEFAULT_START"), *run_sh_array("DEFAULT_RELEASE"), *run_sh_array("DEFAULT_SERVER_STAGE"),
            *run_sh_array("DEFAULT_WIRE")]


def test_the_noise_aware_start_is_named_in_every_run_that_used_one():
    """--noise-aware-epochs is part of a run's arguments (a recorded run is read back only for the same
    arguments): set at the end for a noise-aware start, dropped for a run from the plain student."""
    from research.pretrain_table import with_epochs

    flag = "--noise-aware-epochs"
    start = ["--init", "distilled", "--noise-aware-epochs", "30", "--lr", "0.01"]
    assert with_epochs(start, flag, 10) == ["--init", "distilled", "--lr", "0.01", "--noise-aware-epochs", "10"]
    assert with_epochs(start, flag, None) == ["--init", "distilled", "--lr", "0.01"]
    assert with_epochs(["--lr", "0.01"], flag, 10) == ["--lr", "0.01", "--noise-aware-epochs", "10"]
    assert with_epochs(["--student-epochs", "60", *start], "--student-epochs", None) == start
    rows = json.loads((ROOT / "results" / "pretrain" / "summary.json").read_text())
    for r in rows:
        if r["role"] == "split-finetune" and "distilled" in r["demo_args"] and "--release" in r["demo_args"]:
            assert "--noise-aware-epochs" in r["demo_args"], r["run"]


def test_the_start_flags_name_the_recipes_and_their_defaults_the_recorded_starts():
    """--student-epochs, --noise-aware-epochs and the two --*-views set only the epochs and the views of the two
    recipes; left out, they name the recipes that the recorded runs' starts were built with (the same cache keys,
    the same files)."""
    from dataclasses import replace

    from research.demo import parser, start_recipes
    from research.distill import NOISE_AWARE_RECIPE, PLAIN_RECIPE

    assert start_recipes(parser().parse_known_args([])[0]) == (PLAIN_RECIPE, NOISE_AWARE_RECIPE)
    args = parser().parse_known_args(["--student-epochs", "60", "--noise-aware-epochs", "30"])[0]
    assert start_recipes(args) == (replace(PLAIN_RECIPE, epochs=60), replace(NOISE_AWARE_RECIPE, epochs=30))
    args = parser().parse_known_args(["--student-views", "8", "--noise-aware-views", "4"])[0]
    assert start_recipes(args) == (replace(PLAIN_RECIPE, views=8), replace(NOISE_AWARE_RECIPE, views=4))


@pytest.mark.parametrize("flag", ["--student-epochs", "--noise-aware-epochs"])
@pytest.mark.parametrize("epochs", ["0", "-3"])
def test_a_distilled_start_of_no_epochs_is_a_usage_error(flag, epochs, capsys):
    from research.demo import main

    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(ROOT / "no-such-lfw"), flag, epochs])
    assert exit_.value.code == 2 and f"{flag} must be 1 or more" in capsys.readouterr().err


def test_the_table_names_the_dct_server_stage_and_averages_the_compared_seeds():
    """results/pretrain's rows say which server stage a DCT run had (none named: the conv alone, as recorded
    before the option) and its seed; the compared runs' line gives each seed's accuracy and their mean."""
    from research.pretrain_table import release_name, seed_means

    none = {"name": "none"}
    spec = {"release": "dct", "dct_drop": 4}
    assert release_name(spec, "layer2", none) == "dct drop 4 (layer2)"
    assert release_name({**spec, "dct_stem_blocks": 2}, "layer2", none) == "dct drop 4 (layer2), server stage conv + 2 blocks"
    rows = [{"role": "split-finetune", "run": name, "lfw158_test_accuracy": test, "view1_accuracy": view1}
            for name, test, view1 in (("a", 0.70, 0.80), ("a-seed1", 0.80, 0.90), ("a-seed2", 0.75, 0.85))]
    line = seed_means(rows, {"a": "the first"})
    assert "the first (`a`), seeds 0, 1, 2: LFW-158 test accuracy 0.700, 0.800, 0.750 (mean 0.750)" in line
    assert "View 1 0.800, 0.900, 0.850 (mean 0.850)" in line
