"""Torch work in other threads, at the thread count torch was given.

OpenMP's thread count is a per-thread setting: a new thread starts at every core (or OMP_NUM_THREADS), and torch
applies its own (`torch.set_num_threads`, a device's `--threads 1`) there only at its first parallel op, after any
oneDNN convolution that came first ran on every core; a thread keeps the count it was first given when torch's
changes later. A convolution's weight gradient summed over two threads rounds differently from one summed over
one, so which pool thread picked up a step changed a device's last bits. So each call passes the caller's count
along and the worker applies it where its own differs."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def at_torch_threads(threads: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in this thread with OpenMP at `threads` (torch's count where the work was asked for)."""
    if torch.get_num_threads() != threads:   # asking applies torch's count to a fresh thread; else set it here
        torch.set_num_threads(threads)
    return fn(*args)


async def in_compute_thread(fn: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread` for torch work: `fn(*args)` in the loop's default executor, at the caller's count."""
    return await asyncio.to_thread(at_torch_threads, torch.get_num_threads(), fn, *args)
