"""Attacker-aware pre-training of the device part: ResSFL (Li et al., CVPR'22) with NoPeek's distance
correlation (Vepakomma et al., 2020) and an identity-matching adversary (FaceLinkGen-style).

The model provider (the edge server's operator) pre-trains the device layers, the release transform
and the server's tail on public faces, while two simulated attackers train beside them on the same
releases: a decoder from releases back to the image, and a matcher from releases to a strong
recognizer's (dlib's) embedding of the clean face. The device part's loss is the classification loss
plus rewards for the attackers' failure:

    CE(head(tail(z)), y) - lambda_rec * MSE(decoder(z), x) + lambda_id * |cos(matcher(z), dlib(x))|
                         + lambda_dcor * dCor(x, z),            z = device(x)

The devices then run that part frozen, with these published weights, and the server starts its tail
from the same file (`--device-weights F --layer-training frozen --server-init F`).

Threat model: the server made these weights, so it knows them. The audit attacks such a run with the
white-box device part and fresh attackers trained on its releases; a defence that only beats the
attackers it was trained against does not count.

Public faces: View 1 DevTrain people with 3-9 images (disjoint from the frontier's private people,
who have >= 10, and from View 1's DevTest people).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from splitface.common.options import add_data_root_arg, add_model_args, add_seed_arg, add_threads_arg, add_training_args, apply_threads, model_spec
from splitface.device.privacy.options import add_noise_args
from splitface.common.data import load_lfw
from splitface.device.trainer import to_input
from splitface.common.models import ModelSpec, build_backbone, build_classifier, split_backbone
from splitface.common.models.weights import RELEASE_STAGES, save_backbone
from splitface.common.optim import exponential_decay, make_sgd
from splitface.device.privacy.mechanisms import PerImageGaussian
from splitface.device.privacy.nopeek import distance_correlation

from research.audit.decoder import DecoderNet
from research.audit.inversion import resized
from research.audit.matcher import MatcherNet
from research.audit.recognizer import CachedFaces, DlibResNet


def release_stage_state(device: torch.nn.Module, server: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transform's stages at the cut, trained here: they travel in the backbone file."""
    return {k: v for part in (device, server) for k, v in part.state_dict().items()
            if k.split(".")[1] in RELEASE_STAGES}


