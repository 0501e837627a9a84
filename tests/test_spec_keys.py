"""SPEC.md's model-key table, the HELLO vectors and device_sdk's ModelSpec are one key set.

The server compares HELLO's `model` map whole with its own spec, so a client written to SPEC.md
is refused if the table misses a key (as it once missed `release_pool`). protocol/ cannot import
the device SDK; this test is where the two meet.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from device_sdk.models import PRESETS, RELEASE_KEYS, ModelSpec
from protocol.vectors import generate as gen

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "protocol" / "SPEC.md"
MARKER = "<!-- model-keys:"
ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| .+\|$")


def spec_model_table() -> list[tuple[str, str]]:
    """(key, type) rows of the table that follows the model-keys marker in SPEC.md."""
    lines = SPEC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(MARKER))
    rows = []
    for line in lines[start + 3:]:  # marker, header, separator
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"SPEC.md model-key row not understood: {line!r}"
        rows.append((match[1], match[2]))
    return rows


def test_spec_table_is_modelspec_in_order_with_types():
    fields = [(f.name, str(f.type)) for f in dataclasses.fields(ModelSpec)]
    assert spec_model_table() == fields


def test_release_keys_are_the_table_tail():
    keys = [k for k, _ in spec_model_table()]
    assert set(RELEASE_KEYS) <= set(keys)
    assert tuple(keys[keys.index(RELEASE_KEYS[0]):]) == RELEASE_KEYS


def test_hello_vectors_carry_every_key_of_a_real_spec():
    want = PRESETS["vgg_face_small"].to_dict()
    assert gen.MODEL == want and list(gen.MODEL) == list(want)
    for stem in ("01_hello_server_head", "02_hello_device_head"):
        model = json.loads((gen.HERE / f"{stem}.json").read_text())["model"]
        assert list(model) == [k for k, _ in spec_model_table()], stem
        assert ModelSpec.from_dict(model) == PRESETS["vgg_face_small"], stem
        # float-typed keys are floats on the wire (SPEC.md section 3), ints are ints
        types = dict(spec_model_table())
        assert all(type(v).__name__ == types[k] for k, v in model.items()), (stem, model)
