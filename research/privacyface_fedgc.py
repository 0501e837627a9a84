"""FedPE, the fixed random head, FedGC and PrivacyFace on identity-partitioned clients, reduced, scored on LFW
View 1 DevTest pairs (docs/privacyface.md). Writes results/federated/privacyface_fedgc.json (one row per run, with
summary.json's keys plus `mode`; `epsilon` is PrivacyFace's composed identity-level epsilon; the backbone
averaging is not private in any run here).

Every run starts from the public backbone of research/federated_table.py (runs/federated/public_backbone.pt, pre-trained
there if missing) and uses the same private users, clients (k people each), sampled clients per round and
local training (research/federated/methods.py). Resumable: a finished run's row is kept under
runs/privacyface_fedgc/ and reused (--force reruns).

    python research/privacyface_fedgc.py --data /path/to/lfw
    python research/privacyface_fedgc.py --data /path/to/lfw --start distilled   # -> privacyface_fedgc_distilled.*

With --start distilled every run starts from the backbone distilled from dlib's recognizer on the "federated"
public set (research/distill.py; no private user, no View 1 DevTest person) and writes beside the default
outputs under the suffix _distilled (its runs kept under runs/privacyface_fedgc-distilled/); each output says
which start, which public set, and which runs (--only: a reduced subset).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from splitface.common.dplc import DPLCConfig, dplc_sigma
from splitface.device.federated.private_head import HeadConfig
from splitface.common.models import build_backbone, resolve_spec
from splitface.common.options import add_data_root_arg, add_threads_arg, apply_threads
from research.federated.experiment import add_start_args, describe_start, load_shared, summary_row
from research.federated.methods import (MethodConfig, PrivateHeadRun, class_embedding_linkage, inverted_class_embedding_linkage)
from splitface.common.accountants.clusters import identity_epsilon

ROOT = Path(__file__).resolve().parents[1]
HEAD = HeadConfig(epochs=2, batch_size=8, lr=0.01, head_lr_scale=10.0, kind="cosface", scale=32.0, margin=0.35,
                  rho=DPLCConfig().rho)
BASE = dict(rounds=8, users_per_client=4, clients_per_round=10, head=HEAD, seed=0)


def runs() -> list[tuple[str, MethodConfig | None]]:
    fixed = dataclasses.replace(HEAD, train_head=False)
    rows: list[tuple[str, MethodConfig | None]] = [
        ("public-only", None),
        ("fedpe", MethodConfig("fedpe", **BASE)),
        ("fixed-head", MethodConfig("fixed-head", **{**BASE, "head": fixed})),
        ("fedgc lambda=20", MethodConfig("fedgc", **BASE)),
        ("fedgc lambda=20 s=32", MethodConfig("fedgc", **BASE, fedgc_scale=32.0)),  # the local loss's scale
    ]
    # the epsilon figure: per-query epsilon 0.25..inf at T = 1 and 2 (a smaller T releases more, smaller clusters,
    # whose sigma is larger: sigma ~ 1 / (|S| epsilon))
    for t, eps in ((2, 1.0), (1, math.inf), (1, 1.0), (2, math.inf), (1, 0.25), (2, 0.25), (1, 4.0), (2, 4.0)):
        rows.append((f"privacyface T={t} eps/query={eps:g}",
                     MethodConfig("privacyface", **BASE, dplc=DPLCConfig(min_members=t, queries=2, epsilon=eps))))
    # the cap radius's effect: a smaller rho, in both the release and the loss, without noise
    small = DPLCConfig(rho=0.5, min_members=1, queries=2, epsilon=math.inf)
    rows.append(("privacyface T=1 eps/query=inf rho=0.5",
                 MethodConfig("privacyface", **{**BASE, "head": dataclasses.replace(HEAD, rho=0.5)}, dplc=small)))
    return rows


def dplc_tradeoff(dim: int, rounds: int) -> list[dict]:
    """What smaller T costs: sigma per coordinate and the noise's expected norm sigma sqrt(d) (the cluster mean has
    norm <= 1) for clusters of |S| = 1..4 (the most a 4-person client has) at the default rho, delta, Q; and the
    identity-level epsilon after `rounds` DPLC calls (independent of |S|)."""
    rows = []
    for eps in (1.0, 8.0):
        config = DPLCConfig(epsilon=eps)
        composed = identity_epsilon(config, rounds, config.delta)
        for size in (1, 2, 3, 4):
            sigma = dplc_sigma(size, eps, config.delta, config.rho)
            rows.append({"query_epsilon": eps, "size": size, "sigma": sigma, "noise_norm": sigma * math.sqrt(dim),
                         "rounds": rounds, "queries": config.queries, "identity_epsilon": composed["epsilon"],
                         "delta": config.delta})
    return rows


def dlib_photo_vectors(data, max_users: int, cache: Path, size: int):
    """dlib's vectors of the private photos, as the audit embeds them (its on-disk cache, by path/size/crop)."""
    from research.audit.recognizer import CachedFaces, DlibResNet
    from research.federated.population import private_faces
    dlib = DlibResNet()
    faces = private_faces(data, max_users, seed=0)
    return dlib, CachedFaces(dlib, f"dlib-{dlib.fingerprint}", cache).embed_faces(faces, size, 160)


