"""`splitface-server`: run the edge server, or issue device tokens."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, TypeVar


from splitface.common.faults import Fault
from splitface.common.options import (add_model_args, add_optimizer_args, add_seed_arg, add_threads_arg, add_training_args, apply_threads, model_spec, train_config)
from splitface.common.transforms import release_mirror
from splitface.protocol.messages import DEFAULT_MAX_MESSAGE_BYTES
from splitface.protocol.server_session import GRADIENT_ROUNDING

from splitface.server.app import SERVER_FAULTS, EdgeServer, Limits, ServerConfig, server_info
from splitface.server.auth import TokenAuthenticator, issue_tokens, load_tokens
from splitface.server.trainer import ServerTrainer, StepGuard

T = TypeVar("T")


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One option per field of `cls` (--field-name), its default and help taken from the field: the values
    are declared once, in the dataclass."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        group.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                           help=f"{f.metadata.get('help', '')} (default: {f.default})")


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    values: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**values)


def add_tail_args(p: argparse.ArgumentParser) -> None:
    """What the server trains and what it records: `serve` and the demo that starts it."""
    p.add_argument("--train-only", choices=("all", "classifier"), default="all",
                   help="classifier: freeze the tail, train only the output layer")
    add_record_max_arg(p)
    p.add_argument("--mirror-average", action=argparse.BooleanOptionalAction, default=False,
                   help="outside training, average the tail's embeddings of each release and of the mirror image's "
                        "release, which the server computes from it: test-time flipping at no further release, for "
                        "the releases that are the image or its block DCT (--release dct or mask; docs/pretrain.md)")
    p.add_argument("--mirror-train", action=argparse.BooleanOptionalAction, default=False,
                   help="with --mirror-average, train on the average too (the loss, the imprinted class means and a "
                        "device head's embeddings are the average's), so that the model learns the embedding that it is "
                        "tested on; the tail runs on each training batch with its mirror's, as one batch twice the size")
    p.add_argument("--gradient-rounding", choices=GRADIENT_ROUNDING, default="nearest",
                   help="how i8 and i8c gradients round on their way down: nearest (the reference encoder's) or stochastic "
                        "(unbiased; docs/wire.md)")


def add_record_max_arg(p: argparse.ArgumentParser, default: int = 0) -> None:
    p.add_argument("--record-max", type=int, default=default,
                   help="play the curious server for the privacy audit: keep up to N received training samples per "
                        f"device in <run dir>/recordings/ (default {default}; 0: keep nothing)")


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """`serve`'s options (also those of a server that hosts a federated run beside its split sessions,
    `splitface-research federated-serve`)."""
    add_model_args(s)
    s.add_argument("--init", type=Path, default=None,
                   help="start the tail from a saved backbone (see `splitface-research pretrain classify`)")
    add_tail_args(s)
    s.add_argument("--num-classes", type=int, required=True, help="identities of the server-head classifier")
    s.add_argument("--imprint-steps", type=int, default=0,
                   help="server head: for this many training steps its rows are its classes' mean embeddings (weight "
                        "imprinting, for a pre-trained --init), then trained from there")
    s.add_argument("--imprint-hold-tail", action="store_true",
                   help="while the head is imprinted the tail's weights take no step either (its batch norms "
                        "still follow the batches), so that fine-tuning starts from the start's class means "
                        "(splitface/server/imprint.py)")
    s.add_argument("--tokens", type=Path, required=True, help="JSON of device id -> token digest (see `tokens`)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on start)")
    s.add_argument("--run-dir", type=Path, default=Path("runs/server"), help="checkpoint and metrics; resumed if present")
    s.add_argument("--checkpoint-every", type=float, default=30.0, help="seconds between checkpoints")
    s.add_argument("--checkpoint-every-batches", type=int, default=0, help="also checkpoint after this many batches")
    add_training_args(s, epochs=None, batch_size=None, lr=0.01)
    add_optimizer_args(s, decay_steps=1000, decay_help="steps over which lr decays by --lr-decay")
    s.add_argument("--max-batch", type=int, default=64)
    s.add_argument("--max-message-mb", type=float, default=DEFAULT_MAX_MESSAGE_BYTES / 2 ** 20)
    s.add_argument("--pending-timeout", type=float, default=60.0,
                   help="device head: seconds a device may hold the shared model from its FORWARD to its gradient")
    s.add_argument("--reply-retention", type=float, default=3600.0,
                   help="seconds a disconnected device's last reply is kept for its retry (then: its progress only)")
    add_dataclass_options(s, Limits, "limits against hostile or broken clients (docs/operations.md)")
    add_dataclass_options(s, StepGuard, "poisoning guard: what a batch must look like to reach the model")
    s.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve wss:// (with --tls-key)")
    s.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    s.add_argument("--insecure", action="store_true",
                   help="allow plain ws:// on a non-loopback --host (tokens in clear; e.g. behind a TLS proxy)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0: a free one; default: none)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.add_argument("--fault", default=None, metavar="KIND:N",
                   help="TESTS ONLY: exit hard at server step N (counted across restarts): " + ", ".join(SERVER_FAULTS))
    s.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_threads_arg(s)
    add_seed_arg(s)


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser, hosted=None) -> None:
    """Run the edge server of `add_serve_args`' options until it is stopped. `hosted`: a federated run that the
    server hosts beside its split sessions (it gives the server its `board` and `start`s once it listens)."""
    apply_threads(args)
    server_config = ServerConfig(args.host, args.port, args.run_dir, args.checkpoint_every,
                                 args.checkpoint_every_batches, pending_timeout_s=args.pending_timeout,
                                 reply_retention_s=args.reply_retention,
                                 record_max=args.record_max, gradient_rounding=args.gradient_rounding,
                                 limits=from_args(Limits, args),
                                 metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                                 tls_cert=args.tls_cert, tls_key=args.tls_key, insecure=args.insecure)
    if args.imprint_steps < 0:
        parser.error(f"--imprint-steps must be >= 0, not {args.imprint_steps}")
    if args.imprint_hold_tail and not args.imprint_steps:
        parser.error("--imprint-hold-tail holds the tail while the head is imprinted: it needs --imprint-steps")
    if args.mirror_train and not args.mirror_average:
        parser.error("--mirror-train trains on the mirror average: it needs --mirror-average")
    try:
        if args.mirror_average:
            release_mirror(model_spec(args))   # a release the server cannot mirror, before anything is built
        server_config.fault = Fault.parse(args.fault, SERVER_FAULTS) if args.fault else None
        server_config.tls()  # before building the model: plain ws:// off loopback, a missing or bad certificate
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    max_message_bytes = int(args.max_message_mb * 2 ** 20)
    federated = hosted(max_message_bytes) if hosted is not None else None
    trainer = ServerTrainer(model_spec(args), args.split, args.num_classes, train_config(args), args.device, args.init,
                            args.train_only, from_args(StepGuard, args), args.imprint_steps, args.imprint_hold_tail,
                            args.mirror_average, args.mirror_train)
    info = server_info(trainer, args.max_batch, max_message_bytes)
    server = EdgeServer(trainer, info, TokenAuthenticator(load_tokens(args.tokens)), server_config,
                        board=federated.board if federated else None)
    logging.getLogger("splitface.server").info("training %s split at %s on %s", args.model, args.split, trainer.device)

    def ready(port: int) -> None:
        print(f"READY {port}", flush=True)
        if federated is not None:
            federated.start(server, asyncio.get_running_loop())
    asyncio.run(server.run(on_ready=ready))
    if federated is not None and federated.error is not None:
        sys.exit(f"splitface-server: the federated run failed: {federated.error}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitface-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="train the server part for connecting devices"))
    t = sub.add_parser("tokens", help="issue tokens for devices; digests go to the file, tokens to stdout as JSON")
    t.add_argument("--file", type=Path, required=True)
    t.add_argument("device_ids", nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if args.command == "tokens":
        print(json.dumps(issue_tokens(args.file, args.device_ids), indent=2))
        return
    serve(args, parser)


if __name__ == "__main__":
    main()