def attacker_aware_pretrain(spec: ModelSpec, split: str, lfw_root: Path, out: Path, epochs: int = 10,
                            lambda_rec: float = 1.0, lambda_id: float = 1.0, lambda_dcor: float = 0.0,
                            lr: float = 0.1, attacker_lr: float = 2e-3, batch_size: int = 64, image_size: int = 32,
                            seed: int = 0, crop: int = 160, cache: Path | None = Path("runs") / "audit-cache",
                            limit: int | None = None, progress: bool = True, clip_norm: float = 0.0,
                            noise_multiplier: float = 0.0) -> dict[str, Any]:
    """`limit`: only the first N public images (smoke tests). `noise_multiplier` > 0: every release is clipped
    and noised as the devices' per-image mechanism will (clip_norm C, std z C), so that the tail learns to
    classify noisy releases on public faces before it sees a private one (noise-aware pre-training; the
    attackers train on the same noisy releases)."""
    if spec.release == "none":
        raise ValueError("attacker-aware pre-training trains a release transform with the device part: "
                         "give one (e.g. --release bottleneck)")
    data = load_lfw(lfw_root, min_images=3, max_images=9, people="devtrain", seed=seed)
    faces = data.train if limit is None else data.train.subset(np.arange(min(limit, len(data.train.labels))))
    images = faces.load(spec.input_size, crop, progress)
    x_all = to_input(images)
    y_all = torch.from_numpy(faces.labels)
    targets = None
    if lambda_id > 0:
        dlib = DlibResNet()
        recognizer = CachedFaces(dlib, f"dlib-{dlib.fingerprint}", cache)
        targets = F.normalize(torch.from_numpy(recognizer.embed_faces(
            faces, spec.input_size, crop, images.astype(np.float32) / 255)), dim=1)
    pixels = torch.from_numpy(resized(images.astype(np.float32) / 255, image_size))

    torch.manual_seed(seed)
    backbone = build_backbone(spec)
    device, server = split_backbone(backbone, split)
    classifier = build_classifier(spec, len(data.class_names))
    with torch.no_grad():
        channels, size = device.eval()(x_all[:1]).shape[1], device(x_all[:1]).shape[-1]
    decoder = DecoderNet(channels, 32, image_size)
    matcher = MatcherNet(channels, size, 48, targets.shape[1]) if targets is not None else None
    attackers = [decoder, *([matcher] if matcher is not None else [])]
    attacker_opt = torch.optim.Adam([p for a in attackers for p in a.parameters()], lr=attacker_lr)
    defender = [*device.parameters(), *server.parameters(), *classifier.parameters()]
    steps = epochs * -(-len(y_all) // batch_size)
    optimizer = make_sgd(list(dict.fromkeys(defender)), lr, 0.9, 5e-4)
    scheduler = exponential_decay(optimizer, 0.1, steps)
    rng = np.random.default_rng(seed)
    mechanism = PerImageGaussian(clip_norm, noise_multiplier) if noise_multiplier > 0 else None
    noise = torch.Generator().manual_seed(seed + 1)
    history, started = [], time.time()
    for epoch in tqdm(range(epochs), desc="attacker-aware pretrain", disable=not progress):
        for m in (device, server, classifier, *attackers):
            m.train()
        sums = {"ce": 0.0, "acc": 0.0, "rec_mse": 0.0, "id_cos": 0.0, "dcor": 0.0}
        order = rng.permutation(len(y_all))
        for i in range(0, len(order) - 1, batch_size):
            idx = torch.from_numpy(order[i:i + batch_size])
            if len(idx) < 2:   # batch norm needs two samples
                continue
            x, y = x_all[idx], y_all[idx]
            z = device(x)
            if mechanism is not None:
                z = mechanism.privatize(z, noise)
            # the attackers' step, on releases they cannot change
            rec_loss = F.mse_loss(decoder(z.detach()), pixels[idx])
            id_loss = (1 - F.cosine_similarity(matcher(z.detach()), targets[idx])).mean() if matcher is not None \
                else 0 * rec_loss
            attacker_opt.zero_grad()
            (rec_loss + id_loss).backward()
            attacker_opt.step()
            # the defenders' step: classify, and make the current attackers fail
            logits = classifier(server(z))
            ce = F.cross_entropy(logits, y)
            rec = F.mse_loss(decoder(z), pixels[idx])
            cos = F.cosine_similarity(matcher(z), targets[idx]).abs().mean() if matcher is not None else 0 * ce
            dcor = distance_correlation(x, z) if lambda_dcor > 0 else 0 * ce
            loss = ce - lambda_rec * rec + lambda_id * cos + lambda_dcor * dcor
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            n = len(idx)
            for k, v in (("ce", ce), ("rec_mse", rec), ("id_cos", cos), ("dcor", dcor)):
                sums[k] += float(v.detach()) * n
            sums["acc"] += float((logits.argmax(1) == y).sum())
        history.append({"epoch": epoch + 1, **{k: v / len(y_all) for k, v in sums.items()},
                        "wall_s": time.time() - started})
    meta = {"method": "attacker-aware pre-training (ResSFL + NoPeek + identity matcher)",
            "public_people": "View 1 DevTrain people with 3-9 images", "identities": len(data.class_names),
            "images": len(y_all), "split": split, "epochs": epochs, "lambda_rec": lambda_rec, "lambda_id": lambda_id,
            "lambda_dcor": lambda_dcor, "clip_norm": clip_norm, "noise_multiplier": noise_multiplier,
            "lr": lr, "attacker_lr": attacker_lr, "seed": seed, "history": history}
    save_backbone(out, spec, backbone, meta, release_stage_state(device, server))
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-research ressfl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, required=True, help="LFW root (with View 1's people files)")
    p.add_argument("--out", type=Path, required=True, help="the backbone file to write")
    add_model_args(p)
    add_training_args(p, epochs=10, batch_size=64, lr=0.1)
    p.add_argument("--lambda-rec", type=float, default=1.0, help="weight of the decoder's failure (ResSFL)")
    p.add_argument("--lambda-id", type=float, default=1.0, help="weight of the identity matcher's failure")
    p.add_argument("--lambda-dcor", type=float, default=0.0, help="NoPeek's distance-correlation weight")
    add_noise_args(p, clip_norm=0.0, noise_multiplier=0.0,
                   noise_help="pre-train on releases noised as the devices will noise them (std z C); 0: no noise")
    add_seed_arg(p)
    add_threads_arg(p)
    p.add_argument("--cache", type=Path, default=Path("runs") / "audit-cache",
                   help="dlib's embeddings of clean photos, shared with the audit")
    args = p.parse_args(argv)
    apply_threads(args)
    meta = attacker_aware_pretrain(model_spec(args), args.split, args.data, args.out, args.epochs, args.lambda_rec,
                                   args.lambda_id, args.lambda_dcor, args.lr, batch_size=args.batch_size,
                                   seed=args.seed, cache=args.cache, clip_norm=args.clip_norm,
                                   noise_multiplier=args.noise_multiplier)
    for h in meta["history"]:
        print(" ".join(f"{k}={v:.4g}" for k, v in h.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
