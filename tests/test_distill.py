"""The distilled public start (research/distill.py) on a few real public LFW faces: the public set keeps out
View 1's test people and LFW-158, the teacher's embeddings are cached by content, the distillation loss falls, an
interrupted run resumes to the same weights, a noise-aware start builds on the plain one, `--init distilled`
finds its files in the cache, and a split run from a distilled file starts where the file says and is audited."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from splitface.common.data import FaceSet, dev_people, find_lfw_root
from splitface.common.models import PRESETS, build_backbone, split_backbone
from splitface.common.models.weights import load_into, save_backbone
from splitface.device.privacy.mechanisms import NoNoise, PerImageGaussian
from research.audit.cli import headline
from research.audit.run import load_run
from research.audit.recognizer import DlibResNet
from research.distill import (CROP, LFW158_MIN_IMAGES, TEACHER_SIZE, Recipe, TeacherCache, checkpoint_key, distill,
                             distilled_start, load_student, public_faces, teacher_fit)
from splitface.server.checkpoint import load_checkpoint
from research.evaluation.verification import view1_pairs
from research.federated.population import PUBLIC_MIN_IMAGES, private_people
from tests.conftest import ROOT, tiny_audit
from tests.test_dlib_resnet import TOLERANCE

LIMIT = 48
SPEC = PRESETS["iresnet_small"]
TINY = Recipe(epochs=4, batch_size=16, lr=0.1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, lfw):
    """The teacher's embeddings of the first LIMIT public faces, made once for this file's tests."""
    folder = tmp_path_factory.mktemp("teacher")
    faces, _ = public_faces(lfw, LIMIT)
    TeacherCache(folder).embed(faces.paths, progress=False)
    return folder


def test_public_faces_are_neither_view1_test_people_nor_lfw158(lfw):
    faces, manifest = public_faces(lfw)
    people = set(faces.class_names)
    assert not people & view1_pairs(lfw, "test").people
    counts = np.bincount(faces.labels)
    assert counts.max() < LFW158_MIN_IMAGES and counts.min() >= 1
    assert manifest["images"] == len(faces) == sum(manifest["per_person"].values())
    assert manifest["people"] == len(people) == len(manifest["per_person"])
    # LFW deep-funneled: 13,233 images of 5,749 people, less the 963 people of DevTest's pairs and LFW-158's 158
    assert (manifest["people"], manifest["images"]) == (4671, 7153)
    assert len(manifest["content_sha256"]) == 64


def test_the_federated_public_set_holds_no_federated_private_user_and_no_devtest_person(lfw):
    """The start for the federated experiments: every DevTrain person who can be a private user there (2-9 photos,
    and the one-photo people) is left out, the public DevTrain people (>= 10 photos) are in; another public set
    is another file (its content hash is in the key)."""
    faces, manifest = public_faces(lfw, public_set="federated")
    people = set(faces.class_names)
    private = {person for person, _ in private_people(lfw, single_photo=True)}
    assert len(private) == 1073 + 2854 and not people & private
    assert not people & view1_pairs(lfw, "test").people
    devtrain = dev_people(find_lfw_root(lfw), "train")
    public = {p for p, n in manifest["per_person"].items() if p in devtrain}
    assert all(manifest["per_person"][p] >= PUBLIC_MIN_IMAGES for p in public)
    assert len(public) == 111 and sum(manifest["per_person"][p] for p in public) == 3264   # population.py's public
    # the rest: LFW people in neither of View 1's development lists (744 with fewer than 10 photos, 4 with more)
    others = {p: n for p, n in manifest["per_person"].items() if p not in devtrain}
    assert (len(others), sum(others.values()), sum(n >= PUBLIC_MIN_IMAGES for n in others.values())) == (748, 967, 4)
    assert (manifest["people"], manifest["images"]) == (859, 4231) and manifest["public_set"] == "federated"
    assert "private users" in manifest["rule"]
    _, default = public_faces(lfw)
    assert default["public_set"] == "lfw158" and default["content_sha256"] != manifest["content_sha256"]
    keys = {checkpoint_key(SPEC, "conv1", NoNoise(), Recipe(), m, None) for m in (default, manifest)}
    assert len(keys) == 2
    with pytest.raises(ValueError, match="public_set"):
        public_faces(lfw, public_set="everyone")


def test_a_start_keeps_its_key_when_a_later_spec_key_is_at_its_default():
    """A start's cache key hashes its spec less the keys added after the first starts were built, while those are
    at their defaults: the starts built before keep their names (which recorded runs name); set, they count."""
    manifest = {"content_sha256": "0" * 64}
    dct = replace(SPEC, release="dct", dct_drop=4)
    assert "dct_stem_blocks" not in dct.compact_dict() and dct.compact_dict().items() <= dct.to_dict().items()
    assert replace(dct, dct_stem_blocks=2).compact_dict()["dct_stem_blocks"] == 2
    keys = {checkpoint_key(s, "layer2", NoNoise(), Recipe(), manifest, None) for s in (dct, replace(dct, dct_stem_blocks=2))}
    assert len(keys) == 2


def test_the_teacher_cache_is_keyed_by_each_images_bytes(tmp_path, lfw, cache):
    faces, _ = public_faces(lfw, 2)
    copy = tmp_path / "renamed.jpg"
    shutil.copy(faces.paths[0], copy)
    teacher = TeacherCache(cache)
    cached = teacher.embed([faces.paths[0], copy], progress=False)
    assert teacher.computed == 0 and np.array_equal(cached[0], cached[1])   # same bytes, another name: a hit
    # the cached vector is dlib's embedding of that image as the teacher sees it (embedded in a batch of 48 there,
    # alone here: the same sums in another order, within test_dlib_resnet's tolerance)
    direct = DlibResNet(TEACHER_SIZE).embed(FaceSet([faces.paths[0]], [0], ["x"]).load(TEACHER_SIZE, CROP) / 255.0)
    assert np.linalg.norm(cached[0] - direct[0]) <= TOLERANCE * np.linalg.norm(direct[0])
    edited = tmp_path / "edited.png"
    with Image.open(faces.paths[1]) as im:
        im.transpose(Image.FLIP_LEFT_RIGHT).save(edited)
    teacher.embed([edited], progress=False)
    assert teacher.computed == 1   # other bytes: computed, then kept
    assert TeacherCache(cache).embed([edited], progress=False).shape == (1, 128)


@pytest.mark.slow
def test_distillation_loss_falls_and_an_interrupted_run_resumes_to_the_same_weights(tmp_path, lfw, cache):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread: the same sums in the same order in both runs
    try:
        _distill_twice(tmp_path, lfw, cache)
    finally:
        torch.set_num_threads(threads)   # later tests in this process keep their own setting


def _distill_twice(tmp_path, lfw, cache) -> None:
    whole = distill(SPEC, "conv1", NoNoise(), lfw, tmp_path / "whole.pt", TINY, cache, limit=LIMIT, progress=False,
                    evaluate=False)
    assert whole["teacher"]["computed_now"] == 0   # the module's cache: the teacher never ran again
    losses = [h["cosine"] for h in whole["history"]]
    # from a seeded net (cosine loss ~1: no relation to the teacher) the student moves towards the teacher
    assert losses[-1] < 0.8 * losses[0], losses
    assert whole["public_faces"]["images"] == LIMIT and whole["recipe"]["epochs"] == 4

    out = tmp_path / "interrupted.pt"
    partial = distill(SPEC, "conv1", NoNoise(), lfw, out, TINY, cache, limit=LIMIT, progress=False, evaluate=False,
                      stop_after=1)
    assert len(partial["history"]) == 1 and not out.exists() and out.with_suffix(".partial.pt").exists()
    resumed = distill(SPEC, "conv1", NoNoise(), lfw, out, TINY, cache, limit=LIMIT, progress=False, evaluate=False)
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in whole["history"]]
    assert not out.with_suffix(".partial.pt").exists()
    a, b = (torch.load(p, weights_only=True)["state"] for p in (tmp_path / "whole.pt", out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the teacher's fit: the trained student is closer to the teacher on its public faces than its seeded start (one
    # thread, so the same figures each run; the training loss fell by more than a fifth, asserted above)
    seeded = tmp_path / "seeded.pt"
    torch.manual_seed(TINY.seed)
    save_backbone(seeded, SPEC, build_backbone(SPEC))
    fits = [teacher_fit(load_student(f, "conv1", NoNoise()), lfw, cache, limit=LIMIT, sample=LIMIT, view1_limit=10)
            for f in (seeded, tmp_path / "whole.pt")]
    assert fits[1]["public_cosine_loss"] < fits[0]["public_cosine_loss"], fits


def test_the_fit_command_measures_a_file_on_its_public_faces_and_on_view1(tmp_path, lfw, cache):
    """`splitface-research pretrain fit FILE`: the cosine loss against the teacher on a seeded choice of the public
    faces and on View 1's DevTest images (each image of the pairs once)."""
    start = tmp_path / "start.pt"
    save_backbone(start, SPEC, build_backbone(SPEC))
    fit = teacher_fit(load_student(start, "conv1", NoNoise()), lfw, cache, limit=LIMIT, sample=16, view1_limit=10)
    unseen = view1_pairs(lfw, "test", 10).faces
    assert fit["public_sample"] == 16 and fit["view1_images"] == len(unseen) == len(set(unseen.paths))
    assert fit["teacher_input"] == TEACHER_SIZE   # a file distilled without views: the teacher at 150 px
    assert 0 <= fit["public_cosine_loss"] <= 2 and 0 <= fit["view1_cosine_loss"] <= 2
    # against the targets function matching learns from (the teacher on the 64 px input): other targets, other loss
    small = teacher_fit(load_student(start, "conv1", NoNoise()), lfw, cache, limit=LIMIT, sample=16, view1_limit=10,
                        teacher_size=64)
    assert small["teacher_input"] == 64 and small["view1_cosine_loss"] != fit["view1_cosine_loss"]
    run = subprocess.run([sys.executable, "-m", "research", "pretrain", "fit", str(start), "--data", str(lfw),
                          "--cache", str(cache), "--sample", "16", "--limit", str(LIMIT), "--view1-limit", "10",
                          "--threads", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    # the same images and weights in another process (one thread: the convolutions' sums in another order, about
    # 1e-6 relative on each cosine), each figure rounded to 4 decimals: at most one rounding step apart
    assert json.loads(run.stdout) == pytest.approx(fit, abs=1e-4 + 1e-6)
    run = subprocess.run([sys.executable, "-m", "research", "pretrain", "fit", str(start), "--data", str(lfw),
                          "--cache", str(cache), "--sample", "16", "--limit", str(LIMIT), "--view1-limit", "10",
                          "--teacher-input", "64", "--threads", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout) == pytest.approx(small, abs=1e-4 + 1e-6)
    # a file that records its cut and noise is measured with them: other options are refused, not silently used
    recorded = tmp_path / "recorded.pt"
    save_backbone(recorded, SPEC, build_backbone(SPEC), {"student": {"split": "conv1",
                                                                     "release_mechanism": NoNoise().describe()}})
    refused = subprocess.run([sys.executable, "-m", "research", "pretrain", "fit", str(recorded), "--data", str(lfw),
                              "--split", "layer1", "--limit", str(LIMIT), "--view1-limit", "10"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode == 2 and "distilled cut at conv1" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_a_noise_aware_start_builds_on_the_plain_student_and_the_cache_serves_it_again(tmp_path, lfw, cache):
    """`--init distilled` for the main job's release (DCT at layer2, per-image noise): the plain student first,
    then the transform's stages and the tail trained on noisy releases from it; asked again, both come from
    the cache without training."""
    spec = replace(SPEC, release="dct", dct_drop=4)
    mechanism = PerImageGaussian(12.0, 0.005, 2.0)
    tiny = (Recipe(epochs=1, batch_size=16), Recipe(epochs=1, batch_size=16, lr=0.02))
    shutil.copytree(cache, tmp_path / "cache")
    path = distilled_start(spec, "layer2", mechanism, lfw, tmp_path / "cache", progress=False, recipes=tiny,
                           limit=LIMIT)
    built = sorted((tmp_path / "cache" / "distilled").glob("*.pt"))
    assert len(built) == 2 and path in built
    saved = torch.load(path, weights_only=True)
    assert any(k.startswith("stages.dct_server.") for k in saved["state"])   # the transform's trained stage
    assert saved["meta"]["student"]["release_mechanism"]["noise_multiplier"] == 0.005
    assert saved["meta"]["student"]["init"] in map(str, built)
    torch.manual_seed(0)
    _, server = split_backbone(build_backbone(spec), "layer2")
    load_into(server, path, spec)   # the server's tail (with dct_server) loads it
    stamps = [p.stat().st_mtime_ns for p in built]
    again = distilled_start(spec, "layer2", mechanism, lfw, tmp_path / "cache", progress=False, recipes=tiny,
                            limit=LIMIT)
    assert again == path and [p.stat().st_mtime_ns for p in built] == stamps


@pytest.mark.slow
def test_a_split_run_starts_from_a_distilled_file_and_is_audited(tmp_path, lfw, cache):
    """splitface-research demo --init FILE: the server's tail and the device's layer start from the file (with both
    learning rates 0 their weights stay the file's), the server's head is imprinted over the epoch (one mean
    embedding per image it trained on), and the audit attacks the run end to end."""
    start = tmp_path / "start.pt"
    distill(SPEC, "conv1", NoNoise(), lfw, start, Recipe(epochs=1, batch_size=16), cache, limit=LIMIT,
            progress=False, evaluate=False)
    run = tmp_path / "run"
    demo = subprocess.run(
        [sys.executable, "-m", "research.demo", "--data", str(lfw), "--init", str(start), "--run-dir", str(run),
         "--epochs", "1", "--max-identities", "3", "--devices", "1", "--batch-size", "8", "--lr", "0",
         "--device-lr", "0", "--record-max", "8", "--threads", "1", "--no-progress", "--imprint-epochs", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    file_state = torch.load(start, weights_only=True)["state"]
    trainer = load_checkpoint(run / "server" / "checkpoint.pt")["trainer"]
    tail = trainer["tail"]
    trained_on = json.loads((run / "results.json").read_text())["devices"][0]["train_samples"]
    assert trainer["imprint"]["counts"].sum() == trained_on
    rows = trainer["classifier"]["weight"].norm(dim=1)
    torch.testing.assert_close(rows, rows[0].expand(3))   # 3 classes, each row SCALE / the mean embedding norm
    conv = "stages.layer1.0.conv1.weight"
    assert torch.equal(tail[conv], file_state[conv])
    layer = torch.load(run / "device_layers" / "device-0.pt", weights_only=True)
    assert torch.equal(layer["stages.conv1.0.weight"], file_state["stages.conv1.0.weight"])
    report = tiny_audit(run, lfw, tmp_path)
    figures = headline(report)
    assert 0 <= figures["identity_r1"] <= 1 and 0 < figures["identity_r1_chance"] < 1
    assert 0 <= figures["linkage_pixels"] <= 1
    # the curious server's copy of the device part starts from the start it sent the devices, not from seeded weights
    assert report["device_layer"].startswith("surrogate (the published start's device part")
    assert report["device_layer_start"] == report["device_layer"]   # recorded, so a later substitute keeps it
    surrogate = load_run(run).layer.state_dict()["stages.conv1.0.weight"]
    assert torch.equal(surrogate, file_state["stages.conv1.0.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["iresnet50", "vgg_face"])
def test_the_full_size_command_runs(tmp_path, lfw, cache, model):
    """The documented full-size distillation (docs/pretrain.md) for one step on 4 faces: IResNet-50 at 112 px
    (512-d, as the teacher's 128-d after a projection that is not saved) and VGG-Face at 224 px."""
    out = tmp_path / f"{model}.pt"
    run = subprocess.run(
        [sys.executable, "-m", "research.distill", "distill", "--data", str(lfw), "--model", model, "--out", str(out),
         "--limit", "4", "--epochs", "1", "--batch-size", "4", "--view1-limit", "20", "--cache", str(cache),
         "--no-progress", "--threads", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    saved = torch.load(out, weights_only=True)
    assert saved["spec"] == PRESETS[model].to_dict() and not any(k.startswith("project") for k in saved["state"])
    assert saved["meta"]["view1"]["pairs"] == 20 and saved["meta"]["public_faces"]["images"] == 4
