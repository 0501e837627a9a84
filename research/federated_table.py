"""Federated experiments: DP-FedEmb against its baselines on LFW DevTrain people, scored on View 1
DevTest pairs. Writes results/federated/{summary.json, table.md, utility_vs_epsilon.png, utility_vs_rounds.png}.

Runs (all from one start: by default the backbone pre-trained on the public split, see
research/federated/population.py; with --start distilled the backbone distilled from dlib's recognizer on the
"federated" public set, research/distill.py, which holds no private user and no View 1 DevTest person):
public-only (that backbone), centralized (non-private, every private user's photos at once), fedavg and
fedemb (non-private), dp-fedemb at several noise multipliers (and once with adaptive clipping), dp-fedavg
at some of the same multipliers; plus extrapolation rows (the seed's: the same noise on the average
update with 1e5 and 1e6 users, accounted, not trained).

Reduced configuration for a shared 2-core CPU (see CONFIG): IResNet-small at 64 px, a few rounds of a few
virtual clients. Resumable: a run with result.json is reused, a run with a checkpoint resumes from its last
round (--force starts afresh).

    python research/federated_table.py --data /path/to/lfw
    python research/federated_table.py --data /path/to/lfw --start distilled      # -> results/federated-distilled

`--wire` instead writes results/federated/wire.json: the bytes of each round message per client and round for
the bench's model (encoded by the protocol's own builders; f32 sizes do not depend on the values).
`--backends` instead runs one short DP-FedEmb run (random-init backbone: the backends, not accuracy) on each
backend in turn - in-process, Ray (local, 2 CPUs), websocket with one device process per virtual client on
this machine - and writes results/federated/backends.json: wall time per round side by side and whether each
final global model equals the in-process one bit for bit (every client on one torch thread).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

from splitface.common.models import resolve_spec  # noqa: E402
from splitface.common.options import add_data_root_arg, add_threads_arg, apply_threads  # noqa: E402
from research.federated import FederatedConfig
from splitface.common.accountants.user_level import extrapolate  # noqa: E402
from research.federated.experiment import (Shared, add_start_args, describe_start, load_shared, run_centralized, run_federated, run_public_only)
from research.federated.population import load_population  # noqa: E402
from research.results import write_summary  # noqa: E402

# The reduced configuration: every federated run shares it (CPU budget: ~45 min for everything). Client lr 0.01:
# at 0.05 local updates grew from norm 1.2 to 2.5 over rounds and View 1 fell from 0.79 to 0.63 (fedemb and fedavg
# alike); at 0.01 the median update norm is ~0.04, hence the clip norm 0.05.
CONFIG = FederatedConfig(method="fedemb", rounds=10, users_per_client=4, clients_per_round=10.0, local_epochs=2,
                         batch_size=8, client_lr=0.01, head_lr_scale=10.0, server_lr=1.0, server_momentum=0.9,
                         clip_norm=0.05, seed=0)
# The clients' own optimizer over everyone at once (head lr x10 with momentum 0.9 at lr 0.05 diverged: mean loss 9.5)
CENTRALIZED = {"epochs": 1, "lr": 0.01, "batch_size": 8, "head_lr_scale": 10.0, "momentum": 0.0}
NOISE = (0.1, 0.3, 1.0)  # dp-fedemb; dp-fedavg at the first two
FEDAVG_CLIP = 1.4  # the median norm of DP-FedAvg's updates at the shared clip norm (1.15-1.48 per round)
EXTRAPOLATE_USERS = (100_000, 1_000_000)
# the runs the two questions compare (FedEmb against centralized, DP-FedEmb against DP-FedAvg at the same
# z), run again with these seeds: a single seed's difference is inside its 10-fold spread
HEADLINE = ("centralized", "fedemb", "dp-fedemb-z0.1", "dp-fedemb-z0.3", "dp-fedavg-z0.1", "dp-fedavg-z0.3")
EXTRA_SEEDS = (1, 2)
# DP-FedEmb with the 2854 one-photo DevTrain people as extra users (local heads allow them; population.py)
SINGLE_PHOTO = f"dp-fedemb-z{NOISE[1]:g}-single-photo"


def runs() -> list[tuple[str, FederatedConfig | None, int]]:
    """(name, config (None: not federated), seed) of every run: the seed-0 runs, then the headline runs again
    with the other seeds (only the seed changes: the virtual clients' grouping, the sampling, the clients'
    shuffles and heads, the noise; the public backbone and the View 1 calibration images stay)."""
    out: list[tuple[str, FederatedConfig | None]] = [("public-only", None), ("centralized", None),
                                                     ("fedavg", dataclasses.replace(CONFIG, method="fedavg")),
                                                     ("fedemb", CONFIG)]
    for z in NOISE:
        out.append((f"dp-fedemb-z{z:g}", dataclasses.replace(CONFIG, method="dp-fedemb", noise_multiplier=z)))
    out.append((f"dp-fedemb-z{NOISE[1]:g}-adaptive", dataclasses.replace(
        CONFIG, method="dp-fedemb", noise_multiplier=NOISE[1], target_quantile=0.5)))
    out.append((SINGLE_PHOTO, dataclasses.replace(CONFIG, method="dp-fedemb", noise_multiplier=NOISE[1])))
    for z in NOISE[:2]:
        out.append((f"dp-fedavg-z{z:g}", dataclasses.replace(CONFIG, method="dp-fedavg", noise_multiplier=z)))
    for z in NOISE[:2]:  # DP-FedAvg clipped at its own median update norm (the global head's change dominates it)
        out.append((f"dp-fedavg-z{z:g}-C{FEDAVG_CLIP:g}", dataclasses.replace(
            CONFIG, method="dp-fedavg", noise_multiplier=z, clip_norm=FEDAVG_CLIP)))
    seeded = [(name, config, CONFIG.seed) for name, config in out]
    for seed in EXTRA_SEEDS:
        seeded += [(seed_name(name, seed), config and dataclasses.replace(config, seed=seed), seed)
                   for name, config in out if name in HEADLINE]
    return seeded


def with_single_photo_users(shared: Shared, lfw: str | None) -> Shared:
    """The same experiment with DevTrain's one-photo people as private users too."""
    return dataclasses.replace(shared, population=load_population(lfw, shared.spec.input_size, single_photo=True))