def public_faces(data, count: int, size: int):
    """`count` public faces (a seeded sample of the public split): the inversion's training set."""
    import numpy as np
    from research.federated.population import public_split
    public = public_split(data).train
    keep = np.sort(np.random.default_rng(1).permutation(len(public))[:count])
    return public.subset(keep).load(size)


def run_one(shared, name: str, config: MethodConfig | None, attack=None) -> dict:
    started = time.time()
    if config is None:
        model = build_backbone(shared.spec)
        model.load_state_dict(shared.init_state)
        return summary_row("public-only", 0, None, {}, shared.evaluator(model),
                           {"run": name, "mode": "federated", "start": shared.start, "wall_s": time.time() - started})
    run = PrivateHeadRun(config, shared.spec, shared.population, shared.init_state)
    history = run.run(log=lambda s: print(s, flush=True))
    privacy = run.privacy()
    report = shared.evaluator(run.backbone)
    extra = {"run": name, "mode": "federated", "start": shared.start, "users": len(shared.population.users),
             "clients": len(run.clients), "users_per_client": config.users_per_client,
             "clients_per_round": config.clients_per_round, "dplc_calls_max": int(run.dplc_calls.max()),
             "history": history, "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
             "privacy": privacy, "wall_s": time.time() - started}
    if config.method in ("fedpe", "fedgc"):  # FedGC uploads these heads; FedPE's stay home (a reference)
        extra.update(class_embedding_linkage(run, shared.evaluator.public_images))
        if attack is not None:  # (recognizer, its photo vectors, public faces for the inversion)
            recognizer, photos, public = attack
            extra.update(inverted_class_embedding_linkage(run, public, recognizer.embed, photos))
    if config.method == "privacyface":
        released = [h["clusters_released"] for h in history]
        extra.update({"clusters_released_total": int(sum(released)), "dplc_min_members": config.dplc.min_members,
                      "dplc_queries": config.dplc.queries, "dplc_rho": config.dplc.rho,
                      "query_epsilon": None if math.isinf(config.dplc.epsilon) else config.dplc.epsilon,
                      "query_delta": config.dplc.delta})
    return summary_row(config.method, config.rounds, config.clients_per_round * config.users_per_client,
                       privacy, report, extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p)
    add_start_args(p)
    p.add_argument("--out", type=Path, default=None,
                   help="default results/federated/privacyface_fedgc.json (public-split), "
                        "privacyface_fedgc_<start>.json otherwise")
    p.add_argument("--cache", type=Path, default=None,
                   help="finished runs (default runs/privacyface_fedgc, runs/privacyface_fedgc-<start> otherwise)")
    p.add_argument("--max-users", type=int, default=200)
    p.add_argument("--only", nargs="*", default=None, help="run only these runs (names as in the output)")
    p.add_argument("--dlib-linkage", action="store_true",
                   help="FedPE/FedGC runs also attack the held heads by ridge inversion + dlib (the audit extra)")
    p.add_argument("--audit-cache", type=Path, default=ROOT / "runs" / "audit-cache")
    add_threads_arg(p, 1)
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    suffix = "" if args.start == "public-split" else f"_{args.start}"
    args.out = args.out or ROOT / "results" / "federated" / f"privacyface_fedgc{suffix}.json"
    args.cache = args.cache or ROOT / "runs" / f"privacyface_fedgc{suffix.replace('_', '-')}"
    apply_threads(args)
    started = time.time()
    spec = resolve_spec("iresnet_small")
    args.cache.mkdir(parents=True, exist_ok=True)
    cache = {name: args.cache / (name.replace(" ", "_").replace("/", "-") + ".json") for name, _ in runs()}
    todo = [(name, config) for name, config in runs()
            if (args.force or not cache[name].exists()) and (args.only is None or name in args.only)]
    if todo:  # decoding the data and the pairs costs minutes: only when something runs
        shared = load_shared(spec, args.data, args.backbone, args.pretrain_epochs, args.max_users, start=args.start)
        attack = None
        if args.dlib_linkage:
            recognizer, photos = dlib_photo_vectors(args.data, args.max_users, args.audit_cache, spec.input_size)
            attack = (recognizer, photos, public_faces(args.data, 1024, spec.input_size))
        for name, config in todo:
            print(f"== {name}", flush=True)
            cache[name].write_text(json.dumps(run_one(shared, name, config, attack), indent=2))
    rows = [json.loads(path.read_text()) for path in cache.values() if path.exists()]
    for row in rows:
        print(f"{row['run']}: View 1 {row['view1_accuracy']:.3f} +- {row['view1_std']:.3f}, "
              f"TAR@1e-2 {row['tar_at_far_1e-2']:.3f}, identity-level eps {row['epsilon']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ran = {row["run"] for row in rows}
    missing = [name for name, _ in runs() if name not in ran]
    start = ["--backbone", str(args.backbone)] if args.start == "public-split" else ["--start", args.start]
    command = ["python", "research/privacyface_fedgc.py", "--data", "LFW", *start] \
        + (["--dlib-linkage"] if any("inverted_linkage_top1" in row for row in rows) else []) \
        + (["--max-users", str(args.max_users)] if args.max_users != 200 else []) \
        + (["--only", *(repr(name) for name, _ in runs() if name in ran)] if missing else [])
    # rows made before runs recorded their start: the public-split one these options name
    started_from = rows[0].get("start", {"start": args.start, "file": str(args.backbone),
                                         "pretrain_epochs": args.pretrain_epochs}) if rows else {}
    args.out.write_text(json.dumps({"command": " ".join(command), "max_users": args.max_users,
                                    "backbone": started_from.get("file", str(args.backbone)), "start": started_from,
                                    "not_run": missing, "rows": rows,
                                    "dplc_tradeoff": dplc_tradeoff(spec.embedding_dim, BASE["rounds"])}, indent=2))
    if rows:
        default = ROOT / "results" / "federated" / "privacyface_fedgc.json"
        reference = {} if args.start == "public-split" or not default.exists() else \
            {r["run"]: r for r in json.loads(default.read_text())["rows"]}
        args.out.with_suffix(".md").write_text(table(rows, started_from, missing, args.max_users, " ".join(command),
                                                     reference))
    summary = args.out.with_name(args.out.stem + "_summary.json")
    summary.write_text(json.dumps(summary_rows(rows), indent=2))
    epsilon_figure(rows, args.out.with_name(args.out.stem + "_epsilon.png"))
    print(f"wrote {args.out}, {summary.name} and the epsilon figure ({time.time() - started:.0f} s)")


def table(rows: list[dict], start: dict, missing: list[str], max_users: int, command: str,
          reference: dict[str, dict]) -> str:
    """The runs' View 1, TAR, identity-level epsilon and (FedPE/FedGC) class-embedding linkage, under a header that
    says the size, the start and which runs are missing; `reference`: the same runs from the public-split start
    (results/federated/privacyface_fedgc.json), a column beside."""
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3g}" if abs(x) >= 100 else f"{x:.3f}"
    head = BASE["head"]
    lines = ["# PrivacyFace, FedGC, FedPE and the fixed head: reduced run"
             + (f", from the {start['start']} start" if start.get("start", "public-split") != "public-split" else ""),
             "",
             f"**Reduced**: IResNet-small at 64x64 on a shared 2-core CPU; {max_users} private users (a seeded subset "
             f"of the View 1 DevTrain people with 2-9 photos), {BASE['users_per_client']} per client, "
             f"{BASE['clients_per_round']} clients per round, {BASE['rounds']} rounds, {head.epochs} local epochs "
             f"(batch {head.batch_size}, lr {head.lr}, head lr x{head.head_lr_scale:g}, {head.kind} "
             f"s = {head.scale:g}, m = {head.margin}); " + (describe_start(start) if start else "start unknown")
             + ". epsilon: "
             "PrivacyFace's composed identity-level epsilon (the backbone averaging is not private in any run). "
             f"Regenerate: `{command}`.", ""]
    if missing:
        lines += [f"**Partial**: {len(rows)} of the bench's {len(rows) + len(missing)} runs; not run here: "
                  f"{', '.join(missing)}.", ""]
    before = " public-split start: View 1 (TAR) |" if reference else ""
    lines += ["| run | method | epsilon | View 1 acc | std | AUC | TAR@FAR=1e-2 | head linkage top-1 (chance) |"
              + before,
              "|---|---|---|---|---|---|---|---|" + ("---|" if reference else "")]
    for r in rows:
        link = "-" if r.get("linkage_top1") is None else f"{r['linkage_top1']:.3f} ({r['linkage_chance']:.3f})"
        ref = reference.get(r["run"])
        same = "" if not reference else f" {ref['view1_accuracy']:.3f} ({ref['tar_at_far_1e-2']:.3f}) |" if ref \
            else " - |"
        lines.append(f"| {r['run']} | {r['method']} | {num(r['epsilon'])} | {r['view1_accuracy']:.3f} "
                     f"| {r['view1_std']:.3f} | {r['roc_auc']:.3f} | {r['tar_at_far_1e-2']:.3f} | {link} |" + same)
    return "\n".join(lines) + "\n"


