"""The Android demo's pure-JVM core (android_demo/core) against the Python reference: its device layer
equals PyTorch's on real faces, and a Java device trains against the real edge server on loopback, over
wss:// with real (trustme) certificates too.
The JUnit tests (protocol vectors byte for byte, gradients, noise, budget guard) run from test.sh via
android_demo/jvm_test.sh; this file builds the core with the same script."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Callable

import msgpack
import numpy as np
import pytest
import torch

from splitface.common.faults import FAULT_EXIT
from splitface.common.data import load_lfw
from splitface.device.trainer import to_input
from splitface.common.models import build_backbone, resolve_spec, split_backbone
from splitface.common.models.lrn import PaperLRN
from splitface.device.privacy.planner import release_schedule
from splitface.device.runtimes.native import ARM64_RUN
from splitface.server.checkpoint import load_checkpoint
from splitface.export.java_layer import java_layer_job
from tests.conftest import TOKENS, PausingTrainer, recording_trainer, serve_in_thread, small_trainer
from tests.steps import Float64Layer, check_grads, check_release, check_trajectory, lr_at
from tests.test_integration import NUM_CLASSES, _setup, _start_server, _stop

pytestmark = pytest.mark.slow  # real processes or real-face training: the full tier

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "android_demo"
MODEL = "iresnet_small"


ARM64_JAVA = [*ARM64_RUN, "/usr/lib/jvm/java-17-openjdk-arm64/bin/java"]  # Debian's arm64 JRE (scripts/setup_arm64.sh)


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> list[str]:
    """The core's command line, after the JVM that runs it."""
    out = tmp_path_factory.mktemp("jvm")   # its own build: another build of core/build cannot pull it away
    build = subprocess.run([str(DEMO / "jvm_test.sh"), "--build-only"], capture_output=True, text=True,
                           env={**os.environ, "JVM_BUILD_DIR": str(out)})
    assert build.returncode == 0, build.stdout + build.stderr
    return ["-cp", f"{out / 'main'}:/usr/share/java/msgpack-core.jar", "org.splitface.core.Cli"]


@pytest.fixture(scope="module")
def java(cli) -> list[str]:
    return ["java", *cli]


