"""The privacy frontier: every release transform at several strengths, trained through the product,
scored on accuracy (LFW classification and View 1 verification of unseen people), attacked by the
strong audit, and costed on the device.

Each point is one `splitface-research demo` run (an edge server and simulated devices in their own
processes) that trains on View 1's DevTrain people with >= 10 images (111 identities: the source
paper's LFW-158 set less its 47 people who are in View 1's DevTest list), with the server recording the first
--record-max releases of each device. Then:
- View 1: DevTest pairs, released as the device releases them (`splitface-research evaluate`);
- the audit (`splitface-research audit --substitute`): reconstructions, identity matching with dlib's
  recognizer, the server's own model, every attacker trained on releases of the same transform and
  mechanism, through a copy of the device part fitted to the recorded releases where the devices
  trained their own.

Resumable: a point with results.json is not re-trained, one with view1.json not re-evaluated, and the
audit keeps the reports it already wrote (--force starts everything afresh).

Outputs (--out, default results/frontier): runs/<point>/ (results, logs; recordings and checkpoints
are gitignored), audit/ (per-point reports), summary.json (one row per point), table.md,
frontier.png (relative accuracy against identity R@1 / chance, one curve per transform) and
best.json (the main job's default release: see `best_point`).

Reduced configuration (2 CPU cores): IResNet-small at 64 x 64, 3 epochs, 2 devices. The full-size
configuration is the same command with --model iresnet50 (112 px) and more epochs, and needs a GPU:

    python research/frontier.py --data LFW --model iresnet50 --epochs 20 --out results/frontier-full \
        --demo-args "--batch-size 128" --audit-args "--public-images 3000"

(tests/test_frontier.py runs a few steps of it on the CPU.)

From the distilled public start (docs/pretrain.md; every point from the start made noise-aware for its release,
the undefended point from the plain student), beside the rows from scratch:

    python research/frontier.py --data LFW --start distilled --out results/frontier-distilled \
        --demo-args "--threads 1 --head-lr-scale 10 --noise-aware-epochs 10" \
        --only bottleneck-channels4-stride2-clip_norm16-noise_multiplier0.02 \
               dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2

and as the main job fine-tunes (the noise-aware start distilled for 60 epochs from the recipe's plain student of
30, the server's head imprinted, the body at lr 0.01):

    python research/frontier.py --data LFW --start distilled --out results/frontier-distilled-imprinted \
        --demo-args "--threads 1 --noise-aware-epochs 60 --head-lr-scale 10 --imprint-epochs 1 --lr 0.01" \
        --only dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2 \
               dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2-stem_blocks2

(the undefended point, the reference, always runs; --demo-args reach it too, where --noise-aware-epochs changes
nothing: it starts from the plain student), and from run.sh's earlier plain student, distilled for 60 epochs:

    python research/frontier.py --data LFW --start distilled --out results/frontier-distilled-imprinted-student60 \
        --demo-args "--threads 1 --student-epochs 60 --noise-aware-epochs 60 --head-lr-scale 10 --imprint-epochs 1 \
                     --lr 0.01" \
        --only dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2-stem_blocks2

and the same with the server's tail held while its head is imprinted, as run.sh trains, with the main job's release
at twice and four times its noise too (each from a noise-aware start of its own):

    python research/frontier.py --data LFW --start distilled --out results/frontier-distilled-imprinted-student60-hold \
        --demo-args "--threads 1 --student-epochs 60 --noise-aware-epochs 60 --head-lr-scale 10 --imprint-epochs 1 \
                     --lr 0.01 --imprint-hold-tail" \
        --only dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2-stem_blocks2 \
               dct-drop4-clip_norm12-noise_multiplier0.01-frequency_gamma2-stem_blocks2 \
               dct-drop4-clip_norm12-noise_multiplier0.02-frequency_gamma2-stem_blocks2

and from the plain student distilled by function matching on 16 views a face for 150 epochs, its noise-aware
start on 16 views too (`python -m research.views_table --recipes 16:150` measures both starts):

    python research/frontier.py --data LFW --start distilled --out results/frontier-distilled-student150-views16 \
        --demo-args "--threads 1 --student-epochs 150 --student-views 16 --noise-aware-epochs 60 \
                     --noise-aware-views 16 --head-lr-scale 10 --imprint-epochs 1 --lr 0.01" \
        --only dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2-stem_blocks2

and as run.sh trains now: from that plain student with its noise-aware start distilled on 16 views
for 150 epochs, the server's tail held while its head is imprinted, each release's embedding averaged with its mirror
image's in training and at test (`--mirror-average --mirror-train`, which the undefended point's conv1 release has no
mirror for: its server embeds each release once):

    python research/frontier.py --data LFW --start distilled \
        --out results/frontier-distilled-student150-views16-noiseaware150-hold-mirror-train \
        --demo-args "--threads 1 --student-epochs 150 --student-views 16 --noise-aware-epochs 150 \
                     --noise-aware-views 16 --head-lr-scale 10 --imprint-epochs 1 --lr 0.01 --imprint-hold-tail \
                     --mirror-average --mirror-train" \
        --only dct-drop4-clip_norm12-noise_multiplier0.005-frequency_gamma2-stem_blocks2 \
               dct-drop4-clip_norm12-noise_multiplier0.02-frequency_gamma2-stem_blocks2
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from splitface.common.options import add_data_root_arg, add_model_arg, add_model_args, add_training_args, model_argv
from splitface.device.trainer import initial_layer  # noqa: E402
from splitface.common.models import ModelSpec  # noqa: E402
from research.audit.cli import headline  # noqa: E402
from splitface.server.cli import add_record_max_arg  # noqa: E402
from research.demo import run_recorded, same_arguments  # noqa: E402
from research.results import write_json, write_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# (transform, params, splitface-research demo arguments): the undefended point first, the reference for relative accuracy
POINTS: list[tuple[str, dict, list[str]]] = [
    ("none", {}, []),
    ("per-activation", {"epsilon": 3}, ["--mechanism", "per-activation", "--epsilon", "3"]),
    ("per-activation", {"epsilon": 10}, ["--mechanism", "per-activation", "--epsilon", "10"]),
    ("bottleneck", {"channels": 4, "stride": 2},
     ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2"]),
    *(("bottleneck", {"channels": 4, "stride": 2, "clip_norm": 16, "noise_multiplier": z},
       ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2",
        "--mechanism", "per-image", "--clip-norm", "16", "--noise-multiplier", f"{z:g}"])
      for z in (0.01, 0.02, 0.05)),
    ("dct", {"drop": 4}, ["--release", "dct", "--split", "layer2", "--dct-drop", "4"]),
    ("dct", {"drop": 4, "keep": 36}, ["--release", "dct", "--split", "layer2", "--dct-drop", "4", "--dct-keep", "36"]),
    # DCT with per-image clipping and noise (DCTDP-style, uniform over the released frequencies): the device trains
    # nothing, so the per-image guarantee is not voided by a trained layer. C = 8 clips ~10% of releases (median
    # norm 6.7 at 64 px); per value, z 0.0025 / 0.005 put the noise power at ~0.4x / 1.7x
    # the signal's (the bottleneck points' z 0.01 / 0.02 are at ~0.4x / 1.6x if clipped)
    *(("dct", {"drop": 4, "clip_norm": 8, "noise_multiplier": z},
       ["--release", "dct", "--split", "layer2", "--dct-drop", "4",
        "--mechanism", "per-image", "--clip-norm", "8", "--noise-multiplier", f"{z:g}"])
      for z in (0.0025, 0.005)),
    # DCTDP-style noise per frequency: frequency (u, v) gets z C / ((1+u+v)/3)^gamma (transforms/dct.py), so the low
    # frequencies that carry a face's look get more noise and the mid ones less, at the same per-image epsilon as
    # uniform noise of the same z. C ~ 1.26x the median weighted norm of public faces, as C = 8 is for gamma 0.
    *(("dct", {"drop": 4, "clip_norm": c, "noise_multiplier": z, "frequency_gamma": g},
       ["--release", "dct", "--split", "layer2", "--dct-drop", "4", "--mechanism", "per-image",
        "--clip-norm", f"{c:g}", "--noise-multiplier", f"{z:g}", "--frequency-gamma", f"{g:g}"])
      for g, c, z in ((2, 12, 0.005), (3, 20, 0.005), (2, 12, 0.01), (2, 12, 0.02))),
    # the main job's release as it is, read by a deeper server stage: two residual blocks after the stage's conv
    # (--dct-stem-blocks; the device and what it releases are unchanged). The stage stands in for every device
    # stage up to the cut, which one conv did poorly
    # (and at twice and four times its noise: measured from the distilled start, whether a stronger start buys more
    # noise; a whole run from scratch, with no --only, trains them too)
    *(("dct", {"drop": 4, "clip_norm": 12, "noise_multiplier": z, "frequency_gamma": 2, "stem_blocks": 2},
       ["--release", "dct", "--split", "layer2", "--dct-drop", "4", "--mechanism", "per-image", "--clip-norm", "12",
        "--noise-multiplier", f"{z:g}", "--frequency-gamma", "2", "--dct-stem-blocks", "2"])
      for z in (0.005, 0.01, 0.02)),
    # NoPeek: the devices train the bottleneck with a distance-correlation penalty between their images and their
    # releases (splitface/device/privacy/nopeek.py); weight 5 puts the penalty's gradient at about the size of the
    # server's cross-entropy gradient on the device layer at the start (weight 1 at a fifth of it). Alone, and with the
    # noise of the nearest point.
    *(("nopeek", {"channels": 4, "stride": 2, "weight": w},
       ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2", "--nopeek-weight", f"{w:g}"])
      for w in (5, 1)),
    ("nopeek", {"channels": 4, "stride": 2, "weight": 5, "clip_norm": 16, "noise_multiplier": 0.01},
     ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2", "--nopeek-weight", "5",
      "--mechanism", "per-image", "--clip-norm", "16", "--noise-multiplier", "0.01"]),
    # the bottleneck's device part pre-trained against a decoder and an identity matcher (research/ressfl.py),
    # then run frozen with those published weights: the audit attacks it white-box with fresh attackers
    *(("ressfl", {"channels": 4, "stride": 2, "lambda_rec": r, "lambda_id": i},
       ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2", "{pretrained}"])
      for r, i in ((10, 2), (30, 10))),
    # noise-aware public pre-training: the same bottleneck pre-trained on public faces (no adversary) on releases
    # clipped and noised as the devices will noise them (z 0.05, the stronger noise of the plain bottleneck points);
    # the first is the reference of the pre-trained points
    ("public-pretrained", {"channels": 4, "stride": 2, "lambda_rec": 0, "lambda_id": 0},
     ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2", "{pretrained}"]),
    *(("public-pretrained", {"channels": 4, "stride": 2, "lambda_rec": 0, "lambda_id": 0, "clip_norm": 16,
                             "noise_multiplier": z},
       ["--release", "bottleneck", "--bottleneck-channels", "4", "--bottleneck-stride", "2",
        "--mechanism", "per-image", "--clip-norm", "16", "--noise-multiplier", f"{z:g}", "{pretrained}"])
      for z in (0.05,)),
    # FaceMAE: the device releases its image with 75% of its 8 px patches zeroed; the server fills them in with an
    # MAE pre-trained on public faces with the IRM loss (research/facemae.py), frozen, and trains on that
    ("facemae", {"ratio": 0.75, "patch": 8, "lambda_irm": 1}, ["--release", "mask", "{facemae}"]),
    ("facemae", {"ratio": 0.9, "patch": 8, "lambda_irm": 1}, ["--release", "mask", "--mask-ratio", "0.9", "{facemae}"]),
]

# what a point's "{pretrained}" stands for: the devices load the attacker-aware weights, frozen, and the server's
# tail starts from the same file. "{facemae}": the server starts from the file holding the pre-trained MAE (the
# device has no weights). Each: (the pre-training's command, its point params passed on, its demo arguments).
PRETRAINED_ARGS = ["--device-weights", "{weights}", "--layer-training", "frozen", "--server-init", "{weights}"]
PRETRAININGS = {
    "{pretrained}": (["research.ressfl"], ("lambda_rec", "lambda_id", "lambda_dcor", "clip_norm", "noise_multiplier"),
                     PRETRAINED_ARGS),
    "{facemae}": (["research.facemae", "pretrain"], ("lambda_irm",), ["--server-init", "{weights}"]),
}


def point_name(transform: str, params: dict) -> str:
    return "-".join([transform, *(f"{k}{v:g}" for k, v in params.items())])


# A point whose server tail (and device part) starts from a public pre-training is compared with the same
# pre-trained model trained without a defence; every other point with the undefended run (POINTS[0]).
PRETRAINED_REFERENCE = point_name("public-pretrained", {"channels": 4, "stride": 2, "lambda_rec": 0, "lambda_id": 0})


def reference_of(demo_args: list[str], undefended: str) -> str:
    return PRETRAINED_REFERENCE if "{pretrained}" in demo_args else undefended


def pretrained_weights(name: str, params: dict, demo_args: list[str], args: argparse.Namespace,
                       placeholder: str = "{pretrained}") -> Path:
    """The point's pre-trained weights: the attacker-aware device part (`splitface-research ressfl`) or the
    FaceMAE reconstruction (`splitface-research facemae pretrain`), made once and kept (re-made when its
    settings differ or with --force)."""
    module, passed, _ = PRETRAININGS[placeholder]
    weights = args.out / "pretrained" / f"{name}.pt"
    recorded = weights.with_suffix(".args.json")
    # e.g. the adversary's weights and the devices' noise: the pre-training sees the releases the devices will make
    lambdas = [f"--{k.replace('_', '-')}={v:g}" for k, v in params.items() if k in passed]
    model = argparse.ArgumentParser(add_help=False)
    add_model_args(model)
    known, _ = model.parse_known_args(["--model", args.model, *demo_args])
    extra = args.pretrain_args if placeholder == "{pretrained}" else args.facemae_args
    cmd = ["--data", str(args.data), *model_argv(known), *lambdas, *extra.split()]
    if weights.exists() and recorded.exists() and same_arguments(json.loads(recorded.read_text()), cmd) and not args.force:
        return weights
    weights.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", *module, "--out", str(weights), *cmd], check=True)
    recorded.write_text(json.dumps(cmd))
    return weights


def point_args(name: str, params: dict, demo_args: list[str], args: argparse.Namespace) -> list[str]:
    """The point's splitface-research demo arguments, with "{pretrained}" or "{facemae}" made real."""
    placeholder = next((a for a in demo_args if a in PRETRAININGS), None)
    if placeholder is None:
        return demo_args
    weights = str(pretrained_weights(name, params, [a for a in demo_args if a != placeholder], args,
                                     placeholder).resolve())
    return [b for a in demo_args for b in ([x.format(weights=weights) for x in PRETRAININGS[placeholder][2]]
                                           if a == placeholder else [a])]


