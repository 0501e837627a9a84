"""LFW View 1 verification: the metrics on embeddings with known answers, the pairs and the DevTrain
people on the real LFW files, a cheap recognizer far above chance on real faces, and a split run
(device layer saved by the simulator, tail from the server's checkpoint) evaluated end to end."""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splitface.common.options import add_data_args, data_argv, data_selection
from splitface.common.data import dev_people, find_lfw_root, load_lfw
from splitface.device.trainer import initial_layer, to_input
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.sim.simulator import SimConfig, simulate
from research.audit.recognizer import Eigenfaces
from research.evaluation import evaluate_embedder, evaluate_run, verification_report, view1_pairs
from research.evaluation.run import load_split_model, seen_people
from tests.conftest import LFW, TOKENS, serve_in_thread, small_trainer


@pytest.fixture(scope="module")
def lfw() -> Path:
    """Fails, never skips: these numbers are what every training mode is judged by."""
    if not (LFW / "images").is_dir() or not (LFW / "pairsDevTest.txt").is_file():
        pytest.fail(f"LFW not found at {LFW}: put the deep-funneled LFW there as images/<Person>/<Person>_NNNN.jpg, "
                    f"with View 1's pairsDevTrain.txt, pairsDevTest.txt, peopleDevTrain.txt and peopleDevTest.txt "
                    f"beside images/ (http://vis-www.cs.umass.edu/lfw/)")
    return LFW


