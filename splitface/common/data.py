"""Face data: LFW (the source paper's subset) and plain ImageFolder trees.

Images are listed eagerly but decoded lazily (:meth:`FaceSet.load`), so a
device can list its share of a dataset cheaply and decode only that share.
No network access here: LFW must be obtained by the user (see
:func:`find_lfw_root`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")

LFW_HOWTO = (
    "LFW (deep-funneled) was not found. To get it: download the deep-funneled tarball "
    "`lfw-deepfunneled.tgz` from the LFW website (http://vis-www.cs.umass.edu/lfw/), extract it "
    "(`tar xzf lfw-deepfunneled.tgz`, giving lfw-deepfunneled/<Person_Name>/<Person_Name>_0001.jpg), "
    "then pass --data PATH (the extracted lfw-deepfunneled/ dir, or a dir holding images/<person>/...) "
    "or set SPLITFACE_DATA=PATH. Default locations tried: $SPLITFACE_DATA, ~/.cache/splitface/lfw, ./data/lfw."
)

LFW_PEOPLE = ("all", "devtrain")


@dataclass
class FaceSet:
    """A list of images with integer labels; ``labels`` index into ``class_names``.

    Subsets keep the full ``class_names`` and the original label ids, so labels
    mean the same thing on every device and on the server.
    """

    paths: list[Path]
    labels: np.ndarray  # int64, shape (N,)
    class_names: list[str]

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.int64)
        if self.labels.shape != (len(self.paths),):
            raise ValueError(f"labels shape {self.labels.shape} does not match {len(self.paths)} paths")

    def __len__(self) -> int:
        return len(self.paths)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "FaceSet":
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return FaceSet([self.paths[i] for i in idx], self.labels[idx].copy(), list(self.class_names))

    def load(self, size: int, crop: int | None = 160, progress: bool = False) -> np.ndarray:
        """Decode to uint8 (N, 3, size, size).

        The centre crop keeps the face: LFW deep-funneled images are 250x250
        with the aligned face in the middle. A dimension smaller than ``crop``
        is left uncropped; ``crop=None`` or 0 disables cropping.
        """
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        out = np.empty((len(self.paths), 3, size, size), dtype=np.uint8)

        def _one(i: int) -> None:
            out[i] = _load_image(self.paths[i], size, crop)

        with ThreadPoolExecutor(max_workers=2) as pool:
            it = pool.map(_one, range(len(self.paths)))
            if progress:
                from tqdm import tqdm

                it = tqdm(it, total=len(self.paths), desc="loading images", unit="img")
            for _ in it:
                pass
        return out


def _load_image(path: Path, size: int, crop: int | None) -> np.ndarray:
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        if crop:
            cw, ch = min(crop, w), min(crop, h)
            left, top = (w - cw) // 2, (h - ch) // 2
            im = im.crop((left, top, left + cw, top + ch))
        im = im.resize((size, size), Image.BILINEAR)
        return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)


@dataclass
class DataSplit:
    train: FaceSet
    test: FaceSet
    class_names: list[str]


def _is_person_dir_root(path: Path) -> bool:
    """True if ``path`` holds <person>/<image> folders (checks the first few entries only; LFW has 5749)."""
    if not path.is_dir():
        return False
    with os.scandir(path) as entries:
        for n, entry in enumerate(entries):
            if entry.is_dir():
                with os.scandir(entry.path) as inner:
                    if any(f.name.lower().endswith(IMAGE_EXTENSIONS) for f in inner):
                        return True
            if n > 50:
                break
    return False


def find_lfw_root(path: str | Path | None = None) -> Path:
    """Locate the per-person LFW directory (the one holding <Person_Name>/ folders)."""
    if path is not None:
        candidates = [Path(path).expanduser()]
    else:
        candidates = []
        if os.environ.get("SPLITFACE_DATA"):
            candidates.append(Path(os.environ["SPLITFACE_DATA"]).expanduser())
        candidates += [Path.home() / ".cache" / "splitface" / "lfw", Path("data") / "lfw"]
    for base in candidates:
        for cand in (base / "images", base / "lfw-deepfunneled", base):
            if _is_person_dir_root(cand):
                return cand
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"{LFW_HOWTO} (looked in: {tried})")


def lfw_list(base: Path, name: str) -> Path:
    """One of LFW's list files (pairsDevTest.txt, peopleDevTrain.txt, ...). They come with LFW and sit
    next to the per-person folder ``base`` (as found by :func:`find_lfw_root`)."""
    path = base.parent / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found: expected {path}, next to the per-person folder {base} "
                                f"(it comes with LFW: http://vis-www.cs.umass.edu/lfw/{name})")
    return path


def dev_people(base: Path, which: str = "train") -> set[str]:
    """The people of View 1's development split (peopleDevTrain.txt or peopleDevTest.txt: a count, then
    `name  n_images` lines). The two lists are disjoint."""
    if which not in ("train", "test"):
        raise ValueError(f"which must be 'train' or 'test', not {which!r}")
    lines = lfw_list(base, f"peopleDev{which.title()}.txt").read_text().splitlines()
    names = {line.split()[0] for line in lines[1:] if line.strip()}
    if len(names) != int(lines[0]):
        raise ValueError(f"peopleDev{which.title()}.txt announces {lines[0]} people but lists {len(names)}")
    return names


def _list_images(folder: Path) -> list[Path]:
    return sorted(
        (p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(IMAGE_EXTENSIONS)),
        key=lambda p: p.name,
    )


def _split_per_class(
    per_class: list[tuple[str, list[Path]]], test_fraction: float, seed: int
) -> DataSplit:
    """Per-identity split so every identity is in both train and test (closed-set recognition)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    class_names = [name for name, _ in per_class]
    train_p: list[Path] = []
    train_l: list[int] = []
    test_p: list[Path] = []
    test_l: list[int] = []
    for label, (_, files) in enumerate(per_class):
        n = len(files)
        order = rng.permutation(n)
        n_test = min(n - 1, max(1, round(test_fraction * n)))
        for k, i in enumerate(order):
            if k < n_test:
                test_p.append(files[i])
                test_l.append(label)
            else:
                train_p.append(files[i])
                train_l.append(label)
    return DataSplit(
        train=FaceSet(train_p, np.array(train_l, dtype=np.int64), list(class_names)),
        test=FaceSet(test_p, np.array(test_l, dtype=np.int64), list(class_names)),
        class_names=class_names,
    )


