"""Command-line options shared by the project's programs, each declared once.

The device simulator, the edge server, the demo, the attacker-aware pre-training and the benches take
the same data, model, training and privacy options; they add them with these helpers, passing the
defaults that legitimately differ per program, and turn them back into objects (or into another
program's arguments) with the functions beside each declaration. The edge server may import this
module; nothing here imports the server.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

from .data import LFW_PEOPLE
from .models import DEFAULT_SPLIT, PRESETS, RELEASE_KEYS, ModelSpec, resolve_spec
from .optim import TrainConfig
from .privacy.discrete import DiscreteGaussianMechanism
from .privacy.engine import LAYER_TRAINING, PrivacyEngine
from .privacy.mechanisms import MECHANISMS, Mechanism, build_mechanism
from .privacy.planner import plan_per_image
from .transforms import RELEASES

NOISE = ("float", "discrete")  # --noise: how the per-image mechanism draws its noise
DATA_HELP = ("LFW root (holding images/<person>/...) or an ImageFolder with --image-folder; "
             "default: $SPLITFACE_DATA, ~/.cache/splitface/lfw, ./data/lfw")


# ---- data ---------------------------------------------------------------------------------

def add_data_root_arg(p: argparse.ArgumentParser, *, required: bool = False, default: Path | None = None,
                      help: str = DATA_HELP) -> None:
    """--data: the face data's root; a bench that runs on the shared copy passes it as its default."""
    typed = required or default is not None
    p.add_argument("--data", type=Path if typed else None, required=required, default=default, help=help)


def add_data_args(p: argparse.ArgumentParser) -> None:
    """--data and the selection of people and images in it, and the seed of the split."""
    add_data_root_arg(p)
    p.add_argument("--image-folder", action="store_true", help="--data is a plain <class>/<image> folder")
    p.add_argument("--min-images", type=int, default=10, help="LFW: people with at least this many images")
    p.add_argument("--max-identities", type=int, default=None, help="LFW: keep only the first K identities")
    p.add_argument("--max-images", type=int, default=None, help="LFW: only people with at most this many images")
    p.add_argument("--people", choices=LFW_PEOPLE, default="all",
                   help="LFW: everyone, or only View 1's DevTrain people (peopleDevTrain.txt), so that View 1's "
                        "test pairs are people the model never saw (python -m edge_server.evaluation)")
    add_seed_arg(p)


def add_seed_arg(p: argparse.ArgumentParser,
                 help: str = "seeds the data split, the shuffles and the initial weights") -> None:
    p.add_argument("--seed", type=int, default=0, help=help)


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


# ---- model --------------------------------------------------------------------------------

def add_model_arg(p: argparse.ArgumentParser, default: str = "vgg_face_small") -> None:
    p.add_argument("--model", default=default, help=f"preset ({', '.join(PRESETS)}) or a JSON model spec "
                                                    f"(default {default})")


def add_model_args(p: argparse.ArgumentParser, model: str = "vgg_face_small") -> None:
    """--model, the split and the release transform: what both sides must agree on."""
    add_model_arg(p, model)
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
    g.add_argument("--mask-ratio", type=float, default=0.75,
                   help="mask (FaceMAE): share of each image's patches zeroed before release")
    g.add_argument("--mask-patch", type=int, default=8, help="mask: side of the square patches, in pixels")


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


# ---- the devices -------------------------------------------------------------------------

def add_devices_args(p: argparse.ArgumentParser) -> None:
    """How many simulated devices, where the classifier lives, and whether they pipeline."""
    p.add_argument("--head", choices=("server", "device"), default="server")
    add_devices_arg(p)
    p.add_argument("--pipeline", action="store_true",
                   help="make batch n+1's release while batch n is at the server (its weights are one step stale; "
                        "the gradient is taken at them); server head, plain or frozen layer training")


def add_devices_arg(p: argparse.ArgumentParser, default: int = 2, help: str | None = None) -> None:
    """--devices: how many devices run at once (the load and hostile benches run more than the simulator)."""
    p.add_argument("--devices", type=int, default=default, help=help)


# ---- training -----------------------------------------------------------------------------

def add_training_args(p: argparse.ArgumentParser, *, epochs: int | None, batch_size: int | None, lr: float | None,
                      lr_help: str | None = None) -> None:
    """--epochs, --batch-size and --lr with this program's defaults; None leaves one out (the server trains as
    long as devices send, in their batches; a bench has no learning rate of its own)."""
    if epochs is not None:
        p.add_argument("--epochs", type=int, default=epochs)
    if batch_size is not None:
        p.add_argument("--batch-size", type=int, default=batch_size)
    if lr is not None:
        p.add_argument("--lr", type=float, default=lr, help=lr_help)


