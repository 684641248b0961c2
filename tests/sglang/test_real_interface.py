"""kvfsm's adapter against SGLang 0.5.23's real interface (installed by ``./dev.sh`` with
``--no-deps``, see tests/sglang/requirements-cpu.txt and docs/sglang-import.md).

* the adapter classes subclass SGLang's real base classes, override their methods with the same
  parameter names, kinds and defaults, and leave no abstract method;
* the pinned copy (``kvfsm/sglang/_pinned.py``, used where SGLang is not installed) still equals
  the real interface, so a version bump that changes the contract fails here;
* SGLang's real plugin loader finds kvfsm's entry point and, with ``KVFSM_SGLANG=1``, its real
  ``HookRegistry`` routes ``get_kv_class`` for ``nixl`` to kvfsm.

The plugin test runs SGLang's own ``get_kv_class`` (``disaggregation/utils.py``, which imports
here with SGLang's torch 2.14.1 pin: docs/sglang-import.md), as its schedulers call it.
Without SGLang these tests fail and say how to install it; ``KVFSM_NO_SGLANG=1`` skips them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

import pytest

from kvfsm.sglang import _pinned

if os.environ.get("KVFSM_NO_SGLANG") == "1":
    pytest.skip("KVFSM_NO_SGLANG=1", allow_module_level=True)

try:
    real: ModuleType = importlib.import_module("sglang.srt.disaggregation.base.conn")
except ImportError as exc:  # pragma: no cover - the failure message is the point
    raise ImportError(
        f"SGLang 0.5.23 is not importable ({exc}); ./dev.sh installs it, or set "
        "KVFSM_NO_SGLANG=1 to skip the real-interface tests"
    ) from exc

from kvfsm.sglang import (
    BASES,
    KvfsmKVBootstrapServer,
    KvfsmKVManager,
    KvfsmKVReceiver,
    KvfsmKVSender,
)

PAIRS = [
    (KvfsmKVManager, "BaseKVManager"),
    (KvfsmKVSender, "BaseKVSender"),
    (KvfsmKVReceiver, "BaseKVReceiver"),
    (KvfsmKVBootstrapServer, "BaseKVBootstrapServer"),
]
CLASSES = [
    "BaseKVManager",
    "BaseKVSender",
    "BaseKVReceiver",
    "BaseKVBootstrapServer",
    "KVPoll",
    "KVTransferMetric",
    "KVTransferDestination",
]


def test_sglang_is_the_pinned_release() -> None:
    from importlib.metadata import version

    assert version("sglang") == _pinned.SGLANG_VERSION
    assert BASES == "sglang"


def shape(sig: inspect.Signature) -> list[tuple[str, Any, str]]:
    """Names, kinds and defaults (by repr: enum members, None, False); annotations differ in
    spelling (upstream's are strings under ``from __future__ import annotations``)."""
    return [(p.name, p.kind, repr(p.default)) for p in sig.parameters.values()]


def members(cls: type) -> dict[str, Any]:
    return {k: v for k, v in vars(cls).items() if not (k.startswith("__") and k != "__init__")}


@pytest.mark.parametrize(("ours", "base_name"), PAIRS, ids=[b for _, b in PAIRS])
def test_adapter_subclasses_the_real_base_with_equal_signatures(ours: type, base_name: str) -> None:
    base = getattr(real, base_name)
    assert issubclass(ours, base)
    assert not getattr(ours, "__abstractmethods__", frozenset())
    for name, value in members(base).items():
        if name == "_abc_impl":
            continue
        mine = inspect.getattr_static(ours, name)
        if callable(value):
            assert callable(mine), name
            assert shape(inspect.signature(mine)) == shape(inspect.signature(value)), name
        elif isinstance(value, property):
            assert isinstance(mine, property | bool), name
        else:
            # Capability flags: kvfsm may turn one on, but then it must implement it.
            assert type(mine) is type(value), name


@pytest.mark.parametrize("name", CLASSES)
def test_the_pinned_copy_equals_the_real_interface(name: str) -> None:
    pinned, upstream = getattr(_pinned, name), getattr(real, name)
    if name == "KVPoll":
        assert members(pinned) == members(upstream)
        return
    if name == "KVTransferDestination":
        assert [(m.name, m.value) for m in pinned] == [(m.name, m.value) for m in upstream]
        return
    if name == "KVTransferMetric":
        assert shape(inspect.signature(pinned)) == shape(inspect.signature(upstream))
        return
    assert getattr(pinned, "__abstractmethods__", None) == upstream.__abstractmethods__
    mine, theirs = members(pinned), members(upstream)
    theirs.pop("_abc_impl", None)
    mine.pop("_abc_impl", None)
    assert sorted(mine) == sorted(theirs)
    for attr, value in theirs.items():
        if callable(value):
            assert shape(inspect.signature(mine[attr])) == shape(inspect.signature(value)), attr
        elif isinstance(value, property):
            assert isinstance(mine[attr], property), attr
        else:
            assert mine[attr] == value, attr


def test_the_pinned_kvargs_fields_exist_upstream() -> None:
    upstream = real.KVArgs.__annotations__
    for field in _pinned.KVArgs.__annotations__:
        assert field in upstream, field


def test_kvfsm_is_in_sglangs_plugin_group() -> None:
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvfsm"]
    assert ep.value == "kvfsm.sglang._plugin:register"


# Run in a fresh interpreter: load_plugins() runs once per process and patches modules. Everything
# here is SGLang's own: its plugin loader, its HookRegistry, and the get_kv_class of
# sglang.srt.disaggregation.utils, as its prefill and decode schedulers call it (the module
# imports on this CPU machine with SGLang's torch 2.14.1: docs/sglang-import.md).
PLUGIN_PROBE = textwrap.dedent(
    """
    import json, warnings
    warnings.simplefilter("ignore")  # SGLang's model stack warns that AWQ/GGUF need CUDA

    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    from sglang.srt.disaggregation import prefill, decode
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    hooks = [(t, ht.value, getattr(h, "__qualname__", "")) for t, hs in HookRegistry._hooks.items()
             for ht, h, _ in hs]
    def name(cls):
        return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
    routed = {c.name: name(get_kv_class(TransferBackend.NIXL, c)) for c in KVClassType}
    fake = name(get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER))
    # The schedulers' own references: prefill.py and decode.py import get_kv_class by name.
    schedulers = [name(m.get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER))
                  for m in (prefill, decode)]
    print(json.dumps({"hooks": hooks, "routed": routed, "fake": fake, "schedulers": schedulers}))
    """
)


def probe_plugins(switch: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVFSM_SGLANG", "SGLANG_PLUGINS")}
    if switch is not None:
        env["KVFSM_SGLANG"] = switch
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_sglangs_plugin_loader_routes_nixl_to_kvfsm_when_switched_on() -> None:
    result = probe_plugins("1")
    assert result["hooks"] == [
        ["sglang.srt.disaggregation.utils.get_kv_class", "around", "route_get_kv_class"]
    ]
    routed = result["routed"]
    assert routed["MANAGER"] == qualified(KvfsmKVManager)
    assert routed["SENDER"] == qualified(KvfsmKVSender)
    assert routed["RECEIVER"] == qualified(KvfsmKVReceiver)
    assert routed["BOOTSTRAP_SERVER"] == qualified(KvfsmKVBootstrapServer)
    assert routed["KVARGS"] == qualified(real.KVArgs)  # KVArgs stays SGLang's
    assert result["fake"] == "sglang.srt.disaggregation.fake.conn.FakeKVManager"
    assert result["schedulers"] == [qualified(KvfsmKVManager)] * 2


def test_an_installed_kvfsm_changes_nothing_until_switched_on() -> None:
    result = probe_plugins(None)
    assert result["hooks"] == []
    assert result["routed"]["MANAGER"] == "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
    assert result["routed"]["BOOTSTRAP_SERVER"].startswith("sglang.srt.disaggregation.")
    assert "kvfsm" not in json.dumps(result)
