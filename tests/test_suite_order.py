"""test.sh's order of the test files (tests/conftest.py HEAVY_FIRST): it names files that exist, each once, and
test.sh keeps it (xdist would otherwise reorder the files by their number of tests)."""
from __future__ import annotations

from tests.conftest import HEAVY_FIRST, ROOT


def test_the_heavy_files_named_first_exist_once():
    assert [name for name in HEAVY_FIRST if not (ROOT / "tests" / name).is_file()] == []
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)


def test_test_sh_runs_the_files_in_that_order():
    assert "--dist loadfile --no-loadscopereorder" in (ROOT / "test.sh").read_text()
