"""`splitface-research demo`: the main job. Starts an edge server and N simulated devices as separate
processes on loopback, trains on LFW (or the data given), and prints the results.

The server and the devices share nothing but the websocket: the launcher only issues
tokens, starts the two programs, and stops the server (which checkpoints on the way out).
Killing the launcher (SIGTERM or SIGINT) stops both programs too, on its way out, so nothing is
left orphaned; they stay in its process group, so a signal to the whole group reaches them all.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, TextIO

import torch

from splitface.common.options import load_data
from splitface.common.models import ModelSpec
from splitface.common.options import add_data_args, add_devices_args, add_model_args, add_training_args, data_argv, model_argv, model_spec
from splitface.common.transforms import MIRRORED, release_mirror
from splitface.device.privacy.options import add_privacy_args, release_mechanism
from splitface.sim.simulator import device_ranges, merge_results

from splitface.server.auth import issue_tokens
from splitface.server.cli import add_tail_args
from research.distill import NOISE_AWARE_RECIPE, PLAIN_RECIPE, Recipe, distilled_start


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitface-research demo", description=__doc__)
    add_data_args(p)
    add_model_args(p, model="iresnet_small")
    p.add_argument("--init", default="scratch",
                   help="where the model starts: scratch (seeded weights), distilled (the public start distilled from "
                        "dlib's recognizer for this model, cut and release: built on first use, then cached; "
                        "splitface-research pretrain distill), or a backbone file; the server's tail and the devices' layer "
                        "start from it")
    p.add_argument("--student-epochs", type=int, default=PLAIN_RECIPE.epochs,
                   help="with --init distilled: the epochs of the plain student's distillation from dlib's recognizer, "
                        "which every distilled start begins from (part of its identity, and of every noise-aware "
                        "start made from it: another number, other files; docs/pretrain.md)")
    p.add_argument("--noise-aware-epochs", type=int, default=NOISE_AWARE_RECIPE.epochs,
                   help="with --init distilled and a release with noise or a transform: the epochs of its noise-aware "
                        "start's distillation from the plain student (part of that start's identity: another number, "
                        "another file; docs/pretrain.md)")
    p.add_argument("--student-views", type=int, default=PLAIN_RECIPE.views,
                   help="with --init distilled: the plain student learns by function matching on this many views of "
                        "each public face, each with the teacher's own embedding of it (research/views.py); 0: the "
                        "clean image's embedding, the first recipe (part of its identity, as --student-epochs)")
    p.add_argument("--noise-aware-views", type=int, default=NOISE_AWARE_RECIPE.views,
                   help="with --init distilled: the same for the noise-aware start (part of its identity)")
    p.add_argument("--server-init", type=Path, default=None,
                   help="start only the server's tail from this saved backbone (the devices' weights are set apart)")
    add_tail_args(p)
    add_devices_args(p)
    add_training_args(p, epochs=3, batch_size=64, lr=0.05, lr_help="the server's learning rate")
    p.add_argument("--device-lr", type=float, default=0.005,
                   help="the devices' learning rate for their own layer; kept small so that the devices' layers "
                        "stay close to their shared start (docs/overview.md: several devices and batch norm)")
    p.add_argument("--head-lr-scale", type=float, default=1.0,
                   help="the classifier's lr over the rest's, on the server (server head) or the devices (device "
                        "head): a fresh head on a distilled start learns at the usual fine-tuning ratio (e.g. 10)")
    p.add_argument("--imprint-epochs", type=float, default=0.0,
                   help="server head: for this many epochs its rows are its classes' mean embeddings (weight "
                        "imprinting), then trained from there: a pre-trained start keeps what it knows while a fresh "
                        "head would still be random (splitface/server/imprint.py). A device head is not imprinted: "
                        "with --head device it starts fresh, and the run says so")
    p.add_argument("--imprint-hold-tail", action=argparse.BooleanOptionalAction, default=False,
                   help="with --imprint-epochs: the server's tail takes no step while its head is imprinted, so "
                        "that fine-tuning starts from the start's class means (docs/pretrain.md; run.sh holds it: "
                        "--no-imprint-hold-tail does not, and with --imprint-epochs 0 nothing is held)")
    p.add_argument("--device-processes", type=int, default=1,
                   help="run the devices in this many simulator processes (devices dealt in contiguous ranges, "
                        "each process with the CPU cores / this many torch threads unless --threads is given); "
                        "their results are merged into one results.json")
    p.add_argument("--run-dir", type=Path, default=None, help="default: runs/demo-<time>")
    p.add_argument("--port", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if not 1 <= args.device_processes <= args.devices:
        p.error(f"--device-processes must be between 1 and --devices ({args.devices})")
    for flag in ("student_epochs", "noise_aware_epochs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be 1 or more, not {getattr(args, flag)}")
    for flag in ("student_views", "noise_aware_views"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be 0 or more, not {getattr(args, flag)}")
    drop_hold_without_imprinting(args)
    drop_mirror_without_map(args)
    run_dir = args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)

    data = load_data(args)  # fails early, with instructions, if there is no data
    init = initial_weights(args, extra)
    if init is not None:
        if args.server_init is not None:
            p.error("--init and --server-init both set where the server starts: give one")
        args.server_init = init
        if "--device-weights" not in extra:
            extra = [*extra, "--device-weights", str(init)]
    device_ids = [f"device-{i}" for i in range(args.devices)]
    tokens = issue_tokens(run_dir / "server" / "tokens.json", device_ids)
    token_file = run_dir / "device_tokens.json"
    token_file.write_text(json.dumps(tokens))
    token_file.chmod(0o600)
    per_device = math.ceil(len(data.train) / args.devices / args.batch_size) + 1
    decay_steps = per_device * args.devices * args.epochs
    imprint_steps = server_imprint_steps(args, len(data.train))

    common = model_argv(args)  # the same model and release options to the server and the devices
    data_args = data_argv(args)
    server_cmd = [sys.executable, "-m", "splitface.server.cli", "serve", *common,
                  "--num-classes", str(len(data.class_names)), "--tokens", str(run_dir / "server" / "tokens.json"), "--port", str(args.port),
                  "--run-dir", str(run_dir / "server"), "--lr", str(args.lr), "--decay-steps", str(decay_steps),
                  "--max-batch", str(args.batch_size), "--seed", str(args.seed), "--train-only", args.train_only,
                  "--record-max", str(args.record_max), "--gradient-rounding", args.gradient_rounding,
                  "--head-lr-scale", str(args.head_lr_scale), "--imprint-steps", str(imprint_steps),
                  "--release-noise-std", repr(devices_noise_std(args, extra)),
                  *(["--imprint-hold-tail"] if args.imprint_hold_tail and imprint_steps else []),
                  *(["--mirror-average"] if args.mirror_average else []),
                  *(["--mirror-train"] if args.mirror_train else [])]
    if args.server_init:
        server_cmd += ["--init", str(args.server_init)]
    server_log = open(run_dir / "server.log", "w")
    previous = _stop_on_signals()
    server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    copier, sims = None, []
    try:
        port = _wait_ready(server, server_log)
        # Keep draining the server's output: a full pipe would block the server.
        copier = threading.Thread(target=_copy, args=(server.stdout, server_log), daemon=True)
        copier.start()
        print(f"edge server on ws://127.0.0.1:{port} (log: {run_dir / 'server.log'})", flush=True)
        sim_cmd = [sys.executable, "-m", "splitface.device_cli", "sim", "--server", f"ws://127.0.0.1:{port}",
                   "--tokens", str(token_file), *common, *data_args, "--head", args.head, *(["--pipeline"] if args.pipeline else []),
                   "--devices", str(args.devices), "--epochs", str(args.epochs),
                   "--batch-size", str(args.batch_size), "--lr", str(args.device_lr),
                   "--head-lr-scale", str(args.head_lr_scale), *extra]
        parts = device_ranges(args.devices, args.device_processes)
        if len(parts) == 1:
            sims = [subprocess.Popen([*sim_cmd, "--results", str(run_dir / "results.json")])]
        else:
            threads = [] if "--threads" in extra else ["--threads", str(max(1, (os.cpu_count() or 1) // len(parts)))]
            sims = [subprocess.Popen([*sim_cmd, *threads, "--only-devices", f"{start}:{stop}",
                                      "--results", str(part_results(run_dir, k))])
                    for k, (start, stop) in enumerate(parts)]
        failed = _wait_all(sims)
        if failed is not None:
            raise SystemExit(f"the device simulator failed (exit {failed}); server log: {run_dir / 'server.log'}")
        if len(parts) > 1:
            merged = merge_results([json.loads(part_results(run_dir, k).read_text()) for k in range(len(parts))],
                                   processes=len(parts))
            (run_dir / "results.json").write_text(json.dumps(merged, indent=2))
    except Stopped as stop:
        print(f"splitface-research demo: {stop.name}: stopping the devices and the edge server", file=sys.stderr, flush=True)
        raise SystemExit(128 + stop.signum) from None
    finally:
        for sig in previous:  # a second signal must not cut the stopping short
            signal.signal(sig, signal.SIG_IGN)
        for sim in sims:
            _stop(sim, signal.SIGTERM, timeout=30)
        _stop(server, signal.SIGINT, timeout=120)  # SIGINT: the server checkpoints on its way out
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if copier is not None:
            copier.join(10)
        server_log.close()
    _report(run_dir, data, args)


def part_results(run_dir: Path, k: int) -> Path:
    """Simulator process k's results (beside results.json, so that the device layers and privacy states of every
    process land in the run's one device_layers/ and privacy_state/)."""
    return run_dir / f"results.part-{k}.json"


