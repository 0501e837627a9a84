"""The project's import graph, read from the source with `ast`: no module imports itself back through
others (an import cycle makes import order matter and breaks lazy imports), and a device never
imports server code (device_sdk/ and protocol/ reach no module of edge_server/, directly or not).

Every import counts, including those inside functions (they run too, only later), except those
under `if TYPE_CHECKING:`, which never run. An import names the module it loads: `from a import b`
is an edge to `a.b` when that is a module of the project, else to `a`.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "edge_server", "device_sdk", "export")
DEVICE_SIDE = ("protocol", "device_sdk")


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
    assert "device_sdk.models" in graph["device_sdk.engine"]              # from .models import ...
    assert "device_sdk.models.lrn" in graph["export.programs"]           # from device_sdk.models.lrn import ...
    assert "protocol.tensor" in graph["protocol"]                        # from .tensor import ... in an __init__
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_device_side_never_imports_the_server():
    graph = import_graph()
    for name in (n for n in graph if n.split(".")[0] in DEVICE_SIDE):
        via = reachable(graph, name)
        server = sorted(n for n in via if n.split(".")[0] == "edge_server")
        if server:
            chain = [server[0]]
            while chain[-1] != name:
                chain.append(via[chain[-1]] if chain[-1] in via else name)
            raise AssertionError(f"{name} imports server code: " + " -> ".join(reversed(chain)))
