"""The README is a landing page (issue #29): at most 200 lines, and what it links or embeds exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the landing page's limit is 200 (move detail to docs/)"


def test_readme_links_resolve():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert "docs/layers.png" in targets  # the layer figure is embedded
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
