"""splitface: split and federated face-recognition training between phones and an edge server.

Importing it makes OpenMP's idle threads sleep instead of spin (OMP_WAIT_POLICY=PASSIVE, unless the environment
says otherwise). libgomp's default keeps each thread of a parallel team spinning at every barrier for about
300,000 turns; with the edge server's team of one thread a core beside the devices' processes, or beside any
other job, a spinning thread holds the core its partner needs. On this project's 2-core machines, with another
training job running, the server's step on a batch of 32 (IResNet-small, 64 px) took 3.7 s in the default policy
against 0.5 s passive, and a 2-device run 59 s against 22 s; with nothing else running, 0.33 s against 0.26 s
(docs/testing.md). torch's libgomp reads the policy once, when torch loads: so this holds in a process that imports
splitface (or research, or bench, whose packages import it first) before torch, and in every child process, which
inherits the setting. OPENMP_WAIT_POLICY is the policy this process's torch read or will read (None: libgomp's
default, spinning), for the benchmarks' records."""
import os
import sys

_TORCH_LOADED_FIRST = "torch" in sys.modules
_INHERITED = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # for this process's torch, if not loaded yet, and children
OPENMP_WAIT_POLICY = _INHERITED if _TORCH_LOADED_FIRST else os.environ["OMP_WAIT_POLICY"]