def on_circle(cosines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of 2-d embeddings whose cosine similarities are exactly `cosines` (lengths vary: cosine ignores them)."""
    angles = np.arccos(np.clip(cosines, -1, 1))
    a = np.tile([[2.0, 0.0]], (len(cosines), 1))
    return a, np.stack([np.cos(angles), np.sin(angles)], axis=1)


def test_separable_pairs_score_perfectly() -> None:
    same = np.repeat([True, False], 100)
    report = verification_report(*on_circle(np.where(same, 0.9, 0.1)), same)
    assert report["view1_accuracy"] == 1.0 and report["view1_std"] == 0.0
    assert report["roc_auc"] == 1.0 and report["tar_at_far_1e-2"] == 1.0
    assert report["pairs"] == 200 and report["negatives"] == 100 and "1e-2" in report["note"]


def test_tar_at_far_allows_one_false_accept_in_a_hundred() -> None:
    positives = np.linspace(0.5, 1.0, 100)
    negatives = np.r_[np.zeros(98), 0.9, 0.95]           # accepting 0.95 is FAR 0.01; accepting 0.9 too is 0.02
    same = np.repeat([True, False], 100)
    report = verification_report(*on_circle(np.r_[positives, negatives]), same)
    assert report["tar_at_far_1e-2"] == pytest.approx((positives > 0.9).mean())


def test_random_embeddings_are_at_chance() -> None:
    rng = np.random.default_rng(0)
    report = verification_report(rng.normal(size=(2000, 32)), rng.normal(size=(2000, 32)), np.arange(2000) % 2 == 0)
    assert abs(report["view1_accuracy"] - 0.5) < 0.05 and abs(report["roc_auc"] - 0.5) < 0.05


def test_devtest_pairs_are_people_devtrain_never_lists(lfw) -> None:
    pairs = view1_pairs(lfw)
    assert len(pairs.same) == 1000 and pairs.same[:500].all() and not pairs.same[500:].any()
    person = pairs.faces.labels
    assert (person[pairs.a] == person[pairs.b]).tolist() == pairs.same.tolist()
    assert (pairs.a != pairs.b).all() and len(set(pairs.faces.paths)) == len(pairs.faces)
    assert all(p.parent.name == pairs.faces.class_names[l] for p, l in zip(pairs.faces.paths, pairs.faces.labels))
    assert not pairs.people & dev_people(find_lfw_root(lfw), "train")
    assert len(view1_pairs(lfw, "train").same) == 2200


def test_missing_pairs_file_names_where_it_belongs(tmp_path) -> None:
    (tmp_path / "images" / "Some_One").mkdir(parents=True)
    Image.new("RGB", (250, 250)).save(tmp_path / "images" / "Some_One" / "Some_One_0001.jpg")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "pairsDevTest.txt")):
        view1_pairs(tmp_path)


def test_devtrain_people_only(lfw) -> None:
    data = load_lfw(lfw, min_images=10, people="devtrain")
    assert len(data.class_names) == 111 and len(data.train) + len(data.test) == 3264
    assert set(data.class_names) <= dev_people(find_lfw_root(lfw), "train")


def test_demo_hands_every_data_option_to_the_simulator() -> None:
    p = argparse.ArgumentParser()
    add_data_args(p)
    args = p.parse_args(["--data", "x", "--people", "devtrain", "--max-images", "9", "--max-identities", "5"])
    assert data_selection(p.parse_args(data_argv(args))) == data_selection(args)
    assert data_selection(args)["people"] == "devtrain"


def test_eigenfaces_verify_real_faces_above_chance(lfw) -> None:
    public = load_lfw(lfw, min_images=2, people="devtrain").train
    public = public.subset(np.random.default_rng(0).permutation(len(public))[:400])
    eigenfaces = Eigenfaces().fit(to_input(public.load(64, 160)).numpy())
    report = evaluate_embedder(eigenfaces.embed, lfw, 64, limit=200)
    assert report["pairs"] == 200 and report["input"] == "64x64 from the 160 px centre crop"
    assert report["view1_accuracy"] > 0.6 and report["roc_auc"] > 0.6


def test_flipping_sums_each_faces_unit_embedding_with_its_mirror_images(lfw) -> None:
    """A mirror-symmetric embedding (each row's pixels summed with their mirror) gives the same figures flipped or
    not (its two unit embeddings are one); an embedding of the left half alone changes under flipping."""
    def symmetric(x: np.ndarray) -> np.ndarray:
        return (x + x[..., ::-1]).reshape(len(x), -1)[:, ::7] + 1e-3

    def left(x: np.ndarray) -> np.ndarray:
        return x[..., :32].reshape(len(x), -1)[:, ::7] + 1e-3

    plain, flipped = (evaluate_embedder(symmetric, lfw, 64, limit=100, flip=f) for f in (False, True))
    assert flipped["input"] == "64x64 from the 160 px centre crop, and its mirror"
    for key in ("view1_accuracy", "roc_auc", "tar_at_far_1e-2"):
        assert flipped[key] == pytest.approx(plain[key], abs=1e-12)   # the same cosines up to rounding
    unit = lambda e: e / np.linalg.norm(e, axis=1, keepdims=True)  # noqa: E731
    by_hand = evaluate_embedder(lambda x: unit(left(x)) + unit(left(x[..., ::-1])), lfw, 64, limit=100)
    flipped = evaluate_embedder(left, lfw, 64, limit=100, flip=True)
    for key in ("view1_accuracy", "roc_auc", "tar_at_far_1e-2"):   # the same sums, so the same cosines
        assert flipped[key] == pytest.approx(by_hand[key], abs=1e-12)
    assert flipped["roc_auc"] != evaluate_embedder(left, lfw, 64, limit=100)["roc_auc"]


def test_a_split_run_is_evaluated_with_its_own_device_layer(lfw, tmp_path) -> None:
    selection = {"image_folder": False, "min_images": 10, "max_identities": 4, "max_images": None,
                 "people": "devtrain", "seed": 0}
    data = load_lfw(lfw, min_images=10, max_identities=4, people="devtrain")
    data.train, data.test = data.train.subset(np.arange(48)), data.test.subset(np.arange(8))
    spec = resolve_spec("iresnet_small")
    config = SimConfig(url="", spec=spec, num_devices=1, epochs=1, batch_size=24, progress=False,
                       train=TrainConfig(lr=0.05), results=tmp_path / "results.json", data=selection)
    with serve_in_thread(small_trainer(4, "iresnet_small", lr=0.05), tmp_path / "server") as server:
        config.url = server.url
        asyncio.run(simulate(config, data, {"device-0": TOKENS["device-0"]}))
        live_tail = server.trainer.tail.eval()
    layer, tail, _ = load_split_model(tmp_path)
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        assert not torch.equal(layer(x), initial_layer(spec, "conv1", 0)(x))   # the device's trained layer
        torch.testing.assert_close(tail(layer(x)), live_tail(layer(x)))      # the server's final tail
    report = evaluate_run(tmp_path, lfw, limit=40)
    assert report["device_layer"] == "device-0" and report["pairs"] == 40
    assert report["trained_people"] == "devtrain" and report["pairs_with_seen_people"] == 0
    assert 0.0 <= report["view1_accuracy"] <= 1.0

    results = json.loads((tmp_path / "results.json").read_text())
    results["config"]["data"] = {**selection, "people": "all"}     # the first 4 of everyone include Abdullah_Gul
    seen = seen_people(lfw, results)
    assert seen["devtest_people_seen"] >= 1 and seen["pairs_with_seen_people"] >= 1
