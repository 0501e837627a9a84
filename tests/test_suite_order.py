"""test.sh's order of the test files (tests/conftest.py HEAVY_FIRST): it names files that exist, each once, and
test.sh keeps it (xdist would otherwise reorder the files by their number of tests)."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import HEAVY_FIRST, ROOT


def test_the_heavy_files_named_first_exist_once():
    assert [name for name in HEAVY_FIRST if not (ROOT / "tests" / name).is_file()] == []
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)


def test_test_sh_runs_the_files_in_that_order():
    """The options are xdist's own (pytest refuses an unknown one, and the suite would not start)."""
    options = ["--dist", "loadfile", "--no-loadscope-reorder"]
    assert " ".join(options) in (ROOT / "test.sh").read_text()
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-n", "0",
                          *options, __file__], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
