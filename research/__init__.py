"""Experiments apart from the product: `splitface-research`'s subcommands and the drivers that write results/.

Every research process runs numpy's BLAS (OpenBLAS) on one thread. Torch's OpenMP threads stay awake for a while
after each op, and OpenBLAS's own threads then wait on the same cores: on 2 cores, a (16 x 200k) by (200k x 48)
product of the audit's ridge inversion took 4 s after a torch op against 0.02 s on one thread, and the full-size
frontier's audit 74 s against 48 s (docs/testing.md). Numpy's products here are small next to torch's work. (SciPy's
own OpenBLAS, loaded later by what uses it, keeps its threads.) Torch's own OpenMP threads sleep when idle: splitface,
imported here before anything loads torch, sets their policy (splitface/__init__.py)."""
import splitface  # noqa: F401  (first: OpenMP's wait policy must be set before torch loads)
import numpy
from threadpoolctl import threadpool_limits

threadpool_limits(limits=1, user_api="blas")   # numpy's OpenBLAS, loaded by the import above (else none is found)
del numpy
