"""`splitface-device federated`: one federated device process (SPEC.md section 15; also run as
`python -m splitface.device.federated`, how the federated experiment launches its devices).

    splitface-device federated --url ws://127.0.0.1:8765 --device-id client-0 --token-file T \
        --data client-0.npz --model iresnet_small

`--data` is this device's own photos: an .npz with `images` (uint8, N x 3 x S x S) and `labels` (one person
id per image). The device trains the rounds it is sampled for and exits when the server says the run is over.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

import numpy as np
import torch

from splitface.common.models import resolve_spec
from splitface.device.federated.device import FederatedDevice
from splitface.common.options import add_model_arg, add_threads_arg


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitface-device federated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--device-id", required=True)
    p.add_argument("--token-file", type=Path, required=True, help="a file holding this device's token")
    p.add_argument("--data", type=Path, required=True, help=".npz with images (uint8 N,3,S,S) and labels")
    add_model_arg(p, "iresnet_small")
    p.add_argument("--ca-file", type=Path, default=None, help="CA certificates (PEM) trusted for a wss:// server")
    p.add_argument("--insecure", action="store_true", help="allow plain ws:// to a non-loopback host")
    add_threads_arg(p, 1, help="torch threads (results depend on it in the last bits)")
    p.add_argument("--leave-in-round", type=int, default=None, help=argparse.SUPPRESS)  # tests: drop mid-round
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    spec = resolve_spec(json.loads(args.model) if args.model.startswith("{") else args.model)
    with np.load(args.data) as data:
        images, labels = data["images"], data["labels"]
    device = FederatedDevice(args.url, args.device_id, args.token_file.read_text().strip(), spec, images, labels,
                             ca_file=args.ca_file, insecure=args.insecure, leave_in_round=args.leave_in_round)
    rounds = asyncio.run(device.run())
    print(json.dumps({"device_id": args.device_id, "rounds": rounds}))


if __name__ == "__main__":
    main()
