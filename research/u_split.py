"""PrivacyFace and FedGC in U-shaped split training, reduced: identity-partitioned device-head devices over a
real loopback EdgeServer, plain (each head alone) against PrivacyFace (DPLC releases relayed by the server, consensus-aware loss) and FedGC's
opt-in head correction, with the server head on the same people as the reference. Scored on LFW View 1 DevTest pairs (research.evaluation)
with device 0's first layer and the server's shared part. Writes results/federated/u_split.json.

Small on purpose (vgg_face_small at 64 px from its seeded start, split conv1; a few people per device, a few
epochs): it shows the path works end to end and what it costs, not the papers' regime.

    python research/u_split.py --data /path/to/lfw
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer
from splitface.common.dplc import DPLCConfig
from splitface.device.federated.u_split import ConsensusEngine, ConsensusHead, train_u_split
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.common.options import add_data_root_arg, add_seed_arg, add_threads_arg, apply_threads
from splitface.server.app import EdgeServer, ServerConfig, ServerThread, server_info
from splitface.server.auth import TokenAuthenticator, hash_token
from research.evaluation.verification import evaluate_embedder
from research.federated.fedgc import device_head_board
from research.federated.population import private_faces
from splitface.common.accountants.clusters import identity_epsilon
from splitface.server.trainer import ServerTrainer

ROOT = Path(__file__).resolve().parents[1]


def run_mode(mode: str, args, images: np.ndarray, labels: np.ndarray, dplc: DPLCConfig) -> dict:
    """One U-split run: `plain` / `privacyface` / `fedgc` (device heads; FedGC's opt-in correction every
    `exchange_every` batches, lambda 20, s 1, the heads' lr) or `server-head`."""
    spec, devices = resolve_spec("vgg_face_small"), args.devices
    people = args.people_per_device
    config = TrainConfig(lr=args.lr, seed=args.seed)
    trainer = ServerTrainer(spec, "conv1", devices * people, config)
    tokens = {f"device-{k}": f"token-{k}" for k in range(devices)}
    started = time.time()
    with tempfile.TemporaryDirectory() as run_dir, ServerThread(EdgeServer(
            trainer, server_info(trainer, 64, 64 << 20), TokenAuthenticator({d: hash_token(t) for d, t in tokens.items()}),
            ServerConfig(port=0, run_dir=Path(run_dir)),
            heads=device_head_board(spec.embedding_dim, args.lr) if mode == "fedgc" else None)) as server:
        async def device(k: int):
            mine = (labels >= k * people) & (labels < (k + 1) * people)
            if mode == "server-head":
                engine = DeviceTrainer(spec, "conv1", "server", devices * people, config)
                y = labels[mine]
            else:
                engine = ConsensusEngine(spec, "conv1", "device", people, config, head_loss=ConsensusHead(rho=dplc.rho))
                y = labels[mine] - k * people
            client = DeviceClient(server.url, f"device-{k}", tokens[f"device-{k}"], engine, batch_size=args.batch_size)
            await client.connect()
            try:
                losses = await train_u_split(client, engine, images[mine], y, args.epochs, args.batch_size,
                                             args.exchange_every if mode == "privacyface" else None, dplc, args.seed + k,
                                             fedgc_every=args.exchange_every if mode == "fedgc" else None)
            finally:
                await client.close()
            return engine, losses

        async def all_devices():
            return await asyncio.gather(*(device(k) for k in range(devices)))

        results = asyncio.run(all_devices())
    layer, tail = results[0][0].layer.eval(), trainer.tail.eval()

    def embed(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return tail(layer(torch.from_numpy(x))).numpy()

    report = evaluate_embedder(embed, args.data, spec.input_size)
    calls = max(getattr(e, "dplc_calls", 0) for e, _ in results)
    privacy = identity_epsilon(dplc, calls, dplc.delta) if mode == "privacyface" and calls else {}
    released = [len(r) for r in server.server.relay.latest.values()] if mode == "privacyface" else []
    label = f" eps/query={dplc.epsilon:g}" if mode == "privacyface" else ""
    return {"run": f"u-split {mode}{label}", "method": {"plain": "u-split", "privacyface": "privacyface",
                                                 "fedgc": "fedgc", "server-head": "server-head"}[mode],
            "mode": "u-split",
            "epsilon": privacy.get("epsilon"), "delta": privacy.get("delta"),
            **{k: report[k] for k in ("view1_accuracy", "view1_std", "roc_auc", "tar_at_far_1e-2")},
            "devices": devices, "people_per_device": people, "images": int(len(images)), "epochs": args.epochs,
            "dplc_calls_max": calls, "last_release_sizes": released,
            "final_loss_mean": float(np.mean([l[-1] for _, l in results])), "wall_s": time.time() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "federated" / "u_split.json")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--people-per-device", type=int, default=4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--exchange-every", type=int, default=2, help="batches between a device's cluster exchanges")
    p.add_argument("--query-epsilon", type=float, nargs="+", default=[math.inf, 1.0],
                   help="PrivacyFace runs: DPLC's per-query epsilon (inf: no noise)")
    add_seed_arg(p)
    add_threads_arg(p, 1)
    args = p.parse_args()
    apply_threads(args)
    faces = private_faces(args.data, args.devices * args.people_per_device, seed=args.seed)
    images, labels = faces.load(64, 160), faces.labels
    configs = [DPLCConfig(min_members=1, queries=2, epsilon=eps) for eps in args.query_epsilon]
    rows = []
    for mode, dplc in [("plain", configs[0]), *(("privacyface", c) for c in configs), ("fedgc", configs[0]),
                       ("server-head", configs[0])]:
        row = run_mode(mode, args, images, labels, dplc)
        print(f"{row['run']}: View 1 {row['view1_accuracy']:.3f} +- {row['view1_std']:.3f}, eps {row['epsilon']} "
              f"({row['wall_s']:.0f} s)", flush=True)
        rows.append(row)
    command = f"python research/u_split.py --data LFW --devices {args.devices} --people-per-device " \
              f"{args.people_per_device} --epochs {args.epochs} --query-epsilon " + \
              " ".join(f"{e:g}" for e in args.query_epsilon)
    dplc = configs[0]
    args.out.write_text(json.dumps({"command": command, "dplc": {"rho": dplc.rho, "min_members": dplc.min_members,
                                                                 "queries": dplc.queries, "delta": dplc.delta},
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
