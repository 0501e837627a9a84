"""The project's import graph, read from the source with `ast`: no module imports itself back through
others (an import cycle makes import order matter and breaks lazy imports), and a device never
imports server code (splitface/device/ and splitface/protocol/ reach no module of splitface/server/, directly or not).

Every import counts, including those inside functions (they run too, only later), except those
under `if TYPE_CHECKING:`, which never run. An import names the module it loads: `from a import b`
is an edge to `a.b` when that is a module of the project, else to `a`.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("splitface", "research")
# what the wire may import besides itself: a client in another language needs nothing more
PROTOCOL_ALLOWED = {"numpy", "msgpack", "__future__", "dataclasses", "enum", "math", "typing", "json", "argparse",
                    "pathlib", "struct", "sys", "collections", "itertools", "functools", "random", "hashlib", "re", "time", "uuid"}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import statements anywhere in the tree, skipping `if TYPE_CHECKING:` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if _type_checking_only(node):
            yield from (n for child in node.orelse for n in [child, *_imports(child)]
                        if isinstance(n, (ast.Import, ast.ImportFrom)))
            continue
        yield from _imports(node)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute: the module holding it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports directly or not, each with the module that imports it."""
    via, todo = {}, [start]
    while todo:
        current = todo.pop()
        for nxt in graph[current]:
            if nxt not in via and nxt != start:
                via[nxt] = current
                todo.append(nxt)
    return via


def test_the_graph_is_read_correctly():
    graph = import_graph()
    assert len(graph) > 40
    assert "splitface.common.models" in graph["splitface.device.trainer"]
    assert "splitface.common.models.lrn" in graph["splitface.export.programs"]
    assert "splitface.protocol.messages" in graph["splitface.protocol"]    # an __init__'s import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_layers_hold():
    """import-linter's contracts (pyproject.toml), function-level imports included."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "broken" not in done.stdout.split("Contracts:")[-1].replace("0 broken", "")


def test_the_wire_needs_only_numpy_and_msgpack():
    for path in sorted((ROOT / "splitface" / "protocol").rglob("*.py")):
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("splitface.protocol")):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top in PROTOCOL_ALLOWED or name.startswith("splitface.protocol"), \
                    f"{path.relative_to(ROOT)} imports {name}"
