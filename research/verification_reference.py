"""Reference rows for LFW View 1 verification (DevTest pairs), at the input the reduced experiments use
(64x64 from the 160 px centre crop), so that a split run's `view1.json` can be read against them:

- dlib's ResNet face recognizer (trained on about 3 million public faces; none of LFW's protocol
  constrains it), the strong reference;
- eigenfaces fitted on DevTrain images (people disjoint from DevTest's), the weak one;
- dlib's network without aligning each face: one fixed chip geometry (its landmarks averaged over the DevTrain
  images), and none (the crop itself): what per-face alignment is worth to the teacher, since the students
  distilled from it see their crops unaligned (docs/pretrain.md).

Writes `reference.json` (one row per method) and `table.md` under --out.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import numpy as np

from splitface.common.data import FaceSet, load_lfw
from splitface.device.trainer import to_input
from splitface.common.options import add_data_root_arg
from research.audit.recognizer import DlibResNet, Eigenfaces
from research.evaluation import evaluate_embedder, view1_pairs
from research.results import write_report


def devtrain_faces(lfw: str | None, count: int, seed: int = 0) -> FaceSet:
    """`count` images of DevTrain people (with >= 2 images), checked to share no one with the DevTest pairs."""
    split = load_lfw(lfw, min_images=2, people="devtrain")
    faces = FaceSet([*split.train.paths, *split.test.paths], np.concatenate([split.train.labels, split.test.labels]),
                    split.class_names)
    if set(faces.class_names) & view1_pairs(lfw, "test").people:
        raise ValueError("DevTrain and DevTest people overlap: not LFW's View 1 lists")
    return faces.subset(np.random.default_rng(seed).permutation(len(faces))[:count])


def row(method: str, embed: Callable[[np.ndarray], np.ndarray], args: argparse.Namespace, **extra) -> dict:
    started = time.time()
    report = evaluate_embedder(embed, args.data, args.size, args.crop)
    print(f"{method}: View 1 accuracy {report['view1_accuracy']:.3f} +- {report['view1_std']:.3f}, "
          f"ROC AUC {report['roc_auc']:.3f}, TAR@FAR=1e-2 {report['tar_at_far_1e-2']:.3f}", flush=True)
    return {"method": method, **report, **extra, "seconds": round(time.time() - started, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| method | input | View 1 accuracy (10-fold) | ROC AUC | TAR @ FAR 1e-2 |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['input']} | {r['view1_accuracy']:.3f} ± {r['view1_std']:.3f} | "
              f"{r['roc_auc']:.3f} | {r['tar_at_far_1e-2']:.3f} |" for r in rows]
    return "\n".join([*lines, "", f"{rows[0]['pairs']} DevTest pairs. {rows[0]['note']}.", ""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, help="LFW root (holding images/ and the View 1 files)")
    p.add_argument("--out", type=Path, default=Path("results/verification"))
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--crop", type=int, default=160)
    p.add_argument("--devtrain-images", type=int, default=3000,
                   help="DevTrain images (other people than the pairs') that eigenfaces are fitted on and that the "
                        "fixed alignment averages dlib's landmarks over")
    args = p.parse_args(argv)
    public = devtrain_faces(args.data, args.devtrain_images)
    faces = to_input(public.load(args.size, args.crop)).numpy()
    eigenfaces = Eigenfaces(components=64, size=32).fit(faces)
    rows = [
        row("eigenfaces (64 components, 32 px grey)", eigenfaces.embed, args,
            fitted_on=f"{len(public)} DevTrain images of {len(np.unique(public.labels))} people"),
        row("dlib ResNet (face-recognition-models)", DlibResNet().embed, args,
            fitted_on="dlib's public training set (about 3 million faces)",
            network="dlib's weights run in PyTorch (research/audit/dlib_resnet.py; dlib aligns)"),
        row("dlib ResNet, one fixed alignment", DlibResNet(alignment="fixed").fix_alignment(faces).embed, args,
            fitted_on="dlib's public training set; the alignment: dlib's 5 landmarks averaged over "
                      f"{len(public)} DevTrain images",
            network="dlib's weights run in PyTorch; every face cut by the same chip geometry"),
        row("dlib ResNet, not aligned", DlibResNet(alignment="none").embed, args,
            fitted_on="dlib's public training set",
            network="dlib's weights run in PyTorch; the crop itself resized to its 150 px input"),
    ]
    write_report(args.out / "reference.json", rows, args.out / "table.md", table(rows), echo=False)
    print(f"wrote {args.out / 'reference.json'} and {args.out / 'table.md'}")


if __name__ == "__main__":
    main()
