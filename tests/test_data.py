"""Face data: the paper's LFW subset (on the shared copy), partitioning, and ImageFolder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from splitface.common.data import FaceSet, find_lfw_root, load_image_folder, load_lfw, partition
from tests.conftest import LFW



@pytest.fixture(scope="module")
def paper_set(lfw: Path):
    """The source paper's subset of the real LFW copy (conftest's `lfw` fails, never skips, when it is missing)."""
    return load_lfw(lfw)


def as_set(fs: FaceSet) -> set[str]:
    return {str(p) for p in fs.paths}


def test_lfw_paper_subset(paper_set) -> None:
    assert len(paper_set.class_names) == 158
    assert len(paper_set.train) + len(paper_set.test) == 4324
    assert paper_set.class_names == sorted(paper_set.class_names)
    assert not as_set(paper_set.train) & as_set(paper_set.test)
    assert set(paper_set.train.labels.tolist()) == set(range(158)) == set(paper_set.test.labels.tolist())
    assert paper_set.train.labels.dtype == np.int64
    # Each path's label matches its person directory.
    for fs in (paper_set.train, paper_set.test):
        assert all(p.parent.name == paper_set.class_names[l] for p, l in zip(fs.paths, fs.labels))
    # Per identity: n_test = max(1, round(0.1 n)).
    for label in (0, 57, 157):
        n = int((paper_set.train.labels == label).sum() + (paper_set.test.labels == label).sum())
        assert (paper_set.test.labels == label).sum() == max(1, round(0.1 * n))


def test_lfw_root_forms_and_determinism(paper_set) -> None:
    assert find_lfw_root(LFW) == LFW / "images"
    again = load_lfw(LFW / "images")  # the per-person dir itself is accepted too
    assert again.train.paths == paper_set.train.paths and again.test.paths == paper_set.test.paths
    other = load_lfw(LFW, seed=1)
    assert as_set(other.test) != as_set(paper_set.test)
    assert len(other.train) + len(other.test) == 4324
    small = load_lfw(LFW, max_identities=3)
    assert small.class_names == paper_set.class_names[:3]


@pytest.mark.parametrize("mode", ["iid", "identity"])
def test_partition_disjoint_and_covering(paper_set, mode: str) -> None:
    k = 3
    parts = [partition(paper_set.train, k, i, mode=mode, seed=7) for i in range(k)]
    sets = [as_set(p) for p in parts]
    assert sum(len(s) for s in sets) == len(paper_set.train)
    assert set().union(*sets) == as_set(paper_set.train)
    ids = [set(p.labels.tolist()) for p in parts]
    if mode == "iid":
        assert all(s == set(range(158)) for s in ids)  # every identity has >= 9 train images
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    else:
        assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert partition(paper_set.train, k, 1, mode=mode, seed=7).paths == parts[1].paths
    assert parts[0].class_names == paper_set.class_names


def test_partition_bad_args() -> None:
    fs = FaceSet([Path(f"{i}.jpg") for i in range(4)], np.array([0, 0, 1, 1]), ["a", "b"])
    for kwargs in (dict(num_parts=0, part=0), dict(num_parts=2, part=2), dict(num_parts=2, part=-1),
                   dict(num_parts=2, part=0, mode="bogus"), dict(num_parts=3, part=0, mode="identity"),
                   dict(num_parts=5, part=0)):
        with pytest.raises(ValueError):
            partition(fs, **kwargs)


def test_faceset_load(paper_set) -> None:
    x = paper_set.train.subset([0, 1, 2, 3]).load(64)
    assert x.dtype == np.uint8 and x.shape == (4, 3, 64, 64)
    assert x.std() > 10  # real image content, not blank


def test_find_lfw_root_error_says_how_to_get_lfw(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SPLITFACE_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        find_lfw_root(None)
    msg = str(err.value)
    assert "lfw-deepfunneled.tgz" in msg and "--data" in msg and "SPLITFACE_DATA" in msg
    with pytest.raises(FileNotFoundError, match="lfw-deepfunneled"):
        find_lfw_root(tmp_path / "missing")


def test_find_lfw_root_env_and_tarball_layout(tmp_path, monkeypatch) -> None:
    person = tmp_path / "lfw-deepfunneled" / "Some_Person"
    person.mkdir(parents=True)
    Image.new("RGB", (250, 250)).save(person / "Some_Person_0001.jpg")
    monkeypatch.setenv("SPLITFACE_DATA", str(tmp_path))
    assert find_lfw_root(None) == tmp_path / "lfw-deepfunneled"
    assert find_lfw_root(tmp_path / "lfw-deepfunneled") == tmp_path / "lfw-deepfunneled"


def test_load_image_folder(tmp_path) -> None:
    rng = np.random.default_rng(0)
    counts = {"cat": 5, "dog": 3, "eel": 1}  # eel is below min_images=2
    for name, n in counts.items():
        (tmp_path / name).mkdir()
        for i in range(n):
            arr = rng.integers(0, 256, size=(40, 30, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    split = load_image_folder(tmp_path, test_fraction=0.2, seed=0)
    assert split.class_names == ["cat", "dog"]
    assert len(split.train) + len(split.test) == 8
    assert sorted(split.test.labels.tolist()) == [0, 1]
    assert not as_set(split.train) & as_set(split.test)
    x = split.train.load(16, crop=160)  # images smaller than crop: resized, not cropped
    assert x.shape == (len(split.train), 3, 16, 16) and x.dtype == np.uint8
    with pytest.raises(FileNotFoundError):
        load_image_folder(tmp_path / "nope")
