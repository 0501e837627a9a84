"""splitface-export: the device layer as ExecuTorch and ONNX programs, verified against PyTorch.

    splitface-export --model iresnet_small --batch-size 8 --out runs/export [--weights public.pt]
                     [--dp-clamp] [--static-weights] [--gemm] [--data ../shared/data/lfw]

Exits non-zero, saying which artifact and by how much, when any output or gradient disagrees
with PyTorch beyond the tolerances in export/verify.py.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import numpy as np

from device_sdk.cli import add_model_args, model_spec
from device_sdk.data import find_lfw_root, load_lfw
from device_sdk.models import build_device_part
from device_sdk.models.lrn import PaperLRN
from device_sdk.models.weights import load_into

from .artifacts import transform_mask
from .verify import ExportMismatch, export_verified
from device_sdk.options import add_data_root_arg, add_seed_arg


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
    p.add_argument("--weights", type=Path, default=None, help="a saved backbone (splitface-server pretrain); "
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


if __name__ == "__main__":
    main()
