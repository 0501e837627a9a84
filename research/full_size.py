#!/usr/bin/env python
"""Full size on a GPU: the split loop with the server's layers on CUDA in bf16, at the presets' real sizes, in one
command of at most 8 minutes. The server's layers are meant for a GPU, and a GPU machine is lent only for minutes
with nothing but the working tree, so everything the run needs is packed here first and the run reads only that:

    .venv/bin/python research/full_size.py pack       # here: LFW-158 and the missing wheels -> build/full_size
    python3 research/full_size.py run --out "$OUT"     # on the CUDA machine: reads only build/full_size

`run` measures the split loop at full size, split against unsplit on CUDA, and the source paper's setting, within
--budget-s; --tiny does the same on a CPU at reduced size (the suite's smoke test). docs/full_size.md says what
each step measures, how to call the device tool, and what to commit.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PACK = ROOT / "build" / "full_size"
DEFAULT_WORK = ROOT / "build" / "full_size_runs"
CPU_REFERENCE = ROOT / "results" / "full_size" / "cpu-tiny" / "full_size.json"
# The project's requirements that the CUDA machine's image lacks (pip name: import name); the rest is there.
CARRIED = {"websockets": "websockets", "dp-accounting": "dp_accounting"}
TARGET = {"python": "3.12", "implementation": "cp",
          "platforms": ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                        "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]}
TRAVEL_LIMIT = 64 * 2 ** 20   # the device tool's working tree, carried paths included
PACK_LIMIT = 50 * 10 ** 6
LFW_MIN_IMAGES = 10           # LFW-158
TINY_PEOPLE = 4

FULL = {"models": ["vgg_face", "iresnet50"], "devices": 16, "batch_size": 32, "epochs": 1,
        "compare_batch": 8, "compare_steps": 3, "paper_model": "vgg_face", "paper_epochs": 3, "budget_s": 450.0}
TINY = {"models": ["vgg_face_small", "iresnet_small"], "devices": 2, "batch_size": 16, "epochs": 1,
        "compare_batch": 4, "compare_steps": 2, "paper_model": "vgg_face_small", "paper_epochs": 1,
        "budget_s": 600.0}
PAPER_RUNS = [("epsilon-3", ["--mechanism", "per-activation", "--epsilon", "3"]),
              ("no-noise", ["--mechanism", "none"])]
NOISE_FACTOR = 1.5   # the per-activation noise is drawn on the devices' CPUs: the noisy run is planned this much slower
COMPARE_LR, COMPARE_DECAY_STEPS = 0.05, 4


# ---- bootstrap (standard library only: runs before the project can be imported) -----------------------------

def bootstrap(pack: Path) -> dict[str, Any]:
    """Make the project importable here and in every process it starts: the tree on the path (the CUDA machine
    has no install of it), and the carried wheels installed into a temporary folder where their packages are
    missing."""
    paths = [str(ROOT)]
    missing = [name for name in CARRIED.values() if importlib.util.find_spec(name) is None]
    installed: list[str] = []
    if missing:
        wheels = sorted((pack / "wheels").glob("*.whl"))
        if not wheels:
            raise SystemExit(f"{', '.join(missing)} not importable and no wheels in {pack / 'wheels'}: "
                             f"run `research/full_size.py pack` where pip works, and carry {pack}")
        site = Path(tempfile.mkdtemp(prefix="splitface-site-"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=True)
        paths.insert(0, str(site))
        installed = [w.name for w in wheels]
    for path in reversed(paths):
        sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"missing": missing, "installed_wheels": installed}


# ---- pack -----------------------------------------------------------------------------------------------------

def pack(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    from importlib.metadata import version

    from splitface.common.data import find_lfw_root, load_lfw

    out: Path = args.pack
    faces = out / "lfw" / "images"
    shutil.rmtree(out / "lfw", ignore_errors=True)
    shutil.rmtree(out / "wheels", ignore_errors=True)
    data = load_lfw(find_lfw_root(args.data), min_images=LFW_MIN_IMAGES,
                    max_identities=TINY_PEOPLE if args.tiny else None)
    copied = 0
    for path in [*data.train.paths, *data.test.paths]:
        (faces / path.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, faces / path.parent.name / path.name)   # the original bytes: the same pixels
        copied += path.stat().st_size
    wheels: dict[str, str] = {}
    if not args.no_wheels:
        pinned = [f"{name}=={version(name)}" for name in CARRIED]
        target = ["--only-binary=:all:", "--python-version", TARGET["python"], "--implementation",
                  TARGET["implementation"], *[a for p in TARGET["platforms"] for a in ("--platform", p)]]
        pip = [sys.executable, "-m", "pip"]
        subprocess.run([*pip, "download", "-q", "--no-deps", *target, "-d", str(out / "wheels"), *pinned], check=True)
        files = sorted((out / "wheels").glob("*.whl"))
        with tempfile.TemporaryDirectory() as scratch:  # would pip there install them? (a dry run for that target)
            subprocess.run([*pip, "install", "-q", "--dry-run", "--no-index", "--no-deps", "--target", scratch,
                            *target, *map(str, files)], check=True)
        wheels = {f.name: f"{f.stat().st_size} bytes" for f in files}
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.name != "pack.json")
    travel = tree_bytes() + size
    manifest = {"made": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "tiny": args.tiny,
                "source": str(find_lfw_root(args.data)), "people": len(data.class_names),
                "images": len(data.train) + len(data.test), "image_bytes": copied, "wheels": wheels,
                "wheel_target": TARGET, "pack_bytes": size, "travelling_tree_bytes": travel}
    (out / "pack.json").write_text(json.dumps(manifest, indent=2))
    print(json.dumps(manifest, indent=2))
    if size > PACK_LIMIT:
        raise SystemExit(f"the pack is {size / 1e6:.1f} MB, over {PACK_LIMIT / 1e6:.0f} MB")
    if travel > TRAVEL_LIMIT:
        raise SystemExit(f"the tree would travel with {travel / 2 ** 20:.1f} MiB, over the device tool's 64 MiB")
    return manifest


def tree_bytes() -> int:
    """What travels besides the pack: tracked and untracked-but-not-ignored files."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())


