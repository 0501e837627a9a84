"""splitface-export: the device layer as ExecuTorch and ONNX programs, verified against PyTorch.

    splitface-export --model iresnet_small --batch-size 8 --out runs/export [--weights public.pt]
                     [--dp-clamp] [--static-weights] [--gemm] [--data ../shared/data/lfw]
    splitface-export --model iresnet_small --app --num-classes 158 --out app-bundle [--url wss://...]
                     [--epsilon 3 --dp-clamp [--budget 10]] [--activations f16] ...

--app writes the Android app's folder instead (splitface/export/app_bundle.py): the strip programs, the starting layer,
the job and a manifest the app checks; the strip programs are held to PyTorch by tests/test_android_core.py.

Exits non-zero, saying which artifact and by how much, when any output or gradient disagrees
with PyTorch beyond the tolerances in splitface/export/verify.py.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import numpy as np

from splitface.common.options import add_model_args, model_spec
from splitface.common.data import find_lfw_root, load_lfw
from splitface.common.models import build_device_part
from splitface.common.models.lrn import PaperLRN
from splitface.common.models.weights import load_into

from splitface.export.app_bundle import ENCODINGS, job_settings, write_app_bundle
from splitface.export.artifacts import transform_mask
from splitface.device.runtimes.parity import ExportMismatch
from splitface.export.verify import export_verified
from splitface.common.options import add_data_root_arg, add_seed_arg


def real_images(data: str | None, batch_size: int, input_size: int, seed: int) -> np.ndarray | None:
    """A batch of real LFW faces for the verification, or None without data."""
    if data is None:
        return None
    split = load_lfw(find_lfw_root(data), min_images=10, seed=seed)
    subset = split.train.subset(np.arange(min(batch_size, len(split.train))))
    return subset.load(input_size, 160, progress=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--weights", type=Path, default=None, help="a saved backbone (splitface-research pretrain classify); "
                   "default: the seeded initial layer every device starts from")
    p.add_argument("--batch-size", type=int, default=8, help="fixed in the programs; shorter batches are zero-padded")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dp-clamp", action="store_true",
                   help="clamp LRN inputs to [0, 1], as the per-activation mechanism requires")
    p.add_argument("--static-weights", action="store_true",
                   help="bake the weights into release.pte (a frozen public layer: XNNPACK then runs the conv too)")
    p.add_argument("--gemm", action="store_true",
                   help="also the im2col programs (release_gemm.pte, vjp_gemm.pte) for --backend executorch-xnnpack: "
                        "conv + ReLU + LRN in XNNPACK with the weights as inputs (stride-1 conv1 layers)")
    add_data_root_arg(p, help="LFW directory: also verify on real faces")
    add_seed_arg(p)
    add_app_args(p)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    spec = model_spec(args)
    import torch
    torch.manual_seed(args.seed)
    layer = build_device_part(spec, args.split)  # the device's stages only, as a device builds them
    if args.weights:
        load_into(layer, args.weights, spec)
    if args.dp_clamp:
        for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
            lrn.input_max = 1.0
    if args.app:
        write_app(args, spec, layer)
        return
    images = real_images(args.data, args.batch_size, spec.input_size, args.seed)
    try:
        manifest = export_verified(layer, spec.input_size, args.batch_size, args.out, images, args.static_weights,
                                   transform_mask(spec, layer), gemm=args.gemm)
    except ExportMismatch as exc:
        sys.exit(f"export verification FAILED: {exc}")
    for name, check in manifest.verification["checks"].items():
        print(f"ok  {name}: release max abs err {check['release_max_abs_err']:.2e}, "
              f"gradient max rel err {check['grad_max_rel_err']:.2e}")
    if args.gemm and manifest.gemm_refusal:
        print(f"no im2col programs: {manifest.gemm_refusal}")
    if not manifest.trainable:
        print(f"release programs only: the runtimes refuse to train this device part ({manifest.training_refusal})")
    print(f"verified (release atol {manifest.verification['release_atol']}, gradient rtol "
          f"{manifest.verification['grad_rtol']}); artifacts in {args.out}")


def add_app_args(p: argparse.ArgumentParser) -> None:
    """--app and the job it describes (the app's defaults are `Cli train`'s and the demo's)."""
    g = p.add_argument_group("the Android app's folder (--app)")
    g.add_argument("--app", action="store_true", help="write the app's folder (strip programs, layer, job, manifest)")
    g.add_argument("--url", default=None, help="the edge server (default: a placeholder the app asks to replace)")
    g.add_argument("--num-classes", type=int, default=None, help="the server's classes (required with --app)")
    g.add_argument("--epochs", type=int, default=3)
    g.add_argument("--lr", type=float, default=0.005)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--lr-decay", type=float, default=0.1, help="lr is multiplied by this over the device's whole run")
    g.add_argument("--activations", choices=ENCODINGS, default="f32", help="wire encoding of the releases")
    g.add_argument("--gradients", choices=ENCODINGS, default="f32", help="wire encoding of the gradients")
    g.add_argument("--epsilon", type=float, default=None, help="per-activation noise: the paper's epsilon per value "
                   "(needs --dp-clamp)")
    g.add_argument("--delta", type=float, default=1e-5)
    g.add_argument("--budget", type=float, default=None,
                   help="per-image epsilon the device may spend (with --epsilon: writes schedule.msgpack)")
    g.add_argument("--classes", type=Path, default=None,
                   help="a text file of the server's class names in label order, one a line: the app labels the photos "
                        "in faces/<name>/ by it (without it, the app cannot label its photos)")
    g.add_argument("--strip-rows", type=int, default=4, help="image rows per strip in the strip programs")


def write_app(args: argparse.Namespace, spec, layer) -> None:
    """`--app`: the app's folder, or the reason this device part or these settings cannot make one."""
    if args.num_classes is None:
        sys.exit("--app needs --num-classes (the server's classifier size, sent in HELLO)")
    if args.budget is not None and args.epsilon is None:
        sys.exit("--budget needs --epsilon: a budget limits noised releases")
    classes = None if args.classes is None else [c for c in args.classes.read_text().splitlines() if c.strip()]
    try:
        job = job_settings(url=args.url, num_classes=args.num_classes, batch_size=args.batch_size,
                           epochs=args.epochs, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                           lr_decay=args.lr_decay, activations=args.activations, gradients=args.gradients,
                           epsilon=args.epsilon, delta=args.delta, budget=args.budget, classes=classes)
    except ValueError as exc:
        sys.exit(f"no app folder: {exc}")
    schedule = None
    if args.budget is not None:  # each image is released once an epoch
        import torch
        from splitface.device.privacy.planner import release_schedule

        with torch.no_grad():
            numel = layer.eval()(torch.zeros(1, 3, spec.input_size, spec.input_size)).numel()
        schedule = release_schedule(args.epsilon, args.delta, numel, args.epochs)
    try:
        manifest = write_app_bundle(layer, spec, args.split, job, args.out, args.strip_rows, schedule)
    except ValueError as exc:
        sys.exit(f"no app folder: {exc}")
    for name, entry in manifest["files"].items():
        print(f"{name:20s} {entry['bytes']:>10d} bytes  sha256 {entry['sha256'][:16]}")
    url = "" if args.url else " (url: a placeholder; the app asks for the server's)"
    print(f"app folder in {args.out}{url}")


if __name__ == "__main__":
    main()
