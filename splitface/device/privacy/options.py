"""The device's privacy options, declared once: what it does to its releases, how its layer learns, its budget."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from splitface.device.privacy.discrete import DiscreteGaussianMechanism
from splitface.device.privacy.engine import LAYER_TRAINING, PrivacyEngine
from splitface.device.privacy.mechanisms import MECHANISMS, Mechanism, build_mechanism
from splitface.device.privacy.planner import plan_per_image

NOISE = ("float", "discrete")  # --noise: how the per-image mechanism draws its noise


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
