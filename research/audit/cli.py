"""`splitface-research audit`: play the curious edge server against recorded training runs.

    splitface-research audit RUN_DIR [RUN_DIR ...] --data LFW --out results/audit/sweep \\
        [--recognizer-weights runs/public_iresnet_small.pt]

Each RUN_DIR is a `splitface-research demo --record-max N` run (the epsilon sweep records every run). Per
run: reconstructions (ridge and decoder, fitted on public faces; for a release whose mirror image's release the
server can compute, also from that, mirrored back and averaged) scored by PSNR, SSIM, linkage and
re-identification risk; identity matching straight from the releases to dlib's embedding; linkage
through the server's own model (also averaged with the mirror's, where it can be); label leakage; membership inference. Every attacker knows the
release transform and its parameters and trains on releases made by it. Writes <out>/<run>.json, and for all runs together summary.json, table.md, reconstructions.png
and privacy_utility.png. See docs/audit.md for the threat model.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from splitface.common.data import find_lfw_root  # noqa: E402
from splitface.device.trainer import to_input  # noqa: E402

from splitface.common.data import FaceSet  # noqa: E402
from splitface.common.transforms import MIRRORED, release_mirror  # noqa: E402

from research.audit.attack import label_leakage, membership_inference, reconstruction_report, retrieval_report  # noqa: E402
from research.audit.decoder import DecoderInversion  # noqa: E402
from research.audit.inversion import resized, tuned_inversion  # noqa: E402
from research.audit.matcher import IdentityMatcher  # noqa: E402
from research.audit.metrics import reidentification_risk  # noqa: E402
from research.audit.recognizer import CachedFaces, DlibResNet, Eigenfaces, PublicBackbone  # noqa: E402
from research.audit.substitute import fit_substitute  # noqa: E402
from research.audit.run import AttackerView, GroundTruth, ground_truth, load_run, public_faces  # noqa: E402
from splitface.common.options import add_data_root_arg, add_threads_arg
from research.results import write_summary

SAMPLES = 6  # reconstructions shown per run
STRONG = "dlib"  # the strong recognizer: identity matching targets its embedding
INFORMATIVE = 0.9  # a risk is informative only where the recognizer finds people on clean photos this often


def audit_run(view: AttackerView, truth: GroundTruth, public: PublicFaces, recognizers: dict[str, CachedFaces],
              args: argparse.Namespace) -> tuple[dict, dict[str, np.ndarray]]:
    """Every attack on one run; `public`: the attacker's public faces at the run's input size.
    Returns (report, sample reconstructions by inversion)."""
    wanted = np.isin(truth.photos.labels, truth.private.labels)   # the attacker looks for the people it trained on
    photo_set = truth.photos.subset(np.flatnonzero(wanted))
    private, photos = (to_input(s.load(truth.size, truth.crop)).numpy() for s in (truth.private, photo_set))
    ids, photo_ids = truth.private.labels, photo_set.labels
    # each recognizer's view of the attacker's photos and of the clean originals: the queries and the upper bound
    references = {name: (r.embed_faces(photo_set, truth.size, truth.crop, photos),
                         r.embed_faces(truth.private, truth.size, truth.crop, private))
                  for name, r in recognizers.items()}
    received = view.recorded("activations").astype(np.float32)
    report: dict = {"run": view.name, "head": view.head, "mechanism": view.mechanism.describe(),
                    # where the attacker's copy of the device part begins, before any substitute is fitted from it
                    "device_layer": view.layer_knowledge, "device_layer_start": view.layer_knowledge,
                    "test_accuracy": view.test_accuracy,
                    "epsilon_image_accountant": view.epsilon_image, "recorded_releases": len(received),
                    "public_images": len(public.images), "attacks": {}}
    samples = {"original": resized(private[:SAMPLES], args.image_size)}

    if args.substitute and view.layer_knowledge.startswith("surrogate"):
        substitute, fit = fit_substitute(view.layer, view.spec, view.mechanism, public.images, received)
        report["substitute_client"] = {**fit, "used": fit.get("mmd_after", 1) < fit.get("mmd_before", 0)}
        if report["substitute_client"]["used"]:   # the attacker's own criterion: no private data needed
            view = replace(view, layer=substitute,
                           layer_knowledge="substitute (fitted to the recorded releases, FORA-style)")
            report["device_layer"] = view.layer_knowledge
    sample = view.release_sampler(public.images)
    ridge, chosen = tuned_inversion(sample(1), public.images, args.image_size)
    decoder = DecoderInversion(args.image_size, epochs=args.decoder_epochs).fit(sample, public.images)
    plain = {name: r.recognizer for name, r in recognizers.items()}
    mirror = release_mirror(view.spec) if view.spec.release in MIRRORED else None
    for name, inversion, extra in (("ridge", ridge, chosen), ("decoder", decoder, {"epochs": args.decoder_epochs})):
        recon = inversion.reconstruct(received)
        report["attacks"][f"reconstruction_{name}"] = {
            **extra, **reconstruction_report(recon, private, ids, photo_ids, plain, references)}
        samples[name] = recon[:SAMPLES]
        if mirror is not None:   # and from the mirror image's release, mirrored back: two views of each face, averaged
            mirrored = mirror_reconstruction(inversion, received, mirror)
            report["attacks"][f"reconstruction_{name}_mirror"] = {
                **extra, **reconstruction_report((recon + mirrored) / 2, private, ids, photo_ids, plain, references)}

    # identity matching: releases straight to the strongest recognizer's embedding of the clean face
    strong = STRONG if STRONG in recognizers else next(iter(recognizers))
    targets = recognizers[strong].embed_faces(public.faces, truth.size, truth.crop, public.images)
    matcher = IdentityMatcher(epochs=args.matcher_epochs).fit(sample, targets)
    queries, clean = references[strong]
    report["attacks"]["identity_matching"] = {
        "recognizer": strong, "epochs": args.matcher_epochs,
        **retrieval_report(queries, photo_ids, matcher.embed(received), ids),
        **{f"risk@{k}_clean_upper_bound": reidentification_risk(queries, photo_ids, clean, ids, k) for k in (1, 5)}}
    report["strong_recognizer"] = {"name": strong,
                                   "clean_risk@1": report["attacks"]["identity_matching"]["risk@1_clean_upper_bound"]}

    # the server's own model as the recognizer: its embeddings of what it received, and of the attacker's
    # photos sent through the device layer it knows (or its surrogate) and the mechanism
    attacker_releases = view.releases(photos, seed=3)
    report["attacks"]["server_model_linkage"] = retrieval_report(view.embed(attacker_releases), photo_ids,
                                                                 view.embed(received), ids)
    if view.spec.release in MIRRORED:   # and as a server with --mirror-average embeds: each release with its mirror's
        report["attacks"]["server_model_linkage_mirror"] = retrieval_report(
            view.embed(attacker_releases, mirror_average=True), photo_ids, view.embed(received, mirror_average=True),
            ids)

    if view.head == "server":
        recorded = view.recorded("labels")
        report["attacks"]["label_leakage"] = {
            "labels_sent": True, "share_of_recorded_labels_that_are_true": float(np.mean(recorded == ids)),
            "note": "server head: every training label travels in FORWARD; leakage is total by design"}
        members = view.losses(view.releases(private, seed=4), ids)
        non_members = view.losses(view.releases(photos, seed=5), photo_ids)
        report["attacks"]["membership_inference"] = membership_inference(members, non_members)
    else:
        batch_keys = np.concatenate([np.full(len(r["batch_ids"]), i) * 1_000_000 + r["batch_ids"]
                                     for i, (_, r) in enumerate(sorted(view.recordings.items()))])
        report["attacks"]["label_leakage"] = {"labels_sent": False, **label_leakage(
            view.recorded("embedding_grads"), ids, batch_keys)}
        report["attacks"]["membership_inference"] = {
            "skipped": "device head: the server holds no classifier to threshold"}
    return report, samples


def mirror_reconstruction(inversion, releases: np.ndarray, mirror) -> np.ndarray:
    """`inversion`'s reconstruction of each face from its mirror image's release (`mirror`: release_mirror's map),
    mirrored back along the width (the last axis of (N, 3, s, s)): a second view of the same face."""
    return inversion.reconstruct(mirror(torch.from_numpy(releases)).numpy())[..., ::-1]


def identity_attacks(report: dict) -> list[tuple[str, dict]]:
    """Every attack that ranks identities for the attacker's photos, with its figures."""
    attacks = [(f"{name.removeprefix('reconstruction_')} + {rec}", r) for name, a in report["attacks"].items()
               if name.startswith("reconstruction") for rec, r in a["recognizers"].items()]
    attacks.append(("identity matching", report["attacks"]["identity_matching"]))
    attacks += server_model_attacks(report)
    return attacks


def server_model_attacks(report: dict) -> list[tuple[str, dict]]:
    """The server's own model as the recognizer: each release embedded once and, where the server can compute the
    mirror image's release (reports since --mirror-average), averaged with it."""
    mirrored = report["attacks"].get("server_model_linkage_mirror")
    return [("server model", report["attacks"]["server_model_linkage"]),
            *([("server model, mirror-averaged", mirrored)] if mirrored is not None else [])]


def server_model(report: dict) -> dict:
    """The stronger of the server-model attacks (by R@1 over its chance)."""
    return max((r for _, r in server_model_attacks(report)), key=lambda r: r["risk@1"] - r["risk@1_chance"])


def strongest(report: dict) -> tuple[str, str, dict]:
    """(inversion, recognizer, figures) of the reconstruction attack with the highest R@1: the upper
    envelope of every inversion and recognizer, which favours the attacker (each one's own figures are in the
    report)."""
    return max(((name, rec, r) for name, a in report["attacks"].items() if name.startswith("reconstruction")
                for rec, r in a["recognizers"].items()), key=lambda t: t[2]["risk@1"])


def identity_kinds(report: dict) -> dict:
    """The identity figure split by what it means (docs/privacy.md): `reconstruction_identity_r1`, the strong
    recognizer on the best reconstructions (what a curious server can *see*), and `model_identity_r1`, the best
    of a matcher trained on releases and the server's own model (what it can *recognise*: a release from which
    the server can learn a recognizer lets it recognise people, which is the task itself). Each with its chance."""
    strong = report["strong_recognizer"]["name"]
    seen = max((a["recognizers"][strong] for name, a in report["attacks"].items()
                if name.startswith("reconstruction") and strong in a["recognizers"]), key=lambda r: r["risk@1"])
    models = (report["attacks"]["identity_matching"], server_model(report))
    known = max(models, key=lambda r: r["risk@1"] - r["risk@1_chance"])
    return {"reconstruction_identity_r1": seen["risk@1"], "reconstruction_identity_r1_chance": seen["risk@1_chance"],
            "model_identity_r1": known["risk@1"], "model_identity_r1_chance": known["risk@1_chance"]}


def headline(report: dict) -> dict:
    """The figures the summary and the chart use. `identity_r1`: the strongest of every attack that
    ranks identities (reconstructions x recognizers, identity matching, the server's model), judged
    against the strong recognizer's R@1 on clean photos: below INFORMATIVE the figures say little;
    `identity_kinds` splits it into what the server sees and what it recognises."""
    best = strongest(report)
    attack, top = max(identity_attacks(report), key=lambda t: t[1]["risk@1"] - t[1]["risk@1_chance"])
    linkage = server_model(report)
    clean = report["strong_recognizer"]["clean_risk@1"]
    return {"run": report["run"], "head": report["head"], "mechanism": report["mechanism"],
            "test_accuracy": report["test_accuracy"], "best_attack": f"{best[0]} + {best[1]}",
            "risk@1": best[2]["risk@1"], "risk@1_chance": best[2]["risk@1_chance"],
            "risk@1_clean_upper_bound": best[2]["risk@1_clean_upper_bound"],
            "identity_attack": attack, "identity_r1": top["risk@1"], "identity_r1_chance": top["risk@1_chance"],
            "recognizer": report["strong_recognizer"]["name"], "recognizer_clean_r1": clean,
            "informative": clean >= INFORMATIVE,
            "linkage_pixels": max(a["linkage_pixels"] for n, a in report["attacks"].items()
                                  if n.startswith("reconstruction")),
            "linkage_pixels_chance": report["attacks"]["reconstruction_ridge"]["linkage_pixels_chance"],
            "identity_matching_r1": report["attacks"]["identity_matching"]["risk@1"],
            "server_model_risk@1": linkage["risk@1"],
            "membership_auc": report["attacks"]["membership_inference"].get("auc"),
            "label_direction_auc": report["attacks"]["label_leakage"].get("direction_auc"),
            **identity_kinds(report)}


def table(reports: list[dict]) -> str:
    """One line per run: the headline figures, each beside its chance level."""
    lines = ["| run | release | head | test acc | per-image eps (accountant) | pixel linkage ridge / decoder "
             "(chance) | best reconstruction R@1 (chance; clean) | identity matching R@1 (chance) | strongest "
             "identity attack: R@1 (chance) | strong recognizer clean R@1 | server-model R@1 (chance) | "
             "membership AUC | labels |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for report in reports:
        a, (_, _, best), h = report["attacks"], strongest(report), headline(report)
        ridge, decoder, match = a["reconstruction_ridge"], a["reconstruction_decoder"], a["identity_matching"]
        leak = a["label_leakage"]
        labels = "sent (total)" if leak["labels_sent"] else f"direction AUC {leak['direction_auc']:.2f}"
        flag = "" if h["informative"] else " (uninformative: clean bound < 0.9)"
        lines.append(
            f"| {report['run']} | {_label(report['mechanism'])} | {report['head']} | {report['test_accuracy']:.3f} | "
            f"{report['epsilon_image_accountant']:.3g} | {ridge['linkage_pixels']:.3f} / {decoder['linkage_pixels']:.3f} "
            f"({ridge['linkage_pixels_chance']:.3f}) | {best['risk@1']:.3f} ({best['risk@1_chance']:.3f}; "
            f"{best['risk@1_clean_upper_bound']:.3f}) | {match['risk@1']:.3f} ({match['risk@1_chance']:.3f}) | "
            f"{h['identity_attack']}: {h['identity_r1']:.3f} ({h['identity_r1_chance']:.3f}){flag} | "
            f"{h['recognizer']} {h['recognizer_clean_r1']:.3f} | "
            f"{h['server_model_risk@1']:.3f} ({server_model(report)['risk@1_chance']:.3f}) | "
            f"{_fmt(a['membership_inference'].get('auc'))} | {labels} |")
    return "\n".join(lines) + "\n"


def _label(mechanism: dict) -> str:
    if mechanism["name"] == "per_activation":
        return f"eps {mechanism['epsilon_per_activation']:g}/value"
    if mechanism["name"] == "per_image":
        return f"z {mechanism['noise_multiplier']:.3g}, C {mechanism['clip_norm']:g}"
    return "no noise"


def plot_privacy_utility(rows: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, title in ((axes[0], "identity_r1", "strongest identity attack (reconstructions, matching, server model)"),
                           (axes[1], "server_model_risk@1", "linkage through the server's own model")):
        for r in rows:
            marker = {"per_activation": "o", "per_image": "s", "none": "*"}[r["mechanism"]["name"]]
            color = "tab:orange" if "finetune" in r["run"] else "tab:blue"
            ax.scatter(r[key], r["test_accuracy"], marker=marker, color=color, s=60,
                       facecolors="none" if r["head"] == "device" else color)
            ax.annotate(_label(r["mechanism"]), (r[key], r["test_accuracy"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        chance = np.mean([r["identity_r1_chance"] for r in rows])
        ax.axvline(chance, color="grey", ls="--", lw=1, label=f"chance ({chance:.3f})")
        ax.set_xlabel("re-identification risk R@1 (higher = less private)")
        ax.set_ylabel("test accuracy of the run")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("privacy vs utility per run (orange: finetune, blue: scratch; o per-activation, s per-image, "
                 "* none; hollow: device head)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reconstructions(samples: dict[str, dict[str, np.ndarray]], reports: dict[str, dict], path: Path) -> None:
    """One row per run: its better inversion (by pixel linkage, then PSNR) of the same first recorded images."""
    rows = [("original", next(iter(samples.values()))["original"])]
    for name, report in reports.items():
        scores = {i: report["attacks"][f"reconstruction_{i}"] for i in ("ridge", "decoder")}
        best = max(scores, key=lambda i: (scores[i]["linkage_pixels"], scores[i]["psnr_db"]))
        rows.append((f"{name}\n{_label(report['mechanism'])}, {best}", samples[name][best]))
    cols = len(rows[0][1])
    fig, axes = plt.subplots(len(rows), cols, figsize=(1.2 * cols + 1.2, 1.2 * len(rows)), squeeze=False)
    for i, (label, images) in enumerate(rows):
        for j in range(cols):
            axes[i, j].imshow(images[j].transpose(1, 2, 0).clip(0, 1))
            axes[i, j].set_xticks([]), axes[i, j].set_yticks([])
        axes[i, 0].set_ylabel(label, fontsize=6)
    fig.suptitle("what the curious server reconstructs from the releases it received", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class PublicFaces:
    faces: FaceSet
    images: np.ndarray        # decoded at one input size and crop, in [0, 1]


def add_attacker_args(p: argparse.ArgumentParser) -> None:
    """The attacker's resources and effort; shared with the frontier runner."""
    p.add_argument("--recognizers", nargs="+", choices=("dlib", "eigenfaces"), default=["dlib", "eigenfaces"],
                   help="face recognizers for re-identification; dlib (the audit extra) is the strong one")
    p.add_argument("--recognizer-weights", type=Path, default=None,
                   help="also a backbone pre-trained on public faces (splitface-research pretrain classify) as a recognizer")
    p.add_argument("--public-images", type=int, default=1200, help="public faces the attacker fits on")
    p.add_argument("--image-size", type=int, default=32, help="reconstruction size")
    p.add_argument("--decoder-epochs", type=int, default=12)
    p.add_argument("--matcher-epochs", type=int, default=24, help="epochs of the identity-matching network")
    p.add_argument("--substitute", action="store_true",
                   help="where the devices trained their own layer: fit the attacker's copy to the recorded releases "
                        "(FORA-style substitute client) before the attacks")
    p.add_argument("--cache", type=Path, default=Path("runs") / "audit-cache",
                   help="where the strong recognizer's embeddings of clean photos are kept between audits")


def recognizer_names(args: argparse.Namespace) -> list[str]:
    """The recognizers `make_recognizers` builds, by name, in its order."""
    return [*args.recognizers, *(["public_backbone"] if args.recognizer_weights else [])]


def attacker_settings(args: argparse.Namespace, run_dir: Path) -> dict:
    """What a kept report must have been made with to be resumed: the same attacker, the same run."""
    try:
        digest = hashlib.sha256((run_dir / "results.json").read_bytes()).hexdigest()
    except FileNotFoundError as exc:
        raise SystemExit(f"splitface-research audit: {run_dir} has no results.json: not a finished splitface-research demo run ({exc})")
    return {"public_images": args.public_images, "image_size": args.image_size, "decoder_epochs": args.decoder_epochs,
            "recognizers": recognizer_names(args), "matcher_epochs": args.matcher_epochs,
            "substitute": args.substitute, "run_results_sha256": digest}


def kept_report(args: argparse.Namespace, run_dir: Path) -> tuple[dict, dict] | None:
    """With --resume, the report and samples already written for this run by the same attacker, if any. Read
    without the run's recordings, which are never committed: a clean clone resumes from the reports alone."""
    saved = args.out / f"{run_dir.name}.json"
    saved_samples = saved.with_suffix(".samples.npz")
    if not (args.resume and saved.exists() and saved_samples.exists()):
        return None
    report = json.loads(saved.read_text())
    settings = attacker_settings(args, run_dir)
    if {k: report["config"].get(k) for k in settings} != settings:
        return None
    with np.load(saved_samples) as z:
        return report, dict(z)


def make_recognizers(args: argparse.Namespace, public: np.ndarray) -> dict[str, CachedFaces]:
    recognizers: dict[str, CachedFaces] = {}
    for name in args.recognizers:
        if name == "dlib":
            try:
                dlib = DlibResNet()
                recognizers[name] = CachedFaces(dlib, f"{name}-{dlib.fingerprint}", args.cache)
            except ImportError as exc:
                raise SystemExit(f"splitface-research audit: {exc} (or pass --recognizers eigenfaces)")
        else:
            recognizers[name] = CachedFaces(Eigenfaces().fit(public), name, None)
    if args.recognizer_weights:
        recognizers["public_backbone"] = CachedFaces(PublicBackbone(args.recognizer_weights), "public_backbone", None)
    return recognizers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-research audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="splitface-research demo run directories recorded with --record-max")
    add_data_root_arg(p, help="LFW root (the private images' ground truth and the public faces)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--published-weights", type=Path, default=None,
                   help="the frozen device layer's published weights, if not at the path the run recorded")
    p.add_argument("--resume", action="store_true", help="keep the reports of runs already audited into --out")
    add_threads_arg(p)
    add_attacker_args(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = find_lfw_root(args.data)
    if args.recognizer_weights and not args.recognizer_weights.exists():
        raise SystemExit(f"splitface-research audit: {args.recognizer_weights} does not exist "
                         f"(make one with `splitface-research pretrain classify`, or leave --recognizer-weights out)")
    kept = {r: kept_report(args, r) for r in args.runs}
    to_audit = [r for r in args.runs if kept[r] is None]
    try:
        # fail on a bad run before spending time on the others
        views = {r: load_run(r, args.published_weights) for r in to_audit}
        faces = public_faces(root, args.public_images) if to_audit else None
        truths = {r: ground_truth(views[r], root, faces) for r in to_audit}
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise SystemExit(f"splitface-research audit: {exc}")
    args.out.mkdir(parents=True, exist_ok=True)
    public: dict[tuple[int, int], PublicFaces] = {}   # decoded once per input size and crop, for all runs
    for truth in truths.values():
        if (truth.size, truth.crop) not in public:
            public[truth.size, truth.crop] = PublicFaces(faces, to_input(faces.load(truth.size, truth.crop)).numpy())
    recognizers = make_recognizers(args, next(iter(public.values())).images) if to_audit else {}
    rows, samples, reports = [], {}, {}
    for run_dir in args.runs:
        started = time.time()
        if kept[run_dir] is not None:
            report, samples[run_dir.name] = kept[run_dir]
        else:
            view, truth = views[run_dir], truths[run_dir]
            report, samples[view.name] = audit_run(view, truth, public[truth.size, truth.crop], recognizers, args)
            report["config"] = {**attacker_settings(args, run_dir), "seconds": round(time.time() - started, 1)}
            saved = args.out / f"{view.name}.json"
            saved.write_text(json.dumps(report, indent=2))
            np.savez_compressed(saved.with_suffix(".samples.npz"), **samples[view.name])
        rows.append(headline(report))
        reports[run_dir.name] = report
        r = rows[-1]
        print(f"{run_dir.name}: test acc {r['test_accuracy']:.3f} | identity R@1 {r['identity_r1']:.3f} (chance "
              f"{r['identity_r1_chance']:.3f}, {r['identity_attack']}; {r['recognizer']} clean {r['recognizer_clean_r1']:.3f}) "
              f"| pixel linkage {r['linkage_pixels']:.3f} | server-model R@1 {r['server_model_risk@1']:.3f} "
              f"| MI AUC {_fmt(r['membership_auc'])} | label AUC {_fmt(r['label_direction_auc'])} "
              f"| {time.time() - started:.0f}s", flush=True)
    write_summary(args.out, rows, table(list(reports.values())), echo=False)
    plot_privacy_utility(rows, args.out / "privacy_utility.png")
    plot_reconstructions(samples, reports, args.out / "reconstructions.png")
    print(f"wrote {args.out}", flush=True)


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


if __name__ == "__main__":
    main()
