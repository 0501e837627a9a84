"""Killing `splitface-research demo` stops its edge server and its devices: SIGTERM (what research/frontier.py and a
service manager send) and SIGINT (Ctrl-C, or a kill of the launcher alone) leave no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ROOT

MODEL = {"family": "vgg_face", "input_size": 32, "width": 4, "fc_width": 32, "dropout": 0.0}


def _faces(root: Path) -> None:
    """3 people x 9 photos of noise: the test is about processes, not faces."""
    rng = np.random.default_rng(0)
    for person in range(3):
        (root / f"p{person}").mkdir(parents=True)
        for k in range(9):
            Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(root / f"p{person}" / f"{k}.png")


def _processes_naming(text: str) -> dict[int, str]:
    """Live (not zombie) processes whose command line contains `text`, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it exited meanwhile
            continue
        if text in cmdline and state != "Z":
            found[int(entry.name)] = cmdline
    return found


@pytest.mark.slow
def test_sigterm_to_the_demo_stops_its_server_and_devices(tmp_path):
    """SIGINT takes the same handler; SIGTERM is the one that used to orphan both processes."""
    sig = signal.SIGTERM
    _faces(tmp_path / "faces")
    run_dir = tmp_path / "run"
    demo = subprocess.Popen(
        [sys.executable, "-m", "research.demo", "--data", str(tmp_path / "faces"), "--image-folder",
         "--min-images", "1", "--model", json.dumps(MODEL), "--devices", "1", "--epochs", "1000", "--batch-size", "8",
         "--run-dir", str(run_dir), "--no-progress", "--threads", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        children: dict[int, str] = {}
        while time.monotonic() < deadline and demo.poll() is None:
            children = {pid: cmd for pid, cmd in _processes_naming(str(run_dir)).items() if pid != demo.pid}
            if any(" -m splitface.device_cli sim " in c for c in children.values()) and any(" -m splitface.server.cli serve " in c
                                                                             for c in children.values()):
                break
            time.sleep(0.2)
        assert demo.poll() is None, demo.communicate()[0]
        assert len(children) == 2, children  # the server and the simulator, both running

        demo.send_signal(sig)
        out, _ = demo.communicate(timeout=150)
        assert demo.returncode == 128 + sig, out
        assert f"{signal.Signals(sig).name}: stopping the devices and the edge server" in out
        assert _processes_naming(str(run_dir)) == {}
        # the server was stopped by its SIGINT, so it checkpointed on the way out
        assert (run_dir / "server" / "metrics.json").exists()
    finally:
        if demo.poll() is None:
            demo.kill()
        for pid in _processes_naming(str(run_dir)):  # never leave a process behind, even when failing
            os.kill(pid, signal.SIGKILL)