def device_layer(clamp: float | None) -> torch.nn.Module:
    torch.manual_seed(0)
    layer, _ = split_backbone(build_backbone(resolve_spec(MODEL)), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = clamp
    return layer


@pytest.fixture(scope="module")
def faces(lfw):
    split = load_lfw(lfw, min_images=10, max_identities=4)
    # Shuffled once (LFW lists are grouped by person): every batch mixes identities.
    train = split.train.subset(np.random.default_rng(0).permutation(len(split.train))[:64])
    return train.load(64, 160), train.labels, len(split.class_names)


def parity(java, layer: torch.nn.Module, images: np.ndarray, tmp_path: Path, timeout: float = 120, **extra) -> dict:
    """`Cli parity` on `images` with a random server gradient, held to float64 eager PyTorch: the release within
    its a-priori float32 bound, the weight gradients within GRAD_RTOL (tests/steps.py); the job it ran (with
    `extra`, e.g. "programs")."""
    x = to_input(images)
    f64 = Float64Layer(layer)
    weights = [p.detach() for p in layer.parameters()]
    grad = torch.randn(f64.release(weights, x).shape, generator=torch.Generator().manual_seed(3)).float()
    job = {**java_layer_job(layer), "images": images.tobytes(), "shape": list(images.shape),
           "grad": grad.numpy().astype("<f4").tobytes(), **extra}
    (tmp_path / "job.msgpack").write_bytes(msgpack.packb(job))
    run = subprocess.run([*java, "parity", str(tmp_path / "job.msgpack"), str(tmp_path / "out.msgpack")],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    got = msgpack.unpackb((tmp_path / "out.msgpack").read_bytes())
    check_release(f64, weights, x, np.frombuffer(got["out"], "<f4"), "the Java device's release")
    java_grads = [torch.from_numpy(np.frombuffer(got[name], "<f4").copy()).reshape(w.shape)
                  for name, w in zip(("grad_weight", "grad_bias"), weights)]
    check_grads(f64.grads(weights, x, grad), java_grads, "the Java device")
    return job


@pytest.mark.parametrize("clamp", [None, 1.0])
def test_java_device_layer_equals_pytorch_on_real_faces(java, faces, tmp_path, clamp):
    parity(java, device_layer(clamp), faces[0][:4], tmp_path)


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> Callable[..., dict]:
    """A job's "programs": the seeded layer's (`device_layer(clamp)`) im2col programs for `batch` images ("gemm",
    `splitface-export --gemm`) or its strip programs ("strips", 4 rows of 64-px images, as the native backend runs
    them; any batch), and the JNI library through which the Java device runs them on ExecuTorch's C++ runtime (built
    for this machine, or for arm64). Each program is lowered once for the module: the arm64 tests and the training
    test run the programs the parity tests checked (about 10 s a lowering)."""
    from splitface.device.runtimes.native import jni_library
    from splitface.device.runtimes.manifest import RELEASE_GEMM_PTE, VJP_GEMM_PTE
    from splitface.export.artifacts import example_inputs, export_gemm_ptes, write_strip_ptes

    lowered: dict[tuple, tuple[Path, Path]] = {}

    def job_programs(clamp: float | None, kind: str, batch: int, arm64: bool = False) -> dict:
        key = (clamp, kind, batch if kind == "gemm" else None)
        if key not in lowered:
            layer, out = device_layer(clamp), tmp_path_factory.mktemp(kind)
            if kind == "strips":
                lowered[key] = write_strip_ptes(layer, 4, 64, out)
            else:
                paths = out / RELEASE_GEMM_PTE, out / VJP_GEMM_PTE
                for path, program in zip(paths, export_gemm_ptes(layer, *example_inputs(layer, batch, 64), None)):
                    path.write_bytes(program)
                lowered[key] = paths   # kept once written: a failed lowering is not reused
        release, vjp = lowered[key]
        return {"library": str(jni_library(arm64)), "kind": kind, "release": str(release), "vjp": str(vjp)}

    return job_programs


# what each kind of programs says when the images or the weights do not fit them
REFUSALS = {"gemm": ("values as 3 images of 32 x 64; the programs take up to 4 images of 3 x 64 x 64",
                     r"input 2 has \d+ values; its shape \(\d+, 3, 3, 3\) takes \d+"),
            "strips": ("an image height of 30 is not a positive multiple of the strip's 4 rows",
                       r"weight 0 of \d+ values; the programs take \d+")}


@pytest.mark.parametrize("kind", ["gemm", "strips"])
@pytest.mark.parametrize("clamp", [None, 1.0])
def test_java_device_on_executorch_equals_pytorch_on_real_faces(java, faces, programs, tmp_path, clamp, kind):
    """The Java device's layer through ExecuTorch's C++ runtime (JNI, XNNPACK, no PyTorch in the JVM), on the
    batch im2col programs and on the strip programs, equals PyTorch's on real faces, with a batch shorter than the
    batch programs' 4; images or weights that do not fit the programs are refused by name, not a crash."""
    images = faces[0][:3]
    layer = device_layer(clamp)
    job = parity(java, layer, images, tmp_path, programs=programs(clamp, kind, 4))
    cout = job["conv"]["cout"]
    other_layer = {"conv": {**job["conv"], "cout": cout + 1}, "weight": job["weight"] + bytes(len(job["weight"]) // cout),
                   "bias": job["bias"] + bytes(4)}  # the programs were exported for another layer
    rows = 32 if kind == "gemm" else 30
    shorter = {"images": np.ascontiguousarray(images[:, :, :rows]).tobytes(), "shape": [3, 3, rows, 64]}
    not_a_program = {"programs": {**job["programs"], "release": str(tmp_path / "job.msgpack")}}  # a file, not a .pte
    for wrong, why in zip((shorter, other_layer, not_a_program), (*REFUSALS[kind], r"cannot (load|read) .*job\.msgpack"),
                          strict=True):
        (tmp_path / "wrong.msgpack").write_bytes(msgpack.packb({**job, **wrong}))
        run = subprocess.run([*java, "parity", str(tmp_path / "wrong.msgpack"), str(tmp_path / "out.msgpack")],
                             capture_output=True, text=True, errors="replace", timeout=120)  # the runtime logs bytes
        assert run.returncode != 0 and "IllegalArgumentException" in run.stderr and re.search(why, run.stderr), run.stderr


@pytest.mark.parametrize("kind", ["gemm", "strips"])
def test_java_device_on_executorch_equals_pytorch_on_an_arm64_jvm_under_qemu(cli, faces, programs, tmp_path, kind):
    """The same parity on the phone's instruction set: Debian's arm64 JVM, under qemu-user, runs the Java device,
    whose layer goes through libsplitface_jni and ExecuTorch's runtime for arm64 (the aarch64 wheel's;
    docs/device.md, "On arm64"), on the batch and the strip programs."""
    layer = device_layer(None)
    parity([*ARM64_JAVA, *cli], layer, faces[0][:3], tmp_path, timeout=600,  # a JVM emulated instruction by instruction
           programs=programs(None, kind, 4, arm64=True))


def train_job(url: str, faces, token: str, epochs: int, **extra) -> dict:
    images, labels, classes = faces
    return {**java_layer_job(device_layer(extra.pop("clamp", None))), "url": url, "device_id": "device-0", "token": token,
            "model": resolve_spec(MODEL).to_dict(), "split": "conv1", "num_classes": classes, "batch_size": 16,
            "epochs": epochs, "images": images.tobytes(), "shape": list(images.shape),
            "labels": [int(y) for y in labels], "lr": 0.005, "momentum": 0.9, "weight_decay": 0.0, "lr_decay": 0.1,
            "epsilon": None, "delta": 1e-5, "schedule": None, "budget": float("inf"), **extra}


def run_java(java, job: dict, tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    path = tmp_path / "train.msgpack"
    path.write_bytes(msgpack.packb(job))
    return subprocess.run([*java, "train", str(path), *options], capture_output=True, text=True, timeout=300)


def check_java_steps(job: dict, faces, received: list, weights_out: Path, layer: torch.nn.Module | None = None) -> None:
    """Every step of a Java run (`train_job` with "weights_out") held to float64 eager PyTorch along the run's own
    trajectory (tests/steps.py): its releases at its weights before each step, and each SGD step from them with
    the gradient the server sent back (`received`: the RecordingTrainer's, one per step). `layer`: the run's
    starting layer (default: `device_layer(None)`)."""
    images, _, _ = faces
    assert job["weight_decay"] == 0.0 and job["lrn"]["input_max"] is None   # what Float64Layer and SgdReplay model
    layer = device_layer(None) if layer is None else layer
    weights = [p.detach().clone() for p in layer.parameters()]
    batch, per_epoch = job["batch_size"], -(-len(images) // job["batch_size"])
    record = 8 + 4 * sum(w.numel() for w in weights)   # batch id (int64), weight and bias (float32)
    trace = weights_out.read_bytes()
    assert len(trace) == record * len(received), f"{len(trace)} bytes for {len(received)} steps"
    steps = []
    for k, (activations, grad) in enumerate(received):
        blob = trace[k * record:(k + 1) * record]
        assert int.from_bytes(blob[:8], "little") == k + 1   # one record per batch, in order: none applied twice
        values, after = np.frombuffer(blob[8:], "<f4"), []
        for w in weights:
            after.append(torch.from_numpy(values[:w.numel()].copy()).reshape(w.shape))
            values = values[w.numel():]
        start = k % per_epoch * batch
        x = to_input(images[start:start + batch])
        lr = lr_at(job["lr"], job["lr_decay"], per_epoch * job["epochs"], k)   # Sgd: decay over the whole run
        steps.append((x, activations, None, grad, lr, after))
    check_trajectory(layer, weights, steps, job["momentum"], "the Java device")


def test_java_device_on_executorch_trains_against_the_python_server(java, faces, programs, tmp_path):
    """Two epochs of the Java device with its layer through ExecuTorch's C++ runtime (JNI), on the batch im2col
    programs and on the strip programs: every batch is applied once, and every step is eager PyTorch's (float64)
    along the run's own trajectory: the release the server got, and the SGD step with the gradient it sent back.
    Not the runs' losses against a reference run's: see tests/steps.py for why those are not comparable."""
    for name in ("gemm", "strips"):
        job = train_job("", faces, TOKENS["device-0"], epochs=2, weights_out=str(tmp_path / f"{name}.weights"),
                        programs=programs(None, name, 16))
        with serve_in_thread(recording_trainer(faces[2], MODEL, lr=0.05), tmp_path / f"server-{name}") as server:
            run = run_java(java, {**job, "url": server.url}, tmp_path)
            steps, received = server.trainer.steps, server.trainer.received
        assert run.returncode == 0, run.stderr
        batches = [json.loads(line) for line in run.stdout.splitlines()]
        assert [b["batch_id"] for b in batches] == list(range(1, 9)) and steps == 8
        check_java_steps(job, faces, received, tmp_path / f"{name}.weights")


def test_java_device_trains_against_the_python_server(java, faces, tmp_path):
    """Five epochs of the plain-Java device: it learns (the last epoch's losses below the first's), every step is
    eager PyTorch's (float64) along its trajectory, and it reports its costs."""
    job = train_job("", faces, TOKENS["device-0"], epochs=5, weights_out=str(tmp_path / "weights"))
    with serve_in_thread(recording_trainer(faces[2], MODEL, lr=0.05), tmp_path / "server") as server:
        run = run_java(java, {**job, "url": server.url}, tmp_path)
        steps, received = server.trainer.steps, server.trainer.received
    assert run.returncode == 0, run.stderr
    batches = [json.loads(line) for line in run.stdout.splitlines()]
    assert [b["batch_id"] for b in batches] == list(range(1, 21)) and steps == 20
    check_java_steps(job, faces, received, tmp_path / "weights")
    losses = [b["loss"] for b in batches]  # the server's loss, from its BACKWARD replies
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3, losses  # the same 4 batches, epoch 5 vs epoch 1
    first = batches[0]
    assert first["bytes_up"] > 16 * 16 * 64 * 64 * 4 and first["bytes_down"] > 16 * 16 * 64 * 64 * 4
    assert first["forward_ms"] > 0 and first["backward_ms"] > 0 and first["server_ms"] > 0
    assert first["energy_mah"] is None  # a JVM has no battery: unavailable, not invented


def test_java_device_is_refused_in_words_and_stops_at_its_budget(java, faces, tmp_path):
    numel = 16 * 64 * 64
    schedule = release_schedule(10.0, 1e-5, numel, 3)
    budget = (schedule[0] + schedule[1]) / 2   # one release of each image, not two
    sched = msgpack.packb({"delta": 1e-5, "epsilon_after": schedule})
    state_file = tmp_path / "state" / "device-0.budget.msgpack"

    def private(url: str) -> subprocess.CompletedProcess:
        return run_java(java, train_job(url, faces, TOKENS["device-0"], epochs=2, epsilon=10.0, clamp=1.0,
                                        schedule=sched, budget=budget, state_dir=str(tmp_path / "state")), tmp_path)
    with serve_in_thread(small_trainer(faces[2], MODEL, lr=0.05), tmp_path / "server") as server:
        refused = run_java(java, train_job(server.url, faces, "wrong-token", epochs=1), tmp_path)
        noisy = private(server.url)
        steps = server.trainer.steps
        reported = server.server.metrics.epsilon["device-0"]   # the FORWARDs' spent_epsilon
        assert state_file.exists()   # resuming from it and refusing past the budget: BudgetStateTest (JUnit)
        state_file.unlink()   # lost: a new file would start at 0, but this server's WELCOME says more
        lost = private(server.url)
    assert refused.returncode == 2 and "server refused (unauthorized)" in refused.stderr
    assert noisy.returncode == 3 and "privacy budget spent" in noisy.stderr and "nothing was sent" in noisy.stderr
    batches = [json.loads(line) for line in noisy.stdout.splitlines()]
    assert len(batches) == 4 and steps == 4   # epoch 1 trained; epoch 2's first release refused, never sent
    assert batches[-1]["epsilon_spent"] == pytest.approx(schedule[0], rel=1e-6) and reported == schedule[0]
    assert lost.returncode == 6 and f"{state_file} says epsilon 0.0 spent, but the server recorded {reported}" \
        in lost.stderr, lost.stderr


def test_java_device_survives_a_killed_server(java, faces, tmp_path):
    """The server process exits hard right after replying step 12 (`--fault crash-after-batch:12`), 2 steps
    after its checkpoint at step 10; restarted on the same port from that checkpoint, the Java device
    reconnects, rolls back to what the checkpoint holds, replays, and finishes; the server applied every
    batch exactly once."""
    epochs = 6
    tokens = _setup(tmp_path)
    token = json.loads(tokens.read_text())["device-0"]
    server, port = _start_server(tmp_path, checkpoint_every_batches="5", checkpoint_every="1000",
                                 fault="crash-after-batch:12")
    job = train_job(f"ws://127.0.0.1:{port}", faces, token, epochs=epochs, num_classes=NUM_CLASSES)
    (tmp_path / "train.msgpack").write_bytes(msgpack.packb(job))
    device = subprocess.Popen([*java, "train", str(tmp_path / "train.msgpack")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        server.communicate(timeout=300)
        assert server.returncode == FAULT_EXIT
        killed_at = load_checkpoint(tmp_path / "checkpoint.pt")["trainer"]["steps"]
        assert killed_at == 10
        server, _ = _start_server(tmp_path, port=port, checkpoint_every_batches="5", checkpoint_every="1000")
        out, err = device.communicate(timeout=300)
    finally:
        if device.poll() is None:
            device.kill()
        _stop(server)
    assert device.returncode == 0, err
    total = epochs * 4
    assert "rolled back" in err   # the device had committed steps 11 and 12, which the checkpoint lacks
    final = load_checkpoint(tmp_path / "checkpoint.pt")
    assert final["trainer"]["steps"] == total and final["devices"]["device-0"]["last_applied"] == total
    assert json.loads(out.splitlines()[-1])["batch_id"] == total


def test_java_device_over_wss_trusts_only_its_ca_and_the_servers_name(java, faces, tmp_path, pki):
    """The Java device trains a batch over wss:// with the CA file that signed the server's certificate; with
    an unrelated CA, or with the right CA but a host name the certificate does not carry, it stops at the
    handshake, names the certificate problem and sends nothing; it refuses a message over its size limit."""
    images, labels, classes = faces
    one_batch = (images[:16], labels[:16], classes)
    with serve_in_thread(small_trainer(classes, MODEL, lr=0.05), tmp_path / "server", tls_cert=pki / "cert.pem",
                         tls_key=pki / "key.pem") as server:
        port = server.server.port
        job = lambda url: train_job(url, one_batch, TOKENS["device-0"], epochs=1)  # noqa: E731
        trusted = run_java(java, job(f"wss://localhost:{port}"), tmp_path, "--ca-file", str(pki / "ca.pem"))
        applied = server.server.records["device-0"].last_applied
        wrong_ca = run_java(java, job(f"wss://localhost:{port}"), tmp_path, "--ca-file", str(pki / "other-ca.pem"))
        wrong_name = run_java(java, job(f"wss://127.0.0.1:{port}"), tmp_path, "--ca-file", str(pki / "ca.pem"))
        too_small = run_java(java, job(f"wss://localhost:{port}"), tmp_path, "--ca-file", str(pki / "ca.pem"),
                             "--max-message-bytes", "64")
        steps = server.trainer.steps
    assert trusted.returncode == 0, trusted.stderr
    assert [json.loads(line)["batch_id"] for line in trusted.stdout.splitlines()] == [1]
    assert applied == 1 and steps == 1   # the refused devices below sent no batch
    for refused in (wrong_ca, wrong_name):
        assert refused.returncode == 5 and refused.stdout == "", refused.stderr
        assert "ERROR TLS certificate of wss://" in refused.stderr and "not accepted" in refused.stderr
    assert "unable to find valid certification path" in wrong_ca.stderr   # the issuer is not trusted
    assert "No subject alternative names matching IP address 127.0.0.1" in wrong_name.stderr
    # WELCOME is larger than 64 bytes: the connection is closed before the device takes it
    assert too_small.returncode == 4 and "exceeds this device's limit of 64 bytes" in too_small.stderr, too_small.stderr


def test_java_device_refuses_plain_ws_off_loopback(java, faces, tmp_path):
    job = train_job("ws://face-edge.example:8765", faces, TOKENS["device-0"], epochs=1)
    refused = run_java(java, job, tmp_path)
    assert refused.returncode == 64 and refused.stdout == ""
    assert "ws://face-edge.example:8765: plain ws:// to a non-loopback host would send the device token in clear" \
        in refused.stderr and "--insecure" in refused.stderr
    with_ca = run_java(java, {**job, "url": "ws://127.0.0.1:8765"}, tmp_path, "--ca-file", "ca.pem")
    assert with_ca.returncode == 64 and "a CA file was given for a plain ws:// URL; use wss://" in with_ca.stderr


def server_state(trainer) -> dict[str, torch.Tensor]:
    """The server's model: its tail and its classifier, copied."""
    return {f"{name}.{k}": v.clone() for name, m in (("tail", trainer.tail), ("classifier", trainer.classifier))
            for k, v in m.state_dict().items()}


def test_java_device_killed_mid_epoch_rejoins_the_same_run(java, faces, tmp_path):
    """SIGKILL hits the Java device while the server holds its batch 6 (epoch 2 of 2) applied and the BACKWARD
    unsent. Restarted with the same job, it resumes its committed batch 5 from its training state
    (TrainingState), re-sends batch 6 (answered from the server's cache) and finishes: the server applied 8
    batches, each once, and its model and the device's layer equal an uninterrupted run's."""
    job = train_job("", faces, TOKENS["device-0"], epochs=2)
    with serve_in_thread(PausingTrainer(resolve_spec(MODEL), faces[2], None, lr=0.05), tmp_path / "plain") as server:
        plain = run_java(java, {**job, "url": server.url, "weights_out": str(tmp_path / "plain.weights")}, tmp_path)
        want = server_state(server.trainer)
    assert plain.returncode == 0, plain.stderr

    pausing = PausingTrainer(resolve_spec(MODEL), faces[2], 6, lr=0.05)
    with serve_in_thread(pausing, tmp_path / "server") as server:
        killed = {**job, "url": server.url, "weights_out": str(tmp_path / "killed.weights"),
                  "state_dir": str(tmp_path / "state")}
        (tmp_path / "killed.msgpack").write_bytes(msgpack.packb(killed))
        device = subprocess.Popen([*java, "train", str(tmp_path / "killed.msgpack")], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert pausing.reached.wait(240), "the Java device never reached batch 6"
        os.kill(device.pid, signal.SIGKILL)
        device.communicate(timeout=60)
        assert device.returncode == -signal.SIGKILL
        pausing.go.set()
        envelope = msgpack.unpackb((tmp_path / "state" / "device-0.training.msgpack").read_bytes())
        assert msgpack.unpackb(envelope["state"])["committed"] == 5
        restarted = run_java(java, killed, tmp_path)
        applied, steps = server.server.records["device-0"].last_applied, server.trainer.steps
        got = server_state(server.trainer)
    assert restarted.returncode == 0, restarted.stderr
    assert [json.loads(line)["batch_id"] for line in restarted.stdout.splitlines()] == [6, 7, 8]
    assert applied == steps == 8
    assert all(torch.equal(got[k], want[k]) for k in want)
    record = (tmp_path / "plain.weights").stat().st_size // 8   # the layer after batch 8, the last record of each
    assert (tmp_path / "killed.weights").read_bytes()[-record:] == (tmp_path / "plain.weights").read_bytes()[-record:]


# ---- the app's folder (splitface-export --app) through the app's run (`Cli app`: AppBundle, AppRun) ----------------

@pytest.fixture(scope="module")
def app_folder(tmp_path_factory, faces) -> Path:
    """`splitface-export --app` as a developer runs it: the strip programs, the seeded starting layer, the job."""
    from splitface.export.cli import main as export_main

    out = tmp_path_factory.mktemp("app") / "bundle"
    (out.parent / "classes.txt").write_text("".join(f"person-{k}\n" for k in range(faces[2])))
    export_main(["--model", MODEL, "--app", "--num-classes", str(faces[2]), "--batch-size", "16", "--epochs", "2",
                 "--lr", "0.005", "--lr-decay", "0.1", "--classes", str(out.parent / "classes.txt"), "--out", str(out)])
    return out


def run_app(java, folder: Path, tmp_path: Path, **device) -> subprocess.CompletedProcess:
    """`Cli app FOLDER DEVICE`: DEVICE holds what the phone's user and storage give (library, id, token, photos)."""
    from splitface.device.runtimes.native import jni_library

    path = tmp_path / "device.msgpack"
    path.write_bytes(msgpack.packb({"library": str(jni_library()), "device_id": "device-0", "token": TOKENS["device-0"],
                                    **device}))
    return subprocess.run([*java, "app", str(folder), str(path)], capture_output=True, text=True, errors="replace",
                          timeout=300)


def test_app_folder_trains_against_the_python_server(java, faces, app_folder, tmp_path):
    """The exported folder is all the app needs: its run (the JNI strip trainer from the exported layer, the job's
    batch size, epochs and SGD) trains two epochs against the real server on loopback, every batch applied once and
    every step eager PyTorch's along the run's trajectory; per batch it reports the device's latency, and energy as
    not reported (a JVM has no battery), never a figure."""
    images, labels, classes = faces
    job = msgpack.unpackb((app_folder / "job.msgpack").read_bytes())
    layer_job = msgpack.unpackb((app_folder / "layer.msgpack").read_bytes())
    assert job["url"] == "wss://EDGE-SERVER.invalid:8765" and job["batch_size"] == 16 and job["num_classes"] == classes
    assert job["model"] == resolve_spec(MODEL).to_dict() and job["split"] == "conv1" and job["epsilon"] is None
    assert job["classes"] == [f"person-{k}" for k in range(classes)]
    start = device_layer(None)   # the starting weights are the export's: the layer the steps are replayed from
    with torch.no_grad():
        for p, name in zip(start.parameters(), ("weight", "bias")):
            p.copy_(torch.from_numpy(np.frombuffer(layer_job[name], "<f4").copy()).reshape(p.shape))
    with serve_in_thread(recording_trainer(classes, MODEL, lr=0.05), tmp_path / "server") as server:
        run = run_app(java, app_folder, tmp_path, url=server.url, images=images.tobytes(), shape=list(images.shape),
                      labels=[int(y) for y in labels], weights_out=str(tmp_path / "weights"))
        steps, received = server.trainer.steps, server.trainer.received
    assert run.returncode == 0, run.stderr
    batches = [json.loads(line) for line in run.stdout.splitlines()]
    assert [b["batch_id"] for b in batches] == list(range(1, 9)) and steps == 8
    check_java_steps({**job, **layer_job}, faces, received, tmp_path / "weights", layer=start)
    assert all(b["forward_ms"] > 0 and b["backward_ms"] > 0 for b in batches)
    assert all(b["energy_mah"] is None and b["energy_mj"] is None and b["energy_source"] is None for b in batches)
    assert run.stderr.count("energy not reported by this phone") == 8, run.stderr


def test_app_folder_is_checked_against_its_manifest(java, faces, app_folder, tmp_path):
    """A folder that does not match its manifest, or whose programs do not fit its layer, stops the app before
    anything is built or sent (exit 65), naming the file and what is wrong; so does a job without a server."""
    import hashlib
    import shutil

    from splitface.export.app_bundle import MANIFEST
    from splitface.device.runtimes.manifest import RELEASE_STRIP_PTE
    from splitface.export.artifacts import write_strip_ptes

    def broken(name: str, change) -> Path:
        folder = tmp_path / name
        shutil.copytree(app_folder, folder)
        change(folder)
        return folder

    def resign(folder: Path, **manifest) -> None:   # a manifest rewritten to match whatever the folder now holds
        m = msgpack.unpackb((folder / MANIFEST).read_bytes())
        for name, entry in m["files"].items():
            data = (folder / name).read_bytes()
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        (folder / MANIFEST).write_bytes(msgpack.packb({**m, **manifest}))

    def other_programs(folder: Path) -> None:   # strips of 8 rows where the manifest says 4
        write_strip_ptes(device_layer(None), 8, 64, tmp_path / "rows8")
        shutil.copy(tmp_path / "rows8" / RELEASE_STRIP_PTE, folder / RELEASE_STRIP_PTE)
        shutil.copy(tmp_path / "rows8" / "vjp_strip.pte", folder / "vjp_strip.pte")
        resign(folder)

    images, labels, _ = faces
    photos = {"images": images.tobytes(), "shape": list(images.shape), "labels": [int(y) for y in labels]}
    url = {"url": "ws://127.0.0.1:9"}   # nothing listens: every case stops before connecting
    cases = [
        (broken("missing", lambda f: (f / "vjp_strip.pte").unlink()), url,
         r"vjp_strip\.pte is missing \(listed in bundle\.msgpack\)"),
        (broken("truncated", lambda f: (f / "release_strip.pte").write_bytes(
            (f / "release_strip.pte").read_bytes()[:-1])), url,
         r"release_strip\.pte does not match bundle\.msgpack: \d+ bytes, sha256 [0-9a-f]{64}; expected \d+ bytes"),
        (broken("no-manifest", lambda f: (f / MANIFEST).unlink()), url,
         r"has no bundle\.msgpack: not a folder from splitface-export --app"),
        (broken("version", lambda f: resign(f, version=1)), url,  # a folder from before the runner's LRN
         r"format splitface-app version 1; this app reads splitface-app version 2"),
        (broken("rows", other_programs), url,
         r"release_strip\.pte takes .* = \[3, 16, 8, 64, 3, 3\], but layer\.msgpack and bundle\.msgpack say "
         r"\[3, 16, 4, 64, 3, 3\]"),
        (app_folder, {}, r"job\.msgpack names no server \(exported without --url\): give the server's URL"),
    ]
    for folder, device, why in cases:
        run = run_app(java, folder, tmp_path, **device, **photos)
        assert run.returncode == 65 and re.search(why, run.stderr), (folder.name, run.returncode, run.stderr)


def test_export_refuses_an_app_folder_the_strip_trainer_cannot_run(tmp_path):
    """The app's trainer runs conv1 + ReLU + LRN released as is: another release or split, noise without the clamp
    its sensitivity needs, a budget without noise, or a class list of the wrong length is refused by the export with
    the reason, and nothing is written."""
    from splitface.export.cli import main as export_main

    base = ["--model", MODEL, "--app", "--num-classes", "4", "--out", str(tmp_path / "out")]
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    for extra, why in ((["--classes", str(tmp_path / "three.txt")], "3 class names for 4 classes"),
                       (["--release", "dct"], "not through the dct release"),
                       (["--split", "layer1"], "runs the conv1 split only, not layer1"),
                       (["--epsilon", "3"], "needs the LRN inputs clamped to [0, 1] (--dp-clamp)"),
                       (["--budget", "3"], "--budget needs --epsilon")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            export_main(base + extra)
    assert not (tmp_path / "out").exists()


def test_app_folder_with_noise_stops_at_its_budget(java, faces, tmp_path):
    """An app folder with the noise and a budget (--dp-clamp --epsilon --budget: schedule.msgpack): the app's run
    noises every release, reports its spent epsilon to the server, and stops before the first release past the
    budget (one release of each image, not two), nothing sent; its budget state is in the device's folder."""
    from splitface.export.cli import main as export_main

    schedule = release_schedule(10.0, 1e-5, 16 * 64 * 64, 2)
    budget = (schedule[0] + schedule[1]) / 2
    export_main(["--model", MODEL, "--app", "--num-classes", str(faces[2]), "--batch-size", "16", "--epochs", "2",
                 "--dp-clamp", "--epsilon", "10", "--budget", str(budget), "--out", str(tmp_path / "bundle")])
    assert msgpack.unpackb((tmp_path / "bundle" / "schedule.msgpack").read_bytes())["epsilon_after"] == schedule
    images, labels, classes = faces
    with serve_in_thread(small_trainer(classes, MODEL, lr=0.05), tmp_path / "server") as server:
        run = run_app(java, tmp_path / "bundle", tmp_path, url=server.url, images=images.tobytes(),
                      shape=list(images.shape), labels=[int(y) for y in labels], state_dir=str(tmp_path / "state"))
        steps, reported = server.trainer.steps, server.server.metrics.epsilon["device-0"]
    assert run.returncode == 3 and "privacy budget spent" in run.stderr, run.stderr
    batches = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(batches) == 4 and steps == 4
    assert batches[-1]["epsilon_spent"] == pytest.approx(schedule[0], rel=1e-6) and reported == schedule[0]
    assert (tmp_path / "state" / "device-0.budget.msgpack").exists()
