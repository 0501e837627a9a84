"""Function matching (research/views.py) on real public LFW faces: the views follow their seeded recipes, the
first is the students' clean test crop, the teacher's target for a view is its embedding of those very pixels and
is cached, the distillation on the views trains, and a recipe without views keeps the cached starts' names."""
from __future__ import annotations

import json

import numpy as np
import pytest

from research.audit.recognizer import DlibResNet
from research.distill import (CROP, Recipe, TeacherCache, checkpoint_key, distill, file_hash, fit_teacher_size,
                              plain_spec, public_faces)
from research.views import CROP_SIDE, MIX_WEIGHT, SHIFT, ViewSet, render, view_recipes
from splitface.common.models import PRESETS
from splitface.device.privacy.mechanisms import NoNoise
from tests.conftest import ROOT
from tests.test_dlib_resnet import TOLERANCE

SPEC = PRESETS["iresnet_small"]
LIMIT = 32
CLEAN = {"side": 160, "dx": 0, "dy": 0, "flip": False, "b": 1.0, "c": 1.0, "s": 1.0, "grey": False}


def test_views_follow_their_seeded_recipes_and_the_first_is_the_clean_test_crop(lfw):
    faces, _ = public_faces(lfw, 12)
    recipes = view_recipes(len(faces), 6, seed=0)
    assert recipes == view_recipes(len(faces), 6, seed=0) != view_recipes(len(faces), 6, seed=1)
    for i, row in enumerate(recipes):
        assert len(row) == 6 and row[0] == CLEAN
        for r in row[1:]:
            assert CROP_SIDE[0] <= r["side"] <= CROP_SIDE[1] and max(abs(r["dx"]), abs(r["dy"])) <= SHIFT
            assert "mix" not in r or (r["mix"] != i and 0 <= r["mix"] < len(faces)
                                      and MIX_WEIGHT[0] <= r["w"] <= MIX_WEIGHT[1])
    assert any("mix" in r for row in recipes for r in row) and any(r["flip"] for row in recipes for r in row)

    views = np.stack([render(faces.paths, recipes, 64, i) for i in range(len(faces))])
    assert views.shape == (12, 6, 3, 64, 64) and views.dtype == np.uint8
    assert np.array_equal(views[:, 0], faces.load(64, CROP))   # what the students see at test time, bit for bit
    assert not np.array_equal(views[:, 1], views[:, 0])
    mirrored = render(faces.paths, [[{**CLEAN, "flip": True}]], 64, 0)[0]
    assert np.array_equal(mirrored, views[0, 0][:, :, ::-1])
    grey = render(faces.paths, [[{**CLEAN, "grey": True}]], 64, 0)[0]
    assert np.array_equal(grey[0], grey[1]) and np.array_equal(grey[1], grey[2])


def test_a_views_cache_key_names_the_mixed_in_face_by_its_bytes(tmp_path, lfw):
    """Two public sets share the teacher's views cache: a view mixed with another face is keyed by that face's
    bytes, so the same recipe over other images is another key, and the same images another set's same key."""
    faces, _ = public_faces(lfw, 12)
    hashes = [file_hash(p) for p in faces.paths]
    ours = ViewSet(faces.paths, hashes, 4, 0, 64, tmp_path, "t")
    i, j = next((i, j) for i, row in enumerate(ours.recipes) for j, r in enumerate(row) if "mix" in r)
    other = list(hashes)
    other[ours.recipes[i][j]["mix"]] = "0" * 64   # another image at the mixed-in face's place
    theirs = ViewSet(faces.paths, other, 4, 0, 64, tmp_path, "t")
    assert theirs.keys[i][j] != ours.keys[i][j] and theirs.keys[i][0] == ours.keys[i][0]
    assert ViewSet(faces.paths, hashes, 4, 0, 64, tmp_path, "t").keys == ours.keys


def test_a_recipe_without_views_keeps_the_cached_starts_names(lfw):
    """`views` came after the starts that recorded runs name (run.sh's plain student among them): at 0 it is left
    out of the key, so those files keep their names; set, it names another file."""
    _, manifest = public_faces(lfw)
    plain = plain_spec(SPEC)
    assert checkpoint_key(plain, "conv1", NoNoise(), Recipe(epochs=60), manifest, None) == "b1307629db41978d"
    assert checkpoint_key(plain, "conv1", NoNoise(), Recipe(epochs=60, views=8), manifest, None) != "b1307629db41978d"