def load_lfw(
    root: str | Path | None,
    min_images: int = 10,
    test_fraction: float = 0.1,
    seed: int = 0,
    max_identities: int | None = None,
    max_images: int | None = None,
    people: str = "all",
) -> DataSplit:
    """The source paper's LFW subset: people with >= ``min_images`` images.

    ``max_images`` keeps only people with at most that many images: with min_images=3,
    max_images=9 it is a public set disjoint from the paper's (743 identities, 3282 images).
    ``people="devtrain"`` keeps only the people of View 1's peopleDevTrain.txt, so that View 1's
    test pairs (research.evaluation) are people the model never saw: with min_images=10 that is
    111 identities, 3264 images (the other 47 of the 158 are DevTest people, 43 of them in its pairs).

    With min_images=10 that is 158 identities / 4324 images. Labels are
    assigned in name order so they are stable across machines.
    """
    if min_images < 2:
        raise ValueError(f"min_images must be >= 2 (each identity needs a train and a test image), got {min_images}")
    if max_identities is not None and max_identities < 1:
        raise ValueError(f"max_identities must be >= 1 or None, got {max_identities}")
    if people not in LFW_PEOPLE:
        raise ValueError(f"people must be one of {LFW_PEOPLE}, not {people!r}")
    base = find_lfw_root(root)
    kept = dev_people(base, "train") if people == "devtrain" else None
    per_class: list[tuple[str, list[Path]]] = []
    for person in sorted(p.name for p in base.iterdir() if p.is_dir()):
        if kept is not None and person not in kept:
            continue
        files = _list_images(base / person)
        if len(files) >= min_images and (max_images is None or len(files) <= max_images):
            per_class.append((person, files))
            if max_identities is not None and len(per_class) >= max_identities:
                break
    if not per_class:
        raise ValueError(f"no identity in {base} has >= {min_images} images")
    return _split_per_class(per_class, test_fraction, seed)


def load_image_folder(
    root: str | Path, test_fraction: float = 0.1, seed: int = 0, min_images: int = 2
) -> DataSplit:
    """Any <root>/<class>/<img>.(jpg|jpeg|png) tree, split per class like LFW."""
    if min_images < 2:
        raise ValueError(f"min_images must be >= 2, got {min_images}")
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(f"image folder {base} does not exist")
    per_class = []
    for name in sorted(p.name for p in base.iterdir() if p.is_dir()):
        files = _list_images(base / name)
        if len(files) >= min_images:
            per_class.append((name, files))
    if not per_class:
        raise ValueError(f"no class folder in {base} has >= {min_images} images ({'/'.join(IMAGE_EXTENSIONS)})")
    return _split_per_class(per_class, test_fraction, seed)


def partition(faceset: FaceSet, num_parts: int, part: int, mode: str = "iid", seed: int = 0) -> FaceSet:
    """One device's share of ``faceset``; all devices must use the same ``seed``.

    "iid": each identity's images are shuffled and dealt round-robin (the deal
    continues across identities so part sizes differ by at most one), so every
    part sees every identity that has >= num_parts images. "identity": whole
    identities are dealt to parts (disjoint identities, a non-iid setting).
    Parts are disjoint and together cover the set.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if not 0 <= part < num_parts:
        raise ValueError(f"part must be in [0, {num_parts}), got {part}")
    rng = np.random.default_rng(seed)
    labels = faceset.labels
    identities = np.unique(labels)
    if mode == "iid":
        if num_parts > len(faceset):
            raise ValueError(f"cannot deal {len(faceset)} images to {num_parts} parts")
        dealt = np.concatenate(
            [rng.permutation(np.flatnonzero(labels == c)) for c in identities]
        ) if len(identities) else np.empty(0, dtype=np.int64)
        chosen = dealt[part::num_parts]
    elif mode == "identity":
        if num_parts > len(identities):
            raise ValueError(f"cannot deal {len(identities)} identities to {num_parts} parts")
        mine = rng.permutation(identities)[part::num_parts]
        chosen = np.flatnonzero(np.isin(labels, mine))
    else:
        raise ValueError(f"unknown partition mode {mode!r}; expected 'iid' or 'identity'")
    return faceset.subset(np.sort(chosen))
