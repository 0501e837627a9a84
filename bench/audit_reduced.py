"""The reconstruction attack on a reduced configuration, across the per-activation epsilons of the
sweep, with the releases computed directly (not yet from a recorded run: see docs/audit.md).

Private: the first 10 LFW people with >= 10 images (training images released; their test images
are the attacker's other photos). Public, for the attacker: 800 images of LFW people with 3..9
images. Device layer: iresnet_small conv1 + ReLU + LRN (clamped), known to the attacker.
Attack: ridge inversion (pool and ridge chosen on held-out public images), eigenfaces recognizer.

    python bench/audit_reduced.py --data ../shared/data/lfw   # writes results/audit/reduced_attack.{json,png}
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from device_sdk.data import find_lfw_root, load_lfw  # noqa: E402
from device_sdk.engine import to_input  # noqa: E402
from device_sdk.models import build_backbone, resolve_spec, split_backbone  # noqa: E402
from device_sdk.models.lrn import PaperLRN  # noqa: E402
from device_sdk.privacy.mechanisms import NoNoise, PerActivationGaussian  # noqa: E402
from edge_server.audit.attack import reconstruction_report, releases  # noqa: E402
from edge_server.audit.inversion import resized, tuned_inversion  # noqa: E402
from edge_server.audit.recognizer import Eigenfaces  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--epsilons", nargs="+", type=float, default=[1, 3, 10, math.inf])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "audit" / "reduced_attack")
    args = p.parse_args(argv)
    root = find_lfw_root(args.data)
    private = load_lfw(root, min_images=10, max_identities=10)
    public = load_lfw(root, min_images=3, max_images=9)
    public_train = public.train.subset(np.random.default_rng(0).permutation(len(public.train))[:800])
    torch.manual_seed(0)
    layer, _ = split_backbone(build_backbone(resolve_spec("iresnet_small")), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0
    images = {name: to_input(s.load(64, 160)).numpy() for name, s in
              (("public", public_train), ("private", private.train), ("photos", private.test))}
    recognizer = Eigenfaces().fit(images["public"])
    rows, recons = [], {}
    for eps in args.epsilons:
        mechanism = NoNoise() if math.isinf(eps) else PerActivationGaussian(eps, 1e-5)
        inversion, chosen = tuned_inversion(releases(layer, images["public"], mechanism, 1), images["public"])
        report, recon = reconstruction_report(inversion, recognizer, releases(layer, images["private"], mechanism, 2),
                                              images["private"], private.train.labels, images["photos"],
                                              private.test.labels)
        rows.append({"epsilon_per_activation": None if math.isinf(eps) else eps, **chosen, **report})
        recons[eps] = recon[:6]
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({
        "config": {"model": "iresnet_small", "input": 64, "private_identities": 10,
                   "private_train_images": len(private.train), "attacker_photos": len(private.test),
                   "public_images": len(public_train), "recognizer": "eigenfaces (64 components) on public faces",
                   "inversion": "ridge, dual form, pool/ridge chosen on held-out public faces", "delta": 1e-5},
        "rows": rows}, indent=2))
    originals = resized(images["private"][:6], 32)
    fig, axes = plt.subplots(len(recons) + 1, 6, figsize=(9, 1.6 * (len(recons) + 1)))
    for j in range(6):
        axes[0, j].imshow(originals[j].transpose(1, 2, 0))
        for i, (eps, rec) in enumerate(recons.items(), start=1):
            axes[i, j].imshow(rec[j].transpose(1, 2, 0))
    for ax in axes.flat:
        ax.set_xticks([]), ax.set_yticks([])
    axes[0, 0].set_ylabel("original", fontsize=8)
    for i, eps in enumerate(recons, start=1):
        axes[i, 0].set_ylabel("no noise" if math.isinf(eps) else f"eps {eps:g}", fontsize=8)
    fig.suptitle("Ridge reconstructions from what the server received (reduced: iresnet_small, 64 px)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
