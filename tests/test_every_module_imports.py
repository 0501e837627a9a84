"""Every module of the project imports, bench/ and research/ included: the layering contract (tests/test_imports.py)
covers only the packages, and a script whose import broke in a move would otherwise wait for its next run."""
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for room in ("splitface", "research", "bench") for p in (ROOT / room).rglob("*.py")
                 if p.name != "__main__.py")


def test_the_list_is_read():
    assert {"bench.transport", "research.frontier", "splitface.net.fastws"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)


def test_every_import_statement_names_a_module_that_exists():
    """Imports inside functions too (they run only later): each names a module this environment can find."""
    import ast
    import importlib.util
    missing = []
    for room in ("splitface", "research", "bench", "tests"):
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if importlib.util.find_spec(name.split(".")[0]) is None:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not missing, missing
