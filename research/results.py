"""Writing a script's results: its figures as JSON beside the text a reader reads (a markdown table, or a
benchmark's report with its machine record), the folder made if need be. The experiments in research/ and the
benchmarks in bench/ all write results/ this way, so the files keep one format."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def write_json(path: Path, data: Any, *, newline: bool = False, default: Callable[[Any], Any] | None = None) -> None:
    """`data` as JSON indented by 2, ending in a newline if `newline`; `default` as json.dumps takes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=default) + ("\n" if newline else ""))


def write_report(json_path: Path, data: Any, text_path: Path, text: str, *, newline: bool = False,
                 default: Callable[[Any], Any] | None = None, echo: bool = True) -> None:
    """`data` at `json_path` (as write_json writes it) and `text` at `text_path`; then `text` on stdout, unless not
    `echo`."""
    write_json(json_path, data, newline=newline, default=default)
    text_path.write_text(text)
    if echo:
        print(text, flush=True)


def write_summary(out: Path, summary: Any, table: str, **options: Any) -> None:
    """A results folder's usual pair: `out`/summary.json and `out`/table.md (options as write_report takes them)."""
    write_report(out / "summary.json", summary, out / "table.md", table, **options)


def write_record(stem: Path, saved: Any, text: str, **options: Any) -> None:
    """A benchmark's figures with its machine record, `stem`.json, and its report, `stem`.txt (options as
    write_report takes them)."""
    write_report(stem.with_suffix(".json"), saved, stem.with_suffix(".txt"), text, **options)