SUMMARY_KEYS = ("run", "method", "mode", "noise_multiplier", "rounds", "users_per_round", "epsilon", "delta",
                "view1_accuracy", "view1_std", "roc_auc", "tar_at_far_1e-2", "epsilon_rdp", "users",
                "linkage_top1", "linkage_chance", "inverted_linkage_top1", "inverted_linkage_chance",
                "dplc_min_members", "query_epsilon", "dplc_calls_max")


def summary_rows(rows: list[dict]) -> list[dict]:
    """These rows in results/federated/summary.json's form (its keys, plus `mode` and the method's own:
    class-embedding linkage for FedPE/FedGC, T and per-query epsilon for PrivacyFace); the public-only
    reference is summary.json's own row already. research/federated_table.py appends these (see docs/privacyface.md)."""
    return [{k: row[k] for k in SUMMARY_KEYS if k in row} for row in rows if row["method"] != "public-only"]


def epsilon_figure(rows: list[dict], path: Path) -> None:
    """View 1 accuracy against PrivacyFace's composed identity-level epsilon, one line per T (no noise at the right
    edge), with FedPE (its plain baseline) and the public backbone as horizontal references."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ours = [r for r in rows if r["method"] == "privacyface" and r.get("dplc_rho", 0) > 0.6]  # the default rho
    finite = [r["epsilon"] for r in ours if r["epsilon"] is not None]
    if not finite:
        return
    inf_x = max(finite) * 4
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in sorted({r["dplc_min_members"] for r in ours}):
        pts = sorted((r["epsilon"] if r["epsilon"] is not None else inf_x, r["view1_accuracy"], r["view1_std"])
                     for r in ours if r["dplc_min_members"] == t)
        x, y, e = zip(*pts)
        ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=f"PrivacyFace T={t}")
    for name, style in (("fedpe", "--"), ("public-only", ":")):
        ref = [r for r in rows if r["method"] == name]
        if ref:
            ax.axhline(ref[0]["view1_accuracy"], linestyle=style, color="grey", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"identity-level epsilon (PLD, delta 1e-5; no noise plotted at {inf_x:.0f})")
    ax.set_ylabel("LFW View 1 accuracy (DevTest)")
    ax.set_title("PrivacyFace: utility vs identity-level epsilon")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