def seed_name(name: str, seed: int) -> str:
    return name if seed == CONFIG.seed else f"{name}-seed{seed}"


def across_seeds(measured: dict[str, dict]) -> dict[str, dict]:
    """Each headline run's View 1 accuracy over the seeds run: mean, sample std (n - 1) and the values."""
    out = {}
    for name in HEADLINE:
        accs = [measured[n]["view1_accuracy"] for n in [name, *(seed_name(name, s) for s in EXTRA_SEEDS)]
                if n in measured]
        if len(accs) > 1:
            out[name] = {"seeds": len(accs), "mean": statistics.mean(accs), "std": statistics.stdev(accs),
                         "values": accs, "epsilon": measured[name]["epsilon"]}
    return out


def extrapolation_rows(row: dict, name: str) -> list[dict]:
    rows = []
    for users in EXTRAPOLATE_USERS:
        e = extrapolate(row["sampling_rate"], row["noise_multiplier"], row["rounds"], row["users"], users)
        rows.append({"method": f"{row['method']} (extrapolated)", "noise_multiplier": e["noise_multiplier"],
                     "rounds": row["rounds"], "users_per_round": row["sampling_rate"] * users,
                     "epsilon": e["epsilon"], "delta": e["delta"], "view1_accuracy": None, "view1_std": None,
                     "roc_auc": None, "tar_at_far_1e-2": None, "epsilon_rdp": e["epsilon_rdp"], "users": users,
                     "run": f"extrapolated from {name}",
                     "note": f"accounted only, not trained: {users} users, the same sampling rate and rounds, z scaled "
                             f"by {users}/{row['users']} so the noise on the average update equals {name}'s; "
                             f"utility is assumed, not measured, to be at least {name}'s"})
    return rows


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}" if abs(x) >= 100 or abs(x) < 0.01 else f"{x:.{digits}f}"


def within(gap: float, a: dict, b: dict) -> str:
    """Says when a difference is inside the 10-fold spread (one seed per run: not a measured difference)."""
    spread = max(a["view1_std"], b["view1_std"])
    return f"; within one 10-fold std ({spread:.3f}) of a single-seed run" if abs(gap) < spread else ""