# ---- run --------------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, boot: dict[str, Any]) -> int:
    import torch

    from bench.bench_split import code_version, machine
    from research.pretrain_table import run_sh_array
    from research.results import write_record

    cfg = dict(TINY if args.tiny else FULL)
    for key in ("devices", "batch_size", "epochs", "paper_epochs", "budget_s"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the full-size run is for a GPU machine (--tiny runs on a CPU)")
    started = time.monotonic()
    deadline = started + cfg["budget_s"]
    data = args.pack / "lfw"
    if not (data / "images").is_dir():
        raise SystemExit(f"no pack at {args.pack}: run `research/full_size.py pack{' --tiny' if args.tiny else ''}`")
    args.out.mkdir(parents=True, exist_ok=True)
    wire = run_sh_array("DEFAULT_WIRE")
    common = ["--data", str(data), "--min-images", str(LFW_MIN_IMAGES), "--devices", str(cfg["devices"]),
              "--device-processes", str(cfg["devices"]), "--batch-size", str(cfg["batch_size"]), "--seed", "0",
              *wire, *args.demo_args.split()]
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "tiny": args.tiny,
        "machine": machine(), "code": code_version(), "bootstrap": boot, "config": cfg, "wire": wire,
        "demo_args": common, "pack": _read_json(args.pack / "pack.json"), "load_before": os.getloadavg()}
    print(f"full_size: {'tiny, CPU' if args.tiny else 'full size'}; {report['machine']['gpu'] or 'no GPU'}; "
          f"budget {cfg['budget_s']:.0f} s", flush=True)

    report["split_loop"] = [split_loop(model, common, cfg["epochs"], args.work) for model in cfg["models"]]
    report["split_vs_unsplit"] = [split_vs_unsplit(model, data, cfg, "cpu" if args.tiny else "cuda")
                                  for model in cfg["models"]]
    report["paper_setting"] = paper_setting(cfg, common, args.work, report["split_loop"], deadline)
    report["load_after"] = os.getloadavg()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["cpu_reference"] = None if args.tiny else _read_json(CPU_REFERENCE)
    report["ok"] = all(r.get("exactly_once") for r in report["split_loop"] + report["paper_setting"]["runs"])
    write_record(args.out / "full_size", report, table(report))
    plot(report, args.out / "loss_curves.png")
    print(f"outputs: {args.out / 'full_size.json'}, {args.out / 'full_size.txt'}, {args.out / 'loss_curves.png'}")
    return 0 if report["ok"] else 1


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def split_loop(model: str, common: list[str], epochs: int, work: Path, name: str | None = None,
               extra: list[str] = ()) -> dict[str, Any]:
    """One `splitface-research demo` run (fresh processes), measured from its outputs."""
    from bench.load import check_counts
    from splitface.common.models import resolve_spec
    from splitface.server.checkpoint import load_checkpoint
    from research.demo import run_recorded

    name = name or model
    run_dir = work / name
    demo_args = ["--model", model, "--epochs", str(epochs), *common, *extra]
    row: dict[str, Any] = {"name": name, "model": model, "input_size": resolve_spec(model).input_size,
                           "epochs": epochs, "run_dir": str(run_dir)}
    print(f"[{time.strftime('%H:%M:%S')}] split loop: {name}", flush=True)
    t0 = time.monotonic()
    try:
        results = run_recorded(run_dir, demo_args, force=True)
    except SystemExit as exc:
        row["error"] = str(exc)
        row["exactly_once"] = False
        for log in ("demo.log", "server.log"):
            if (run_dir / log).exists():
                tail = (run_dir / log).read_text()[-3000:]
                row[f"{log}_tail"] = tail
                print(f"---- {run_dir / log} (tail)\n{tail}", flush=True)
        return row
    row["wall_s"] = round(time.monotonic() - t0, 1)
    metrics = json.loads((run_dir / "server" / "metrics.json").read_text())
    state = load_checkpoint(run_dir / "server" / "checkpoint.pt")
    devices = results["devices"]
    committed = {d["device_id"]: d["committed"] for d in devices}
    counts = check_counts(committed, state)
    batch_size = results["config"]["batch_size"]
    planned = sum(math.ceil(d["train_samples"] / batch_size) * epochs for d in devices)
    batches = sorted((b for d in devices for b in d["batches"]), key=lambda b: b["finished"])
    window = batches[-1]["finished"] - batches[0]["finished"] if len(batches) > 1 else 0.0
    k = max(1, len(batches) // 10)
    server_log = (run_dir / "server.log").read_text() if (run_dir / "server.log").exists() else ""
    row |= {
        "devices": len(devices), "processes": results["config"].get("processes", 1), "batch_size": batch_size,
        "steps_planned": planned, "steps": counts["server_steps"], "device_batches": counts["device_batches"],
        "lost": counts["lost"], "double_applied": counts["double_applied"],
        "mismatched_devices": counts["mismatched_devices"],
        "exactly_once": (counts["lost"] == counts["double_applied"] == 0 and not counts["mismatched_devices"]
                         and counts["server_steps"] == counts["device_batches"] == planned),
        "samples": sum(b["n"] for b in batches),
        "window_s": round(window, 2),
        # the first batch ends the window's start: the samples after it, over the time they took
        "samples_per_s": sum(b["n"] for b in batches[1:]) / window if window > 0 else None,
        "server_compute_samples_per_s": metrics["global"]["compute_samples_per_s"],
        "server_samples_per_s_since_start": metrics["global"]["samples_per_s"],
        "accelerator": metrics.get("accelerator"),
        "checkpoints": server_log.count("checkpoint at server step"),
        "device_ms_per_batch": 1e3 * statistics.fmean(b["device_s"] for b in batches),
        "device_ms_per_batch_p50": 1e3 * statistics.median(b["device_s"] for b in batches),
        "round_trip_ms_per_batch": 1e3 * statistics.fmean(b["round_trip_s"] for b in batches),
        "loss_first": batches[0]["loss"], "loss_last": batches[-1]["loss"],
        "loss_first_tenth": statistics.fmean(b["loss"] for b in batches[:k]),
        "loss_last_tenth": statistics.fmean(b["loss"] for b in batches[-k:]),
        "loss_curve": loss_curve([b["loss"] for b in batches]),
        "epochs_summary": [{key: e[key] for key in ("epoch", "train_loss", "train_acc", "test_loss", "test_acc",
                                                     "epsilon_image_max")} for e in results["epochs"]],
        "bytes_up_per_batch": sum(e["bytes_sent"] for e in results["epochs"]) / max(1, len(batches)),
        "mechanism": devices[0]["privacy"]["mechanism"],
    }
    peak = (row["accelerator"] or {}).get("memory_peak_allocated_bytes")
    print(f"  {row['steps']}/{planned} steps, {fmt(row['samples_per_s'], '.1f')} samples/s, "
          f"GPU peak {fmt(peak and peak / 2 ** 30, '.2f')} GiB, loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}, "
          f"lost {row['lost']}, double-applied {row['double_applied']}, {row['wall_s']} s", flush=True)
    return row


def loss_curve(losses: list[float], bins: int = 20) -> list[dict[str, float]]:
    """Per-step losses (in the order the server applied them) averaged in up to `bins` consecutive bins."""
    n = len(losses)
    edges = sorted({round(i * n / bins) for i in range(bins + 1)})
    return [{"steps": f"{a + 1}-{b}", "mean_loss": statistics.fmean(losses[a:b])} for a, b in zip(edges, edges[1:])]


def paper_setting(cfg: dict[str, Any], common: list[str], work: Path, loops: list[dict[str, Any]],
                  deadline: float) -> dict[str, Any]:
    """The paper's epsilon 3 and no noise, with as many of the planned epochs as fit before the deadline."""
    model, planned = cfg["paper_model"], cfg["paper_epochs"]
    out: dict[str, Any] = {"model": model, "epochs_planned": planned, "runs": [], "notes": []}
    if planned < 1:
        out["notes"].append("skipped: --paper-epochs 0")
        return out
    measured = next((r for r in loops if r["model"] == model and "error" not in r), None)
    if measured is None:
        out["notes"].append(f"skipped: no measured split loop of {model} to plan from")
        return out
    per_epoch = measured["window_s"] * measured["steps"] / max(1, measured["steps"] - 1) / measured["epochs"]
    overhead = max(0.0, measured["wall_s"] - measured["window_s"])
    reserve = 20.0   # the comparison's outputs and the report

    def fits(epochs: int, factors: tuple[float, ...]) -> bool:
        """Runs of `epochs` epochs, each `factor` times the measured pace, before the deadline."""
        needed = sum(overhead + factor * per_epoch * epochs for factor in factors)
        return needed <= deadline - time.monotonic() - reserve

    # the noisy run first, planned slower; the run without noise is step 1's VGG-Face run again, more epochs
    epochs = next((e for e in range(planned, 0, -1) if fits(e, (NOISE_FACTOR, 1.0))), 0)
    out["plan"] = {"seconds_per_epoch_measured": round(per_epoch, 1), "startup_s": round(overhead, 1),
                   "noise_factor": NOISE_FACTOR, "seconds_left": round(deadline - time.monotonic(), 1),
                   "epochs": epochs}
    if epochs == 0:
        out["notes"].append(f"skipped: one epoch of each run does not fit the {cfg['budget_s']:.0f} s budget "
                            f"({per_epoch:.0f} s per epoch measured, {overhead:.0f} s start-up)")
        return out
    if epochs < planned:
        out["notes"].append(f"{epochs} of the {planned} planned epochs: what fits the budget")
    for name, mechanism in PAPER_RUNS:
        if out["runs"]:  # re-plan from the run just made (the noisy one: an upper bound)
            last = out["runs"][-1]
            if "error" not in last:
                per_epoch, overhead = last["window_s"] / epochs, max(0.0, last["wall_s"] - last["window_s"])
            if not fits(epochs, (1.0,)):
                out["notes"].append(f"{name} skipped: {epochs} epoch(s) no longer fit the budget")
                continue
        out["runs"].append(split_loop(model, common, epochs, work, name=f"paper-{name}", extra=mechanism))
    return out


def split_vs_unsplit(model: str, data: Path, cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """A few SGD steps split (through the protocol) and unsplit (one process) from the same start on the same
    faces; the largest differences."""
    import asyncio
    import dataclasses

    import numpy as np
    import torch

    from bench.bench_split import DEVICE_ID, TOKEN, serve_in_thread
    from splitface.device.connection import DeviceClient
    from splitface.common.data import load_lfw
    from splitface.device.trainer import DeviceTrainer
    from splitface.common.models import build_backbone, build_classifier, resolve_spec, split_backbone
    from splitface.common.optim import TrainConfig
    from splitface.server.trainer import ServerTrainer

    print(f"[{time.strftime('%H:%M:%S')}] split vs unsplit: {model} on {device}", flush=True)
    t0 = time.monotonic()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = dataclasses.replace(resolve_spec(model), dropout=0.0)
    faces = load_lfw(data, min_images=LFW_MIN_IMAGES)
    classes = len(faces.class_names)
    n, steps = cfg["compare_batch"], cfg["compare_steps"]
    chosen = faces.train.subset(np.random.default_rng(0).permutation(len(faces.train))[:n * steps])
    images = chosen.load(spec.input_size)
    batches = [(images[i * n:(i + 1) * n], chosen.labels[i * n:(i + 1) * n]) for i in range(steps)]
    train = TrainConfig(lr=COMPARE_LR, decay_steps=COMPARE_DECAY_STEPS)
    torch.manual_seed(123)
    init = {"backbone": build_backbone(spec).state_dict(), "classifier": build_classifier(spec, classes).state_dict()}

    def start() -> tuple[torch.nn.Module, torch.nn.Module]:
        backbone, classifier = build_backbone(spec), build_classifier(spec, classes)
        backbone.load_state_dict(init["backbone"])
        classifier.load_state_dict(init["classifier"])
        return backbone, classifier

    # split: the device engine on the CPU, the server's trainer on `device`, the real protocol between
    backbone, classifier = start()
    device_part, tail = split_backbone(backbone, "conv1")
    trainer = ServerTrainer(spec, "conv1", classes, train, device)
    trainer.tail.load_state_dict(tail.state_dict())
    trainer.classifier.load_state_dict(classifier.state_dict())
    engine = DeviceTrainer(spec, "conv1", "server", classes, train)
    engine.layer.load_state_dict(device_part.state_dict())
    with tempfile.TemporaryDirectory(prefix="full_size_compare_") as run_dir, \
            serve_in_thread(trainer, n, Path(run_dir)) as server:
        async def steps_through_protocol() -> list[float]:
            client = DeviceClient(server.url, DEVICE_ID, TOKEN, engine, n,
                                  encodings={"activations": "f32", "gradients": "f32"})
            await client.connect()
            out = [(await client.train_batch(i + 1, x, y, np.arange(len(y)) + i * n)).loss
                   for i, (x, y) in enumerate(batches)]
            await client.close()
            return out
        split_losses = asyncio.run(steps_through_protocol())
    split_weights = {**_weights("device", engine.layer), **_weights("tail", trainer.tail),
                     **_weights("classifier", trainer.classifier)}

    references = [("split's precision (device layers fp32, the rest bf16 autocast)", True)] if device == "cuda" else []
    references.append(("fp32", False))
    row: dict[str, Any] = {"model": model, "input_size": spec.input_size, "device": device, "batch": n,
                           "steps": steps, "dropout": 0.0, "split_losses": split_losses, "references": []}
    for label, bf16 in references:
        backbone, classifier = start()
        losses, weights, start_weights = _unsplit_steps(backbone, classifier, batches, train, device, bf16)
        update = max(float((weights[k] - start_weights[k]).abs().max()) for k in weights)
        row["references"].append({
            "reference": label, "unsplit_losses": losses,
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses, split_losses)),
            "max_abs_weight_diff": max(float((split_weights[k] - weights[k]).abs().max()) for k in weights),
            "max_abs_weight_update": update})
    row["seconds"] = round(time.monotonic() - t0, 1)
    for r in row["references"]:
        print(f"  vs unsplit in {r['reference']}: loss diff {r['max_abs_loss_diff']:.2e}, weight diff "
              f"{r['max_abs_weight_diff']:.2e} (largest update {r['max_abs_weight_update']:.2e})", flush=True)
    return row


