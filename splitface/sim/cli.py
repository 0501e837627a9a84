"""`splitface-sim`: run N simulated devices against a running edge server."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from splitface.common.options import add_data_args, add_devices_args, add_model_args, add_optimizer_args, add_threads_arg, add_training_args, apply_threads, data_argv, data_selection, load_data, model_argv, model_spec, train_config
from splitface.device.privacy.options import add_privacy_args, privacy_engines
from splitface.device.privacy.state import StateFileError
from splitface.protocol.tensor import ENCODINGS

from splitface.device.runtimes import BACKENDS
from splitface.sim.simulator import SimConfig, simulate

STATE_DIR = "privacy_state"  # default --state-dir, beside --results


def device_range(text: str) -> tuple[int, int]:
    """START:STOP, as --only-devices takes it."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give START:STOP (two integers), not {text!r}") from None
    return start, stop


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-sim", description=__doc__)
    p.add_argument("--server", default="ws://127.0.0.1:8765")
    p.add_argument("--tokens", type=Path, required=True, help="JSON of device id -> token (from `splitface-server tokens`)")
    add_data_args(p)
    add_model_args(p)
    add_devices_args(p)
    add_training_args(p, epochs=3, batch_size=64, lr=0.01)
    p.add_argument("--partition", choices=("iid", "identity"), default="iid")
    p.add_argument("--crop", type=int, default=160, help="centre crop in pixels before resizing (LFW faces are central)")
    p.add_argument("--activation-encoding", choices=ENCODINGS, default="f32")
    p.add_argument("--gradient-encoding", choices=ENCODINGS, default="f32",
                   help="i8c: int8 with a scale per image and channel (docs/wire.md: i8 loses accuracy, i8c does not)")
    add_optimizer_args(p)
    p.add_argument("--results", type=Path, default=Path("runs/sim/results.json"))
    p.add_argument("--state-dir", type=Path, default=None,
                   help="each device's durable privacy state (spent epsilon, noise secret), <device id>.privacy.json, "
                        "and training progress (committed batch, snapshots), <device id>.training.json; a restarted "
                        f"device resumes both and rejoins its server run (default: <results dir>/{STATE_DIR})")
    p.add_argument("--reconnect-timeout", type=float, default=120.0)
    p.add_argument("--ca-file", type=Path, default=None,
                   help="CA certificates (PEM) trusted for a wss:// server; host names are checked (default: the system's)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain ws:// to a server off loopback: the device's token then travels in clear")
    add_threads_arg(p)
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="what runs the device layer: eager PyTorch, ExecuTorch (XNNPACK release + portable training "
                        "program), executorch-xnnpack (conv1 + ReLU + LRN as im2col programs XNNPACK runs whole, "
                        "weights as inputs, closed-form weight gradient), native (the same programs in strips through the C++ "
                        "runner, built with CMake on first use; docs/device.md) or ONNX Runtime (see splitface/export/README.md)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="exported device programs for --backend (default: <results dir>/artifacts, exported there "
                        "and verified on first use)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--only-devices", type=device_range, default=None, metavar="START:STOP",
                   help="run only devices START..STOP-1 of --devices here, each with the share and seeds it has in a "
                        "run of all of them; the others run in other processes (splitface-demo --device-processes)")
    p.add_argument("--placement", choices=("local", "ray"), default="local",
                   help="where the simulated devices run: local (all in this process, as asyncio tasks) or ray (each "
                        "device a Ray actor, all at once, on a local Ray instance or the cluster at --ray-address; "
                        "docs/load_and_faults.md). Named apart from --backend, which says what runs each device's "
                        "layer wherever the device runs; the results are the same either way")
    p.add_argument("--ray-address", default=None,
                   help="--placement ray: the Ray cluster to join ('auto', or HOST:PORT of `ray start --head`); every "
                        "node needs the data at the same path, this project installed, and a route to --server "
                        "(default: start a local Ray instance on this machine's cores)")
    p.add_argument("--devices-per-actor", type=int, default=1,
                   help="--placement ray: devices each actor runs (as asyncio tasks); more than 1 saves a process, "
                        "about 200 MB, per device on a small machine")
    add_privacy_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    apply_threads(args)
    data = load_data(args)
    spec = model_spec(args)
    config = SimConfig(
        url=args.server, spec=spec, split=args.split, head=args.head, num_devices=args.devices, epochs=args.epochs,
        batch_size=args.batch_size, partition=args.partition, crop=args.crop,
        encodings={"activations": args.activation_encoding, "gradients": args.gradient_encoding},
        train=train_config(args), seed=args.seed, results=args.results, progress=not args.no_progress,
        reconnect_timeout_s=args.reconnect_timeout, ca_file=args.ca_file, insecure=args.insecure,
        privacy=privacy_engines(args, releases_per_image=args.epochs),
        state_dir=args.state_dir or args.results.parent / STATE_DIR, device_weights=args.device_weights,
        backend=args.backend, pipeline=args.pipeline, artifacts=args.artifacts or args.results.parent / "artifacts", data=data_selection(args),
        only_devices=args.only_devices)
    try:
        config.devices_here()
    except ValueError as exc:
        p.error(f"--only-devices: {exc}")
    if args.devices_per_actor < 1:
        p.error("--devices-per-actor must be at least 1")
    tokens = json.loads(args.tokens.read_text())
    print(f"{len(data.class_names)} identities, {len(data.train)} train / {len(data.test)} test images; "
          f"{args.devices} devices, {args.head} head, {spec.family} {spec.input_size}px; "
          f"privacy state in {config.state_dir}", flush=True)
    try:
        if args.placement == "ray":
            from splitface.sim.ray_placement import ray_session, simulate_on_ray
            with ray_session(args.ray_address):
                results = simulate_on_ray(config, data, tokens, args.devices_per_actor, args.threads)
        else:
            results = asyncio.run(simulate(config, data, tokens))
    except StateFileError as exc:
        raise SystemExit(f"splitface-sim: {exc}") from exc
    for e in results["epochs"]:
        print(f"epoch {e['epoch']}: train acc {e['train_acc']:.3f} loss {e['train_loss']:.3f} | "
              f"test acc {e['test_acc']:.3f} loss {e['test_loss']:.3f} | "
              f"per-image epsilon <= {e['epsilon_image_max']:.3g} (delta {args.delta:g})", flush=True)
    for d in results["devices"]:
        if d["stopped"]:
            print(f"{d['device_id']} stopped early: {d['stopped']}", flush=True)
        if d["privacy"].get("guarantee_void"):
            print(f"{d['device_id']}: {d['privacy']['note']}", flush=True)
    print(f"results: {args.results}", flush=True)


if __name__ == "__main__":
    main()
