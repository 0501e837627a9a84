"""`splitface-sim`: run N simulated devices against a running edge server."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import torch

from .data import LFW_PEOPLE, DataSplit, find_lfw_root, load_image_folder, load_lfw
from .engine import LAYER_TRAINING, PrivacyConfig
from .models import DEFAULT_SPLIT, PRESETS, RELEASE_KEYS, ModelSpec, resolve_spec
from .optim import TrainConfig
from .privacy.mechanisms import NoNoise, PerActivationGaussian, PerImageGaussian
from .privacy.planner import plan_per_image
from .runtimes import BACKENDS
from .simulator import SimConfig, simulate
from .transforms import RELEASES


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None,
                   help="LFW root (holding images/<person>/...) or an ImageFolder with --image-folder; "
                        "default: $SPLITFACE_DATA, ~/.cache/splitface/lfw, ./data/lfw")
    p.add_argument("--image-folder", action="store_true", help="--data is a plain <class>/<image> folder")
    p.add_argument("--min-images", type=int, default=10, help="LFW: people with at least this many images")
    p.add_argument("--max-identities", type=int, default=None, help="LFW: keep only the first K identities")
    p.add_argument("--max-images", type=int, default=None, help="LFW: only people with at most this many images")
    p.add_argument("--people", choices=LFW_PEOPLE, default="all",
                   help="LFW: everyone, or only View 1's DevTrain people (peopleDevTrain.txt), so that View 1's "
                        "test pairs are people the model never saw (python -m edge_server.evaluation)")
    p.add_argument("--seed", type=int, default=0)


def data_argv(args: argparse.Namespace) -> list[str]:
    """The data options of `add_data_args` as command-line arguments again: hands the same selection to
    another program (the demo to the simulator)."""
    argv = ["--min-images", str(args.min_images), "--seed", str(args.seed), "--people", args.people]
    if args.data:
        argv += ["--data", str(args.data)]
    if args.image_folder:
        argv.append("--image-folder")
    if args.max_identities is not None:
        argv += ["--max-identities", str(args.max_identities)]
    if args.max_images is not None:
        argv += ["--max-images", str(args.max_images)]
    return argv


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vgg_face_small", help=f"preset ({', '.join(PRESETS)}) or a JSON model spec")
    p.add_argument("--split", default=DEFAULT_SPLIT, help="last stage that runs on the device (default: conv1)")
    p.add_argument("--release-pool", type=int, default=1,
                   help="average-pool the device's output k x k before release (server upsamples back)")
    g = p.add_argument_group("release transform (device_sdk/transforms; both sides must agree)")
    g.add_argument("--release", choices=RELEASES, default="none",
                   help="bottleneck: 1x1 conv + tanh after the split; dct: the image's 8x8 block DCT instead of "
                        "the device stages, at the split's spatial size (the server continues after the split)")
    g.add_argument("--bottleneck-channels", type=int, default=8, help="bottleneck: channels released")
    g.add_argument("--bottleneck-stride", type=int, default=1, help="bottleneck: stride of its 1x1 conv")
    g.add_argument("--dct-drop", type=int, default=1,
                   help="dct: lowest zig-zag frequencies of each colour not released (1: the DC only; 0: none)")
    g.add_argument("--dct-keep", type=int, default=0,
                   help="dct: release a random subset of this many channels per image, the others zeroed (0: all)")


MODEL_OPTIONS = RELEASE_KEYS  # the spec keys set by options of their own


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The --model preset or JSON spec, with the release options that differ from their defaults applied."""
    spec = resolve_spec(json.loads(args.model) if args.model.lstrip().startswith("{") else args.model)
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    changes = {k: getattr(args, k) for k in MODEL_OPTIONS if getattr(args, k) != defaults[k]}
    return replace(spec, **changes) if changes else spec


def model_argv(args: argparse.Namespace) -> list[str]:
    """The options of `add_model_args` as command-line arguments again (the demo hands them to both sides)."""
    argv = ["--model", args.model, "--split", args.split]
    for k in MODEL_OPTIONS:
        argv += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return argv


def add_privacy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("privacy (see docs/privacy.md)")
    g.add_argument("--mechanism", choices=("none", "per-activation", "per-image"), default="none")
    g.add_argument("--epsilon", type=float, default=None, help="per-activation: the paper's epsilon for each value")
    g.add_argument("--delta", type=float, default=1e-5)
    g.add_argument("--clip-norm", type=float, default=1.0, help="per-image: L2 clip of each image's release")
    g.add_argument("--noise-multiplier", type=float, default=None, help="per-image: noise std / clip norm")
    g.add_argument("--target-epsilon", type=float, default=None,
                   help="per-image: plan the noise so each image's releases over the run compose to this epsilon")
    g.add_argument("--layer-training", choices=LAYER_TRAINING, default="plain",
                   help="plain voids per-image guarantees; frozen (public weights) or dpsgd keep them")
    g.add_argument("--dpsgd-clip", type=float, default=1.0)
    g.add_argument("--dpsgd-noise", type=float, default=1.0)
    g.add_argument("--budget-epsilon", type=float, default=math.inf, help="refuse releases past this epsilon")
    g.add_argument("--budget-level", choices=("image", "identity"), default="image")
    g.add_argument("--device-weights", type=Path, default=None, help="a saved backbone for the device layer")


