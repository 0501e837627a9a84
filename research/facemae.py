"""FaceMAE on the server (Wang et al. 2022): the masked autoencoder that fills in the device's masked
releases, pre-trained on public faces, and the paper's retrieval risk R(A, S, K) of its reconstructions.

Pre-training (`pretrain`): the operator trains the MAE of the `mask` release
(`splitface/common/transforms/mask.py`) on public faces, View 1 DevTrain people with 3-9 images (the public
set of `research/ressfl.py`: disjoint from the frontier's private people, who have >= 10, and from
View 1's DevTest people). Each step masks a fresh random `mask_ratio` of each face's patches, as a device
does, and minimises

    MSE(MAE(masked), x) on the hidden pixels  +  lambda_irm * IRM(x, reconstruction)

IRM, instance relation matching, is our reading of FaceMAE's loss for closing the gap between real and
reconstructed faces: a face recognizer `FaceFeatures` (trained here on the clean public faces, beside
the MAE) embeds a batch of real faces and their reconstructions; each set gives a matrix of pairwise
cosine similarities between the batch's instances, and the loss is the row-wise KL divergence from the
real faces' relations (softmax at temperature tau, self-pairs left out) to the reconstructions'. So the
reconstructions keep how faces relate to each other (who resembles whom), which recognition learns
from, without being pulled towards their own source image pixel by pixel.

The file written is a backbone file (`splitface.common.models.weights`) carrying the trained release stage
(`stages.mask_server.*`); the rest is the seeded start, so `--server-init FILE` starts the server from
the seeded backbone with the trained MAE, which it keeps frozen.

Retrieval risk (`retrieval_risk`): FaceMAE measures privacy leakage by face retrieval between the
original and the reconstructed data: R(A, S, K) is the share of queries from the original set A (here:
the private people's held-out photos) whose identity is among the K identities that rank first in the
reconstructed set S (here: the server's MAE reconstructions of the releases it recorded), retrieved with
a face recognizer (dlib's). It is `research.audit.metrics.reidentification_risk`, with its chance level
(gallery identities shuffled) and its upper bound (S = the clean originals).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from splitface.common.options import add_model_args, model_spec
from splitface.common.options import add_data_root_arg, add_seed_arg, add_threads_arg
from splitface.common.data import load_lfw
from splitface.device.trainer import to_input
from splitface.common.models import ModelSpec, build_backbone, split_backbone
from splitface.common.models.weights import save_backbone
from splitface.common.transforms.mask import ConvMAE, random_patch_mask

from research.ressfl import release_stage_state

RISK_KS = (1, 5)


class FaceFeatures(nn.Module):
    """A small face recognizer for IRM: image (N, 3, S, S) in [0, 1] -> (N, dim) embedding."""

    def __init__(self, dim: int = 128, width: int = 32) -> None:
        super().__init__()
        layers, c = [], 3
        for w in (width, 2 * width, 4 * width, 4 * width):
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1), nn.ReLU()]
            c = w
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * c, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def relations(features: torch.Tensor, tau: float) -> torch.Tensor:
    """Row-wise log-softmax of the batch's cosine similarities / tau, each instance's self-pair left out."""
    f = F.normalize(features, dim=1)
    sims = f @ f.T / tau
    eye = torch.eye(len(f), dtype=torch.bool, device=f.device)
    return F.log_softmax(sims.masked_fill(eye, float("-inf")), dim=1).masked_fill(eye, 0.0)


def irm_loss(real: torch.Tensor, reconstructed: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Instance relation matching: mean over instances of KL(relations of real || relations of reconstructed)."""
    if len(real) < 3:
        raise ValueError("IRM needs a batch of at least 3 faces (each row relates one face to the others)")
    target = relations(real, tau).detach()
    return F.kl_div(relations(reconstructed, tau), target, log_target=True, reduction="batchmean")


