"""SPEC.md's model-key table, the HELLO vectors and splitface.common.models' ModelSpec are one key set.

The server compares HELLO's `model` map whole with its own spec, so a client written to SPEC.md
is refused if the table misses a key (as it once missed `release_pool`). splitface/protocol/ cannot import
the device SDK; this test is where the two meet.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import msgpack

from splitface.common.models import PRESETS, RELEASE_KEYS, ModelSpec
from splitface.protocol import messages as m
from splitface.protocol.vectors import generate as gen

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "splitface" / "protocol" / "SPEC.md"
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


# ---- an encoder that knows only SPEC.md's tables reproduces every valid vector -----------------------------
CELL = re.compile(r"^\| `(\w+)`\s*\|")


def spec_key_tables() -> tuple[list[str], dict[str, list[str]]]:
    """(the tensor's keys, {message type: its keys}) in the order SPEC.md's tables list them (sections 4, 5, 8, 15)."""
    lines = SPEC.read_text().splitlines()
    tensor: list[str] = []
    messages: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        if not line.startswith("| Key"):
            continue
        rows = [row for row in lines[i + 2:] if row.startswith("|")]
        rows = rows[:next((k for k, row in enumerate(lines[i + 2:]) if not row.startswith("|")), len(rows))]
        keys = [CELL.match(row)[1] for row in rows if CELL.match(row)]
        if keys[0] == "dtype":
            tensor = keys
        elif keys[0] == "type":
            name = re.search(r'`"(\w+)"`', rows[0])[1]
            messages[name] = keys
    return tensor, messages


def spec_encode(meaning: dict, tensor_keys: list[str], message_keys: dict[str, list[str]]) -> bytes:
    """A vector's JSON meaning encoded as a client author would from SPEC.md alone: keys in its tables' order
    (section 3 rule 1; nested maps whose order the text gives in prose are kept as listed), msgpack's smallest
    headers and float64 for every float (msgpack-python's defaults, section 3 rules 2-5)."""
    model_keys = [k for k, _ in spec_model_table()]

    def tensor(t: dict) -> dict:
        wire = {"dtype": t["dtype"], "shape": t["shape"], "data": bytes.fromhex(t["data_hex"])}
        if "scale" in t:
            wire["scale"] = t["scale"]
        if "scales_hex" in t:
            wire["scales"] = bytes.fromhex(t["scales_hex"])
        return {k: wire[k] for k in tensor_keys if k in wire}

    def value(key: str, v):
        if isinstance(v, dict) and "data_hex" in v:
            return tensor(v)
        if key == "visible":
            return {"grid": v["grid"], "bits": bytes.fromhex(v["bits_hex"])}
        if key == "model":
            return {k: v[k] for k in model_keys if k in v}
        if isinstance(v, dict) and v and all(isinstance(t, dict) and "data_hex" in t for t in v.values()):
            return {name: tensor(v[name]) for name in sorted(v)}   # named tensors (section 15): sorted names
        return v

    keys = message_keys[meaning["type"]]
    assert set(meaning) <= set(keys), (meaning["type"], set(meaning) - set(keys))
    return msgpack.packb({k: value(k, meaning[k]) for k in keys if k in meaning}, use_bin_type=True)


def test_every_valid_vector_is_reproducible_from_the_spec_tables():
    """Issue 28: BACKWARD's `server_s` went on the wire before `durable_through` while SPEC.md's table listed it
    after, so a client encoding from the table could not reproduce vector 10 (now the table follows the wire)."""
    tensor_keys, message_keys = spec_key_tables()
    assert tensor_keys == ["dtype", "shape", "data", "scale", "scales"]
    assert message_keys["backward"] == ["type", "batch_id", "grad", "loss", "n_correct", "server_s", "durable_through"]
    assert set(message_keys) == set(m.SCHEMA)
    for mtype, fields in m.SCHEMA.items():   # the decoder validates in table order (section 5.9)
        assert ["type", *fields] == message_keys[mtype], mtype
    checked = 0
    for path in sorted(gen.HERE.rglob("*.json")):
        if path == gen.HERE / gen.RECONNECT_FILE:   # WELCOME decisions, not a message
            continue
        meaning = json.loads(path.read_text())
        if meaning.get("invalid") or meaning.get("accepted"):
            continue
        assert spec_encode(meaning, tensor_keys, message_keys) == path.with_suffix(".msgpack").read_bytes(), path.name
        checked += 1
    assert checked >= 40


def test_spec_lists_every_preset_map():
    """SPEC.md section 5.1 gives each preset's whole model map, so a client can fill HELLO without the Python code."""
    lines = SPEC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- model-presets:"))
    assert lines[start + 1] == "```"
    block = lines[start + 2:lines.index("```", start + 2)]
    listed = {name: json.loads(text) for name, text in (line.split(maxsplit=1) for line in block)}
    assert list(listed) == list(PRESETS)
    for name, model in listed.items():
        assert list(model) == list(PRESETS[name].to_dict()) and ModelSpec.from_dict(model) == PRESETS[name], name
        types = dict(spec_model_table())
        assert all(type(v).__name__ == types[k] for k, v in model.items()), name   # dropout 0.0, not 0


def test_the_later_keys_are_one_set_with_their_defaults_and_a_hello_may_omit_them():
    """Keys added after the protocol was published (ModelSpec's LATER_KEYS, the wire's LATER_MODEL_KEYS with
    their defaults, SPEC.md): a client written before one leaves it out and is admitted as the same model; the
    same key at another value is another model."""
    from splitface.common.models import LATER_KEYS
    from splitface.protocol.server_session import Admit, ServerSession

    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    assert m.LATER_MODEL_KEYS == {k: defaults[k] for k in LATER_KEYS}
    assert all(f"`{k}`" in SPEC.read_text().split("may leave out")[1][:400] for k in LATER_KEYS)
    older = {k: v for k, v in gen.MODEL.items() if k not in LATER_KEYS}

    def hello(model: dict) -> bytes:
        client = gen.ClientSession(gen.DEVICE_ID, gen.TOKEN, model, gen.SPLIT, "server", gen.MAX_BATCH, gen.NUM_CLASSES,
                                   {"activations": "f32", "gradients": "f32"})
        return client.hello()

    def session() -> ServerSession:
        return ServerSession(gen.INFO, lambda d, t: True, {}, lambda d: 0)

    assert isinstance(session().receive(hello(older)), Admit)
    refused = session().receive(hello({**gen.MODEL, "dct_stem_blocks": 2}))
    assert not isinstance(refused, Admit) and m.decode(refused.data)["code"] == "model_mismatch"


def test_a_checkpoint_from_before_a_later_key_resumes_and_another_model_is_refused(tmp_path):
    """The server's checkpoint names the model it was written for: one written before a later key existed (the
    key absent) is the same model and resumes; a checkpoint of another model is refused with what to do."""
    import pytest

    from splitface.server.app import EdgeServer, ServerConfig, server_info
    from splitface.server.auth import TokenAuthenticator
    from splitface.server.checkpoint import save_checkpoint
    from tests.conftest import small_trainer

    def server(run_dir):
        trainer = small_trainer()
        return EdgeServer(trainer, server_info(trainer, 8, 1 << 20), TokenAuthenticator({}),
                          ServerConfig(port=0, run_dir=run_dir))

    first = server(tmp_path / "old")
    identity = first._identity()
    assert "dct_stem_blocks" not in identity["model"]   # at its default: left out, as before the key existed
    old = {**identity, "model": {k: v for k, v in first.info.model.items() if k not in m.LATER_MODEL_KEYS}}
    save_checkpoint(first.config.checkpoint_path, {"identity": old, "trainer": first.trainer.state_dict(), "devices": {}})
    server(tmp_path / "old")   # resumes
    other = {**identity, "model": {**first.info.model, "width": 8}}
    save_checkpoint(tmp_path / "other" / first.config.checkpoint_path.name,
                    {"identity": other, "trainer": first.trainer.state_dict(), "devices": {}})
    with pytest.raises(SystemExit, match="use another --run-dir"):
        server(tmp_path / "other")