def _wait_all(procs: list[subprocess.Popen]) -> int | None:
    """Wait for every process; at the first that fails, return its exit status (the caller stops the others)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.2)


def initial_weights(args: argparse.Namespace, extra: list[str]) -> Path | None:
    """The backbone file that --init names: None from scratch; with `distilled`, the distilled start for this
    model, cut, release and the devices' noise (their privacy options in `extra`), built on first use."""
    if args.init == "scratch":
        return None
    if args.init != "distilled":
        path = Path(args.init)
        if not path.is_file():
            raise SystemExit(f"--init: {path} is not a file (give scratch, distilled or a backbone file)")
        return path
    return distilled_start(model_spec(args), args.split, release_mechanism(_privacy_options(extra)), args.data,
                           progress="--no-progress" not in extra, recipes=start_recipes(args))


def start_recipes(args: argparse.Namespace) -> tuple[Recipe, Recipe]:
    """The recipes of the distilled start that --init distilled names: (the plain student's, the noise-aware
    start's), their epochs and views from --student-epochs, --noise-aware-epochs and the two --*-views."""
    return (replace(PLAIN_RECIPE, epochs=args.student_epochs, views=args.student_views),
            replace(NOISE_AWARE_RECIPE, epochs=args.noise_aware_epochs, views=args.noise_aware_views))


