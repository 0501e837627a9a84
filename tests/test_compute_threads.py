"""Torch work in another thread runs at the thread count torch has where it was asked for, from that thread's first
op: OpenMP's count is per thread, a new thread starts at its own default, and a thread keeps the count it was first
given (splitface/common/compute.py). Each check asks for one more thread than a plain new thread's default, so it
cannot pass by the two agreeing on some machine."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from splitface.common.compute import at_torch_threads, in_compute_thread
from tests.conftest import ROOT, at_torch_count, in_a_plain_thread, openmp_default, openmp_runtime


def first_conv_then_count() -> int:
    """A oneDNN convolution as a thread's first torch op, then OpenMP's count in that thread."""
    torch.nn.functional.conv2d(torch.rand(4, 3, 16, 16), torch.rand(4, 3, 3, 3))
    return openmp_runtime().omp_get_max_threads()


def test_a_plain_thread_convolves_at_openmps_default_not_torchs():
    """What the module prevents: a plain thread's first convolution ignores torch.set_num_threads."""
    default = openmp_default()
    with at_torch_count(default + 1):
        assert in_a_plain_thread(first_conv_then_count) == default


def test_device_work_runs_at_torchs_count_from_its_first_op():
    default = openmp_default()
    with at_torch_count(default + 1):
        assert asyncio.run(in_compute_thread(first_conv_then_count)) == default + 1


def test_a_pool_thread_follows_torchs_count_when_it_changes():
    default = openmp_default()
    with ThreadPoolExecutor(1) as pool, at_torch_count(default + 1):
        assert pool.submit(at_torch_threads, default + 1, first_conv_then_count).result() == default + 1
        assert pool.submit(at_torch_threads, default + 2, first_conv_then_count).result() == default + 2


def test_the_device_and_the_server_hand_torch_work_only_to_such_threads():
    """Every hand-off to another thread in the device and server packages goes through splitface.common.compute."""
    handoffs = re.compile(r"to_thread\(|run_in_executor\(")
    for path in sorted(p for package in ("device", "server") for p in (ROOT / "splitface" / package).rglob("*.py")):
        for line in path.read_text().splitlines():
            if handoffs.search(line):
                assert "at_torch_threads" in line, f"{path.relative_to(ROOT)}: {line.strip()}"



SPIN_COUNT = re.compile(r"GOMP_SPINCOUNT = '(\d+)'")


def openmp_spin_count(code: str, **env: str) -> int:
    """How many turns an idle OpenMP thread spins before it sleeps, as each GNU libgomp loaded reports at start-up
    (OMP_DISPLAY_ENV=VERBOSE: torch/lib's, conftest.openmp_runtime, and others that wheels such as scikit-learn's
    bring), the most of them, in a fresh process that ran `code` and then imported torch; the environment has no
    OpenMP setting but `env`."""
    openmp_runtime()   # fails clearly where torch ships another runtime
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    proc = subprocess.run([sys.executable, "-c", f"{code}\nimport torch"], capture_output=True, text=True, cwd=ROOT,
                          env=clean | {"OMP_DISPLAY_ENV": "VERBOSE"} | env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    turns = SPIN_COUNT.findall(proc.stderr)
    assert turns, f"no libgomp reported GOMP_SPINCOUNT at start-up:\n{proc.stderr}"
    return max(int(t) for t in turns)


def test_importing_splitface_before_torch_makes_openmps_idle_threads_sleep():
    """libgomp's default spins (300,000 turns); splitface's import makes it sleep at once (passive), unless the
    environment chose a policy."""
    default = openmp_spin_count("")
    assert default > 0   # what the import changes
    assert openmp_spin_count("import splitface") == 0
    assert openmp_spin_count("import splitface", OMP_WAIT_POLICY="ACTIVE") > default


@pytest.mark.slow  # a fresh interpreter per entry point, each loading torch
@pytest.mark.parametrize("entry", ["research.distill", "bench.load"])
def test_the_research_and_bench_entry_points_load_torch_with_sleeping_threads(entry):
    """`python -m research.<x>` and `python -m bench.<x>` import their package first, which imports splitface before
    the module's own `import torch`: these modules import torch ahead of splitface themselves. One module of each
    package: it is the package's import that does it (research.frontier, research.federated and bench.bench_native
    were checked too in session 28, about 9 s of the suite each)."""
    assert openmp_spin_count(f"import {entry}") == 0
