"""Shared fixtures: the real LFW copy, an in-process edge server on loopback, a trustme PKI; and no silent skips."""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np
import pytest
import trustme

from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.server.app import EdgeServer, ServerConfig, server_info
from splitface.server.app import ServerThread as EdgeThread
from splitface.server.auth import TokenAuthenticator, hash_token
from splitface.server.trainer import ServerTrainer

if os.environ.get("PYTEST_XDIST_WORKER"):
    # a pytest-xdist worker shares the cores with the others: one thread each, not one per core each
    import torch

    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")

LFW = ROOT.parent / "shared" / "data" / "lfw"
TOKENS = {"device-0": "token-zero", "device-1": "token-one", "device-2": "token-two"}


def openmp_runtime() -> ctypes.CDLL:
    """The OpenMP runtime torch loaded: its own copy in torch/lib (other wheels may load theirs, whose counts torch
    does not set)."""
    import torch

    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    assert found, f"no libgomp in {Path(torch.__file__).parent / 'lib'}: OpenMP's setting is read there"
    return ctypes.CDLL(str(found[0]))


def in_a_plain_thread(fn: Callable[[], T]) -> T:
    """fn() in a new thread that nothing has set up."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def openmp_default() -> int:
    """OpenMP's count in a plain new thread (every core, or OMP_NUM_THREADS): what torch's count must differ from
    for a check of it to mean something."""
    return in_a_plain_thread(lambda: openmp_runtime().omp_get_max_threads())


@contextlib.contextmanager
def at_torch_count(threads: int) -> Iterator[None]:
    """torch.set_num_threads(threads) for the block, then back (an xdist worker's 1 matters to other tests)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def lfw() -> Path:
    if not (LFW / "images").is_dir():
        # never a silent skip: most of the suite trains and attacks on real faces
        pytest.fail(f"LFW (deep-funneled, with View 1's pairs and people files) not found at {LFW}: put it there "
                    f"(images/<Person>/<Person>_NNNN.jpg), i.e. in shared/data/lfw beside this checkout", pytrace=False)
    return LFW


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Real certificates for the TLS tests (Python and JVM clients): a CA, a server certificate for the name
    'localhost' only (so 127.0.0.1 is a name mismatch), and an unrelated CA. Files: cert.pem (chain), key.pem,
    ca.pem, other-ca.pem."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(root / "cert.pem")
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(root / "cert.pem", append=True)
    cert.private_key_pem.write_to_path(root / "key.pem")
    ca.cert_pem.write_to_path(root / "ca.pem")
    other.cert_pem.write_to_path(root / "other-ca.pem")
    return root


def serve_in_thread(trainer: ServerTrainer, run_dir: Path, max_batch: int = 64, max_message_bytes: int = 64 << 20,
                 **config) -> EdgeThread:
    """An EdgeServer for the test tokens, on a free loopback port, in a background thread."""
    info = server_info(trainer, max_batch, max_message_bytes)
    return EdgeThread(EdgeServer(trainer, info, TokenAuthenticator({d: hash_token(t) for d, t in TOKENS.items()}),
                                 ServerConfig(port=0, run_dir=run_dir, **config)))


def small_trainer(num_classes: int = 5, model: str = "vgg_face_small", **kw) -> ServerTrainer:
    return ServerTrainer(resolve_spec(model), "conv1", num_classes, TrainConfig(**kw))


class RecordingTrainer(ServerTrainer):
    """A real ServerTrainer (server head) that also keeps, for every step it applies, the activations it received
    and the gradient it sent back, as float32 copies: what a device's own step was taken from (tests/steps.py)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.received: list[tuple[np.ndarray, np.ndarray]] = []   # (activations, gradient), one per applied step

    def train_server_head(self, activations, labels):
        grad, loss, n_correct = super().train_server_head(activations, labels)
        self.received.append((np.array(activations, np.float32), np.array(grad, np.float32)))
        return grad, loss, n_correct


class PausingTrainer(ServerTrainer):
    """A real trainer (server head) that, once it has applied step `pause_at`, holds that step's reply until the
    test sets `go`: the test can kill a device while its batch is applied and the BACKWARD not yet sent."""

    def __init__(self, spec, num_classes: int, pause_at: int | None, **kw):
        super().__init__(spec, "conv1", num_classes, TrainConfig(**kw), device="cpu")
        self.pause_at, self.reached, self.go = pause_at, threading.Event(), threading.Event()

    def train_server_head(self, activations, labels):
        out = super().train_server_head(activations, labels)
        if self.steps == self.pause_at:
            self.reached.set()
            self.go.wait(300)
        return out


def tiny_audit(run: Path, lfw: Path, tmp_path: Path) -> dict:
    """`research.audit.cli` on a finished demo run at the smallest size that runs every attack (eigenfaces, 64 public
    faces, one epoch of each trained attacker): its report."""
    import json
    import subprocess
    import sys

    audit = subprocess.run(
        [sys.executable, "-m", "research.audit.cli", str(run), "--data", str(lfw), "--out", str(tmp_path / "audit"),
         "--recognizers", "eigenfaces", "--public-images", "64", "--decoder-epochs", "1", "--matcher-epochs", "1",
         "--cache", str(tmp_path / "audit-cache")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    return json.loads((tmp_path / "audit" / f"{run.name}.json").read_text())


def recording_trainer(num_classes: int, model: str, **kw) -> RecordingTrainer:
    return RecordingTrainer(resolve_spec(model), "conv1", num_classes, TrainConfig(**kw))


# No silent skips: a skipped test fails the run (its reason is printed by -rs), unless SPLITFACE_ALLOW_SKIPS=1.
_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and not os.environ.get("SPLITFACE_ALLOW_SKIPS") and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _skipped and not os.environ.get("SPLITFACE_ALLOW_SKIPS"):
        terminalreporter.write_line(f"{len(_skipped)} unexpected skip(s) fail this run (SPLITFACE_ALLOW_SKIPS=1 "
                                    f"allows them): {', '.join(_skipped[:5])}", red=True)