def _privacy_options(extra: list[str]) -> argparse.Namespace:
    """The devices' privacy options among the simulator's arguments in `extra`."""
    privacy = argparse.ArgumentParser(add_help=False)
    add_privacy_args(privacy)
    known, _ = privacy.parse_known_args(extra)
    return known


def devices_noise_std(args: argparse.Namespace, extra: list[str]) -> float:
    """The noise std per released value of the devices' mechanism, for the server's release-aware bound
    (--release-noise-std): the simulator plans --target-epsilon over --epochs releases per image, and so does this."""
    return release_mechanism(_privacy_options(extra), releases_per_image=args.epochs).value_noise_std()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The launcher was asked to stop by a signal; raised in its main thread so that its cleanup runs."""

    def __init__(self, signum: int) -> None:
        self.signum, self.name = signum, signal.Signals(signum).name
        super().__init__(self.name)


def _stop_on_signals() -> dict[int, object]:
    """SIGTERM and SIGINT raise `Stopped` (SIGTERM would otherwise end the launcher at once, leaving the server
    and the devices running). Returns the handlers replaced, to restore. Only the main thread may install
    handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame) -> None:
        raise Stopped(signum)
    return {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}


def _stop(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    """Stop a child: `sig`, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def same_arguments(recorded: list[str], wanted: list[str]) -> bool:
    """Equal command lines, a --data path given relatively or absolutely counting as the same."""
    def normal(argv: list[str]) -> list[str]:
        return [str(Path(a).resolve()) if i and argv[i - 1] == "--data" else a for i, a in enumerate(argv)]
    return normal(recorded) == normal(wanted)


def drop_hold_without_imprinting(args: argparse.Namespace) -> None:
    """run.sh holds the server's tail while its head is imprinted; with --imprint-epochs 0 nothing is imprinted, so
    nothing is held: said, and the hold set off (the recorded command line keeps the flags it was given; `held_tail`
    reads them as the server trained)."""
    if args.imprint_hold_tail and not args.imprint_epochs:
        print("--imprint-hold-tail: with --imprint-epochs 0 nothing is imprinted, so the server's tail is not held",
              file=sys.stderr, flush=True)
        args.imprint_hold_tail = False


def drop_mirror_without_map(args: argparse.Namespace) -> None:
    """run.sh's server averages each test release's embedding with its mirror image's; another --release may have
    no mirror that the server can compute (a learned layer's output): said, and the average set off, so that
    `./run.sh --release none --split conv1` still runs. Without the average there is nothing to train on
    (--mirror-train), so `./run.sh --no-mirror-average` trains on each release once."""
    if not args.mirror_average:
        if args.mirror_train:
            print("--mirror-train: without --mirror-average the server trains on each release once", file=sys.stderr,
                  flush=True)
        args.mirror_train = False
        return
    spec = model_spec(args)
    try:
        release_mirror(spec)
    except ValueError as exc:
        print(f"--mirror-average: {exc}; the server embeds each release once", file=sys.stderr, flush=True)
        args.mirror_average = args.mirror_train = False


def server_imprint_steps(args: argparse.Namespace, train_images: int) -> int:
    """--imprint-epochs as the server's training steps: every device's batches of each epoch. 0 for a device head,
    whose classifier lives on the devices (imprinting it is not built): said, not silently dropped."""
    if not args.imprint_epochs:
        return 0
    if args.head != "server":
        print(f"--imprint-epochs {args.imprint_epochs:g}: the head is on the devices, where it is not imprinted; "
              "it starts fresh" + (" and the server's tail is not held" if args.imprint_hold_tail else ""),
              file=sys.stderr, flush=True)
        return 0
    return round(math.ceil(train_images / args.devices / args.batch_size) * args.devices * args.imprint_epochs)


def run_recorded(run_dir: Path, demo_args: list[str], force: bool = False,
                 on_trained: Callable[[], None] | None = None) -> dict:
    """One experiment run in fresh processes (the sweep's and the frontier's unit), logged to
    `run_dir/demo.log`. Resumable: a run that finished with the same arguments (its results.json and
    demo_args.json) is read back, not re-run, unless `force`; any other is removed first (the server
    would otherwise resume its checkpoint). `on_trained` is called after a run that was trained here."""
    import shutil

    results, recorded_args = run_dir / "results.json", run_dir / "demo_args.json"
    if results.exists() and recorded_args.exists() and not force \
            and same_arguments(json.loads(recorded_args.read_text()), demo_args):
        return json.loads(results.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    recorded_args.write_text(json.dumps(demo_args))
    cmd = [sys.executable, "-m", "research.demo", "--run-dir", str(run_dir), "--no-progress", *demo_args]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (run_dir / "demo.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed; see {run_dir / 'demo.log'}")
    print(f"{run_dir.name}: trained in {time.time() - started:.0f}s", flush=True)
    if on_trained is not None:
        on_trained()
    return json.loads(results.read_text())


def _wait_ready(server: subprocess.Popen, log: TextIO) -> int:
    """The port from the server's READY line (copying what it prints before that to the log)."""
    assert server.stdout is not None
    for line in server.stdout:
        log.write(line)
        if line.startswith("READY "):
            log.flush()
            return int(line.split()[1])
    raise SystemExit(f"the edge server exited before it was ready (exit {server.wait()}); see {log.name}")


def _copy(stream: TextIO, log: TextIO) -> None:
    for line in stream:
        log.write(line)
        log.flush()


def _report(run_dir: Path, data, args: argparse.Namespace) -> None:
    results = json.loads((run_dir / "results.json").read_text())
    metrics = json.loads((run_dir / "server" / "metrics.json").read_text())
    labels = data.test.labels
    majority = max((labels == c).mean() for c in set(labels.tolist()))
    print(f"\n{len(data.class_names)} identities; chance = 1/{len(data.class_names)} = {1 / len(data.class_names):.3f}, "
          f"majority class = {majority:.3f}")
    print(f"{'epoch':>5} {'train acc':>9} {'train loss':>10} {'test acc':>8} {'test loss':>9} {'MB up':>8} {'MB down':>8} "
          f"{'dev ms/batch':>12} {'eps/image':>9}")
    for e in results["epochs"]:
        print(f"{e['epoch']:>5} {e['train_acc']:>9.3f} {e['train_loss']:>10.3f} {e['test_acc']:>8.3f} {e['test_loss']:>9.3f} "
              f"{e['bytes_sent'] / 1e6:>8.1f} {e['bytes_received'] / 1e6:>8.1f} {e['device_s_per_batch'] * 1e3:>12.0f} "
              f"{e['epsilon_image_max']:>9.3g}")
    g = metrics["global"]
    print(f"server: {g['samples']} samples, {g['samples_per_s']:.1f} samples/s, "
          f"{g['bytes_in'] / 1e6:.1f} MB in, {g['bytes_out'] / 1e6:.1f} MB out")
    print(f"results: {run_dir / 'results.json'}  server metrics: {run_dir / 'server' / 'metrics.json'}")
    print(audit_line(results, args))


RESULTS = Path(__file__).resolve().parents[1] / "results"
# the privacy frontiers: from scratch, from the distilled start with the first recipe, and as the main job trains
# (research/frontier.py --start distilled): from run.sh's start (the 16-view student of 150 epochs, its noise-aware
# start of 150, trained on the mirror average), from the earlier 60-epoch student (with the server's tail held while
# its head is imprinted, and without), from the 16-view student with a 60-epoch noise-aware start, and from the
# recipe's (30)
# (a run matches a row by its start file too, so no run finds two students' frontiers; where it matches several,
# `audited_point` prefers the one whose server trained most like its own, then its own start file's over another
# build's, then the first here: the main job's first)
FRONTIERS = (RESULTS / "frontier", RESULTS / "frontier-distilled-student150-views16-noiseaware150-hold-mirror-train",
             RESULTS / "frontier-distilled-imprinted-student60-hold",
             RESULTS / "frontier-distilled-imprinted-student60", RESULTS / "frontier-distilled-student150-views16",
             RESULTS / "frontier-distilled-imprinted", RESULTS / "frontier-distilled")


def release_of(results: dict, by_weights: bool = True) -> tuple:
    """What makes two runs' releases the same: model, split, head, device weights, layer training and mechanism.
    Device weights compare by file name (`by_weights`), else only whether there were any."""
    privacy = results["devices"][0]["privacy"]
    # a run recorded before a ModelSpec field existed holds that field's default
    model = ModelSpec.from_dict(results["config"]["model"]).to_dict()
    weights = results["config"].get("device_weights")
    held = (Path(weights).name if weights else None) if by_weights else weights is not None
    return (model, results["config"]["split"], results["config"]["head"], held, privacy["mechanism"],
            privacy["layer_training"])


def noise_aware_origin(weights: str | None) -> tuple[str, int, int] | None:
    """(the plain student's file name, the epochs, the views) a noise-aware distilled start was made from, from
    its manifest; None for any other weights or a file not on this machine."""
    if not weights or not Path(weights).exists():
        return None
    meta = torch.load(weights, map_location="cpu", weights_only=True).get("meta", {})
    init = meta.get("student", {}).get("init")
    if not init or init == "seeded" or "recipe" not in meta:
        return None
    return Path(init).name, int(meta["recipe"]["epochs"]), int(meta["recipe"].get("views", 0))


def audited_point(results: dict, frontiers: tuple[Path, ...] = FRONTIERS,
                  args: argparse.Namespace | None = None) -> tuple[Path, dict] | None:
    """(frontier, its row) for this run's release (`release_of`), if measured. Device weights compare by file name:
    a distilled start's name holds the hash of everything it was made from, wherever its cache is.

    A noise-aware start's name hashes the plain student's bytes, which a student trained again (on another machine,
    or resumed) does not repeat bit for bit, so such a start built anywhere but where the audit ran has another
    name. A run from one that matches no name matches a run audited from another build of the same recipe: the
    same plain student's name (that key is reproducible: recipe and public faces) in the frontier's undefended run,
    and the same noise-aware epochs and views recorded in the audited run's flags. `audit_line` says so.

    Rows of the same start file come first, then those of another build, each in FRONTIERS' order. With this run's
    `args`, the rows are then ranked by how many of the server's settings (`SERVER_RECIPE`) their recorded run
    trained otherwise, so that a run finds the audit of a server trained as its own was (the same release is
    audited once for each recipe the main job has used), from another build of the start if need be."""
    def find(by_weights: bool, same_start: Callable[[Path, Path], bool]) -> list[tuple[Path, dict]]:
        found = []
        for frontier in frontiers:
            summary = frontier / "summary.json"
            if not summary.exists():
                continue
            for row in json.loads(summary.read_text()):
                run = frontier / "runs" / row["run"]
                if ((run / "results.json").exists() and same_start(frontier, run)
                        and release_of(json.loads((run / "results.json").read_text()), by_weights)
                        == release_of(results, by_weights)):
                    found.append((frontier, row))
        return found

    found = find(True, lambda frontier, run: True)
    origin = noise_aware_origin(results["config"].get("device_weights"))
    if origin is not None:
        plain, epochs, views = origin

        def another_build(frontier: Path, run: Path) -> bool:
            undefended = frontier / "runs" / "none" / "results.json"
            flags = json.loads((run / "demo_args.json").read_text()) if (run / "demo_args.json").exists() else []
            plain_there = json.loads(undefended.read_text())["config"].get("device_weights") if undefended.exists() else None
            def flag(name: str, default: str | None) -> str | None:
                return flags[flags.index(name) + 1] if name in flags else default
            return (plain_there is not None and Path(plain_there).name == plain
                    and flag("--noise-aware-epochs", None) == str(epochs) and flag("--noise-aware-views", "0") == str(views))

        found += [f for f in find(False, another_build) if f not in found]
    if args is not None:
        found.sort(key=lambda f: len(server_recipe_differences(f, args)))   # stable: the order above within each
    return found[0] if found else None


# how the server trains: the audited run's may differ from this run's for the same release
SERVER_RECIPE = ("lr", "head_lr_scale", "imprint_epochs", "imprint_hold_tail", "mirror_train")


def weaker_attacker(frontier: Path, run: str, device_weights: str | None) -> bool:
    """Whether a run from a distilled start, whose devices trained their device part, was audited before the audit's
    copy of that part began from the start the server sent them (it began from seeded weights): reports since
    record where it began (`device_layer_start`), and a surrogate from the start says so in its name."""
    report = frontier / "audit" / f"{run}.json"
    if not device_weights or not report.exists():
        return False
    audit = json.loads(report.read_text())
    known = audit.get("device_layer_start", audit["device_layer"])
    return not known.startswith(("exact", "white-box")) and "published start" not in known


def without_mirror(frontier: Path, run: str) -> bool:
    """Whether an audited release has a mirror that the server can compute (transforms.release_mirror) and its report
    predates the audit's mirror attacks (reports since have `server_model_linkage_mirror`)."""
    report = frontier / "audit" / f"{run}.json"
    if not report.exists():
        return False
    audit = json.loads(report.read_text())
    spec = ModelSpec.from_dict(json.loads((frontier / "runs" / run / "results.json").read_text())["config"]["model"])
    return spec.release in MIRRORED and "server_model_linkage_mirror" not in audit["attacks"]


def held_tail(args: argparse.Namespace) -> bool:
    """Whether the server's tail is held: only where a server head is imprinted."""
    return bool(args.imprint_hold_tail and args.imprint_epochs and args.head == "server")


def mirror_trained(args: argparse.Namespace) -> bool:
    """Whether the server trained on the mirror average: only with the average, of a release that has a mirror."""
    return bool(args.mirror_train and args.mirror_average and model_spec(args).release in MIRRORED)


def server_recipe_differences(point: tuple[Path, dict], args: argparse.Namespace) -> list[str]:
    """Where an audited point's run (its recorded flags) trained the server otherwise than `args`, in words; none
    for a run recorded without its flags."""
    frontier, row = point
    recorded = frontier / "runs" / row["run"] / "demo_args.json"
    if not recorded.exists():
        return []
    audited, _ = parser().parse_known_args(json.loads(recorded.read_text()))
    as_trained = {"imprint_hold_tail": held_tail, "mirror_train": mirror_trained}
    def recipe(a: argparse.Namespace) -> dict:   # as the server trained: a hold without imprinting holds nothing
        return {k: as_trained[k](a) if k in as_trained else getattr(a, k) for k in SERVER_RECIPE}
    ours, theirs = recipe(args), recipe(audited)
    return [f"{k.replace('_', '-')} {theirs[k]:g} there, {ours[k]:g} here" for k in SERVER_RECIPE if theirs[k] != ours[k]]


def audit_line(results: dict, args: argparse.Namespace | None = None) -> str:
    """What the audit measured for this release: the figures, not a promise. With this run's `args`, it also says
    where the audited run's server trained otherwise: what a server can recognise depends on how it trained."""
    found = audited_point(results, args=args)
    if found is None:
        return "privacy: this release setting has not been audited (research/frontier.py, docs/audit.md)"
    frontier, row = found
    caveat = ""
    audited_weights = json.loads((frontier / "runs" / row["run"] / "results.json").read_text())["config"].get(
        "device_weights")
    ours = results["config"].get("device_weights")
    if ours and audited_weights and Path(ours).name != Path(audited_weights).name:
        caveat = (f" [audited from another build of this noise-aware start, the same recipe ({Path(audited_weights).name} "
                  f"there, {Path(ours).name} here): a student trained again does not repeat its weights bit for bit, "
                  f"so these figures are that build's]")
    differ = server_recipe_differences(found, args) if args is not None else []
    if differ:
        caveat += f" [the audited run's server trained otherwise ({'; '.join(differ)}): its figures are for that run]"
    if weaker_attacker(frontier, row["run"], audited_weights):
        caveat += (" [audited when the audit's copy of the trained device part began from seeded weights, not from "
                   "the start the devices trained theirs from: these figures may understate (docs/privacy.md)]")
    if without_mirror(frontier, row["run"]):
        caveat += (" [audited before the audit also attacked the mirror image's release, which the server computes "
                   "from this release: these figures may understate (docs/privacy.md)]")
    split = ""
    if "reconstruction_identity_r1" in row:
        split = (f"; what it can see: dlib names {row['reconstruction_identity_r1']:.3f} from reconstructions (chance "
                 f"{row['reconstruction_identity_r1_chance']:.3f}); what it can recognise: {row['model_identity_r1']:.3f} "
                 f"from its models of releases (chance {row['model_identity_r1_chance']:.3f})")
    return (f"privacy of this release, as audited ({frontier.name}/{row['run']}: a curious server with dlib's recognizer "
            f"and attackers trained on this release): identity R@1 {row['identity_r1']:.3f} against chance "
            f"{row['identity_r1_chance']:.3f} ({row['attack']}; dlib finds {row['recognizer_clean_r1']:.0%} on clean "
            f"photos){split}, pixel linkage {row['pixel_linkage']:.3f} (chance {row['pixel_linkage_chance']:.3f})"
            f"{caveat}")


if __name__ == "__main__":
    main()