@pytest.mark.slow
def test_function_matching_distils_on_the_views_with_the_teachers_embedding_of_each(tmp_path, lfw):
    recipe = Recipe(epochs=4, batch_size=16, lr=0.1, views=3)
    first = distill(SPEC, "conv1", NoNoise(), lfw, tmp_path / "fm.pt", recipe, tmp_path, limit=LIMIT, progress=False,
                    evaluate=False)
    assert first["teacher"]["computed_now"] == 3 * LIMIT and "function matching" in first["method"]
    losses = [h["cosine"] for h in first["history"]]
    assert losses[-1] < 0.8 * losses[0], losses   # from a seeded net (cosine loss ~1) towards the teacher

    again = distill(SPEC, "conv1", NoNoise(), lfw, tmp_path / "again.pt", recipe, tmp_path, limit=LIMIT,
                    progress=False, evaluate=False)
    assert again["teacher"]["computed_now"] == 0   # the teacher never ran again
    # `pretrain fit` measures it against the teacher as it learned from it: on its own 64 px pixels
    assert fit_teacher_size(tmp_path / "fm.pt") == SPEC.input_size

    faces, _ = public_faces(lfw, LIMIT)
    views = ViewSet(faces.paths, [file_hash(p) for p in faces.paths], 3, recipe.seed, SPEC.input_size, tmp_path,
                    TeacherCache(None).fingerprint_of_network)
    images, targets = views.build(progress=False)
    assert views.computed == 0 and images.shape == (LIMIT, 3, 3, 64, 64) and targets.shape == (LIMIT, 3, 128)
    # each target is the teacher's embedding of the view's own pixels (embedded in batches of 64 there, of 3 here: the
    # same sums in another order, within test_dlib_resnet's tolerance)
    mixed = next(i for i, row in enumerate(views.recipes) if "mix" in row[1] or "mix" in row[2])
    chosen = images[[0, mixed, mixed], [0, 1, 2]]
    direct = DlibResNet(150).embed(chosen.astype(np.float32) / 255)
    cached = targets[[0, mixed, mixed], [0, 1, 2]]
    assert np.all(np.linalg.norm(cached - direct, axis=1) <= TOLERANCE * np.linalg.norm(direct, axis=1))


def test_the_views_table_recipes_name_their_flags_and_sort_after_the_first():
    import argparse

    from research.views_table import describe, recipe_flags, recipe_order

    assert recipe_flags("first") == ("first-recipe", [])
    assert recipe_flags("8") == ("views8", ["--student-views", "8", "--noise-aware-views", "8"])
    name, flags = recipe_flags("16:150")
    assert name == "views16-student150"
    assert flags == ["--student-views", "16", "--noise-aware-views", "16", "--student-epochs", "150"]
    assert describe(name) == ("function matching on 16 views in both distillations, the plain student distilled "
                              "for 150 epochs")
    assert describe("first-recipe") == "the first recipe (clean targets)"
    assert describe("views8") == "function matching on 8 views in both distillations"   # the committed rows' words
    name, flags = recipe_flags("16:150:150")
    assert name == "views16-student150-noiseaware150"
    assert flags[-2:] == ["--noise-aware-epochs", "150"] and flags[:-2] == recipe_flags("16:150")[1]
    assert describe(name).endswith("for 150 epochs, the noise-aware start for 150 epochs")
    name, flags = recipe_flags("16:150-quiet")
    assert name == "views16-student150-quiet"
    assert flags == [*recipe_flags("16:150")[1], "--noise-multiplier", "0"]   # after run.sh's release: it wins
    assert describe(name).endswith("the release without its noise (noise multiplier 0; the clip kept) in the start "
                                   "and fine-tuning")
    name, flags = recipe_flags("16:150-quiet-hold")
    assert name == "views16-student150-quiet-hold"
    assert flags == [*recipe_flags("16:150-quiet")[1], "--imprint-hold-tail"]
    assert describe(name).endswith("the server's tail held while its head is imprinted (--imprint-hold-tail)")
    assert recipe_flags("first-hold") == ("first-recipe-hold", ["--imprint-hold-tail"])   # run.sh's, since it holds
    assert describe("first-recipe-hold") == ("the first recipe (clean targets), the server's tail held while its head "
                                             "is imprinted (--imprint-hold-tail)")
    assert recipe_flags("first-hold-mirror") == ("first-recipe-hold-mirror", ["--imprint-hold-tail", "--mirror-average"])
    assert describe("first-recipe-hold-mirror").endswith(
        "(--imprint-hold-tail), each test release's embedding averaged with its mirror image's (--mirror-average)")
    assert recipe_flags("first-hold-mirror-train") == ("first-recipe-hold-mirror-train",
                                                       ["--imprint-hold-tail", "--mirror-average", "--mirror-train"])
    assert describe("first-recipe-hold-mirror-train").endswith(
        "(--mirror-average), and trained on that average (--mirror-train)")
    names = ["views16-student150-noiseaware150", "views16-student150-quiet-hold", "views16-student150-quiet",
             "views16-student150-hold", "views16-student150", "views8", "first-recipe-hold", "first-recipe", "views16",
             "first-recipe-hold-mirror-train", "first-recipe-hold-mirror"]
    assert sorted(names, key=recipe_order) == ["first-recipe", "first-recipe-hold", "first-recipe-hold-mirror",
                                               "first-recipe-hold-mirror-train", "views8", "views16",
                                               "views16-student150",
                                               "views16-student150-hold", "views16-student150-quiet",
                                               "views16-student150-quiet-hold", "views16-student150-noiseaware150"]
    for bad in ("0", "8:", "x", "8:0", "-1", "8:60:", "8:60:0", "8:60:1:1", "quiet", "8-quiet-quiet", "8-hold-quiet",
                "first:60", "first8", "hold", "8-mirror-hold", "mirror", "8-train", "8-hold-train", "8-train-mirror"):
        with pytest.raises(argparse.ArgumentTypeError, match="a recipe is"):
            recipe_flags(bad)