def run_point(name: str, demo_args: list[str], args: argparse.Namespace, seed: int = 0) -> dict:
    """Train (or read back) the point at `seed` and score it on View 1; seed 0's run is the one audited, the
    others (runs/<point>-seed<k>) only add accuracy replicates."""
    run_dir = args.out / "runs" / (name if seed == 0 else f"{name}-seed{seed}")
    start = ["--init", "distilled"] if args.start == "distilled" else []
    results = run_recorded(run_dir, ["--data", str(args.data), "--model", args.model, "--epochs", str(args.epochs),
                                     "--people", "devtrain", "--record-max", str(args.record_max), *start, *demo_args,
                                     *args.demo_args.split(), *(["--seed", str(seed)] if seed else [])], args.force)
    view1 = run_dir / "view1.json"
    pairs = args.view1_limit or 1000
    if not view1.exists() or args.force or json.loads(view1.read_text())["pairs"] != pairs:
        limit = ["--limit", str(args.view1_limit)] if args.view1_limit else []
        subprocess.run([sys.executable, "-m", "research", "evaluate", str(run_dir), "--data", str(args.data), *limit],
                       check=True)
    return {"results": results, "view1": json.loads(view1.read_text())}


def audit(names: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """The audit's headline of each point. Points audited before (with --only: the ones not run now) go to the
    audit too, which reads their kept reports back, so that its own summary, table and figures keep every point."""
    out = args.out / "audit"
    runs = [n for t, params, _ in POINTS for n in [point_name(t, params)]
            if n in names or (not args.force and (out / f"{n}.json").exists())]
    cmd = [sys.executable, "-m", "research.audit.cli", *(str(args.out / "runs" / n) for n in runs),
           "--data", str(args.data), "--out", str(out), *([] if args.force else ["--resume"]), *args.audit_args.split()]
    subprocess.run(cmd, check=True)
    # each point's own report, not the audit's summary.json, which another frontier run may be rewriting
    return {n: headline(json.loads((out / f"{n}.json").read_text())) for n in names}


def retrieval_risks(names: list[str], transforms: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """FaceMAE's retrieval risk R(A, S, K) of each facemae point's server-side reconstructions
    (`splitface-research facemae risk`), computed once per run and kept beside it."""
    risks = {}
    for name, transform in zip(names, transforms):
        if transform != "facemae":
            continue
        run_dir = args.out / "runs" / name
        path = run_dir / "retrieval_risk.json"
        if not path.exists() or args.force:
            subprocess.run([sys.executable, "-m", "research.facemae", "risk", str(run_dir), "--data", str(args.data),
                            "--out", str(path), "--threads", "2"], check=True)
        risks[name] = json.loads(path.read_text())
    return risks


def accuracies(outcomes: dict[int, dict]) -> dict[int, tuple[float, float]]:
    """seed -> (LFW-158 test accuracy after the last epoch, View 1 accuracy)."""
    return {s: (o["results"]["epochs"][-1]["test_acc"], o["view1"]["view1_accuracy"]) for s, o in outcomes.items()}


def relative(point: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """The point's mean accuracies over its seeds that the reference also has, over the reference's mean on those
    same seeds: a lucky or unlucky reference seed (0.415 and 0.635 test accuracy for seeds 0 and 1 of the
    undefended run) then moves both sides alike."""
    seeds = sorted(set(point) & set(reference))
    mean = lambda acc, i: sum(acc[s][i] for s in seeds) / len(seeds)  # noqa: E731
    return mean(point, 0) / mean(reference, 0), mean(point, 1) / mean(reference, 1)


def row(transform: str, params: dict, outcome: dict, attack: dict, reference: str,
        seeds: dict[int, tuple[float, float]], reference_seeds: dict[int, tuple[float, float]],
        start: str = "scratch") -> dict:
    """One point of the frontier, with the keys the issue names. Accuracies are means over `seeds` (seed 0 is the
    audited run); the privacy figures, costs and View 1's 10-fold std (`view1_std`) are seed 0's."""
    results, view1 = outcome["results"], outcome["view1"]
    last = results["epochs"][-1]
    config = results["config"]
    samples = config["train_images"]   # training releases per epoch: bytes_sent counts those
    relative_test, relative_view1 = relative(seeds, reference_seeds)
    return {"transform": transform, "params": params, "run": attack["run"], "reference": reference, "start": start,
            "seeds": sorted(seeds), "test_accuracy_seeds": [seeds[s][0] for s in sorted(seeds)],
            "view1_accuracy_seeds": [seeds[s][1] for s in sorted(seeds)],
            "test_accuracy": sum(a for a, _ in seeds.values()) / len(seeds), "relative_accuracy": relative_test,
            "view1_accuracy": sum(v for _, v in seeds.values()) / len(seeds), "view1_std": view1["view1_std"],
            "view1_pairs": view1["pairs"], "relative_view1_accuracy": relative_view1,
            "roc_auc": view1["roc_auc"], "tar_at_far_1e-2": view1["tar_at_far_1e-2"],
            "pixel_linkage": attack["linkage_pixels"], "pixel_linkage_chance": attack["linkage_pixels_chance"],
            "identity_r1": attack["identity_r1"], "identity_r1_chance": attack["identity_r1_chance"],
            "recognizer_clean_r1": attack["recognizer_clean_r1"], "informative": attack["informative"],
            "attack": attack["identity_attack"], "identity_matching_r1": attack["identity_matching_r1"],
            **{k: attack[k] for k in ("reconstruction_identity_r1", "reconstruction_identity_r1_chance",
                                      "model_identity_r1", "model_identity_r1_chance")},
            "per_image_epsilon": None if math.isinf(last["epsilon_image_max"]) else last["epsilon_image_max"],
            "guarantee_void": results["devices"][0]["privacy"].get("guarantee_void", False),
            "device_ms": 1e3 * last["device_s_per_batch"], "device_batch_size": config["batch_size"],
            "device_macs": device_macs(config),
            "wire_bytes": last["bytes_sent"] / samples}


GOAL = {"relative_accuracy": 0.9, "pixel_linkage": 0.01, "identity_x_chance": 2.0, "recognizer_clean_r1": 0.9}


def best_point(rows: list[dict]) -> dict:
    """The main job's default: the most private point (identity R@1 / chance, then pixel linkage) among
    those that keep the goal's relative accuracy on both LFW classification and View 1; with none
    defended that far, the undefended point. `meets_goal` says whether it reaches the whole goal."""
    def private(r: dict) -> tuple:
        return r["identity_r1"] / r["identity_r1_chance"], r["pixel_linkage"]

    useful = [r for r in rows if min(r["relative_accuracy"], r["relative_view1_accuracy"]) >= GOAL["relative_accuracy"]]
    best = min(useful, key=private) if useful else rows[0]
    meets = (best in useful and best["pixel_linkage"] <= GOAL["pixel_linkage"]
             and private(best)[0] <= GOAL["identity_x_chance"] and best["recognizer_clean_r1"] >= GOAL["recognizer_clean_r1"])
    return {"run": best["run"], "transform": best["transform"], "params": best["params"], "meets_goal": meets,
            "goal": GOAL, "identity_x_chance": private(best)[0], "pixel_linkage": best["pixel_linkage"],
            "relative_accuracy": best["relative_accuracy"], "relative_view1_accuracy": best["relative_view1_accuracy"]}


def device_macs(config: dict) -> int:
    """Multiply-accumulates of the device part for one image (torch's flop counter: 2 flops per MAC)."""
    spec = ModelSpec.from_dict(config["model"])
    layer = initial_layer(spec, config["split"], seed=0).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(torch.zeros(1, 3, spec.input_size, spec.input_size))
    return counter.get_total_flops() // 2


START_TEXT = {"scratch": "seeded weights (from scratch)",
              "distilled": "the public start distilled from dlib's recognizer (research/distill.py), noise-aware for "
                           "each point's release"}


def kind(r: dict, which: str) -> str:
    """One half of the split identity figure, with its chance ('-' in rows audited before the split)."""
    if f"{which}_identity_r1" not in r:
        return "-"
    return f"{r[f'{which}_identity_r1']:.3f} ({r[f'{which}_identity_r1_chance']:.3f})"


def table(rows: list[dict], config: dict) -> str:
    pairs = rows[0]["view1_pairs"]
    lines = [f"Configuration: {config['model']['family']} (width {config['model']['width']}, depth "
             f"{config['model']['depth']}) at "
             f"{config['model']['input_size']}x{config['model']['input_size']}, {config['num_classes']} identities "
             f"(View 1 DevTrain people with >= 10 images; {config['train_images']} train / {config['test_images']} test "
             f"images), {config['num_devices']} devices, {config['epochs']} epochs. View 1: {pairs:,} DevTest pairs of unseen "
             "people. Identity R@1: the strongest attack's, against chance (shuffled gallery identities). Relative "
             "accuracies are against the undefended run, except for points marked *, which start from a public "
             f"pre-training (research/ressfl.py) and are compared with {PRETRAINED_REFERENCE}: the same pre-trained "
             "model without noise or adversary. Accuracies are means over the seeds listed, relative to the "
             "reference's mean over the same seeds; the privacy figures and costs are seed 0's run, the one audited. "
             f"Start: {START_TEXT[rows[0].get('start', 'scratch')]}. The identity figure split by what it means: "
             "seen = dlib on the best reconstructions (what a curious server can see); recognised = the best of a "
             "matcher trained on releases and the server's own model (what it can recognise: the task itself).",
             "",
             "| transform | params | seeds | test acc (rel.) | View 1 acc (rel.) | pixel linkage (chance) | identity R@1 "
             "(chance) | x chance | strongest attack | seen: R@1 (chance) | recognised: R@1 (chance) | dlib clean R@1 | "
             "per-image eps | device MMAC/image | device ms/batch | bytes up/image |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eps = "-" if r["per_image_epsilon"] is None else f"{r['per_image_epsilon']:.3g}" + (
            " (void: layer trained without DP)" if r["guarantee_void"] else "")
        lines.append(
            f"| {r['transform']}{'*' if r['reference'] != rows[0]['run'] else ''} | {json.dumps(r['params'])} | "
            f"{','.join(map(str, r.get('seeds', [0])))} | {r['test_accuracy']:.3f} ({r['relative_accuracy']:.2f}) | "
            f"{r['view1_accuracy']:.3f} ({r['relative_view1_accuracy']:.2f}) | {r['pixel_linkage']:.3f} "
            f"({r['pixel_linkage_chance']:.3f}) | {r['identity_r1']:.3f} ({r['identity_r1_chance']:.3f}) | "
            f"{r['identity_r1'] / r['identity_r1_chance']:.1f} | {r['attack']} | {kind(r, 'reconstruction')} | "
            f"{kind(r, 'model')} | {r['recognizer_clean_r1']:.3f} | {eps} | "
            f"{r['device_macs'] / 1e6:.1f} | {r['device_ms']:.0f} | {r['wire_bytes']:,.0f} |")
    for r in rows:
        if "retrieval_risk" in r:
            k = r["retrieval_risk"]
            lines += ["", f"{r['transform']} {json.dumps(r['params'])}: FaceMAE's retrieval risk R(A,S,K) (dlib; A = "
                      f"{k['queries_A']} held-out photos of the recorded people, S = the server's MAE reconstructions of "
                      f"its {k['gallery_S']} recorded releases): R@1 {k['reconstructions_R@1']:.3f}, R@5 "
                      f"{k['reconstructions_R@5']:.3f} (chance {k['chance_R@1']:.3f} / {k['chance_R@5']:.3f}; S = the "
                      f"masked releases: {k['releases_R@1']:.3f} / {k['releases_R@5']:.3f}; S = the clean originals: "
                      f"{k['originals_R@1']:.3f} / {k['originals_R@5']:.3f})."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], config: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for transform in dict.fromkeys(r["transform"] for r in rows):
        points = sorted((r for r in rows if r["transform"] == transform), key=lambda r: r["identity_r1"])
        x = [r["identity_r1"] / r["identity_r1_chance"] for r in points]
        ax.plot(x, [r["relative_accuracy"] for r in points], marker="o", label=transform)
        for r, xi in zip(points, x):
            ax.annotate(json.dumps(r["params"]).strip("{}").replace('"', ""), (xi, r["relative_accuracy"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axvline(2, color="grey", ls="--", lw=1, label="goal: identity R@1 <= 2x chance")
    ax.axhline(0.9, color="grey", ls=":", lw=1, label="goal: relative accuracy >= 0.9")
    ax.set_xscale("log")
    ax.set_xlabel("identity R@1 / chance (strongest attack; lower = more private)")
    ax.set_ylabel("test accuracy relative to the undefended run")
    model = config["model"]
    ax.set_title(f"privacy frontier ({model['family']}-{model['depth']} width {model['width']}, {model['input_size']} px, "
                 f"{config['epochs']} epochs, {config['num_classes']} identities)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merged_rows(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """With --only, the rows of the points not run now are kept from the existing summary.json (points still in
    POINTS), so that a run of a few points updates the frontier instead of replacing it."""
    known = [point_name(t, params) for t, params, _ in POINTS]
    summary = args.out / "summary.json"
    if args.only is None or not summary.exists():
        return rows
    # rows written before rows named their reference were all relative to the undefended point
    kept = {r["run"]: {"reference": known[0], **r} for r in json.loads(summary.read_text()) if r["run"] in known}
    kept.update({r["run"]: r for r in rows})
    return sorted(kept.values(), key=lambda r: known.index(r["run"]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, required=True, help="LFW root (with View 1's people and pairs files)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "frontier")
    add_model_arg(p, "iresnet_small")
    add_training_args(p, epochs=3, batch_size=None, lr=None)
    add_record_max_arg(p, default=256)
    p.add_argument("--view1-limit", type=int, default=None, help="only this many View 1 pairs (smoke tests)")
    p.add_argument("--only", nargs="*", default=None,
                   help="run only these points (names as in summary.json); the other rows of summary.json are kept")
    p.add_argument("--force", action="store_true", help="re-train, re-evaluate and re-audit every point")
    p.add_argument("--start", choices=("scratch", "distilled"), default="scratch",
                   help="distilled: every point starts from the public start distilled from dlib's recognizer, "
                        "noise-aware for its release (splitface-research demo --init distilled; the undefended point is the "
                        "plain student, the reference of relative accuracy); points with a pre-training of their own "
                        "({pretrained}, {facemae}) are left out")
    p.add_argument("--accuracy-seeds", type=int, default=3,
                   help="train and score each point run now at seeds 0..K-1 (seed 0's run is the one audited): its "
                        "accuracies are the means, relative to the reference's mean over the same seeds")
    p.add_argument("--demo-args", default="--threads 1", help="more splitface-research demo arguments")
    p.add_argument("--audit-args", default="--threads 2 --substitute", help="more splitface-research audit arguments")
    p.add_argument("--pretrain-args", default="--epochs 4 --threads 2",
                   help="more arguments of the attacker-aware pre-training (splitface-research ressfl)")
    p.add_argument("--facemae-args", default="--epochs 3 --threads 2",
                   help="more arguments of the FaceMAE pre-training (splitface-research facemae pretrain)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only or [point_name(t, params) for t, params, _ in POINTS])
    if args.start == "distilled":
        wanted -= {point_name(t, params) for t, params, a in POINTS if any(x in PRETRAININGS for x in a)}
    if any("{pretrained}" in a for t, params, a in POINTS if point_name(t, params) in wanted):
        wanted.add(PRETRAINED_REFERENCE)
    points = [(t, params, a) for t, params, a in POINTS if point_name(t, params) in wanted or (t, params) == POINTS[0][:2]]
    names = [point_name(t, params) for t, params, _ in points]
    demo_args = [point_args(n, params, a, args) for n, (_, params, a) in zip(names, points)]
    outcomes = [run_point(n, a, args) for n, a in zip(names, demo_args)]
    attacks = audit(names, args)
    seeds = {n: accuracies({0: o, **{s: run_point(n, a, args, s) for s in range(1, args.accuracy_seeds)}})
             for n, a, o in zip(names, demo_args, outcomes)}
    rows = [row(t, params, o, attacks[n], reference_of(a, names[0]), seeds[n], seeds[reference_of(a, names[0])],
                args.start)
            for (t, params, a), n, o in zip(points, names, outcomes)]
    risks = retrieval_risks(names, [t for t, _, _ in points], args)
    for r in rows:
        if r["run"] in risks:
            r["retrieval_risk"] = risk = risks[r["run"]]
            # the server's own MAE reconstructions, named by dlib, are an attack the audit does not run: the
            # strongest attack is whichever names more people above its chance
            if risk["reconstructions_R@1"] / risk["chance_R@1"] > r["identity_r1"] / r["identity_r1_chance"]:
                r.update(identity_r1=risk["reconstructions_R@1"], identity_r1_chance=risk["chance_R@1"],
                         attack="server's MAE + dlib")
    rows = merged_rows(rows, args)
    best = best_point(rows)
    _, best_params, best_args = next(p for p in POINTS if point_name(*p[:2]) == best["run"])
    best["demo_args"] = point_args(best["run"], best_params, best_args, args)
    write_json(args.out / "best.json", best)
    write_summary(args.out, rows, table(rows, outcomes[0]["results"]["config"]))
    plot(rows, outcomes[0]["results"]["config"], args.out / "frontier.png")
    print(f"best point (the main job's default release): {best['run']} "
          f"({'meets' if best['meets_goal'] else 'does not meet'} the goal)")


if __name__ == "__main__":
    main()