def add_optimizer_args(p: argparse.ArgumentParser, *, decay_steps: int = 0,
                       decay_help: str = "0: the device's whole run") -> None:
    """The rest of `TrainConfig` (the source paper's SGD with exponential decay)."""
    defaults = TrainConfig()
    p.add_argument("--momentum", type=float, default=defaults.momentum)
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--lr-decay", type=float, default=defaults.lr_decay,
                   help="lr is multiplied by this over --decay-steps steps")
    p.add_argument("--decay-steps", type=int, default=decay_steps, help=decay_help)
    p.add_argument("--head-lr-scale", type=float, default=defaults.head_lr_scale,
                   help="the classifier's lr over the rest's (fine-tuning a pre-trained start: e.g. 10)")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of `add_training_args` + `add_optimizer_args` + --seed."""
    return TrainConfig(args.lr, args.momentum, args.weight_decay, args.lr_decay, args.decay_steps, args.seed,
                       args.head_lr_scale)


def add_threads_arg(p: argparse.ArgumentParser, default: int = 0,
                    help: str = "torch CPU threads (0: torch's choice)") -> None:
    p.add_argument("--threads", type=int, default=default, help=help)


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)


# ---- privacy ------------------------------------------------------------------------------

def add_clip_norm_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: float = 1.0) -> None:
    p.add_argument("--clip-norm", type=float, default=default, help="per-image: L2 clip C of each image's release")


def add_noise_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, clip_norm: float = 1.0,
                   noise_multiplier: float | None = None,
                   noise_help: str = "per-image: noise std / clip norm") -> None:
    """The per-image mechanism's clip norm C and noise multiplier z (std z C)."""
    add_clip_norm_arg(p, clip_norm)
    p.add_argument("--noise-multiplier", type=float, default=noise_multiplier, help=noise_help)


def add_privacy_args(p: argparse.ArgumentParser) -> None:
    """What the device does to its releases, how its layer learns, and its budget (docs/privacy.md)."""
    g = p.add_argument_group("privacy (see docs/privacy.md)")
    g.add_argument("--mechanism", choices=MECHANISMS, default="none")
    g.add_argument("--epsilon", type=float, default=None, help="per-activation: the paper's epsilon for each value")
    g.add_argument("--delta", type=float, default=1e-5)
    add_noise_args(g)
    g.add_argument("--frequency-gamma", type=float, default=0.0,
                   help="per-image with --release dct: noise per frequency (u, v) as z C / ((1+u+v)/(1+u0+v0))^gamma "
                        "(DCTDP-style; 0: uniform); same epsilon")
    g.add_argument("--noise", choices=NOISE, default="float",
                   help="per-image: float draws the Gaussian in floating point (torch, keyed per release); discrete "
                        "releases int8 integers with exact discrete Gaussian noise (rho-zCDP, docs/privacy.md)")
    g.add_argument("--quant-step", type=float, default=None,
                   help="--noise discrete: the public quantisation step of the int8 release (default clip norm / 127)")
    g.add_argument("--target-epsilon", type=float, default=None,
                   help="per-image: plan the noise so each image's releases over the run compose to this epsilon")
    g.add_argument("--layer-training", choices=LAYER_TRAINING, default="plain",
                   help="plain voids per-image guarantees; frozen (public weights) or dpsgd keep them")
    g.add_argument("--dpsgd-clip", type=float, default=1.0)
    g.add_argument("--dpsgd-noise", type=float, default=1.0)
    g.add_argument("--nopeek-weight", type=float, default=0.0,
                   help="plain: weight of NoPeek's distance-correlation penalty between images and releases in the "
                        "layer's loss (0: none; a defence the audit measures, no guarantee)")
    g.add_argument("--budget-epsilon", type=float, default=math.inf, help="refuse releases past this epsilon")
    g.add_argument("--budget-level", choices=("image", "identity"), default="image")
    g.add_argument("--device-weights", type=Path, default=None, help="a saved backbone for the device layer")


def discrete_mechanism(args: argparse.Namespace) -> DiscreteGaussianMechanism:
    """--noise discrete: the per-image mechanism's clip norm and noise multiplier, exact on the integers."""
    if args.mechanism != "per-image":
        raise ValueError(f"--noise discrete is the per-image mechanism's exact form: give --mechanism per-image "
                         f"(not {args.mechanism})")
    if args.frequency_gamma:
        raise ValueError("--frequency-gamma shapes the float Gaussian's noise; --noise discrete has no such option")
    if args.noise_multiplier is None:
        raise ValueError("--noise discrete needs --noise-multiplier (--target-epsilon plans the float Gaussian's "
                         "noise by PLD, which does not hold for the discrete one)")
    return DiscreteGaussianMechanism(args.clip_norm, args.noise_multiplier, args.quant_step)


def release_mechanism(args: argparse.Namespace, releases_per_image: int | None = None) -> Mechanism:
    """The mechanism of `add_privacy_args`; --target-epsilon is planned over `releases_per_image` releases (a
    caller that cannot know them, such as a noise-aware pre-training, passes None and gets an error instead)."""
    noise_multiplier = args.noise_multiplier
    try:
        if args.mechanism == "per-image" and args.target_epsilon is not None:
            if releases_per_image is None:
                raise ValueError("--target-epsilon plans the noise over a run's releases; give --noise-multiplier")
            noise_multiplier = plan_per_image(args.target_epsilon, args.delta, releases_per_image)
        if args.noise == "discrete":
            return discrete_mechanism(args)
        return build_mechanism(args.mechanism, epsilon=args.epsilon, delta=args.delta, clip_norm=args.clip_norm,
                               noise_multiplier=noise_multiplier, frequency_gamma=args.frequency_gamma)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def privacy_engines(args: argparse.Namespace, releases_per_image: int) -> Callable[[], PrivacyEngine]:
    """A factory of the options of `add_privacy_args`: every device gets the same settings and its own secret
    (from the OS CSPRNG, or from its state file)."""
    mechanism = release_mechanism(args, releases_per_image)
    return lambda: PrivacyEngine(mechanism, delta=args.delta, budget_epsilon=args.budget_epsilon,
                                 budget_level=args.budget_level, layer_training=args.layer_training,
                                 dpsgd_clip=args.dpsgd_clip, dpsgd_noise=args.dpsgd_noise,
                                 nopeek_weight=args.nopeek_weight)
