"""The source paper's epsilon sweep on LFW, run through the product: for every setting an edge
server process and a simulator process (`splitface-research demo`), then the paper's figures.

Settings:
- scratch:  both sides train from scratch; the device layer trains without DP (the paper's
            setting; the accountant marks per-image figures void, see docs/privacy.md).
- finetune: a backbone pre-trained on public LFW people (3-9 images each, disjoint from the
            158) is frozen on both sides; only the output layer trains (the paper's second setting).
Mechanisms: the paper's per-activation Gaussian at epsilon in --epsilons (and no noise), and the
per-image clipped Gaussian planned for per-image targets in --image-targets, with and without
a pooled (lower-dimensional) release.

The server records up to --record-max training releases per device (gitignored, under
runs/<name>/server/recordings/) for `splitface-research audit`, which plays the curious server against them.

Outputs (under --out): runs/<name>/ (each run's results.json and server log), summary.json,
fig_training_<setting>.png (train accuracy, test accuracy, loss per epoch per epsilon: the
paper's figures 3 and 4), fig_activations.png (its figure 2), and table.md.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from splitface.device.privacy.options import add_clip_norm_arg
from splitface.common.options import add_data_root_arg, add_model_arg, add_training_args  # noqa: E402
from splitface.server.cli import add_record_max_arg  # noqa: E402
from research.demo import run_recorded  # noqa: E402
from research.results import write_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def runs(args: argparse.Namespace) -> list[dict]:
    """Every run of the sweep: a name, its setting, and the demo arguments that make it."""
    plan = []
    for setting in args.settings:
        base = ["--model", args.model, "--epochs", str(args.epochs), "--lr", str(args.lr)]
        if setting == "finetune":
            base += ["--server-init", str(args.public), "--train-only", "classifier",
                     "--device-weights", str(args.public), "--layer-training", "frozen"]
        for eps in args.epsilons:
            noise = ["--mechanism", "none"] if eps == math.inf else ["--mechanism", "per-activation", "--epsilon", str(eps)]
            plan.append({"name": f"{setting}-act-{eps:g}", "setting": setting, "mechanism": "per-activation",
                         "epsilon": eps, "pool": 1, "head": "server", "args": base + noise})
            if setting == "scratch" and eps in args.device_head_epsilons:
                # the label-leakage audit needs the device head: the labels stay on the device
                plan.append({"name": f"{setting}-devicehead-act-{eps:g}", "setting": setting,
                             "mechanism": "per-activation", "epsilon": eps, "pool": 1, "head": "device",
                             "args": base + noise + ["--head", "device"]})
        if setting != "finetune":
            continue  # the per-image mechanism is studied where the layer is public (its guarantee holds)
        for target in args.image_targets:
            for pool in args.pools:
                plan.append({"name": f"{setting}-img-{target:g}-pool{pool}", "setting": setting,
                             "mechanism": "per-image", "epsilon": target, "pool": pool, "head": "server",
                             "args": base + ["--mechanism", "per-image", "--target-epsilon", str(target),
                                             "--clip-norm", str(args.clip_norm), "--release-pool", str(pool)]})
    return plan


def run_one(run: dict, args: argparse.Namespace) -> dict:
    return run_recorded(args.out / "runs" / run["name"],
                        ["--data", str(args.data), "--threads", "1", "--record-max", str(args.record_max), *run["args"],
                         *args.demo_args.split()], args.force)


def summarize(plan: list[dict], outcomes: list[dict]) -> list[dict]:
    rows = []
    for run, result in zip(plan, outcomes):
        last = result["epochs"][-1]
        privacy = result["devices"][0]["privacy"]
        rows.append({**{k: run[k] for k in ("name", "setting", "mechanism", "epsilon", "pool", "head")},
                     "epochs": result["epochs"], "final_test_acc": last["test_acc"], "final_train_acc": last["train_acc"],
                     "epsilon_image": last["epsilon_image_max"], "epsilon_identity": last["epsilon_identity_max"],
                     "guarantee_void": privacy.get("guarantee_void", False), "mechanism_detail": privacy["mechanism"],
                     "bytes_up_per_epoch": last["bytes_sent"]})
    return rows


def plot_training(rows: list[dict], setting: str, out: Path) -> None:
    chosen = [r for r in rows if r["setting"] == setting and r["mechanism"] == "per-activation" and r["head"] == "server"]
    if not chosen:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in sorted(chosen, key=lambda r: r["epsilon"]):
        label = "no noise" if r["epsilon"] == math.inf else f"eps={r['epsilon']:g}"
        epochs = [e["epoch"] for e in r["epochs"]]
        for ax, key in zip(axes, ("train_acc", "test_acc", "train_loss")):
            ax.plot(epochs, [e[key] for e in r["epochs"]], marker="o", label=label)
    for ax, title in zip(axes, ("training accuracy", "test accuracy", "training loss")):
        ax.set_title(f"{setting}: {title}")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / f"fig_training_{setting}.png", dpi=110)
    plt.close(fig)


def plot_activations(args: argparse.Namespace, out: Path) -> None:
    """The paper's figure 2: one face's device-layer activations (x255, negatives removed) at several epsilon."""
    from splitface.common.data import load_lfw
    from splitface.device.trainer import DeviceTrainer, PrivacyEngine
    from splitface.common.models import resolve_spec
    from splitface.device.privacy.mechanisms import PerActivationGaussian, noise_generator

    data = load_lfw(args.data)
    image = data.test.subset([0]).load(resolve_spec(args.model).input_size)
    epsilons = [math.inf, 10.0, 5.0, 3.0, 1.0]
    channels = [0, 1, 2, 3, 4, 5]
    fig, axes = plt.subplots(len(epsilons), len(channels) + 1, figsize=(2 * (len(channels) + 1), 2 * len(epsilons)))
    for i, eps in enumerate(epsilons):
        mechanism = PerActivationGaussian(3.0 if eps == math.inf else eps, 1e-5)
        engine = DeviceTrainer(resolve_spec(args.model), "conv1", "server", 2,
                              privacy=PrivacyEngine(mechanism, layer_training="frozen"),
                              device_weights=args.public if args.public.exists() else None)
        with torch.no_grad():
            activations = engine.layer(torch.from_numpy(image).float() / 255)
            if eps != math.inf:
                activations = mechanism.privatize(activations, noise_generator(7, i))
        shown = (activations[0].clamp(min=0) * 255).clamp(max=255).numpy()
        axes[i, 0].imshow(image[0].transpose(1, 2, 0))
        axes[i, 0].set_ylabel("no noise" if eps == math.inf else f"eps={eps:g}")
        for j, c in enumerate(channels):
            axes[i, j + 1].imshow(shown[c], cmap="gray", vmin=0, vmax=255)
        for ax in axes[i]:
            ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle("device-layer activations x255, negatives removed (per-activation mechanism, delta=1e-5)")
    fig.tight_layout()
    fig.savefig(out / "fig_activations.png", dpi=110)
    plt.close(fig)


def table(rows: list[dict], config: dict) -> str:
    lines = [f"Reduced CPU configuration: {config['model']['family']} at {config['model']['input_size']}x"
             f"{config['model']['input_size']}, LFW {config['num_classes']} identities ({config['train_images']} train / "
             f"{config['test_images']} test), {config['num_devices']} devices, {config['epochs']} epochs, "
             f"delta = 1e-5.", "",
             "| setting | mechanism | epsilon (as set) | release | final test acc | final train acc | "
             "per-image epsilon (accountant) | per-identity epsilon | note |",
             "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        eps = "none" if r["epsilon"] == math.inf else (f"{r['epsilon']:g} per value" if r["mechanism"] == "per-activation"
                                                       else f"{r['epsilon']:g} per image")
        release = "full" if r["pool"] == 1 else f"{r['pool']}x{r['pool']} avg-pooled"
        note = "; ".join(n for n in ("device head" if r["head"] == "device" else "",
                                     "void: layer trained without DP" if r["guarantee_void"] else "") if n)
        lines.append(f"| {r['setting']} | {r['mechanism'] if r['epsilon'] != math.inf else 'none'} | {eps} | {release} | "
                     f"{r['final_test_acc']:.3f} | {r['final_train_acc']:.3f} | {r['epsilon_image']:.4g} | "
                     f"{r['epsilon_identity']:.4g} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, required=True)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "dp_sweep")
    add_model_arg(p, "iresnet_small")
    p.add_argument("--public", type=Path, default=ROOT / "runs" / "public_iresnet_small.pt",
                   help="backbone pre-trained on the public split (splitface-research pretrain classify)")
    p.add_argument("--settings", nargs="+", default=["scratch", "finetune"], choices=("scratch", "finetune"))
    p.add_argument("--epsilons", nargs="+", type=float, default=[1, 2, 3, 5, 10, math.inf])
    p.add_argument("--image-targets", nargs="+", type=float, default=[10, 1000])
    p.add_argument("--pools", nargs="+", type=int, default=[1, 4])
    add_clip_norm_arg(p, 10.0)
    add_training_args(p, epochs=3, batch_size=None, lr=0.05, lr_help="the server's learning rate")
    p.add_argument("--device-head-epsilons", nargs="*", type=float, default=[3, math.inf],
                   help="scratch: also run these with the classifier on the device (for the label-leakage audit)")
    add_record_max_arg(p, default=256)
    p.add_argument("--force", action="store_true", help="re-run settings that already have results")
    p.add_argument("--demo-args", default="", help="more splitface-research demo arguments, e.g. '--max-identities 20'")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if "finetune" in args.settings and not args.public.exists():
        print(f"pre-training the public backbone into {args.public}", flush=True)
        subprocess.run([sys.executable, "-m", "research.distill", "classify", "--model", args.model, "--data", str(args.data),
                        "--epochs", "12", "--out", str(args.public)], cwd=ROOT, check=True)
    plan = runs(args)
    outcomes = [run_one(run, args) for run in plan]
    rows = summarize(plan, outcomes)
    for setting in args.settings:
        plot_training(rows, setting, args.out)
    plot_activations(args, args.out)
    write_summary(args.out, rows, table(rows, outcomes[0]["config"]), default=str)


if __name__ == "__main__":
    main()
