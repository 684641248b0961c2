"""``kvfsm.sglang._plugin``: the switch, the AROUND hook on SGLang's ``get_kv_class`` and the
entry point that registers it."""

from __future__ import annotations

import enum
from collections import defaultdict
from importlib.metadata import entry_points
from typing import Any

import pytest

from kvfsm.sglang import (
    KvfsmKVBootstrapServer,
    KvfsmKVManager,
    KvfsmKVReceiver,
    KvfsmKVSender,
)
from kvfsm.sglang._plugin import (
    ENV_SWITCH,
    GET_KV_CLASS,
    enabled,
    kv_class,
    register,
    route_get_kv_class,
)


class TransferBackend(enum.Enum):
    """Stand-in for ``sglang.srt.disaggregation.utils.TransferBackend``."""

    MOONCAKE = "mooncake"
    NIXL = "nixl"
    FAKE = "fake"


class KVClassType(enum.Enum):
    """Stand-in for ``sglang.srt.disaggregation.utils.KVClassType``."""

    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


KVFSM_CLASSES = {
    KVClassType.MANAGER: KvfsmKVManager,
    KVClassType.SENDER: KvfsmKVSender,
    KVClassType.RECEIVER: KvfsmKVReceiver,
    KVClassType.BOOTSTRAP_SERVER: KvfsmKVBootstrapServer,
}


class Original:
    """SGLang's own ``get_kv_class``: records its calls, returns a marker."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[str, Any, Any]:
        self.calls.append((*args, kwargs))
        return ("sglang's", args[0], args[1])


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_switch_on(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SWITCH, value)
    assert enabled()


@pytest.mark.parametrize("value", ["0", "", "no", "off", "false", "nixl", None])
def test_switch_off(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(ENV_SWITCH, value)
    assert not enabled()


@pytest.mark.parametrize("backend", list(TransferBackend))
@pytest.mark.parametrize("class_type", list(KVClassType))
def test_switch_off_always_calls_the_original(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend, class_type: KVClassType
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    original = Original()
    assert route_get_kv_class(original, backend, class_type) == ("sglang's", backend, class_type)
    assert original.calls == [(backend, class_type, {})]


@pytest.mark.parametrize("class_type", list(KVFSM_CLASSES))
def test_switch_on_serves_nixl_with_kvfsm(
    monkeypatch: pytest.MonkeyPatch, class_type: KVClassType
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    original = Original()
    found = route_get_kv_class(original, TransferBackend.NIXL, class_type)
    assert found is KVFSM_CLASSES[class_type]
    assert original.calls == []


def test_switch_on_leaves_kvargs_to_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    original = Original()
    result = route_get_kv_class(original, TransferBackend.NIXL, KVClassType.KVARGS)
    assert result == ("sglang's", TransferBackend.NIXL, KVClassType.KVARGS)
    assert kv_class(KVClassType.KVARGS) is None


@pytest.mark.parametrize("backend", [TransferBackend.FAKE, TransferBackend.MOONCAKE])
@pytest.mark.parametrize("class_type", list(KVClassType))
def test_switch_on_leaves_other_backends_to_sglang(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend, class_type: KVClassType
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    original = Original()
    assert route_get_kv_class(original, backend, class_type) == ("sglang's", backend, class_type)
    assert original.calls == [(backend, class_type, {})]


def test_extra_arguments_reach_the_original(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    original = Original()
    route_get_kv_class(original, TransferBackend.FAKE, KVClassType.SENDER, 7, flag=True)
    assert original.calls == [(TransferBackend.FAKE, KVClassType.SENDER, 7, {"flag": True})]


def test_plain_string_backend_names_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    original = Original()
    assert route_get_kv_class(original, "nixl", KVClassType.MANAGER) is KvfsmKVManager
    assert route_get_kv_class(original, "mooncake", KVClassType.MANAGER)[0] == "sglang's"


# -- register(): the entry point ------------------------------------------------------------------


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """SGLang's hook table, as a copy that is put back after the test."""
    registry = pytest.importorskip(
        "sglang.srt.plugins.hook_registry", reason="register() needs SGLang's plugin registry"
    )
    HookRegistry = registry.HookRegistry  # noqa: N806 - SGLang's class

    copy: defaultdict[str, list[Any]] = defaultdict(list)
    for target, entries in HookRegistry._hooks.items():
        copy[target] = list(entries)
    monkeypatch.setattr(HookRegistry, "_hooks", copy)
    return copy


def _snapshot(table: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {target: list(entries) for target, entries in table.items() if entries}


def test_register_with_the_switch_off_registers_nothing(
    monkeypatch: pytest.MonkeyPatch, hooks: dict[str, list[Any]]
) -> None:
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    before = _snapshot(hooks)
    register()
    monkeypatch.setenv(ENV_SWITCH, "0")
    register()
    assert _snapshot(hooks) == before


def test_register_with_the_switch_on_adds_one_around_hook(
    monkeypatch: pytest.MonkeyPatch, hooks: dict[str, list[Any]]
) -> None:
    from sglang.srt.plugins.hook_registry import HookType  # the hooks fixture checked the import

    monkeypatch.setenv(ENV_SWITCH, "1")
    before = _snapshot(hooks)
    register()
    after = _snapshot(hooks)
    added = after.get(GET_KV_CLASS, [])[len(before.get(GET_KV_CLASS, [])) :]
    assert len(added) == 1
    hook_type, hook, _source = added[0]
    assert hook_type is HookType.AROUND
    assert hook is route_get_kv_class
    assert {t: e for t, e in after.items() if t != GET_KV_CLASS} == {
        t: e for t, e in before.items() if t != GET_KV_CLASS
    }
    assert GET_KV_CLASS == "sglang.srt.disaggregation.utils.get_kv_class"


def test_the_entry_point_is_register() -> None:
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvfsm"]
    assert len(found) == 1
    assert found[0].load() is register