def masked_mse(prediction: torch.Tensor, image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MSE on the hidden pixels only (MAE's loss: the visible ones are known)."""
    hidden = (1 - mask).expand_as(image)
    return ((prediction - image) ** 2 * hidden).sum() / hidden.sum().clamp_min(1)


def pretrain(spec: ModelSpec, split: str, lfw_root: Path, out: Path, epochs: int = 6, lambda_irm: float = 1.0,
             tau: float = 0.1, irm_warmup: int = 1, lr: float = 2e-3, batch_size: int = 64, seed: int = 0,
             crop: int = 160, limit: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Train the `mask` release's MAE on public faces (reconstruction + lambda_irm * IRM) and write the
    backbone file. `irm_warmup`: epochs in which only the recognizer learns for IRM (its relations are
    noise before). `limit`: only the first N public images (smoke tests)."""
    if spec.release != "mask":
        raise ValueError(f"the FaceMAE pre-training trains the mask release's MAE; got release {spec.release!r}")
    data = load_lfw(lfw_root, min_images=3, max_images=9, people="devtrain", seed=seed)
    faces = data.train if limit is None else data.train.subset(np.arange(min(limit, len(data.train.labels))))
    x_all = to_input(faces.load(spec.input_size, crop, progress))
    y_all = torch.from_numpy(faces.labels)

    torch.manual_seed(seed)
    backbone = build_backbone(spec)
    device, server = split_backbone(backbone, split)
    mae: ConvMAE = server.stages["mask_server"].mae
    mae.requires_grad_(True)
    recognizer = FaceFeatures()
    classifier = nn.Linear(128, len(data.class_names))
    mae_opt = torch.optim.Adam(mae.parameters(), lr=lr)
    rec_opt = torch.optim.Adam([*recognizer.parameters(), *classifier.parameters()], lr=lr)
    masks = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    history, started = [], time.time()
    for epoch in tqdm(range(epochs), desc="FaceMAE pre-training", disable=not progress):
        sums = {"mse_hidden": 0.0, "irm": 0.0, "recognizer_ce": 0.0, "recognizer_acc": 0.0}
        order = rng.permutation(len(y_all))
        seen = 0
        for i in range(0, len(order), batch_size):
            idx = torch.from_numpy(order[i:i + batch_size])
            if len(idx) < 3:
                continue
            x, y = x_all[idx], y_all[idx]
            # the recognizer learns the public identities from clean faces
            logits = classifier(recognizer(x))
            ce = F.cross_entropy(logits, y)
            rec_opt.zero_grad()
            ce.backward()
            rec_opt.step()
            # the MAE: masks drawn as a device draws them, loss on the hidden pixels, relations matched
            mask = random_patch_mask(len(x), spec.input_size, spec.mask_patch, spec.mask_ratio, masks)
            masked = x * mask
            prediction = mae(masked, mask)
            mse = masked_mse(prediction, x, mask)
            irm = torch.zeros(())
            if lambda_irm > 0 and epoch >= irm_warmup:
                recognizer.requires_grad_(False)
                irm = irm_loss(recognizer(x), recognizer(masked + prediction * (1 - mask)), tau)
                recognizer.requires_grad_(True)
            mae_opt.zero_grad()
            (mse + lambda_irm * irm).backward()
            mae_opt.step()
            n = len(idx)
            seen += n
            for k, v in (("mse_hidden", mse), ("irm", irm), ("recognizer_ce", ce)):
                sums[k] += float(v.detach()) * n
            sums["recognizer_acc"] += float((logits.argmax(1) == y).sum())
        history.append({"epoch": epoch + 1, **{k: v / max(seen, 1) for k, v in sums.items()},
                        "wall_s": time.time() - started})
    mae.requires_grad_(False)
    meta = {"method": "FaceMAE pre-training (masked reconstruction + instance relation matching)",
            "public_people": "View 1 DevTrain people with 3-9 images", "identities": len(data.class_names),
            "images": len(y_all), "split": split, "epochs": epochs, "lambda_irm": lambda_irm, "tau": tau,
            "irm_warmup": irm_warmup, "lr": lr, "seed": seed, "mask_ratio": spec.mask_ratio,
            "mask_patch": spec.mask_patch, "history": history}
    save_backbone(out, spec, backbone, meta, release_stage_state(device, server))
    return meta


@torch.no_grad()
def reconstruct(mae: ConvMAE, releases: np.ndarray, batch: int = 128) -> np.ndarray:
    mae.eval()
    return np.concatenate([mae.reconstruct(torch.from_numpy(np.asarray(releases[i:i + batch], np.float32))).numpy()
                           for i in range(0, len(releases), batch)])


def retrieval_risk(run_dir: Path, lfw_root: Path, cache: Path | None = Path("runs") / "audit-cache") -> dict[str, Any]:
    """R(A, S, K) of a `--release mask` run: A the recorded people's held-out photos, S the server's own
    MAE reconstructions of the releases it recorded (and, for comparison, the masked releases themselves
    and the clean originals), retrieved by dlib's recognizer."""
    from research.audit.metrics import chance_risk, reidentification_risk
    from research.audit.recognizer import CachedFaces, DlibResNet
    from research.audit.run import ground_truth, load_run, public_faces

    view = load_run(run_dir)
    if view.spec.release != "mask":
        raise ValueError(f"{run_dir}: release {view.spec.release!r}, not mask: no MAE reconstructions to score")
    truth = ground_truth(view, lfw_root, public_faces(lfw_root, 1))
    wanted = np.isin(truth.photos.labels, truth.private.labels)
    photo_set = truth.photos.subset(np.flatnonzero(wanted))
    dlib = DlibResNet()
    cached = CachedFaces(dlib, f"dlib-{dlib.fingerprint}", cache)
    queries = cached.embed_faces(photo_set, truth.size, truth.crop)
    released = view.recorded("activations").astype(np.float32)
    galleries = {"reconstructions": dlib.embed(reconstruct(view.tail.stages["mask_server"].mae, released)),
                 "releases": dlib.embed(released),
                 "originals": cached.embed_faces(truth.private, truth.size, truth.crop)}
    ids, photo_ids = truth.private.labels, photo_set.labels
    return {"run": view.name, "recognizer": f"dlib {dlib.fingerprint}", "queries_A": len(photo_ids),
            "gallery_S": len(ids), "identities": int(len(np.unique(ids))),
            "definition": "R(A,S,K): share of photos in A whose identity is among the top-K identities retrieved "
                          "from S (identities ranked by their most similar item)",
            **{f"{name}_R@{k}": reidentification_risk(queries, photo_ids, gallery, ids, k)
               for name, gallery in galleries.items() for k in RISK_KS},
            **{f"chance_R@{k}": chance_risk(queries, photo_ids, galleries["reconstructions"], ids, k) for k in RISK_KS}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-research facemae", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("pretrain", help="train the mask release's MAE on public faces; write a backbone file")
    add_data_root_arg(pre, required=True, help="LFW root (with View 1's people files)")
    pre.add_argument("--out", type=Path, required=True, help="the backbone file to write")
    add_model_args(pre)
    pre.add_argument("--epochs", type=int, default=6)
    pre.add_argument("--lambda-irm", type=float, default=1.0, help="weight of the instance-relation-matching loss")
    pre.add_argument("--tau", type=float, default=0.1, help="IRM's softmax temperature")
    pre.add_argument("--lr", type=float, default=2e-3)
    pre.add_argument("--batch-size", type=int, default=64)
    add_seed_arg(pre)
    pre.add_argument("--limit", type=int, default=None, help="only the first N public images (smoke tests)")
    add_threads_arg(pre)
    risk = sub.add_parser("risk", help="R(A, S, K) of a --release mask run's MAE reconstructions")
    risk.add_argument("run", type=Path, help="a splitface-research demo --record-max N run with --release mask")
    add_data_root_arg(risk, required=True)
    risk.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    risk.add_argument("--cache", type=Path, default=Path("runs") / "audit-cache")
    add_threads_arg(risk)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "pretrain":
        meta = pretrain(model_spec(args), args.split, args.data, args.out, args.epochs, args.lambda_irm, args.tau,
                        lr=args.lr, batch_size=args.batch_size, seed=args.seed, limit=args.limit)
        for h in meta["history"]:
            print(" ".join(f"{k}={v:.4g}" for k, v in h.items()))
        print(f"wrote {args.out}")
        return
    report = retrieval_risk(args.run, args.data, args.cache)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
