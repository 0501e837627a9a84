"""bench/wire_gradient_error.py: the measurement behind docs/wire.md's account of why i8 gradients hurt and i8c's do not."""
from __future__ import annotations

from bench.wire_gradient_error import measure


def test_the_weight_gradient_error_orders_the_encodings(lfw):
    """At initialisation on real faces (one batch of 32): i8's error of conv1's weight gradient is several times
    i8c's, although its error of the split gradient itself is small; f16's is far below both."""
    (row,) = measure(lfw, steps=0, every=1, batch=32, seed=0)
    e = {name: v["weight_gradient"] for name, v in row["encodings"].items()}
    assert e["i8"] > 3 * e["i8c"] and e["i8"] > 0.2
    assert row["encodings"]["i8"]["split_gradient"] < 0.1
    assert e["f16"] < e["i8c"] / 10
    assert e["int8 per channel (what-if)"] < e["i8"]
