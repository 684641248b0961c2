"""The shape of ``kvfsm/``'s imports (issue 16): no import cycle, counting every import
statement (lazy ones inside functions and ``TYPE_CHECKING`` ones too: a cycle hidden in a
function is still a cycle), and no module reaching into another package's private module for a
name that package exports. Read from the source with ``ast``; nothing is imported to check."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

KVFSM = Path(__file__).resolve().parent.parent / "kvfsm"


def _modules() -> dict[str, Path]:
    out = {}
    for path in KVFSM.rglob("*.py"):
        parts = path.relative_to(KVFSM.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.module and not node.level:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                # "from pkg import submodule" depends on the submodule, not on the package
                targets = [t for t in subs if t in mods]
                if len(targets) < len(subs):
                    targets.append(node.module)
            else:
                continue
            for target in targets:
                found = owner(target)
                if found is not None and found != mod and found.startswith("kvfsm"):
                    edges[mod].add(found)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start, children_of_start in edges.items():
        if start in index:
            continue
        work = [(start, iter(sorted(children_of_start)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_there_is_no_import_cycle_in_kvfsm() -> None:
    edges = _graph(_modules())
    assert sum(map(len, edges.values())) > 100  # the graph was read
    assert _cycles(edges) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_reaches_into_a_private_module_for_an_exported_name() -> None:
    mods = _modules()
    offenders = []
    for mod, path in mods.items():
        package = mod.rpartition(".")[0] if path.name != "__init__.py" else mod
        for node in _imports(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            target_pkg, _, last = node.module.rpartition(".")
            if not last.startswith("_") or target_pkg not in mods or target_pkg == "kvfsm":
                continue
            if package == target_pkg or package.startswith(target_pkg + "."):
                continue  # a package's own modules may use each other's insides
            exported = set(getattr(importlib.import_module(target_pkg), "__all__", ()))
            names = [a.name for a in node.names]
            if all(name in exported for name in names):
                offenders.append(f"{mod}: from {node.module} import {', '.join(names)}")
    assert offenders == []


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/helpers/ (and tests/e2e/servers.py for the real servers);
    a test module never imports a test module or a conftest."""
    tests = KVFSM.parent / "tests"
    offenders = []
    for path in tests.rglob("*.py"):
        for node in _imports(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            )
            for name in names:
                last = name.rpartition(".")[2]
                if name.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                    offenders.append(f"{path.relative_to(tests)}: {name}")
    assert offenders == []
