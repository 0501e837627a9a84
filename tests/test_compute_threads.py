"""Torch work in the devices' and the server's compute threads runs at torch's thread count from the first op:
OpenMP's count is per thread, and a new thread starts at every core (splitface.common.compute)."""
from __future__ import annotations

import asyncio
import ctypes
import threading
from pathlib import Path

import torch

from splitface.common.compute import compute_threads, in_compute_thread


def openmp() -> ctypes.CDLL:
    """The OpenMP runtime torch loaded: its own libgomp in the CPU wheel (other wheels, scikit-learn's say, load
    their own copies, whose counts torch does not set)."""
    lib = Path(torch.__file__).parent / "lib"
    loaded = sorted({p for p in open("/proc/self/maps").read().split()
                     if p.startswith(str(lib)) and ("libgomp" in p or "libiomp" in p)})
    assert loaded, f"torch loaded no OpenMP runtime from {lib}"
    return ctypes.CDLL(loaded[0])


def omp_threads_of_a_new_thread(start) -> int:
    """OpenMP's thread count in a thread that `start` runs a conv in first (no parallel op of torch's before)."""
    omp = openmp()

    def first_op() -> int:
        torch.nn.functional.conv2d(torch.rand(4, 3, 16, 16), torch.rand(4, 3, 3, 3))   # oneDNN's
        return omp.omp_get_max_threads()
    return start(first_op)


def in_a_plain_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_compute_threads_run_at_torchs_count_from_their_first_op():
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # a device's --threads 1 (and what tests/conftest.py gives each xdist worker)
    try:
        with compute_threads(1, "test-compute") as pool:
            assert omp_threads_of_a_new_thread(lambda fn: pool.submit(fn).result()) == 1
        # a plain thread: OpenMP's own default (every core, or OMP_NUM_THREADS), what the pool prevents
        default = in_a_plain_thread(openmp().omp_get_max_threads)
        assert default > 1, "a 1-core machine (or OMP_NUM_THREADS=1) cannot show the difference"
        assert omp_threads_of_a_new_thread(in_a_plain_thread) == default
    finally:
        torch.set_num_threads(before)


def test_devices_compute_in_such_a_pool():
    """Every device's torch work (connection.py, federated/device.py) goes through in_compute_thread."""
    assert asyncio.run(in_compute_thread(lambda: threading.current_thread().name)).startswith("device-compute")
