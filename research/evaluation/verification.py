"""LFW View 1 face verification: are the two photos of a pair the same person?

Closed-set test accuracy only says how well a model tells apart the people it trained on. A face
recogniser is used on people it never saw, so every training mode is also scored on View 1's
DevTest pairs (500 matched, 500 mismatched), whose people are disjoint from View 1's DevTrain
people (train with `--people devtrain` to keep them unseen). The score of a pair is the cosine
similarity of its two embeddings; metrics come from scikit-learn.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from sklearn.metrics import accuracy_score, roc_auc_score, roc_curve
from sklearn.metrics.pairwise import paired_cosine_distances
from sklearn.model_selection import StratifiedKFold

from splitface.common.data import FaceSet, find_lfw_root, lfw_list
from splitface.device.trainer import to_input

PAIRS_FILES = {"train": "pairsDevTrain.txt", "test": "pairsDevTest.txt"}
FAR = 1e-2

Embedder = Callable[[np.ndarray], np.ndarray]   # float32 (N, 3, size, size) in [0, 1] -> (N, D)


@dataclass
class Pairs:
    """Pair i compares faces[a[i]] with faces[b[i]]; `same`: they show one person. Each image is listed once."""
    faces: FaceSet
    a: np.ndarray
    b: np.ndarray
    same: np.ndarray

    @property
    def people(self) -> set[str]:
        return set(self.faces.class_names)


def _parse_pairs(text: str, name: str) -> list[tuple[tuple[str, int], tuple[str, int], bool]]:
    """View 1's format: N, then N matched lines `name n1 n2`, then N mismatched lines `name1 n1 name2 n2`."""
    lines = [line.split() for line in text.splitlines()]
    n = int(lines[0][0])
    rows = [r for r in lines[1:] if r]
    if len(rows) != 2 * n or any(len(r) != 3 for r in rows[:n]) or any(len(r) != 4 for r in rows[n:]):
        raise ValueError(f"{name}: expected {n} matched (3 fields) then {n} mismatched (4 fields) pairs")
    matched = [((r[0], int(r[1])), (r[0], int(r[2])), True) for r in rows[:n]]
    return matched + [((r[0], int(r[1])), (r[2], int(r[3])), False) for r in rows[n:]]


def view1_pairs(lfw_root: str | Path | None, which: str = "test", limit: int | None = None) -> Pairs:
    """The pairs of pairsDevTest.txt (which="test") or pairsDevTrain.txt ("train"); `limit`: only the
    first limit/2 matched and limit/2 mismatched pairs (for quick checks)."""
    if which not in PAIRS_FILES:
        raise ValueError(f"which must be one of {sorted(PAIRS_FILES)}, not {which!r}")
    base = find_lfw_root(lfw_root)
    rows = _parse_pairs(lfw_list(base, PAIRS_FILES[which]).read_text(), PAIRS_FILES[which])
    if limit is not None:
        rows = [r for r in rows if r[2]][:limit // 2] + [r for r in rows if not r[2]][:limit // 2]
    images = sorted({image for a, b, _ in rows for image in (a, b)})
    names = sorted({person for person, _ in images})
    paths = [base / person / f"{person}_{k:04d}.jpg" for person, k in images]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} images of {PAIRS_FILES[which]} are missing, e.g. {missing[0]}")
    label = {person: i for i, person in enumerate(names)}
    index = {image: i for i, image in enumerate(images)}
    return Pairs(FaceSet(paths, np.array([label[p] for p, _ in images]), names),
                 np.array([index[a] for a, _, _ in rows]), np.array([index[b] for _, b, _ in rows]),
                 np.array([same for _, _, same in rows], dtype=bool))


def _best_threshold(similarity: np.ndarray, same: np.ndarray) -> float:
    """The threshold with the best accuracy on these pairs (a pair is 'same' when similarity >= it)."""
    fpr, tpr, thresholds = roc_curve(same, similarity, drop_intermediate=False)
    positives = same.sum()
    accuracy = tpr * positives + (1 - fpr) * (len(same) - positives)
    return float(thresholds[np.argmax(accuracy)])


def verification_report(emb_a: np.ndarray, emb_b: np.ndarray, same: np.ndarray, folds: int = 10,
                        seed: int = 0) -> dict:
    """View 1 accuracy by `folds`-fold cross-validation (threshold chosen on the other folds, as LFW's
    protocol asks), ROC AUC, and TAR at FAR = 1e-2 (the highest TAR whose FAR is at most 1e-2)."""
    same = np.asarray(same, dtype=bool)
    similarity = 1.0 - paired_cosine_distances(np.asarray(emb_a, np.float64), np.asarray(emb_b, np.float64))
    accuracies = []
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(similarity, same):
        threshold = _best_threshold(similarity[train], same[train])
        accuracies.append(accuracy_score(same[test], similarity[test] >= threshold))
    fpr, tpr, _ = roc_curve(same, similarity, drop_intermediate=False)
    negatives = int((~same).sum())
    return {
        "view1_accuracy": float(np.mean(accuracies)),
        "view1_std": float(np.std(accuracies)),
        "roc_auc": float(roc_auc_score(same, similarity)),
        "tar_at_far_1e-2": float(tpr[fpr <= FAR].max()),
        "pairs": int(len(same)),
        "negatives": negatives,
        "note": f"{negatives} negative pairs: FAR moves in steps of {1 / negatives:.0e} and FAR 1e-2 is "
                f"{negatives * FAR:.0f} false accepts, too few for a lower FAR to mean anything: none is reported",
    }


def embed_in_batches(embed: Embedder, images: np.ndarray, batch: int = 256) -> np.ndarray:
    """uint8 images -> embeddings, scaled to [0, 1] a batch at a time (a full-size set would not fit as floats)."""
    return np.concatenate([np.asarray(embed(to_input(images[i:i + batch]).numpy()))
                           for i in range(0, len(images), batch)])


def unit_rows(embeddings: np.ndarray) -> np.ndarray:
    """Each row scaled to unit length."""
    return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)


def evaluate_embedder(embed: Embedder, lfw_root: str | Path | None, size: int, crop: int = 160,
                      limit: int | None = None, flip: bool = False) -> dict:
    """`embed` on View 1's DevTest pairs, each image the `crop` px centre crop resized to `size`. `flip`: each
    face's embedding is the sum of its own and its mirror image's, each scaled to unit length first (test-time
    flipping; insightface sums them unscaled): two embeddings a face, so not what one release gives."""
    pairs = view1_pairs(lfw_root, "test", limit)
    images = pairs.faces.load(size, crop)
    embeddings = embed_in_batches(embed, images)
    if flip:
        embeddings = unit_rows(embeddings) + unit_rows(embed_in_batches(embed, images[..., ::-1]))
    report = verification_report(embeddings[pairs.a], embeddings[pairs.b], pairs.same)
    return {**report, "input": f"{size}x{size} from the {crop} px centre crop" + (", and its mirror" if flip else "")}
