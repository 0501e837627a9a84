"""`splitface-server`: run the edge server, or issue device tokens."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

import torch

from device_sdk.models import DEFAULT_SPLIT, PRESETS, resolve_spec
from protocol.messages import DEFAULT_MAX_MESSAGE_BYTES

from .app import EdgeServer, ServerConfig, server_info
from .auth import TokenAuthenticator, issue_tokens, load_tokens
from .trainer import ServerTrainer, TrainConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vgg_face_small", help=f"preset ({', '.join(PRESETS)}) or a JSON model spec")
    p.add_argument("--split", default=DEFAULT_SPLIT, help="last stage that runs on the device (default: conv1)")


def parse_model(value: str):
    return resolve_spec(json.loads(value) if value.lstrip().startswith("{") else value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitface-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="train the server part for connecting devices")
    add_model_args(s)
    s.add_argument("--num-classes", type=int, required=True, help="identities of the server-head classifier")
    s.add_argument("--tokens", type=Path, required=True, help="JSON of device id -> token digest (see `tokens`)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on start)")
    s.add_argument("--run-dir", type=Path, default=Path("runs/server"), help="checkpoint and metrics; resumed if present")
    s.add_argument("--checkpoint-every", type=float, default=30.0, help="seconds between checkpoints")
    s.add_argument("--checkpoint-every-batches", type=int, default=0, help="also checkpoint after this many batches")
    s.add_argument("--lr", type=float, default=0.01)
    s.add_argument("--momentum", type=float, default=0.9)
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--lr-decay", type=float, default=0.1, help="lr is multiplied by this over --decay-steps steps")
    s.add_argument("--decay-steps", type=int, default=1000)
    s.add_argument("--max-batch", type=int, default=64)
    s.add_argument("--max-message-mb", type=float, default=DEFAULT_MAX_MESSAGE_BYTES / 2 ** 20)
    s.add_argument("--pending-timeout", type=float, default=60.0, help="device head: seconds to wait for a gradient")
    s.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    s.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("tokens", help="issue tokens for devices; digests go to the file, tokens to stdout as JSON")
    t.add_argument("--file", type=Path, required=True)
    t.add_argument("device_ids", nargs="+")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if args.command == "tokens":
        print(json.dumps(issue_tokens(args.file, args.device_ids), indent=2))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(args.lr, args.momentum, args.weight_decay, args.lr_decay, args.decay_steps, args.seed)
    trainer = ServerTrainer(parse_model(args.model), args.split, args.num_classes, config, args.device)
    info = server_info(trainer, args.max_batch, int(args.max_message_mb * 2 ** 20))
    server = EdgeServer(trainer, info, TokenAuthenticator(load_tokens(args.tokens)),
                        ServerConfig(args.host, args.port, args.run_dir, args.checkpoint_every,
                                     args.checkpoint_every_batches, pending_timeout_s=args.pending_timeout))
    logging.getLogger("splitface.server").info("training %s split at %s on %s", args.model, args.split, trainer.device)
    asyncio.run(server.run(on_ready=lambda port: print(f"READY {port}", flush=True)))


if __name__ == "__main__":
    main()