def test_a_fine_tuning_rows_start_is_named_by_each_flags_last_value():
    """The committed rows' labels are what finetune_start makes of their recorded flags, and a flag given after
    run.sh's (a recipe's longer student) names the run by its own value, as argparse reads it."""
    from research.pretrain_table import finetune_start

    rows = [r for table in ("pretrain", "pretrain-views", "pretrain-hold")
            for r in json.loads((ROOT / "results" / table / "summary.json").read_text())
            if r["role"] == "split-finetune"]
    assert len(rows) >= 20
    for r in rows:
        assert finetune_start(r["demo_args"]) == r["start"], r["run"]
    longer = ["--init", "distilled", "--student-epochs", "60", "--lr", "0.01", "--student-epochs", "150"]
    assert finetune_start(longer) == "distilled (student: 150 epochs), lr 0.01"
    assert finetune_start(["--seed", "2"]) == "scratch, seed 2"
    held = ["--init", "distilled", "--imprint-epochs", "1", "--imprint-hold-tail"]
    assert finetune_start(held).endswith(", tail held while imprinting")
    assert finetune_start([*held, "--no-imprint-hold-tail"]) == "distilled, head imprinted over 1 epoch"
    assert finetune_start([*held, "--mirror-average"]).endswith(
        ", tail held while imprinting, test embeddings averaged with the mirror image's")
    assert finetune_start([*held, "--mirror-average", "--no-mirror-average"]).endswith(", tail held while imprinting")


def test_the_tables_keep_the_earlier_rows_flags():
    """The tables' start and run.sh's server stage without the mirror average (or training on it) are the earlier
    rows' (their recorded flags); run.sh's start is the tables' with a recipe's flags, so the main job is a recipe
    that they measure."""
    from research.demo import parser
    from research.pretrain_table import MIRROR, MIRROR_TRAIN, TABLE_START, run_sh_array, stage_without_mirror
    from research.views_table import recipe_flags

    assert MIRROR in run_sh_array("DEFAULT_SERVER_STAGE") and MIRROR_TRAIN in run_sh_array("DEFAULT_SERVER_STAGE")
    assert stage_without_mirror() == ["--dct-stem-blocks", "2"]
    rows = json.loads((ROOT / "results" / "pretrain-hold" / "summary.json").read_text())
    first = next(r["demo_args"] for r in rows if r.get("run") == "runsh-first-recipe")
    assert first[:len(TABLE_START)] == list(TABLE_START)
    as_read = vars(parser().parse_known_args([*TABLE_START, *recipe_flags("16:150:150-hold")[1]])[0])
    assert as_read == vars(parser().parse_known_args(run_sh_array("DEFAULT_START"))[0])


def test_the_committed_views_table_is_its_summarys_report(tmp_path, lfw):
    """`--report-only` rewrites table.md from summary.json alone; the committed table is what it writes."""
    import shutil

    from research.views_table import main

    committed = ROOT / "results" / "pretrain-views"
    shutil.copy(committed / "summary.json", tmp_path / "summary.json")
    main(["--data", str(lfw), "--out", str(tmp_path), "--report-only"])
    assert (tmp_path / "table.md").read_text() == (committed / "table.md").read_text()
