"""Choose noise before a run: what noise meets a per-image target, and what the paper's
per-activation epsilon actually means for a whole image (`splitface-device plan`; `splitface-device schedule`
tabulates it for a device's budget guard)."""
from __future__ import annotations

import argparse
import json
import math

from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from splitface.common.accountants.ledger import epsilon_of
from splitface.common.accountants.base import to_add_or_remove
from splitface.device.privacy.mechanisms import PAPER_LRN_SENSITIVITY, PerActivationGaussian


def plan_per_image(target_epsilon: float, delta: float, releases_per_image: int,
                   value_discretization_interval: float = 1e-3) -> float:
    """Noise multiplier z such that ``releases_per_image`` compositions of GaussianDpEvent(z) reach
    ``target_epsilon`` at ``delta`` (PLD, REPLACE_ONE, via dp_accounting's calibrate_dp_mechanism)."""
    if releases_per_image < 1:
        raise ValueError(f"releases_per_image must be >= 1, got {releases_per_image}")

    def event(z: float) -> dp_event.DpEvent:
        return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), releases_per_image)

    # Bracket first with RDP (milliseconds; its z is never below PLD's): PLDs of tiny z are huge and
    # slow, and the library's default search would start there.
    z_rdp = mechanism_calibration.calibrate_dp_mechanism(
        lambda: RdpAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE),
        lambda z: to_add_or_remove(event(z)), target_epsilon, delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-6)
    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=value_discretization_interval),
        event, target_epsilon, delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(z_rdp / 2, z_rdp),
        tol=1e-6,
    ))


def per_activation_view(epsilon: float, delta: float, numel: int, releases_per_image: int,
                        sensitivity: float = PAPER_LRN_SENSITIVITY) -> dict:
    """What the paper's per-activation (epsilon, delta) buys: the true epsilon of one value (PLD), and
    of one image's whole tensor per release and over the run."""
    m = PerActivationGaussian(epsilon, delta, sensitivity)
    one = m.image_event(numel)
    return {
        "epsilon_requested": epsilon,
        "delta": delta,
        "sensitivity": sensitivity,
        "sigma": m.sigma,
        "noise_std": m.std,
        "numel": numel,
        "epsilon_activation": epsilon_of(m.activation_event(), delta),
        "image_noise_multiplier": one.noise_multiplier,
        "epsilon_image_per_release": epsilon_of(one, delta),
        "releases_per_image": releases_per_image,
        "epsilon_image_run": epsilon_of(dp_event.SelfComposedDpEvent(one, releases_per_image), delta),
    }


def per_image_view(epsilon: float, delta: float, numel: int, releases_per_image: int,
                   clip_norm: float = 1.0) -> dict:
    """The clipped per-image mechanism that meets ``epsilon`` per image over the run."""
    z = plan_per_image(epsilon, delta, releases_per_image)
    return {
        "epsilon_target": epsilon,
        "delta": delta,
        "releases_per_image": releases_per_image,
        "noise_multiplier": z,
        "clip_norm": clip_norm,
        "noise_std": z * clip_norm,
        "numel": numel,
        # E||noise|| ~ z C sqrt(numel) against a signal of norm at most C.
        "noise_to_signal_l2": z * math.sqrt(numel),
        "epsilon_check": epsilon_of(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), releases_per_image), delta),
    }


def release_schedule(epsilon: float, delta: float, numel: int, releases: int,
                     sensitivity: float = PAPER_LRN_SENSITIVITY) -> list[float]:
    """Per-image epsilon after k = 1..releases releases of the per-activation mechanism (PLD, REPLACE_ONE).

    A device without dp_accounting (the Android app) enforces its budget from this table instead of
    composing anything itself.
    """
    event = PerActivationGaussian(epsilon, delta, sensitivity).image_event(numel)
    return [epsilon_of(dp_event.SelfComposedDpEvent(event, k), delta) for k in range(1, releases + 1)]


# ---- the command line: splitface-device plan | schedule -----------------------------------

