"""Issue 14, reduced: FedPE, the fixed random head, FedGC and PrivacyFace on identity-partitioned clients,
scored on LFW View 1 DevTest pairs. Writes results/federated/privacyface_fedgc.json (one row per run, with
summary.json's keys plus `mode`; `epsilon` is PrivacyFace's composed identity-level epsilon; the backbone
averaging is not private in any run here).

Every run starts from the public backbone of bench/federated.py (runs/federated/public_backbone.pt, pre-trained
there if missing) and uses the same private users, clients (k people each), sampled clients per round and
local training (edge_server/federated/methods.py). Resumable: a finished run's row is kept under
runs/privacyface_fedgc/ and reused (--force reruns).

    python bench/privacyface_fedgc.py --data /path/to/lfw
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from device_sdk.federated.dplc import DPLCConfig, dplc_sigma
from device_sdk.federated.private_head import HeadConfig
from device_sdk.models import build_backbone, resolve_spec
from device_sdk.options import add_data_root_arg, add_threads_arg, apply_threads
from edge_server.federated.experiment import load_shared, summary_row
from edge_server.federated.methods import MethodConfig, PrivateHeadRun, class_embedding_linkage
from edge_server.federated.privacyface_accounting import identity_epsilon

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
    for t, eps in ((2, 1.0), (1, math.inf), (1, 1.0)):
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


def run_one(shared, name: str, config: MethodConfig | None) -> dict:
    started = time.time()
    if config is None:
        model = build_backbone(shared.spec)
        model.load_state_dict(shared.init_state)
        return summary_row("public-only", 0, None, {}, shared.evaluator(model),
                           {"run": name, "mode": "federated", "wall_s": time.time() - started})
    run = PrivateHeadRun(config, shared.spec, shared.population, shared.init_state)
    history = run.run(log=lambda s: print(s, flush=True))
    privacy = run.privacy()
    report = shared.evaluator(run.backbone)
    extra = {"run": name, "mode": "federated", "users": len(shared.population.users),
             "clients": len(run.clients), "users_per_client": config.users_per_client,
             "clients_per_round": config.clients_per_round, "dplc_calls_max": int(run.dplc_calls.max()),
             "history": history, "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
             "privacy": privacy, "wall_s": time.time() - started}
    if config.method in ("fedpe", "fedgc"):  # FedGC uploads these heads; FedPE's stay home (a reference)
        extra.update(class_embedding_linkage(run, shared.evaluator.public_images))
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
    p.add_argument("--out", type=Path, default=ROOT / "results" / "federated" / "privacyface_fedgc.json")
    p.add_argument("--cache", type=Path, default=ROOT / "runs" / "privacyface_fedgc")
    p.add_argument("--backbone", type=Path, default=ROOT / "runs" / "federated" / "public_backbone.pt")
    p.add_argument("--pretrain-epochs", type=int, default=4)
    p.add_argument("--max-users", type=int, default=200)
    p.add_argument("--only", nargs="*", default=None, help="run only these runs (names as in the output)")
    add_threads_arg(p, 1)
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    apply_threads(args)
    started = time.time()
    shared = load_shared(resolve_spec("iresnet_small"), args.data, args.backbone, args.pretrain_epochs,
                         args.max_users)
    args.cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, config in runs():
        cached = args.cache / (name.replace(" ", "_").replace("/", "-") + ".json")
        if (args.force or not cached.exists()) and (args.only is None or name in args.only):
            print(f"== {name}", flush=True)
            cached.write_text(json.dumps(run_one(shared, name, config), indent=2))
        if cached.exists():
            row = json.loads(cached.read_text())
            rows.append(row)
            print(f"{name}: View 1 {row['view1_accuracy']:.3f} +- {row['view1_std']:.3f}, "
                  f"TAR@1e-2 {row['tar_at_far_1e-2']:.3f}, identity-level eps {row['epsilon']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = ["python", "bench/privacyface_fedgc.py", "--data", "LFW", "--backbone", str(args.backbone)] + \
        (["--max-users", str(args.max_users)] if args.max_users != 200 else [])  # every run, from the cache or not
    args.out.write_text(json.dumps({"command": " ".join(command), "max_users": args.max_users,
                                    "backbone": str(args.backbone), "rows": rows,
                                    "dplc_tradeoff": dplc_tradeoff(shared.spec.embedding_dim, BASE["rounds"])}, indent=2))
    print(f"wrote {args.out} ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