def _weights(prefix: str, module) -> dict[str, Any]:
    """Parameters and buffers (batch-norm statistics): float32 copies on the CPU."""
    return {f"{prefix}.{k}": v.detach().to("cpu", copy=True).float() for k, v in module.state_dict().items()
            if v.is_floating_point()}


def _unsplit_steps(backbone, classifier, batches, train, device: str, bf16: bool):
    """The unsplit model in one process: one optimizer, one backward; with `bf16`, autocast over what the split
    runs on the server (the layers after the cut and the classifier), as the server's trainer does."""
    import torch
    import torch.nn.functional as F

    from splitface.device.trainer import to_input
    from splitface.common.models import split_backbone
    from splitface.common.optim import exponential_decay, make_sgd

    backbone.to(device), classifier.to(device)
    device_part, tail = split_backbone(backbone, "conv1")
    start = {**_weights("device", device_part), **_weights("tail", tail), **_weights("classifier", classifier)}
    opt = make_sgd(list(backbone.parameters()) + list(classifier.parameters()), train.lr, train.momentum,
                   train.weight_decay)
    sched = exponential_decay(opt, train.lr_decay, train.decay_steps)
    losses = []
    for images, labels in batches:
        backbone.train(), classifier.train()
        opt.zero_grad(set_to_none=True)
        x = device_part(to_input(images).to(device))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = classifier(tail(x))
        loss = F.cross_entropy(logits.float(), torch.as_tensor(labels, device=device))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    weights = {**_weights("device", device_part), **_weights("tail", tail), **_weights("classifier", classifier)}
    return losses, weights, start


