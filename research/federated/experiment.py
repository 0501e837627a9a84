"""One experiment end to end: the public backbone, the private users, a federated (or centralized) run,
View 1 on DevTest pairs, and its summary row. Shared by the CLI and research/federated_table.py."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from splitface.device.federated import LocalConfig, train_client
from splitface.common.models import DEFAULT_SPLIT, ModelSpec, build_backbone
from splitface.common.models.weights import load_into
from splitface.device.privacy.mechanisms import NoNoise

from research.distill import distilled_start
from research.pretrain import pretrain
from research.federated.tasks import Backend
from research.federated.rounds import FederatedConfig, FederatedRun
from research.federated.tasks import in_process
from research.federated.evaluate import View1Evaluator
from research.federated.population import Population, load_population, public_split


def public_backbone(path: Path, spec: ModelSpec, lfw_root: str | Path | None, epochs: int, seed: int = 0,
                    log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """The backbone pre-trained on the public people (`population.public_split`); trained and saved at
    `path` unless it is there already."""
    if not path.exists():
        log(f"pre-training on the public split ({epochs} epochs) -> {path}")
        pretrain(spec, public_split(lfw_root), path, epochs=epochs, seed=seed, progress=False)
    backbone = build_backbone(spec)
    load_into(backbone, path, spec)
    return backbone.state_dict()


# Where every run of an experiment starts: "public-split", the backbone pre-trained on the public DevTrain people
# (public_backbone); "distilled", splitface's backbone distilled from dlib's recognizer on the "federated" public
# set (research/distill.py: no private user of these experiments, no View 1 DevTest person), built on first use
# and cached.
STARTS = ("public-split", "distilled")
DEFAULT_BACKBONE = Path(__file__).resolve().parents[2] / "runs" / "federated" / "public_backbone.pt"


def add_start_args(p: argparse.ArgumentParser) -> None:
    """--start and the public-split pre-training's options, as every federated bench takes them (`start_state`)."""
    p.add_argument("--start", choices=STARTS, default="public-split",
                   help="where every run starts: the public-split pre-training (--backbone) or the distilled start "
                        "on the federated public set (built on first use and cached; docs/pretrain.md)")
    p.add_argument("--backbone", type=Path, default=DEFAULT_BACKBONE,
                   help="public-split start: the public backbone (pre-trained there if missing)")
    p.add_argument("--pretrain-epochs", type=int, default=4)


