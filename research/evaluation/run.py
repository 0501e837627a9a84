"""A finished split run on View 1: the embedding is the server tail's output on the device layer's release.

The tail comes from the server's checkpoint, the device layer from the simulator's saved copy
(`<run>/device_layers/<device id>.pt`, on the experimenter's machine). The layer is device 0's:
each device trains its own, and the report names the one used.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from splitface.common.options import add_data_root_arg, load_selection
from splitface.device.trainer import bound_for, privatize
from splitface.common.models import ModelSpec, build_backbone, split_backbone
from splitface.common.transforms import MIRRORED, mirror_averaged, release_mirror
from splitface.device.privacy.described import from_description
from splitface.device.privacy.mechanisms import noise_generator
from splitface.protocol.tensor import decode_tensor, encode_tensor

from splitface.server.checkpoint import load_checkpoint
from research.evaluation.verification import evaluate_embedder, view1_pairs

EVALUATION_SEED = 20_221_001  # the evaluator's noise; not any device's secret


def load_split_model(run_dir: Path) -> tuple[nn.Module, nn.Module, dict]:
    """(device 0's layer, the server's tail, the run's results), both in eval mode."""
    results_file = run_dir / "results.json"
    if not results_file.exists():
        raise FileNotFoundError(f"{run_dir} has no results.json: not a finished splitface-research demo run")
    results = json.loads(results_file.read_text())
    state = load_checkpoint(run_dir / "server" / "checkpoint.pt")
    if state is None:
        raise FileNotFoundError(f"{run_dir / 'server' / 'checkpoint.pt'} is missing")
    device = results["devices"][0]
    layer_file = run_dir / "device_layers" / f"{device['device_id']}.pt"
    if not layer_file.exists():
        raise FileNotFoundError(f"{layer_file} is missing: the run predates the simulator saving device layers")
    config = results["config"]
    layer, tail = split_backbone(build_backbone(ModelSpec.from_dict(config["model"])), config["split"])
    layer.load_state_dict(torch.load(layer_file, map_location="cpu", weights_only=True))
    tail.load_state_dict(state["trainer"]["tail"])
    bound_for(from_description(device["privacy"]["mechanism"]), layer)  # the device's own forward (DP clamps)
    return layer.eval(), tail.eval(), results


def seen_people(lfw_root: str | Path | None, results: dict, limit: int | None = None) -> dict:
    """How many DevTest people and pairs the run trained on (none with --people devtrain)."""
    selection = results["config"].get("data")
    if not selection or selection["image_folder"]:
        return {"trained_people": None, "devtest_people_seen": None, "pairs_with_seen_people": None}
    trained = set(load_selection(lfw_root, selection).class_names)
    pairs = view1_pairs(lfw_root, "test", limit)
    names = np.array(pairs.faces.class_names)[pairs.faces.labels]
    seen = np.isin(names[pairs.a], list(trained)) | np.isin(names[pairs.b], list(trained))
    return {"trained_people": selection.get("people", "all"), "devtest_people_seen": len(trained & pairs.people),
            "pairs_with_seen_people": int(seen.sum())}


def run_embedder(run_dir: str | Path, encoding: str | None = None,
                 mirror_average: bool = False) -> tuple[Callable[[np.ndarray], np.ndarray], dict]:
    """(images in [0, 1] -> embeddings, the run's results): the images released as device 0 releases them (its layer,
    the transform's random subset, the mechanism's noise, drawn here from a fixed seed of the evaluator's own), then
    the server's tail. `encoding` (f16, i8): the release also passes through that wire encoding and back, as the
    protocol carries it. `mirror_average`: the embedding is the mean of the tail's on the release and on the mirror
    image's release, computed from it, as a server run with --mirror-average embeds (ValueError for a release
    without one)."""
    layer, tail, results = load_split_model(Path(run_dir))
    spec = ModelSpec.from_dict(results["config"]["model"])
    mechanism = from_description(results["devices"][0]["privacy"]["mechanism"])
    generator = noise_generator(EVALUATION_SEED, 2)
    mirror = release_mirror(spec) if mirror_average else None

    @torch.no_grad()
    def embed(images: np.ndarray) -> np.ndarray:
        release = privatize(spec, mechanism, layer(torch.from_numpy(images)), generator)
        if encoding is not None:
            release = torch.from_numpy(np.array(decode_tensor(encode_tensor(release.numpy(), encoding))))
        return mirror_averaged(tail, mirror, release).numpy()
    return embed, results


def evaluate_run(run_dir: str | Path, lfw_root: str | Path | None, limit: int | None = None,
                 encoding: str | None = None, mirror_average: bool | None = None) -> dict:
    """View 1 report of a run, each face embedded by `run_embedder`: what enrolling or verifying a face through the
    deployed system computes; the run's own test accuracy is measured the same way. `mirror_average` None: as the
    run's server embedded its test releases (`recorded_mirror_average`)."""
    if mirror_average is None:
        mirror_average = recorded_mirror_average(Path(run_dir))
    embed, results = run_embedder(run_dir, encoding, mirror_average)
    spec = ModelSpec.from_dict(results["config"]["model"])
    report = evaluate_embedder(embed, lfw_root, spec.input_size, results["config"].get("crop", 160), limit)
    wire = f", then {encoding} and back" if encoding is not None else ""
    return {"run": Path(run_dir).name, "device_layer": results["devices"][0]["device_id"],
            "release": f"as deployed: layer, transform, mechanism (evaluator's own noise){wire}",
            "mirror_average": mirror_average,
            "test_acc": results["epochs"][-1]["test_acc"] if results["epochs"] else None,
            **seen_people(lfw_root, results, limit), **report}


def recorded_mirror_average(run_dir: Path) -> bool:
    """Whether the run's server averaged each test release's embedding with its mirror image's, as its metrics.json
    records (servers since that record); for a run made before it, whether the demo asked its server to
    (`demo_args.json`, the last of --mirror-average and --no-mirror-average, for a release that has a mirror)."""
    metrics = run_dir / "server" / "metrics.json"
    recorded = json.loads(metrics.read_text()).get("test_embedding") if metrics.exists() else None
    if recorded is not None:
        return bool(recorded["mirror_average"])
    asked = run_dir / "demo_args.json"
    release = json.loads((run_dir / "results.json").read_text())["config"]["model"].get("release", "none")
    return asked.exists() and last_of(json.loads(asked.read_text()), "--mirror-average") and release in MIRRORED


def last_of(argv: list[str], flag: str) -> bool:
    """Whether a switch (`--x`, undone by `--no-x`) is on in `argv`: its last mention wins, as argparse reads."""
    said = [a for a in argv if a in (flag, flag.replace("--", "--no-", 1))]
    return bool(said) and said[-1] == flag


def summary(report: dict) -> str:
    seen = report["pairs_with_seen_people"]
    trained = "unseen people" if seen == 0 else f"{seen} of {report['pairs']} pairs show people it trained on"
    return (f"{report['run']}: View 1 accuracy {report['view1_accuracy']:.3f} +- {report['view1_std']:.3f}, "
            f"ROC AUC {report['roc_auc']:.3f}, TAR@FAR=1e-2 {report['tar_at_far_1e-2']:.3f} "
            f"({trained if seen is not None else 'training people unknown'})")


def main(argv: list[str] | None = None) -> None:
    """`splitface-research evaluate RUN_DIR [RUN_DIR...] --data LFW`: each run's View 1 verification, one line per
    run, and `view1.json` in the run's directory."""
    p = argparse.ArgumentParser(prog="splitface-research evaluate", description=main.__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="splitface-research demo run directories")
    add_data_root_arg(p, help="LFW root (holding images/ and the View 1 pairs files); "
                              "default: $SPLITFACE_DATA, ~/.cache/splitface/lfw, ./data/lfw")
    p.add_argument("--limit", type=int, default=None, help="only the first N/2 matched and N/2 mismatched pairs")
    p.add_argument("--mirror-average", action=argparse.BooleanOptionalAction, default=None,
                   help="embed each release as a server run with --mirror-average does (the mean of the tail's "
                        "embeddings of the release and of the mirror image's release, computed from it), or not "
                        "(--no-mirror-average); default: as the run's server did (its metrics.json)")
    args = p.parse_args(argv)
    for run_dir in args.runs:
        try:
            report = evaluate_run(run_dir, args.data, args.limit, mirror_average=args.mirror_average)
        except ValueError as exc:   # --mirror-average for a release that has no mirror
            p.error(f"{run_dir}: {exc}")
        (run_dir / "view1.json").write_text(json.dumps(report, indent=2))
        print(summary(report), flush=True)
