"""Command-line options shared by the project's programs, each declared once.

The device simulator, the edge server, the demo, the attacker-aware pre-training and the benches take
the same data, model and training options (the device's privacy options are in splitface/device/privacy/options.py); they add them with these helpers, passing the
defaults that legitimately differ per program, and turn them back into objects (or into another
program's arguments) with the functions beside each declaration. The edge server may import this
module; nothing here imports the server.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path

from splitface.common.data import LFW_PEOPLE, DataSplit, find_lfw_root, load_image_folder, load_lfw
from splitface.common.models import DEFAULT_SPLIT, LATER_KEYS, PRESETS, RELEASE_KEYS, ModelSpec, resolve_spec
from splitface.common.optim import TrainConfig
from splitface.common.transforms import RELEASES

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
                        "test pairs are people the model never saw (splitface-research evaluate)")
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


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number >= 0, refused as a usage error otherwise."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def add_model_args(p: argparse.ArgumentParser, model: str = "vgg_face_small") -> None:
    """--model, the split and the release transform: what both sides must agree on."""
    add_model_arg(p, model)
    p.add_argument("--split", default=DEFAULT_SPLIT, help="last stage that runs on the device (default: conv1)")
    p.add_argument("--release-pool", type=int, default=1,
                   help="average-pool the device's output k x k before release (server upsamples back)")
    g = p.add_argument_group("release transform (splitface/common/transforms; both sides must agree)")
    g.add_argument("--release", choices=RELEASES, default="none",
                   help="bottleneck: 1x1 conv + tanh after the split; dct: the image's 8x8 block DCT instead of "
                        "the device stages, at the split's spatial size (the server continues after the split)")
    g.add_argument("--bottleneck-channels", type=int, default=8, help="bottleneck: channels released")
    g.add_argument("--bottleneck-stride", type=int, default=1, help="bottleneck: stride of its 1x1 conv")
    g.add_argument("--dct-drop", type=int, default=1,
                   help="dct: lowest zig-zag frequencies of each colour not released (1: the DC only; 0: none)")
    g.add_argument("--dct-keep", type=int, default=0,
                   help="dct: release a random subset of this many channels per image, the others zeroed (0: all)")
    g.add_argument("--dct-stem-blocks", type=non_negative_int, default=0,
                   help="dct: residual blocks in the server's stage after its first conv (server side only; the "
                        "release is the same). Other releases ignore it, so that a default naming it can be "
                        "overridden by --release alone")
    g.add_argument("--mask-ratio", type=float, default=0.75,
                   help="mask (FaceMAE): share of each image's patches zeroed before release")
    g.add_argument("--mask-patch", type=int, default=8, help="mask: side of the square patches, in pixels")


MODEL_OPTIONS = RELEASE_KEYS  # the spec keys set by options of their own


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The --model preset or JSON spec, with the release options that differ from their defaults applied."""
    spec = resolve_spec(json.loads(args.model) if args.model.lstrip().startswith("{") else args.model)
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    changes = {k: getattr(args, k) for k in MODEL_OPTIONS if getattr(args, k) != defaults[k]}
    if changes.get("release", spec.release) != "dct":
        changes.pop("dct_stem_blocks", None)   # the DCT's server stage: no other release has it
    return replace(spec, **changes) if changes else spec


def model_argv(args: argparse.Namespace) -> list[str]:
    """The options of `add_model_args` as command-line arguments again (the demo hands them to both sides)."""
    argv = ["--model", args.model, "--split", args.split]
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    for k in MODEL_OPTIONS:
        if k not in LATER_KEYS or getattr(args, k) != defaults[k]:   # a command recorded before one stays the same
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
    """The data that the options of `add_data_args` select."""
    if args.image_folder and not args.data:
        raise SystemExit("--image-folder needs --data PATH")
    return load_selection(args.data, data_selection(args))