def privacy_config(args: argparse.Namespace, releases_per_image: int) -> Callable[[], PrivacyConfig]:
    """A factory: every device gets the same settings and its own secret."""
    if args.mechanism == "per-activation":
        if args.epsilon is None:
            raise SystemExit("--mechanism per-activation needs --epsilon")
        mechanism = PerActivationGaussian(args.epsilon, args.delta)
    elif args.mechanism == "per-image":
        z = args.noise_multiplier
        if args.target_epsilon is not None:
            z = plan_per_image(args.target_epsilon, args.delta, releases_per_image)
        if z is None:
            raise SystemExit("--mechanism per-image needs --noise-multiplier or --target-epsilon")
        mechanism = PerImageGaussian(args.clip_norm, z)
    else:
        mechanism = NoNoise()
    return lambda: PrivacyConfig(mechanism, args.delta, args.budget_epsilon, args.budget_level, args.layer_training,
                                 args.dpsgd_clip, args.dpsgd_noise)


def data_selection(args: argparse.Namespace) -> dict:
    """The data arguments, as recorded in a run's results (the audit reloads the same images with them)."""
    return {"image_folder": args.image_folder, "min_images": args.min_images, "max_identities": args.max_identities,
            "max_images": args.max_images, "people": args.people, "seed": args.seed}


def load_selection(root: str | Path | None, selection: dict) -> DataSplit:
    """The data a run trained on, from its recorded `data_selection` (runs from before --people have no
    "people": they used everyone)."""
    if selection["image_folder"]:
        return load_image_folder(root, seed=selection["seed"])
    return load_lfw(find_lfw_root(root), min_images=selection["min_images"], seed=selection["seed"],
                    max_identities=selection["max_identities"], max_images=selection["max_images"],
                    people=selection.get("people", "all"))


def load_data(args: argparse.Namespace) -> DataSplit:
    if args.image_folder and not args.data:
        raise SystemExit("--image-folder needs --data PATH")
    return load_selection(args.data, data_selection(args))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-sim", description=__doc__)
    p.add_argument("--server", default="ws://127.0.0.1:8765")
    p.add_argument("--tokens", type=Path, required=True, help="JSON of device id -> token (from `splitface-server tokens`)")
    add_data_args(p)
    add_model_args(p)
    p.add_argument("--head", choices=("server", "device"), default="server")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--partition", choices=("iid", "identity"), default="iid")
    p.add_argument("--crop", type=int, default=160, help="centre crop in pixels before resizing (LFW faces are central)")
    p.add_argument("--activation-encoding", choices=("f32", "f16", "i8"), default="f32")
    p.add_argument("--gradient-encoding", choices=("f32", "f16", "i8"), default="f32")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-decay", type=float, default=0.1)
    p.add_argument("--decay-steps", type=int, default=0, help="0: the device's whole run")
    p.add_argument("--results", type=Path, default=Path("runs/sim/results.json"))
    p.add_argument("--reconnect-timeout", type=float, default=120.0)
    p.add_argument("--ca-file", type=Path, default=None,
                   help="CA certificates (PEM) trusted for a wss:// server; host names are checked (default: the system's)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain ws:// to a server off loopback: the device's token then travels in clear")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="what runs the device layer: eager PyTorch, ExecuTorch (XNNPACK release + portable training "
                        "program) or ONNX Runtime (see export/README.md)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="exported device programs for --backend (default: <results dir>/artifacts, exported there "
                        "and verified on first use)")
    p.add_argument("--no-progress", action="store_true")
    add_privacy_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_data(args)
    spec = model_spec(args)
    config = SimConfig(
        url=args.server, spec=spec, split=args.split, head=args.head, num_devices=args.devices, epochs=args.epochs,
        batch_size=args.batch_size, partition=args.partition, crop=args.crop,
        encodings={"activations": args.activation_encoding, "gradients": args.gradient_encoding},
        train=TrainConfig(args.lr, args.momentum, args.weight_decay, args.lr_decay, args.decay_steps, args.seed),
        seed=args.seed, results=args.results, progress=not args.no_progress, reconnect_timeout_s=args.reconnect_timeout,
        ca_file=args.ca_file, insecure=args.insecure, privacy=privacy_config(args, releases_per_image=args.epochs), device_weights=args.device_weights,
        backend=args.backend, artifacts=args.artifacts or args.results.parent / "artifacts", data=data_selection(args))
    tokens = json.loads(args.tokens.read_text())
    print(f"{len(data.class_names)} identities, {len(data.train)} train / {len(data.test)} test images; "
          f"{args.devices} devices, {args.head} head, {spec.family} {spec.input_size}px", flush=True)
    results = asyncio.run(simulate(config, data, tokens))
    for e in results["epochs"]:
        print(f"epoch {e['epoch']}: train acc {e['train_acc']:.3f} loss {e['train_loss']:.3f} | "
              f"test acc {e['test_acc']:.3f} loss {e['test_loss']:.3f} | "
              f"per-image epsilon <= {e['epsilon_image_max']:.3g} (delta {args.delta:g})", flush=True)
    for d in results["devices"]:
        if d["stopped"]:
            print(f"{d['device_id']} stopped early: {d['stopped']}", flush=True)
        if d["privacy"].get("guarantee_void"):
            print(f"{d['device_id']}: {d['privacy']['note']}", flush=True)
    print(f"results: {args.results}", flush=True)


if __name__ == "__main__":
    main()
