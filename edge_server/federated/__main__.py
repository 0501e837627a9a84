"""python -m edge_server.federated: one federated (or centralized) experiment on LFW DevTrain people,
scored on View 1 DevTest pairs, printing per-round progress and the user-level epsilon spent.

A small end-to-end run on a CPU (minutes; pre-trains the public backbone first if --init is not given):

    python -m edge_server.federated --data LFW --method dp-fedemb --rounds 5 --max-users 200 \
        --noise-multiplier 1.0 --out runs/federated/quick

Backends (the same client function and round logic; docs/federated.md): in-process (default), ray (the
clients as Ray tasks), websocket (an edge server on --host/--port whose device processes `client-<c>` train
the rounds: started here with --launch-devices, or connecting with tokens from --tokens).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from device_sdk.models import resolve_spec

from .engine import CRASH_EXIT_CODE, METHODS, FederatedConfig, SimulatedCrash, in_process
from .experiment import Shared, load_shared, run_centralized, run_federated
from .population import virtual_clients

BACKENDS = ("in-process", "websocket", "ray")


# the option defaults are FederatedConfig's fields' (one definition; the defaults alone are not a valid run: dp-*
# methods need a noise multiplier)
DEFAULTS = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(FederatedConfig)})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m edge_server.federated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="LFW (the folder holding the people and View 1's list files)")
    p.add_argument("--model", default="iresnet_small",
                   help="model preset (iresnet_small: 64 px, the CPU size) or a ModelSpec as JSON")
    p.add_argument("--method", choices=(*METHODS, "centralized"), default=DEFAULTS.method)
    p.add_argument("--out", type=Path, required=True, help="run folder (holds the checkpoint: a rerun resumes)")
    p.add_argument("--init", type=Path, default=None,
                   help="public backbone (default: <out>/public_backbone.pt, pre-trained there if missing)")
    p.add_argument("--pretrain-epochs", type=int, default=2, help="epochs of public pre-training when it is made")
    p.add_argument("--max-users", type=int, default=None, help="a seeded random subset of the private users")
    p.add_argument("--rounds", type=int, default=DEFAULTS.rounds)
    p.add_argument("--users-per-client", type=int, default=DEFAULTS.users_per_client,
                   help="k: users grouped in one virtual client")
    p.add_argument("--clients-per-round", type=float, default=DEFAULTS.clients_per_round,
                   help="expected virtual clients per round (Poisson rate = this / number of virtual clients)")
    p.add_argument("--local-epochs", type=int, default=DEFAULTS.local_epochs)
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size)
    p.add_argument("--client-lr", type=float, default=DEFAULTS.client_lr)
    p.add_argument("--head-lr-scale", type=float, default=DEFAULTS.head_lr_scale,
                   help="the local (or global) head's lr / client lr")
    p.add_argument("--server-lr", type=float, default=DEFAULTS.server_lr)
    p.add_argument("--server-momentum", type=float, default=DEFAULTS.server_momentum)
    p.add_argument("--noise-multiplier", type=float, default=DEFAULTS.noise_multiplier,
                   help="z (dp-* methods): noise std z * C on the sum")
    p.add_argument("--clip-norm", type=float, default=DEFAULTS.clip_norm,
                   help="C (the start value with --target-quantile)")
    p.add_argument("--target-quantile", type=float, default=DEFAULTS.target_quantile,
                   help="adaptive clipping (Andrew et al. 2021): the quantile of update norms C tracks")
    p.add_argument("--clip-lr", type=float, default=DEFAULTS.clip_lr)
    p.add_argument("--count-noise-std", type=float, default=DEFAULTS.count_noise_std,
                   help="adaptive clipping's count noise (default: max(expected clients / 20, 2z))")
    p.add_argument("--delta", type=float, default=DEFAULTS.delta, help="default 1 / users^1.1")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--eval-every", type=int, default=0,
                   help="score View 1 every N rounds too (the final score after the last round is always made)")
    p.add_argument("--progress-pairs", type=int, default=None,
                   help="score the every-N-rounds curve on only this many DevTest pairs (the final score uses all)")
    p.add_argument("--view1-limit", type=int, default=None, help="only this many DevTest pairs (quick checks)")
    p.add_argument("--centralized-epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--crash-in-round", type=int, default=None, help=argparse.SUPPRESS)  # tests: exactly-once rounds
    b = p.add_argument_group("backends")
    b.add_argument("--backend", choices=BACKENDS, default="in-process")
    b.add_argument("--host", default="127.0.0.1", help="websocket: the server's address")
    b.add_argument("--port", type=int, default=8765, help="websocket: the server's port (0: a free one)")
    b.add_argument("--tokens", type=Path, default=None,
                   help="websocket: device token digests (`splitface-server tokens`); default <out>/tokens.json")
    b.add_argument("--launch-devices", action="store_true",
                   help="websocket: start one device process per virtual client on this machine (small runs)")
    b.add_argument("--quorum", type=float, default=1.0,
                   help="websocket: a round closes once this fraction of its sampled devices uploaded")
    b.add_argument("--round-deadline-s", type=float, default=600.0,
                   help="websocket: a round closes after this long whatever arrived; the rest are left out")
    b.add_argument("--tls-cert", type=Path, default=None, help="websocket: PEM certificate chain (serve wss://)")
    b.add_argument("--tls-key", type=Path, default=None, help="websocket: its private key")
    b.add_argument("--insecure", action="store_true", help="websocket: allow plain ws:// off loopback")
    b.add_argument("--ray-address", default=None, help="ray: a cluster's address (default: a local Ray instance)")
    return p


@contextlib.contextmanager
def backend_for(args: argparse.Namespace, shared: Shared, config: FederatedConfig):
    """The backend the options name, live for the duration of the run."""
    if args.backend == "in-process":
        yield in_process
    elif args.backend == "ray":
        import ray

        from .ray_backend import ray_backend
        ray.init(address=args.ray_address, include_dashboard=False)
        try:
            yield ray_backend
        finally:
            ray.shutdown()
    else:
        from ..auth import issue_tokens, load_tokens
        from .websocket import client_device_id, hosted_rounds, launch_devices
        tokens_file = args.tokens or args.out / "tokens.json"
        clients = virtual_clients(len(shared.population.users), config.users_per_client, config.seed)
        tokens = issue_tokens(tokens_file, [client_device_id(c) for c in range(len(clients))]) \
            if args.launch_devices else {}
        if not tokens_file.exists():
            raise SystemExit(f"{tokens_file}: no device tokens (issue them with `splitface-server tokens`, "
                             f"or use --launch-devices)")
        with hosted_rounds(shared.spec, load_tokens(tokens_file), args.out / "server", args.host, args.port,
                           args.quorum, args.round_deadline_s, tls_cert=args.tls_cert, tls_key=args.tls_key,
                           insecure=args.insecure) as backend:
            devices = launch_devices(backend.url, shared.spec, [shared.population.of_users(c) for c in clients],
                                     args.out / "devices", tokens) if tokens else []
            yield backend
        for process in devices:
            process.wait(60)


def config_from(args: argparse.Namespace) -> FederatedConfig:
    return FederatedConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FederatedConfig)})


def run(argv: list[str] | None = None) -> dict:
    """Parse, run, print the summary row and return it."""
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = None if args.method == "centralized" else config_from(args)  # bad arguments fail before loading
    spec = resolve_spec(json.loads(args.model) if args.model.startswith("{") else args.model)
    shared = load_shared(spec, args.data, args.init or args.out / "public_backbone.pt", args.pretrain_epochs,
                         args.max_users, view1_limit=args.view1_limit, progress_pairs=args.progress_pairs,
                         seed=args.seed)
    if config is None:
        row = run_centralized(shared, args.out, args.centralized_epochs, args.client_lr, args.batch_size,
                              args.head_lr_scale, seed=args.seed)
    else:
        try:
            with backend_for(args, shared, config) as backend:
                row = run_federated(shared, config, args.out, args.eval_every, args.crash_in_round, backend=backend)
        except SimulatedCrash:  # a hard stop: devices are not told the run ended, nothing is cleaned up
            sys.stdout.flush()
            os._exit(CRASH_EXIT_CODE)
    print(json.dumps({k: v for k, v in row.items() if k not in ("history", "config")}))
    return row


def main(argv: list[str] | None = None) -> None:
    """The console script `splitface-federated` (returns nothing: a returned value would be the exit status)."""
    run(argv)


if __name__ == "__main__":
    main()
