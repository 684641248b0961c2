"""kvfsm's public API, pinned: the front door (``from kvfsm import PrefillManager, ...``) and each
package's ``__all__``, as literal lists. A name is public when users need it (the README's
example, ``examples/``, ``docs/``) or another kvfsm package imports it; what only a package's own
modules use stays out of its ``__all__``, and its tests import it from the private module.
Changing a list here is changing the API: do it on purpose."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

KVFSM = Path(__file__).resolve().parent.parent / "kvfsm"

EXPECTED: dict[str, list[str]] = {
    "kvfsm": [
        "TERMINAL",
        "AgentConfig",
        "BootstrapError",
        "BootstrapServer",
        "ChannelConfig",
        "DecodeManager",
        "KVPoll",
        "KVTransferError",
        "Layout",
        "LayoutError",
        "ManagerConfig",
        "MemKind",
        "PrefillManager",
        "ReceiverRoom",
        "Region",
        "Role",
        "RoomConfig",
        "SenderRoom",
        "TransferConfig",
        "__version__",
    ],
    "kvfsm.rooms": [
        "CommandSink",
        "IllegalEventError",
        "Inbox",
        "KVTransferError",
        "Observer",
        "ReceiverRoom",
        "RoomConfig",
        "RoomCore",
        "RoomEngine",
        "RoomKey",
        "RoomStats",
        "SenderRoom",
        "StateRows",
        "name_this_thread",
        "thread_table",
    ],
    "kvfsm.transport": [
        "NO_KV",
        "Agent",
        "AgentConfig",
        "AgentProgress",
        "Block",
        "HeadShard",
        "KvPiece",
        "Layout",
        "LayoutError",
        "LayoutSummary",
        "Leases",
        "MemKind",
        "NixlTransport",
        "ProgressWatch",
        "Region",
        "RegionSpec",
        "StatePiece",
        "TransferConfig",
        "legs",
        "link_piece",
        "prefill_legs",
        "state_groups",
        "state_legs",
        "targets",
    ],
    "kvfsm.link": [
        "PEER_ERRORS",
        "AcceptErrors",
        "AuthError",
        "Liveness",
        "RawConnection",
        "accept_forever",
        "check_request",
        "check_secret",
        "describe",
        "next_frame",
        "peer_host",
        "request_headers",
        "send_or_beat",
        "shake_hands",
        "sign",
        "tune",
    ],
    "kvfsm.registry": [
        "BootstrapClient",
        "BootstrapError",
        "BootstrapServer",
        "ConnectionStats",
        "Health",
        "NotFoundError",
        "NotReadyError",
        "RankInfo",
        "Registered",
        "RegistryThread",
        "RejectedError",
        "UnauthorizedError",
        "UnreachableError",
        "add_bootstrap_parser",
        "run_bootstrap",
    ],
    "kvfsm.sglang": [
        "BASES",
        "ENV_SWITCH",
        "KvfsmKVBootstrapServer",
        "KvfsmKVManager",
        "KvfsmKVReceiver",
        "KvfsmKVSender",
        "SGLangTransferError",
        "UnsupportedError",
        "configure",
        "register",
    ],
    # The package exports nothing itself: its modules are imported by name.
    "kvfsm.workload": [],
    "kvfsm.testing": [
        "CANARY",
        "AbortAt",
        "Direction",
        "Faults",
        "KvfsmPair",
        "PairOptions",
        "Transfer",
        "VirtualClock",
    ],
}

#: The packages whose names are imported on first use, and what importing each may load of
#: kvfsm (itself and the packages above it, nothing else).
LAZY = {
    "kvfsm": {"kvfsm"},
    "kvfsm.testing": {"kvfsm", "kvfsm.testing"},
    "kvfsm.sglang": {"kvfsm", "kvfsm.sglang"},
}


def _fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_each_package_exports_exactly_its_public_names(package: str) -> None:
    assert importlib.import_module(package).__all__ == EXPECTED[package]


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_every_exported_name_is_importable(package: str) -> None:
    module = importlib.import_module(package)
    for name in EXPECTED[package]:
        namespace: dict[str, object] = {}
        exec(f"from {package} import {name}", namespace)  # the statement a user writes
        assert namespace[name] is getattr(module, name), name


def test_the_front_door_is_the_same_objects_as_their_homes() -> None:
    import kvfsm
    from kvfsm import manager, registry, rooms, states, transport

    homes = {"kvfsm.control": importlib.import_module("kvfsm.control")}
    homes |= {m.__name__: m for m in (manager, registry, rooms, states, transport)}
    assert set(kvfsm._HOMES) | {"__version__"} == set(kvfsm.__all__)
    for name, home in kvfsm._HOMES.items():
        assert getattr(kvfsm, name) is getattr(homes[home], name), name
        assert name in homes[home].__all__, f"{home} does not export {name}"
    assert kvfsm.__version__ == "0.1.0"


@pytest.mark.parametrize("package", sorted(LAZY))
def test_a_lazy_package_imports_its_names_on_first_use_and_dir_lists_them(package: str) -> None:
    result = _fresh(
        "import importlib, json, sys\n"
        f"module = importlib.import_module({package!r})\n"
        "loaded = sorted(m for m in sys.modules if m == 'kvfsm' or m.startswith('kvfsm.'))\n"
        "listed = dir(module)\n"
        "resolved = [name for name in module.__all__ if getattr(module, name) is not None]\n"
        "try:\n"
        "    module.no_such_name\n"
        "    missing = 'resolved'\n"
        "except AttributeError as exc:\n"
        "    missing = str(exc)\n"
        "print(json.dumps({'loaded': loaded, 'listed': listed, 'resolved': resolved,"
        " 'missing': missing}))\n"
    )
    assert set(result["loaded"]) == LAZY[package]
    assert set(EXPECTED[package]) <= set(result["listed"])
    assert result["resolved"] == EXPECTED[package]
    assert result["missing"] == f"module {package!r} has no attribute 'no_such_name'"


def test_from_kvfsm_import_still_finds_submodules() -> None:
    result = _fresh(
        "import json\nfrom kvfsm import diagram, states\n"
        "print(json.dumps([diagram.__name__, states.__name__]))\n"
    )
    assert result == ["kvfsm.diagram", "kvfsm.states"]


def test_the_pytest_plugin_loads_nothing_of_kvfsm_until_a_fixture_runs() -> None:
    result = _fresh(
        "import json, sys\nimport kvfsm.testing.plugin\n"
        "print(json.dumps({'kvfsm': sorted(m for m in sys.modules if m.startswith('kvfsm')),"
        " 'heavy': sorted(m for m in ('nixl', 'aiohttp', 'numpy', 'torch', 'msgspec')"
        " if m in sys.modules)}))\n"
    )
    assert result == {"kvfsm": ["kvfsm", "kvfsm.testing", "kvfsm.testing.plugin"], "heavy": []}


def _modules() -> dict[str, Path]:
    out = {}
    for path in KVFSM.rglob("*.py"):
        parts = path.relative_to(KVFSM.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_other_packages_import_only_what_a_package_exports() -> None:
    """Inside kvfsm, ``from kvfsm.<package> import name`` across packages names an exported
    name or a public submodule; so a package's ``__all__`` is what the rest of kvfsm needs."""
    mods = _modules()
    offenders = []
    for mod, path in sorted(mods.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module not in EXPECTED:
                continue
            own = mod == node.module or mod.startswith(node.module + ".")
            if own and node.module != "kvfsm":
                continue  # a package's own modules (every module is inside kvfsm itself)
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in mods and not alias.name.startswith("_"):
                    continue
                if alias.name not in EXPECTED[node.module]:
                    offenders.append(f"{mod}: from {node.module} import {alias.name}")
    assert offenders == []
