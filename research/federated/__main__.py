"""python -m research.federated: one federated (or centralized) experiment on LFW DevTrain people,
scored on View 1 DevTest pairs, printing per-round progress and the user-level epsilon spent.

A small end-to-end run on a CPU (minutes; pre-trains the public backbone first if --init is not given):

    python -m research.federated --data LFW --method dp-fedemb --rounds 5 --max-users 200 \
        --noise-multiplier 1.0 --out runs/federated/quick

Backends (the same client function and round logic; docs/federated.md): in-process (default), ray (the
clients as Ray tasks), websocket (an edge server on --host/--port whose device processes `client-<c>` train
the rounds: started here with --launch-devices, or connecting with tokens from --tokens).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from research.federated.rounds import CRASH_EXIT_CODE, FederatedConfig, SimulatedCrash
from research.federated.tasks import in_process
from research.federated.experiment import Shared, run_centralized, run_federated
from research.federated.options import add_run_args, check_users, config_from, shared_from, spec_from
from research.federated.population import virtual_clients
from splitface.common.options import add_threads_arg

BACKENDS = ("in-process", "websocket", "ray")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitface-research federated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    add_threads_arg(p)
    b = p.add_argument_group("backends")
    b.add_argument("--backend", choices=BACKENDS, default="in-process")
    b.add_argument("--host", default="127.0.0.1", help="websocket: the server's address")
    b.add_argument("--port", type=int, default=8765, help="websocket: the server's port (0: a free one)")
    b.add_argument("--tokens", type=Path, default=None,
                   help="websocket: device token digests (`splitface-server tokens`); default <out>/tokens.json")
    b.add_argument("--launch-devices", action="store_true",
                   help="websocket: start one device process per virtual client on this machine (small runs)")
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
        from research.federated.ray_backend import ray_backend
        from splitface.sim.ray_placement import ray_session
        with ray_session(args.ray_address):
            yield ray_backend
    else:
        from splitface.server.auth import issue_tokens, load_tokens
        from research.federated.websocket import client_device_id, hosted_rounds, launch_devices
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


def run(argv: list[str] | None = None) -> dict:
    """Parse, run, print the summary row and return it."""
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    check_users(args)  # bad arguments fail before loading
    config = None if args.method == "centralized" else config_from(args)
    shared = shared_from(args, spec_from(args))
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
    """`splitface-research federated` (returns nothing: a returned value would be the exit status)."""
    run(argv)


if __name__ == "__main__":
    main()
