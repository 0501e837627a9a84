"""python -m splitface.device.privacy plan ...: noise for a target per-image epsilon, and what the paper's
per-activation epsilon means per image."""
from __future__ import annotations

import argparse
import json
import math
import sys

from splitface.device.privacy.mechanisms import PAPER_LRN_SENSITIVITY
from splitface.device.privacy.planner import per_activation_view, per_image_view, release_schedule


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
    parser = argparse.ArgumentParser(prog="python -m splitface.device.privacy")
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


if __name__ == "__main__":
    sys.exit(main())
