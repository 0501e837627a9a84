"""research/results.py writes what the scripts wrote by hand before it, byte for byte: json.dumps(indent=2), with
or without a final newline, `default` for what JSON lacks; the text as given, echoed."""
from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import pytest

from research.results import write_json, write_record, write_report, write_summary

ROWS = [{"run": "dct-drop4", "params": {"drop": 4, "keep": [1, 2]}, "epsilon": math.inf, "ok": True, "note": None,
         "accuracy": 0.123456789, "name": "café"},
        {"run": "none", "params": {}, "epsilon": 3.0, "ok": False, "note": "x", "accuracy": 1e-7, "name": "b"}]
TABLE = "| run | accuracy |\n|---|---|\n| none | 0.1 |\n"


@pytest.mark.parametrize("newline", [False, True])
def test_summary_and_table_as_before(tmp_path, newline, capsys):
    out = tmp_path / "new" / "folder"
    write_summary(out, ROWS, TABLE, newline=newline)
    assert (out / "summary.json").read_bytes() == (json.dumps(ROWS, indent=2) + ("\n" if newline else "")).encode()
    assert (out / "table.md").read_bytes() == TABLE.encode()
    assert capsys.readouterr().out == TABLE + "\n"


def test_default_for_what_json_lacks(tmp_path):
    data = {"rows": ROWS, "args": vars(Namespace(out=tmp_path, seeds=[0, 1]))}
    write_summary(tmp_path, data, TABLE, default=str, echo=False)
    assert (tmp_path / "summary.json").read_text() == json.dumps(data, indent=2, default=str)


def test_record_beside_its_report(tmp_path, capsys):
    write_record(tmp_path / "bench_native", {"record": {"cpu": "x"}, "rows": ROWS}, "report\n", echo=False)
    assert (tmp_path / "bench_native.json").read_text() == json.dumps({"record": {"cpu": "x"}, "rows": ROWS}, indent=2)
    assert (tmp_path / "bench_native.txt").read_text() == "report\n"
    assert capsys.readouterr().out == ""


def test_named_files(tmp_path):
    write_report(tmp_path / "ray_sim.json", ROWS, tmp_path / "ray_sim.md", TABLE, newline=True, echo=False)
    write_json(tmp_path / "best.json", ROWS[0])
    assert (tmp_path / "ray_sim.json").read_text() == json.dumps(ROWS, indent=2) + "\n"
    assert (tmp_path / "ray_sim.md").read_text() == TABLE
    assert Path(tmp_path / "best.json").read_text() == json.dumps(ROWS[0], indent=2)