def versus(a: str, b: str, measured: dict[str, dict], seeds: dict[str, dict]) -> tuple[float, str]:
    """Run a's View 1 accuracy against run b's: over the seeds both were run with when there are several (paired
    by seed: the same seed draws the same virtual clients and sample), else the single-seed values."""
    if a in seeds and b in seeds and seeds[a]["seeds"] == seeds[b]["seeds"]:
        diffs = [x - y for x, y in zip(seeds[a]["values"], seeds[b]["values"])]
        gap = statistics.mean(diffs)
        agree = sum((d > 0) == (gap > 0) for d in diffs)
        return gap, (f"{seeds[a]['mean']:.3f} +- {seeds[a]['std']:.3f} vs {seeds[b]['mean']:.3f} +- "
                     f"{seeds[b]['std']:.3f} over {len(diffs)} seeds (mean +- std across seeds); difference "
                     f"{gap:+.3f} +- {statistics.stdev(diffs):.3f}, the same sign in {agree} of {len(diffs)} seeds "
                     f"({', '.join(f'{d:+.3f}' for d in diffs)})")
    ra, rb = measured[a], measured[b]
    gap = ra["view1_accuracy"] - rb["view1_accuracy"]
    return gap, f"{ra['view1_accuracy']:.3f} vs {rb['view1_accuracy']:.3f} ({gap:+.3f}{within(gap, ra, rb)})"


def against_public_split(measured: dict[str, dict]) -> list[str]:
    """The same runs from the public-split start (results/federated/summary.json), side by side: what the start
    changes, at the same seeds, private users and configuration."""
    reference = ROOT / "results" / "federated" / "summary.json"
    if not reference.exists():
        return []
    before = {r["run"]: r for r in json.loads(reference.read_text()) if r.get("run") and r.get("view1_accuracy")}
    both = [name for name in measured if name in before]
    if not both:
        return []
    lines = ["", "## Against the public-split start", "",
             "The same runs from the backbone pre-trained on the 111 public DevTrain people (`results/federated/`): "
             "View 1 accuracy (10-fold std).", "",
             "| run | epsilon | public-split start | distilled start | difference |", "|---|---|---|---|---|"]
    for name in both:
        a, b = before[name], measured[name]
        lines.append(f"| {name} | {fmt(b['epsilon'])} | {a['view1_accuracy']:.3f} ({a['view1_std']:.3f}) "
                     f"| {b['view1_accuracy']:.3f} ({b['view1_std']:.3f}) "
                     f"| {b['view1_accuracy'] - a['view1_accuracy']:+.3f} |")
    return lines


