"""Benchmarks (docs/device.md, results/bench_*): side by side in one run, each with its machine's record.

splitface is imported first so that torch's OpenMP threads, in `python -m bench.<name>`, sleep when idle as they do
in the product (splitface/__init__.py)."""
import splitface  # noqa: F401