# ---- report -------------------------------------------------------------------------------------------------------

def fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict[str, Any]) -> str:
    mc = report["machine"]
    acc = next((r["accelerator"] for r in report["split_loop"] if r.get("accelerator")), {}) or {}
    cpu_ref = {r["model"]: r for r in (report.get("cpu_reference") or {}).get("split_loop", []) if "error" not in r}
    tiny_of = dict(zip(FULL["models"], TINY["models"]))
    lines = [f"# Full size{' (--tiny, CPU)' if report['tiny'] else ''}: {report['date']}",
             "",
             f"Server: {acc.get('name') or acc.get('device', '?')} ({acc.get('device', '?')}, autocast "
             f"{acc.get('autocast') or 'none: fp32'}); {mc['cpu_model']}, {mc['usable_cores']} cores usable, "
             f"{mc['memory_gib']} GiB; torch {mc['torch']}, python {mc['python']}; load (1/5/15 min) "
             f"{', '.join(f'{x:.1f}' for x in report['load_before'])} before, "
             f"{', '.join(f'{x:.1f}' for x in report['load_after'])} after; {report['seconds']} s in all. "
             f"Wire: {' '.join(report['wire'])}. Code {report['code']['commit']}"
             f"{' (dirty)' if report['code']['dirty'] else ''}.",
             "",
             "## 1. The split loop (splitface-research demo: a server process, one process per device, loopback websockets)",
             "",
             "Server samples/s: samples applied from the first to the last applied batch, over that time; compute: "
             "the server's own compute-only figure (metrics.json). CPU --tiny: the same script's figure at --tiny "
             "size on the project's 2-core CPU machine (results/full_size/cpu-tiny), for scale only. Exactly once: "
             "every device's committed batches against the server's checkpoint (none lost, none applied twice, "
             "server steps = device batches = planned). Checkpoints: those the server wrote, the last one (on its "
             "way out) included; each holds the model while it is written.",
             "",
             "| model | px | devices | batch | steps | server samples/s | compute samples/s | CPU --tiny samples/s "
             "| GPU mem peak GiB | device ms/batch | round trip ms/batch | loss first → last (first/last tenth) "
             "| lost | double | exactly once | checkpoints | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    for r in report["split_loop"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['input_size']} | failed: {r['error']} |")
            continue
        peak = (r["accelerator"] or {}).get("memory_peak_allocated_bytes")
        ref = cpu_ref.get(tiny_of.get(r["model"], ""), {}).get("samples_per_s")
        lines.append(
            f"| {r['model']} | {r['input_size']} | {r['devices']} | {r['batch_size']} | {r['steps']}/{r['steps_planned']} "
            f"| {fmt(r['samples_per_s'])} | {fmt(r['server_compute_samples_per_s'])} | {fmt(ref)} "
            f"| {fmt(peak and peak / 2 ** 30, '.2f')} | {r['device_ms_per_batch']:.0f} | {r['round_trip_ms_per_batch']:.0f} "
            f"| {r['loss_first']:.3f} → {r['loss_last']:.3f} ({r['loss_first_tenth']:.3f} → {r['loss_last_tenth']:.3f}) "
            f"| {r['lost']} | {r['double_applied']} | {'yes' if r['exactly_once'] else 'NO'} | {r['checkpoints']} "
            f"| {r['wall_s']} |")
    lines += ["", "## 2. Split equals unsplit (same start, same faces, dropout off, TF32 off)", "",
              "| model | px | server on | batch | steps | unsplit reference | max abs loss diff | max abs weight diff "
              "| largest weight update |",
              "|---|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in report["split_vs_unsplit"]:
        for ref in r["references"]:
            lines.append(f"| {r['model']} | {r['input_size']} | {r['device']} | {r['batch']} | {r['steps']} "
                         f"| {ref['reference']} | {ref['max_abs_loss_diff']:.2e} | {ref['max_abs_weight_diff']:.2e} "
                         f"| {ref['max_abs_weight_update']:.2e} |")
    paper = report["paper_setting"]
    lines += ["", f"## 3. The paper's setting: {paper['model']} from conv1, per-activation epsilon 3 and no noise, "
                  f"LFW-158", ""]
    lines += [f"- {note}" for note in paper["notes"]]
    if paper["runs"]:
        lines += ["", "| run | epochs | steps | server samples/s | loss first/last tenth | train acc | test acc "
                      "| exactly once | wall s |", "|---|---:|---:|---:|---|---:|---:|---|---:|"]
        for r in paper["runs"]:
            if "error" in r:
                lines.append(f"| {r['name']} | failed: {r['error']} |")
                continue
            last = r["epochs_summary"][-1]
            lines.append(f"| {r['name']} | {r['epochs']} | {r['steps']} | {fmt(r['samples_per_s'])} "
                         f"| {r['loss_first_tenth']:.3f} → {r['loss_last_tenth']:.3f} | {last['train_acc']:.3f} "
                         f"| {last['test_acc']:.3f} | {'yes' if r['exactly_once'] else 'NO'} | {r['wall_s']} |")
        lines += ["", "Loss curves (mean per-step loss in consecutive bins of steps, in the order applied):", ""]
        for r in paper["runs"]:
            if "error" not in r:
                lines.append(f"- {r['name']}: " + ", ".join(f"{b['mean_loss']:.2f}" for b in r["loss_curve"]))
    lines += ["", f"All batches applied exactly once: {'yes' if report['ok'] else 'NO'}."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, rows, title in ((axes[0], report["split_loop"], "1. split loop"),
                            (axes[1], report["paper_setting"]["runs"], "3. paper's setting")):
        for r in rows:
            if "error" in r:
                continue
            ends = [int(b["steps"].split("-")[1]) for b in r["loss_curve"]]
            ax.plot(ends, [b["mean_loss"] for b in r["loss_curve"]], marker=".", label=r["name"])
        ax.set_xlabel("server step")
        ax.set_ylabel("training loss (bin mean)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--pack", type=Path, default=DEFAULT_PACK)
    known, _ = first.parse_known_args(argv)
    boot = bootstrap(known.pack)   # before the project's imports

    from splitface.common.options import add_data_root_arg, add_devices_arg

    p = argparse.ArgumentParser(prog="research/full_size.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="here: LFW-158 and the wheels the CUDA machine lacks, into --pack")
    add_data_root_arg(pk, default=ROOT.parent / "shared" / "data" / "lfw")
    pk.add_argument("--no-wheels", action="store_true", help="pack the faces only")
    rn = sub.add_parser("run", help="on the CUDA machine (or with --tiny on a CPU): the three steps, from --pack")
    rn.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else
                    ROOT / "build" / "full_size_out", help="full_size.json, full_size.txt, loss_curves.png "
                                                          "(default: $OUT, else build/full_size_out)")
    rn.add_argument("--work", type=Path, default=DEFAULT_WORK, help="the runs' folders (servers' checkpoints, logs)")
    add_devices_arg(rn, default=None, help=f"simulated devices, one process each (default {FULL['devices']}; "
                                           f"--tiny {TINY['devices']})")
    rn.add_argument("--batch-size", type=int, default=None, help=f"per device (default {FULL['batch_size']}; "
                                                                 f"--tiny {TINY['batch_size']})")
    rn.add_argument("--epochs", type=int, default=None, help="of the split loop (default 1)")
    rn.add_argument("--paper-epochs", type=int, default=None,
                    help=f"of the paper's setting, at most (default {FULL['paper_epochs']}; --tiny 1; 0: skip it)")
    rn.add_argument("--budget-s", type=float, default=None,
                    help=f"the paper's setting runs only what fits in this many seconds from the start "
                         f"(default {FULL['budget_s']:.0f})")
    rn.add_argument("--demo-args", default="", help="more splitface-research demo arguments for every run (they come last)")
    for sp in (pk, rn):
        sp.add_argument("--pack", type=Path, default=DEFAULT_PACK, help="the pack's folder (git-ignored; carried)")
        sp.add_argument("--tiny", action="store_true", help="reduced size on a CPU (the smoke test)")
    args = p.parse_args(argv)
    if args.command == "pack":
        pack(args)
        return 0
    return run(args, boot)


if __name__ == "__main__":
    sys.exit(main())