def table(rows: list[dict], config: dict) -> str:
    """`config`: the private users' count and the start (experiment.start_state's description); a partial table
    names the bench's runs it lacks."""
    measured = {r["run"]: r for r in rows if "extrapolated" not in r["method"]}
    seeds = across_seeds(measured)
    rows = [r for r in rows if r.get("seed") in (None, CONFIG.seed)]  # the other seeds: their own section
    distilled = config["start"]["start"] == "distilled"
    lines = ["# Federated face recognition with user-level DP: reduced run"
             + (", from the distilled start" if distilled else ""), "",
             "**Reduced**: IResNet-small at 64x64 on a shared 2-core CPU; "
             f"{config['users']} private users (View 1 DevTrain people with 2-9 photos); "
             f"{describe_start(config['start'])}; every federated run "
             f"{CONFIG.rounds} rounds, {CONFIG.users_per_client} users per virtual client, "
             f"{CONFIG.clients_per_round:g} virtual clients per round expected (Poisson), {CONFIG.local_epochs} local "
             f"epochs (batch {CONFIG.batch_size}, client lr {CONFIG.client_lr}, head lr x{CONFIG.head_lr_scale:g}), "
             f"server SGD lr {CONFIG.server_lr} momentum {CONFIG.server_momentum}, clip norm {CONFIG.clip_norm}; "
             f"centralized: {CENTRALIZED['epochs']} epoch over all private photos "
             f"(batch {CENTRALIZED['batch_size']}, lr "
             f"{CENTRALIZED['lr']}, momentum {CENTRALIZED['momentum']}, head lr x{CENTRALIZED['head_lr_scale']:g}). "
             "View 1: 1000 DevTest pairs (people never trained on), 10-fold accuracy, TAR at FAR = 1e-2 "
             "(500 negative pairs: no lower FAR is meaningful). epsilon: user-level, PLD (RDP in summary.json), "
             "for the Poisson sampling run; delta = 1/users^1.1. Regenerate: `python research/federated_table.py"
             + (" --start distilled" if distilled else "") + "`.", ""]
    missing = [name for name, _, _ in runs() if name not in measured]
    if missing:
        lines += [f"**Partial**: {len(measured)} of the bench's {len(runs())} runs; not run here: "
                  f"{', '.join(missing)}.", ""]
    lines += [
             "| run | method | z | rounds | users/round | epsilon | delta | View 1 acc | std | AUC | TAR@FAR=1e-2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = "-" if r["rounds"] is None else r["rounds"]
        lines.append(f"| {r['run']} | {r['method']} | {fmt(r['noise_multiplier'])} | {rounds} "
                     f"| {fmt(r['users_per_round'], 3)} | {fmt(r['epsilon'])} | {fmt(r['delta'], 2)} "
                     f"| {fmt(r['view1_accuracy'])} | {fmt(r['view1_std'])} | {fmt(r['roc_auc'])} "
                     f"| {fmt(r['tar_at_far_1e-2'])} |")
    lines += ["", "Extrapolated rows are accounted, not trained (see their `note` in summary.json)."]
    if seeds:
        lines += ["", "## Across seeds", "", f"The headline runs again with seeds {', '.join(map(str, EXTRA_SEEDS))} "
                  "(rows `<run>-seed<s>` in summary.json; only the seed changes: the virtual clients, the sampling, "
                  "the clients' shuffles and heads, the noise; the public backbone and the evaluation stay). "
                  "std here is across seeds (n - 1), not the 10-fold std above.", "",
                  "| run | epsilon | seeds | View 1 acc mean | std across seeds | per seed |", "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {fmt(v['epsilon'])} | {v['seeds']} | {v['mean']:.3f} | {v['std']:.3f} "
                  f"| {' / '.join(f'{x:.3f}' for x in v['values'])} |" for name, v in seeds.items()]
    reference = ROOT / "results" / "verification" / "reference.json"
    if reference.exists():  # measured by research/verification_reference.py on the same pairs
        lines += ["", "Reference recognizers on the same 1000 pairs (`results/verification/reference.json`, from "
                  "`research/verification_reference.py`):", ""]
        lines += [f"- {r['method']}: {r['view1_accuracy']:.3f} +- {r['view1_std']:.3f}, AUC {r['roc_auc']:.3f}, "
                  f"TAR@FAR=1e-2 {r['tar_at_far_1e-2']:.3f}" for r in json.loads(reference.read_text())]
    if distilled:
        lines += against_public_split(measured)
    lines += ["", "## As measured"]
    fedemb, central = measured.get("fedemb"), measured.get("centralized")
    if fedemb and central:
        gap, text = versus("fedemb", "centralized", measured, seeds)
        lines.append(f"- Non-private FedEmb {'reaches' if gap >= 0 else 'does not reach'} centralized training: "
                     f"{text}. FedEmb trained on {fedemb['client_images_trained']} "
                     f"client image-steps, centralized on {central['client_images_trained']}; the non-private "
                     f"federated runs are unclipped (see the DP runs at small z).")
    for z in NOISE:
        emb, avg = f"dp-fedemb-z{z:g}", f"dp-fedavg-z{z:g}"
        if emb in measured and avg in measured:
            gap, text = versus(emb, avg, measured, seeds)
            lines.append(f"- At z = {z:g}, DP-FedEmb {'beats' if gap > 0 else 'does not beat'} DP-FedAvg: {text}.")
    avg = [r for r in measured.values()
           if r["method"] == "dp-fedavg" and r["config"]["clip_norm"] == CONFIG.clip_norm]
    if avg:
        norms = [h["median_norm"] for r in avg for h in r["history"]]
        lines.append(f"- DP-FedAvg's uploads carry the global head's change: their median norm per round is "
                     f"{min(norms):.2f}-{max(norms):.2f} against the clip norm {CONFIG.clip_norm}, so they are scaled "
                     f"down that much and its backbone barely moves from the public one.")
    for z in NOISE[:2]:
        emb, own = measured.get(f"dp-fedemb-z{z:g}"), measured.get(f"dp-fedavg-z{z:g}-C{FEDAVG_CLIP:g}")
        if emb and own:
            gap = emb["view1_accuracy"] - own["view1_accuracy"]
            lines.append(f"- DP-FedAvg clipped at its own median norm {FEDAVG_CLIP:g} (noise z C "
                         f"{FEDAVG_CLIP / CONFIG.clip_norm:.0f}x larger) at z = {z:g}: {own['view1_accuracy']:.3f}, "
                         f"against DP-FedEmb's {emb['view1_accuracy']:.3f} at the same z ({gap:+.3f}"
                         f"{within(gap, emb, own)}).")
    single, base = measured.get(SINGLE_PHOTO), measured.get(f"dp-fedemb-z{NOISE[1]:g}")
    if single and base:
        gap = single["view1_accuracy"] - base["view1_accuracy"]
        lines.append(f"- DP-FedEmb at z = {NOISE[1]:g} with the {single['single_photo_users']} one-photo DevTrain "
                     f"people as extra users ({single['users']} users, the same {CONFIG.clients_per_round:g} virtual "
                     f"clients per round expected, so the same compute and noise per round and a smaller sampling "
                     f"rate): {single['view1_accuracy']:.3f} at epsilon {fmt(single['epsilon'])} (delta "
                     f"{fmt(single['delta'], 2)}), against {base['view1_accuracy']:.3f} at epsilon "
                     f"{fmt(base['epsilon'])} without them ({gap:+.3f}{within(gap, single, base)}).")
    public = measured.get("public-only")
    if public:
        lines.append(f"- The public backbone alone scores {public['view1_accuracy']:.3f}: every run starts there.")
    return "\n".join(lines) + "\n"


def figures(rows: list[dict], out: Path, start: str) -> None:
    """Utility against epsilon and against rounds; the titles name the start."""
    run = "reduced run" + (f", {start} start" if start != "public-split" else "")
    measured = [r for r in rows if "extrapolated" not in r["method"] and r.get("seed") in (None, CONFIG.seed)]
    fig, ax = plt.subplots(figsize=(6, 4))
    def on_curve(r: dict) -> bool:
        return r["epsilon"] is not None and not r.get("adaptive_clipping") and r["run"] != SINGLE_PHOTO
    curves = sorted({(r["method"], r["config"]["clip_norm"]) for r in measured if on_curve(r)})
    for (method, clip), marker in zip(curves, "osD^v"):
        pts = sorted((r["epsilon"], r["view1_accuracy"]) for r in measured
                     if on_curve(r) and (r["method"], r["config"]["clip_norm"]) == (method, clip))
        ax.plot(*zip(*pts), marker=marker, label=f"{method}, clip {clip:g}")
    for r in measured:
        if r["epsilon"] is not None and not on_curve(r):
            ax.scatter([r["epsilon"]], [r["view1_accuracy"]], marker="*", s=120, label=f"{r['run']}")
    for r, style, color in zip([r for r in measured if r["epsilon"] is None], ("--", ":", "-.", (0, (5, 1, 1, 1))),
                               ("gray", "black", "tab:brown", "tab:olive")):
        ax.axhline(r["view1_accuracy"], linestyle=style, color=color, label=f"{r['run']} (no DP)")
    ax.set_xscale("log")
    ax.set_xlabel("user-level epsilon (PLD)")
    ax.set_ylabel("View 1 DevTest accuracy")
    ax.set_title(f"Utility against user-level epsilon ({run})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "utility_vs_epsilon.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    start = [r.get("progress_view1_accuracy") for r in measured if r["method"] == "public-only"]
    for r in measured:
        pts = [(h["round"], h["view1_accuracy"]) for h in r.get("history", []) if h.get("view1_accuracy") is not None]
        if pts and start and start[0] is not None:
            pts = [(0, start[0]), *pts]  # every run starts from the public backbone
        if pts:
            ax.plot(*zip(*pts), marker=".", label=r["run"])
    ax.set_xlabel("round")
    ax.set_ylabel(f"View 1 accuracy ({measured[0].get('progress_pairs', '?')} DevTest pairs)")
    ax.set_title(f"Utility against rounds ({run})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "utility_vs_rounds.png", dpi=120)
    plt.close(fig)


def wire_bytes(spec_name: str = "iresnet_small", users: int = 1073) -> dict:
    """Bytes on the wire per sampled client and round (websocket backend, SPEC.md section 15), FedEmb and FedAvg."""
    import numpy as np

    from splitface.device.federated.wire import backbone_template, config_to_wire, state_to_wire, upload_shapes
    from splitface.protocol import messages as m
    from splitface.protocol.client_session import FederatedClientSession
    from splitface.protocol.round_board import RoundBoard

    spec = resolve_spec(spec_name)
    out = {"model": spec_name, "users_fedavg_head": users, "encoding": "f32"}
    weights = state_to_wire(backbone_template(spec))
    for method, head_shape in (("fedemb", None), ("fedavg", (users, spec.embedding_dim))):
        shapes = upload_shapes(spec, head_shape)
        head = None if head_shape is None else {"weight": np.zeros(head_shape, np.float32),
                                                "bias": np.zeros(head_shape[0], np.float32)}
        board = RoundBoard(spec.to_dict())
        board.open(1, {"client-0": 2**31}, config_to_wire(CONFIG.local(CONFIG.clip_norm))[0], CONFIG.clip_norm, shapes,
                   weights, head, quorum=1, deadline_s=600.0)
        device = FederatedClientSession("client-0", "token", spec.to_dict())
        update = device.update(1, {k: np.zeros(v, np.float32) for k, v in shapes.items()}, 0.0, 10, 1.0)
        sizes = {"round_start": len(board.offer("client-0")), "model_request": len(device.model_request(1)),
                 "model": len(board.model_for("client-0", 1)), "update": len(update),
                 "update_ack": len(board.accept("client-0", m.decode(update))),
                 "round_request": len(device.round_request()), "hello": len(device.hello())}
        sizes["per_round_down"] = sizes["round_start"] + sizes["model"] + sizes["update_ack"]
        sizes["per_round_up"] = sizes["model_request"] + sizes["update"] + sizes["round_request"]
        sizes["trainable_values"] = int(sum(np.prod(v) for v in shapes.values()))
        out[method] = sizes
    return out


def compare_backends(lfw: str | None, out: Path, users: int = 24, rounds: int = 3) -> dict:
    """The same run on the three backends; wall time of the rounds and bit-for-bit equality with in-process."""
    import tempfile

    from splitface.common.models import build_backbone
    from splitface.sim.ray_placement import ray_session
    from splitface.server.auth import hash_token
    from research.federated import FederatedRun, in_process, load_population, virtual_clients
    from research.federated.ray_backend import ray_backend
    from research.federated.websocket import client_device_id, hosted_rounds, launch_devices

    torch.set_num_threads(1)
    spec = resolve_spec("iresnet_small")
    population = load_population(lfw, spec.input_size, max_users=users, seed=0)
    config = dataclasses.replace(CONFIG, method="dp-fedemb", noise_multiplier=1.0, rounds=rounds, users_per_client=6,
                                 clients_per_round=users / 6, local_epochs=1)
    torch.manual_seed(0)
    init = build_backbone(spec).state_dict()
    clients = virtual_clients(len(population.users), config.users_per_client, config.seed)
    result = {"model": "iresnet_small", "method": config.method, "users": users, "virtual_clients": len(clients),
              "rounds": rounds, "local_epochs": config.local_epochs, "batch_size": config.batch_size, "backends": {}}
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        def timed(name: str, backend) -> None:
            run = FederatedRun(config, spec, population, init, Path(tmp) / name, backend)
            started = time.perf_counter()
            run.run(log=lambda line: print(f"{name}: {line}", flush=True))
            wall = time.perf_counter() - started
            models[name] = run.backbone.state_dict()
            ref = models["in-process"]
            result["backends"][name] = {
                "wall_s": wall, "round_wall_s": [row["wall_s"] for row in run.history],
                "clients_per_round": [row["clients"] for row in run.history],
                "equal_to_in_process": all(torch.equal(ref[k], v) for k, v in models[name].items()),
                "max_abs_diff": max(float((ref[k].double() - v.double()).abs().max()) for k, v in models[name].items())}

        timed("in-process", in_process)
        with ray_session(None, num_cpus=2, log_to_driver=False):
            timed("ray", ray_backend)
        tokens = {client_device_id(c): f"bench-token-{c}" for c in range(len(clients))}
        with hosted_rounds(spec, {d: hash_token(t) for d, t in tokens.items()}, Path(tmp) / "server") as backend:
            devices = launch_devices(backend.url, spec, [population.of_users(c) for c in clients],
                                     Path(tmp) / "devices", tokens)
            timed("websocket", backend)
        for process in devices:
            process.wait(60)
    result["note"] = ("wall_s counts the rounds only; the first round of ray and websocket includes starting the Ray "
                      "workers / the device processes; one run each on a shared machine (load average in load_average)")
    result["load_average"] = list(os.getloadavg())
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p)
    add_start_args(p)
    p.add_argument("--out", type=Path, default=None,
                   help="default results/federated (public-split) or results/federated-distilled (distilled)")
    p.add_argument("--max-users", type=int, default=None)
    p.add_argument("--progress-pairs", type=int, default=200, help="DevTest pairs for the per-round curve")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="run only these runs (names as in the table)")
    add_threads_arg(p, 1)
    p.add_argument("--force", action="store_true")
    p.add_argument("--wire", action="store_true", help="only write wire.json (round message sizes); no training")
    p.add_argument("--backends", action="store_true", help="only compare the backends (backends.json)")
    args = p.parse_args()
    if args.out is None:
        args.out = ROOT / "results" / ("federated" if args.start == "public-split" else f"federated-{args.start}")
    if args.backends:
        print(json.dumps(compare_backends(args.data, args.out), indent=2))
        return
    if args.wire:
        sizes = wire_bytes()
        (args.out / "wire.json").write_text(json.dumps(sizes, indent=2) + "\n")
        print(json.dumps(sizes, indent=2))
        return
    apply_threads(args)
    started = time.time()
    shared = load_shared(resolve_spec("iresnet_small"), args.data, args.backbone, args.pretrain_epochs,
                         args.max_users, progress_pairs=args.progress_pairs, start=args.start)
    rows = []
    for name, config, seed in runs():
        run_dir = args.out / "runs" / name
        if args.force and run_dir.exists():
            shutil.rmtree(run_dir)
        result = run_dir / "result.json"
        if not result.exists() and (args.only is None or name in args.only):
            print(f"== {name}", flush=True)
            if name == "public-only":
                run_public_only(shared, run_dir)
            elif config is None:  # centralized (any seed)
                run_centralized(shared, run_dir, CENTRALIZED["epochs"], CENTRALIZED["lr"], CENTRALIZED["batch_size"],
                                CENTRALIZED["head_lr_scale"], CENTRALIZED["momentum"], seed)
            else:
                run_federated(with_single_photo_users(shared, args.data) if name == SINGLE_PHOTO else shared, config,
                              run_dir, args.eval_every)
        if result.exists():
            row = {"run": name, **json.loads(result.read_text()), "progress_pairs": args.progress_pairs, "seed": seed}
            rows.append(row)
            if row["method"] == "dp-fedemb" and not row.get("adaptive_clipping") and seed == CONFIG.seed \
                    and name != SINGLE_PHOTO:
                rows.extend({**x, "run": f"{name} @ {x['users']:.0e} users"} for x in extrapolation_rows(row, name))
    info = {"users": len(shared.population.users), "start": shared.start}
    write_summary(args.out, rows + neighbour_rows(args.out), table(rows, info), echo=False)
    figures(rows, args.out, shared.start["start"])
    print(f"{len(rows)} rows -> {args.out} ({time.time() - started:.0f} s)")


# rows that research/privacyface_fedgc.py and research/u_split.py measure into the same folder; they join summary.json
# (not the table or figures, which are this script's runs), with the summary's keys they lack set to None
NEIGHBOURS = ("privacyface_fedgc_summary.json", "u_split.json")
SUMMARY_KEYS = ("method", "noise_multiplier", "rounds", "users_per_round", "epsilon", "delta", "view1_accuracy",
                "view1_std", "roc_auc", "tar_at_far_1e-2")


def neighbour_rows(out: Path) -> list[dict]:
    rows = []
    for name in NEIGHBOURS:
        if (out / name).exists():
            found = json.loads((out / name).read_text())
            rows += [{**dict.fromkeys(SUMMARY_KEYS), **r} for r in (found["rows"] if isinstance(found, dict) else found)]
    return rows


if __name__ == "__main__":
    main()
