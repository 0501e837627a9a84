"""Wire bytes per image of FaceMAE's release, dense and packed (SPEC.md section 5.12), without training.

The frontier's `bytes up/image` column is a run's `bytes_sent` over one epoch divided by its training images:
the FORWARD messages its devices sent. That needs the run; this script rebuilds the same FORWARDs from a
frontier run's recorded configuration instead: the same images (`load_selection`), the same per-device shares
(`partition`) and batches (`batch_indices`), releases from the device's own engine and messages from the
device's own `ClientSession`, once dense and once packed, in each encoding. The masks are keyed by a fixed
device secret (so the figures repeat), not the run's, but every image shows exactly `visible_patches` patches
either way; only a visible patch whose encoded bytes are all zero (a black square) travels for free in the
packed form, so another secret moves the packed figures by a few bytes.
The dense f32 figure is the run's own column (a check that this counts what the run counted).

    python bench/mask_wire.py results/frontier/runs/facemae-ratio0.75-patch8-lambda_irm1 --data LFW
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


from splitface.common.options import load_selection
from splitface.common.data import partition
from splitface.device.trainer import DeviceTrainer, PrivacyEngine
from splitface.common.models import ModelSpec
from splitface.common.options import add_data_root_arg
from splitface.sim.simulator import batch_indices, batches_per_epoch
from splitface.protocol.client_session import ClientSession
from splitface.protocol.tensor import ENCODINGS


def forward_bytes(run_dir: Path, data_root: Path) -> dict[str, dict[str, float]]:
    """{encoding: {"dense": bytes/image, "packed": bytes/image}} over one epoch of the run's training batches."""
    config = json.loads((run_dir / "results.json").read_text())["config"]
    spec = ModelSpec.from_dict(config["model"])
    if spec.release != "mask":
        raise SystemExit(f"{run_dir} is a {spec.release!r} release; this measures the mask release")
    data = load_selection(data_root, config["data"])
    labels_sent = config["head"] == "server"
    total = {enc: {"dense": 0, "packed": 0} for enc in ENCODINGS}
    for i in range(config["num_devices"]):
        share = partition(data.train, config["num_devices"], i, config["partition"], config["seed"])
        images = share.load(spec.input_size, config["crop"], False)
        engine = DeviceTrainer(spec, config["split"], config["head"], config["num_classes"],
                              privacy=PrivacyEngine(secret=config["seed"] + i))
        for batch_id in range(1, batches_per_epoch(len(share.labels), config["batch_size"]) + 1):
            _, idx = batch_indices(len(share.labels), config["batch_size"], batch_id, config["seed"], i)
            released = engine.forward(images[idx], ("train", batch_id), idx, share.labels[idx])
            for enc in ENCODINGS:
                for form, patch in (("dense", None), ("packed", spec.mask_patch)):
                    session = ClientSession(f"device-{i}", "", config["model"], config["split"], config["head"],
                                            config["batch_size"], config["num_classes"] if labels_sent else None,
                                            {"activations": enc, "gradients": "f32"}, pack_patch=patch)
                    total[enc][form] += len(session.forward(batch_id, released,
                                                            share.labels[idx] if labels_sent else None))
    n = config["train_images"]
    return {enc: {form: b / n for form, b in forms.items()} for enc, forms in total.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a frontier run of the mask release (its results.json has the config)")
    add_data_root_arg(p, required=True, help="LFW root, as the run used")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args()
    figures = forward_bytes(args.run, args.data)
    run = json.loads((args.run / "results.json").read_text())
    recorded = run["epochs"][-1]["bytes_sent"] / run["config"]["train_images"]
    print(f"{args.run.name}: the run's own bytes up/image (dense f32): {recorded:,.1f}")
    print("| encoding | dense bytes/image | packed bytes/image | packed / dense |\n|---|---:|---:|---:|")
    for enc, f in figures.items():
        print(f"| {enc} | {f['dense']:,.1f} | {f['packed']:,.1f} | {f['packed'] / f['dense']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps({"run": args.run.name, "recorded_dense_f32": recorded, **figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
