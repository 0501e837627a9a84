"""Threads that run torch at the thread count torch was given.

OpenMP's thread count is a per-thread setting: a new thread starts at every core, and torch applies its own
(`torch.set_num_threads`, a device's `--threads 1`) there only at its first parallel op, after any oneDNN
convolution that came first ran on every core. A convolution's weight gradient summed over two threads rounds
differently from one summed over one, so which pool thread picked up a step changed a device's last bits. Asking
torch for its count when the thread starts applies it at once."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def compute_threads(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads compute at torch's thread count, as set before the pool's first task."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=torch.get_num_threads)


# the devices' pool, shared by every device in a process (a simulator runs many): asyncio.to_thread's size
_DEVICE_POOL = compute_threads(min(32, (os.cpu_count() or 1) + 4), "device-compute")


async def in_compute_thread(fn: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread` for torch work: `fn(*args)` in the devices' pool, the event loop free meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_DEVICE_POOL, fn, *args)
