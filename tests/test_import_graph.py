"""The shape of ``kvfsm/``'s imports, read from the source with ``ast`` (nothing is imported
to check, except a package's ``__all__`` where a test says so). Every import statement counts:
lazy ones inside functions, ``TYPE_CHECKING`` ones, and ``importlib.import_module`` of a literal
name; a dependency hidden in a function is still a dependency.

* no import cycle;
* the layers: every import between two parts of kvfsm goes downward in :data:`LAYERS`;
* privacy: no module imports a private module (a path component starting with ``_``) of a
  package it is not inside, nor reaches into one for a name that package exports.
"""

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


def _package(mod: str, path: Path) -> str:
    """The package a module's own imports are relative to (a package's ``__init__`` is it)."""
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def _import_module_calls(tree: ast.AST) -> list[str]:
    """The literal names given to ``importlib.import_module`` (or a bare ``import_module``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        is_literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
        if name == "import_module" and is_literal:
            found.append(first.value)
    return found


def _targets(mods: dict[str, Path], mod: str) -> list[str]:
    """Every module name that ``mod``'s source imports (kvfsm's and others'), each statement
    resolved: ``from pkg import submodule`` names the submodule, ``from pkg import name`` the
    package, a relative import its absolute name."""
    path = mods[mod]
    tree = ast.parse(path.read_text())
    out = _import_module_calls(tree)
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            anchor = _package(mod, path).split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        subs = [f"{base}.{a.name}" for a in node.names]
        found = [t for t in subs if t in mods]
        out += found
        if len(found) < len(subs):
            out.append(base)
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod in mods:
        for target in _targets(mods, mod):
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
        package = _package(mod, path)
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


#: kvfsm's parts, lowest first: a top-level module or package of kvfsm (``"kvfsm"`` is the
#: package's own ``__init__``). A part imports only from itself and from lower layers, never
#: from a part of its own layer. Why each sits where it does:
LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaves, which import nothing of kvfsm: the states, events and tables every layer speaks
    # in; stopping a background task (_tasks: transport, registry, control); child processes
    # and stack dumps (_child: the workloads, chaos and the CLI).
    ("states", "_tasks", "_child"),
    ("rooms",),  # room tasks and the ports every sink implements
    ("link",),  # authentication and the raw stream that the listeners above share
    ("transport",),  # NIXL's data path; answers rooms with events
    ("registry",),  # the HTTP bootstrap registry; signs and checks with link
    ("control",),  # the control channel: finds prefill ranks in the registry, sends layouts
    # What a manager serves about its rooms (Prometheus metrics, the /rooms status server, the
    # book of its peers): they import only states and rooms, and only the manager builds them.
    ("metrics", "status", "peer_book"),
    ("manager",),  # one rank: everything above the rooms, wired together
    ("kvfsm",),  # the front door: re-exports names from the manager and below
    # Users of the managers: the SGLang backend, and the workloads that drive a real pair;
    # the state diagrams and ``kvfsm top`` (of states only, and status servers over HTTP) sit
    # here for the CLI, and ``kvfsm explain`` (text in, text out: it imports nothing of kvfsm).
    ("sglang", "workload", "diagram", "top", "explain"),
    ("demo",),  # the main job: orchestrates the workload's ranks
    ("chaos",),  # campaigns over the workload's ranks; runs the demo across two hosts
    ("testing",),  # the test kit injects faults through chaos's proxies
    ("cli",),  # every subcommand
    ("__main__",),  # python -m kvfsm
)


def _part(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else mod


def test_every_part_of_kvfsm_has_a_layer() -> None:
    layered = [part for layer in LAYERS for part in layer]
    assert len(layered) == len(set(layered))
    assert {_part(mod) for mod in _modules()} == set(layered)


def _upward(edges: dict[str, set[str]]) -> tuple[int, list[str]]:
    """How many imports cross from one part to another, and those that do not go down."""
    rank = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    crossings, upward = 0, []
    for mod, targets in sorted(edges.items()):
        for target in sorted(targets):
            if _part(mod) == _part(target):
                continue
            crossings += 1
            if rank[_part(target)] >= rank[_part(mod)]:
                upward.append(f"{mod} -> {target}")
    return crossings, upward


def test_every_import_inside_kvfsm_goes_down_the_layers() -> None:
    crossings, upward = _upward(_graph(_modules()))
    assert crossings > 100  # the graph was read
    assert upward == []


def test_the_layer_check_finds_an_upward_or_sideways_import() -> None:
    edges = {
        "kvfsm.states": {"kvfsm.manager"},  # up
        "kvfsm.manager": {"kvfsm.states", "kvfsm.rooms._core"},  # down
        "kvfsm.metrics": {"kvfsm.status"},  # within one layer
        "kvfsm.rooms._core": {"kvfsm.rooms._ports"},  # inside one part
    }
    assert _upward(edges) == (4, ["kvfsm.metrics -> kvfsm.status", "kvfsm.states -> kvfsm.manager"])


def test_the_graph_counts_lazy_type_checking_relative_and_import_module_imports(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "kvfsm"
    (pkg / "rooms").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "states.py").write_text("")
    (pkg / "rooms" / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from kvfsm.states import KVPoll\n"
        "def f():\n"
        "    from kvfsm.rooms import _core\n"
        "    import importlib\n"
        "    return importlib.import_module('kvfsm.states')\n"
    )
    (pkg / "rooms" / "_core.py").write_text("from .. import states\nfrom . import _core\n")
    mods = {
        "kvfsm": pkg / "__init__.py",
        "kvfsm.states": pkg / "states.py",
        "kvfsm.rooms": pkg / "rooms" / "__init__.py",
        "kvfsm.rooms._core": pkg / "rooms" / "_core.py",
    }
    edges = _graph(mods)
    assert edges["kvfsm.rooms"] == {"kvfsm.states", "kvfsm.rooms._core"}
    assert edges["kvfsm.rooms._core"] == {"kvfsm.states"}


def _private_imports(mods: dict[str, Path]) -> list[str]:
    """``importer -> imported`` for every import of a private module from outside the package
    that holds it. A private module serves its package and everything inside it, so
    ``kvfsm._tasks`` serves all of kvfsm and ``kvfsm.control._frames`` only ``kvfsm.control``."""
    found = set()
    for mod, path in mods.items():
        package = _package(mod, path)
        for target in _targets(mods, mod):
            parts = target.split(".")
            if parts[0] != "kvfsm":
                continue
            for i, part in enumerate(parts[1:], start=1):
                dunder = part.startswith("__") and part.endswith("__")
                holder = ".".join(parts[:i])
                inside = package == holder or package.startswith(holder + ".")
                if part.startswith("_") and not dunder and not inside:
                    found.add(f"{mod} -> {'.'.join(parts[: i + 1])}")
                    break
    return sorted(found)


def test_the_privacy_check_finds_a_private_import(tmp_path: Path) -> None:
    sources = {
        "kvfsm/__init__.py": "",
        "kvfsm/_tasks.py": "",
        "kvfsm/control/__init__.py": "from kvfsm.control._frames import Hello\n",
        "kvfsm/control/_frames.py": "from kvfsm import _tasks\n",
        "kvfsm/chaos/__init__.py": "def f():\n    from kvfsm.control import _frames\n",
        "kvfsm/chaos/_proxy.py": "import kvfsm.control._frames\nimport kvfsm.__main__\n",
        "kvfsm/__main__.py": "",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    mods = {
        ".".join(Path(name).with_suffix("").parts).removesuffix(".__init__"): tmp_path / name
        for name in sources
    }
    assert _private_imports(mods) == [
        "kvfsm.chaos -> kvfsm.control._frames",
        "kvfsm.chaos._proxy -> kvfsm.control._frames",
    ]


def test_no_module_imports_another_packages_private_module() -> None:
    assert _private_imports(_modules()) == []


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