def _numel(text: str) -> int:
    """An int, or a product such as 64*224*224 (the activation shape)."""
    try:
        value = math.prod(int(part) for part in text.replace("x", "*").split("*"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or a product like 64*224*224, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"numel must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """`splitface-device plan` and `splitface-device schedule` (splitface/device_cli.py)."""
    parser = argparse.ArgumentParser(prog="splitface-device")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="noise for a target epsilon; the per-activation mechanism's per-image view")
    p.add_argument("--mechanism", choices=["per-image", "per-activation"], default="per-image")
    p.add_argument("--epsilon", type=float, required=True,
                   help="per-image: target per-image epsilon over the run; per-activation: the paper's epsilon")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--evals-per-epoch", type=int, default=1)
    p.add_argument("--train-images", type=int, default=None, help="only for totals")
    p.add_argument("--numel", type=_numel, default=64 * 224 * 224, help="values per image, e.g. 64*224*224")
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--sensitivity", type=float, default=PAPER_LRN_SENSITIVITY)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    s = sub.add_parser("schedule", help="per-image epsilon after each release, for a device's budget guard (msgpack)")
    s.add_argument("--epsilon", type=float, required=True, help="the paper's per-activation epsilon")
    s.add_argument("--delta", type=float, default=1e-5)
    s.add_argument("--numel", type=_numel, required=True, help="values per image release, e.g. 16*64*64")
    s.add_argument("--releases", type=int, required=True, help="how many releases of one image to tabulate")
    s.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "schedule":
        import msgpack
        table = release_schedule(args.epsilon, args.delta, args.numel, args.releases)
        with open(args.out, "wb") as f:
            f.write(msgpack.packb({"mechanism": "per_activation", "epsilon_per_activation": args.epsilon,
                                   "delta": args.delta, "numel": args.numel, "epsilon_after": table}))
        print(f"per-image epsilon after 1..{args.releases} releases: {table[0]:.4g} ... {table[-1]:.4g} -> {args.out}")
        return 0

    # Worst case: an image that is both trained on and evaluated (our LFW split keeps them apart,
    # so a train image has `epochs` releases and a test image `epochs * evals_per_epoch`).
    k = args.epochs * (1 + args.evals_per_epoch)
    act = per_activation_view(args.epsilon, args.delta, args.numel, k, args.sensitivity)
    img = per_image_view(args.epsilon, args.delta, args.numel, k, args.clip_norm) \
        if args.mechanism == "per-image" else None
    if args.json:
        print(json.dumps({"per_image": img, "per_activation": act}, indent=2))
        return 0
    print(f"releases per image: {k}  ({args.epochs} epochs x (1 training + {args.evals_per_epoch} evaluation); "
          f"worst case, an image both trained on and evaluated)")
    print(f"values per image (numel): {args.numel}   delta: {args.delta:g}")
    if args.train_images is not None:
        print(f"training releases in all: {args.train_images * args.epochs} image tensors")
    if img is not None:
        print(f"\nper-image clipped Gaussian, target epsilon {args.epsilon:g} per image over the run:")
        print(f"  noise multiplier z = {img['noise_multiplier']:.4f}   (check: composed epsilon "
              f"{img['epsilon_check']:.4f})")
        print(f"  clip norm C = {args.clip_norm:g}   noise std per value = z*C = {img['noise_std']:.4f}")
        print(f"  expected noise L2 norm / clipped signal norm = z*sqrt(numel) = {img['noise_to_signal_l2']:.1f}")
    title = "for the same target" if img is not None else ""
    print(f"\nper-activation mechanism (the paper's), epsilon {args.epsilon:g} per activation {title}:")
    print(f"  sigma = sqrt(2 ln(1.25/delta))/eps = {act['sigma']:.4f}   noise std = sensitivity*sigma = "
          f"{act['noise_std']:.4f}   (sensitivity {act['sensitivity']:.4f})")
    print(f"  true epsilon of ONE activation value: {act['epsilon_activation']:.4f}")
    print(f"  per image, one release: z = {act['image_noise_multiplier']:.3g}, epsilon = "
          f"{act['epsilon_image_per_release']:.4g}")
    print(f"  per image, {k} releases: epsilon = {act['epsilon_image_run']:.4g}")
    return 0