def start_state(start: str, spec: ModelSpec, lfw_root: str | Path | None, backbone_path: Path, pretrain_epochs: int,
                seed: int = 0, log: Callable[[str], None] = print,
                distill_args: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The backbone weights every run starts from, and what they are (the tables say it). `backbone_path` and
    `pretrain_epochs` are the public-split start's; `distill_args`: distilled_start's keyword options (cache_dir,
    recipes, limit: tests build a tiny one)."""
    if start == "public-split":
        return (public_backbone(backbone_path, spec, lfw_root, pretrain_epochs, seed, log),
                {"start": start, "file": str(backbone_path), "pretrain_epochs": pretrain_epochs})
    if start != "distilled":
        raise ValueError(f"start must be one of {STARTS}, not {start!r}")
    path = distilled_start(spec, DEFAULT_SPLIT, NoNoise(), lfw_root, public_set="federated", **(distill_args or {}))
    backbone = build_backbone(spec)
    meta = load_into(backbone, path, spec)
    faces = {k: v for k, v in meta["public_faces"].items() if k != "per_person"}
    log(f"starting from the distilled start {path} ({faces['people']} public people, {faces['images']} images)")
    return backbone.state_dict(), {"start": start, "file": str(path), "public_faces": faces,
                                   "view1": meta.get("view1"), "recipe": meta.get("recipe")}


def describe_start(start: dict[str, Any]) -> str:
    """One sentence for a table: which start every run began from, and on which public faces."""
    if start["start"] == "public-split":
        return (f"every run starts from the backbone pre-trained ({start['pretrain_epochs']} epochs) on the 111 public "
                f"DevTrain people with >= 10 photos")
    faces, view1 = start["public_faces"], start.get("view1") or {}
    score = f", View 1 {view1['view1_accuracy']:.3f} before any private data" if view1 else ""
    return (f"every run starts from the **distilled start** (splitface's backbone distilled from dlib's recognizer, "
            f"`research/distill.py`, public set `{faces['public_set']}`: {faces['rule']}; {faces['people']} "
            f"people, {faces['images']} images{score})")


@dataclass
class Shared:
    """What every run of an experiment reads: decoded once."""
    spec: ModelSpec
    init_state: dict[str, torch.Tensor]
    population: Population
    evaluator: View1Evaluator  # the final score: all DevTest pairs (or --view1-limit)
    start: dict[str, Any]  # what init_state is (start_state)
    progress: View1Evaluator | None = None  # the per-round curve: fewer pairs, cheaper


def load_shared(spec: ModelSpec, lfw_root: str | Path | None, backbone_path: Path, pretrain_epochs: int,
                max_users: int | None, calibration_images: int = 256, view1_limit: int | None = None,
                progress_pairs: int | None = None, seed: int = 0, single_photo: bool = False,
                log: Callable[[str], None] = print, start: str = "public-split",
                distill_args: dict[str, Any] | None = None) -> Shared:
    """`progress_pairs`: score the per-round curve on only this many DevTest pairs (half matched);
    `single_photo`: people with one photo are private users too (population.py); `start`, `distill_args`: see
    start_state."""
    init_state, started_from = start_state(start, spec, lfw_root, backbone_path, pretrain_epochs, seed, log,
                                           distill_args)
    public = public_split(lfw_root).train
    keep = np.sort(np.random.default_rng(seed).permutation(len(public))[:calibration_images])
    calibration = public.subset(keep).load(spec.input_size)
    population = load_population(lfw_root, spec.input_size, max_users=max_users, seed=seed, single_photo=single_photo)
    log(f"{len(population.users)} private users, {len(population.labels)} images; "
        f"{len(calibration)} public images for batch-norm recalibration")
    evaluator = View1Evaluator(lfw_root, spec.input_size, calibration, limit=view1_limit)
    progress = None if progress_pairs is None else View1Evaluator(lfw_root, spec.input_size, calibration,
                                                                  limit=progress_pairs)
    return Shared(spec, init_state, population, evaluator, started_from, progress)


def summary_row(method: str, rounds: int | None, users_per_round: float | None, privacy: dict,
                report: dict, extra: dict) -> dict[str, Any]:
    return {"method": method, "noise_multiplier": extra.pop("noise_multiplier", None), "rounds": rounds,
            "users_per_round": users_per_round, "epsilon": privacy.get("epsilon"), "delta": privacy.get("delta"),
            **{k: report[k] for k in ("view1_accuracy", "view1_std", "roc_auc", "tar_at_far_1e-2")},
            "epsilon_rdp": privacy.get("epsilon_rdp"), **extra}


def run_federated(shared: Shared, config: FederatedConfig, out: Path, eval_every: int = 0,
                  crash_in_round: int | None = None, log: Callable[[str], None] = print,
                  backend: Backend = in_process) -> dict[str, Any]:
    """A federated run (resumed from `out` if it has a checkpoint); writes and returns its summary row."""
    started = time.time()
    run = FederatedRun(config, shared.spec, shared.population, shared.init_state, out, backend)
    log(f"{config.method}: {len(run.clients)} virtual clients of {config.users_per_client} users, "
        f"Poisson rate {run.sampling_rate:.4f} ({config.clients_per_round:g} clients per round expected), "
        f"{config.rounds} rounds")
    history = run.run(shared.progress or shared.evaluator, eval_every, crash_in_round, log)
    final = shared.evaluator(run.backbone)
    extra = {"noise_multiplier": config.noise_multiplier if config.private else None,
             "start": shared.start["start"], "users": len(shared.population.users), "virtual_clients": len(run.clients),
             "users_per_client": config.users_per_client, "sampling_rate": run.sampling_rate,
             "single_photo_users": int(np.sum(np.bincount(shared.population.labels) == 1)),
             "adaptive_clipping": config.target_quantile is not None, "config": dataclasses.asdict(config),
             "history": [{k: row.get(k) for k in ("round", "clients", "users", "loss", "median_norm", "epsilon",
                                                   "view1_accuracy", "pairs", "clip_norm")} for row in history],
             "client_images_trained": int(sum(row["images"] for row in history)) * config.local_epochs,
             "wall_s": time.time() - started}
    row = summary_row(config.method, config.rounds, run.sampling_rate * len(shared.population.users),
                      run.privacy(), final, extra)
    (out / "result.json").write_text(json.dumps(row, indent=2))
    log(f"{config.method}: View 1 accuracy {row['view1_accuracy']:.3f} +- {row['view1_std']:.3f}, "
        f"AUC {row['roc_auc']:.3f}, user-level epsilon {row['epsilon']} at delta {row['delta']}")
    return row


def run_centralized(shared: Shared, out: Path, epochs: int, lr: float, batch_size: int = 32,
                    head_lr_scale: float = 10.0, momentum: float = 0.0, seed: int = 0,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Non-private training of the same backbone on all private users' photos at once (a head over all
    of them): the same client function, run once over everyone."""
    started = time.time()
    population = shared.population
    config = LocalConfig(epochs=epochs, batch_size=batch_size, lr=lr, head_lr_scale=head_lr_scale, momentum=momentum)
    log(f"centralized: {len(population.users)} users, {len(population.labels)} images, {epochs} epochs")
    result = train_client(shared.spec, shared.init_state, population.images, population.labels, config, seed)
    backbone = build_backbone(shared.spec)
    backbone.load_state_dict(shared.init_state)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            p += result.delta[name]
    report = shared.evaluator(backbone)
    extra = {"start": shared.start["start"], "users": len(population.users), "seed": seed, "epochs": epochs, "lr": lr,
             "batch_size": batch_size,
             "head_lr_scale": head_lr_scale, "momentum": momentum,
             "client_images_trained": epochs * len(population.labels), "train_loss": result.loss,
             "wall_s": time.time() - started}
    row = summary_row("centralized", None, None, {}, report, extra)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(row, indent=2))
    log(f"centralized: View 1 accuracy {row['view1_accuracy']:.3f} +- {row['view1_std']:.3f}")
    return row


def run_public_only(shared: Shared, out: Path) -> dict[str, Any]:
    """The public backbone itself, before any private training (where every run starts)."""
    backbone = build_backbone(shared.spec)
    backbone.load_state_dict(shared.init_state)
    extra = {"start": shared.start["start"], "users": 0}
    if shared.progress is not None:  # round 0 of the per-round curves
        extra["progress_view1_accuracy"] = shared.progress(backbone)["view1_accuracy"]
    row = summary_row("public-only", 0, None, {}, shared.evaluator(backbone), extra)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(row, indent=2))
    return row
