"""The SGLang plugin: routes SGLang's backend lookup to kvfsm when ``KVFSM_SGLANG=1``.

SGLang calls every function registered in the ``sglang.srt.plugins`` entry-point group in each of
its processes, before parsing arguments (``sglang.srt.plugins.load_plugins``). kvfsm's function
registers an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class``: with the switch set,
asking for the ``nixl`` backend's manager, sender, receiver or bootstrap server returns kvfsm's.

Why the ``nixl`` name and a switch, rather than a new backend name (docs/sglang.md): SGLang's
``TransferBackend`` is a closed enum read in several processes, some of which never load plugins,
and some features are gated on the name (``kv_data_mem_kinds`` is only set for ``nixl``, which
kvfsm reads too). Reusing ``nixl`` keeps every such check as it is for a NIXL deployment, and
installing kvfsm changes nothing until the switch is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = ["ENV_SWITCH", "GET_KV_CLASS", "enabled", "kv_class", "register", "route_get_kv_class"]

_log = logging.getLogger("kvfsm.sglang")

#: The environment variable that turns kvfsm on (1, true, yes, on).
ENV_SWITCH = "KVFSM_SGLANG"
#: The function the hook wraps.
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
#: The SGLang backend name kvfsm stands in for.
BACKEND = "nixl"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def kv_class(class_type: Any) -> type | None:
    """kvfsm's class for a ``KVClassType`` member (by name), or None (KVARGS: SGLang's own)."""
    name = getattr(class_type, "name", str(class_type))
    if name == "KVARGS":
        return None
    # Lazily, from the modules themselves (not the package, whose __init__ exports this
    # module's names): SGLang may load the plugin long before it needs the classes.
    from kvfsm.sglang._conn import KvfsmKVReceiver, KvfsmKVSender  # noqa: PLC0415
    from kvfsm.sglang._manager import KvfsmKVManager  # noqa: PLC0415
    from kvfsm.sglang._server import KvfsmKVBootstrapServer  # noqa: PLC0415

    classes: dict[str, type] = {
        "MANAGER": KvfsmKVManager,
        "SENDER": KvfsmKVSender,
        "RECEIVER": KvfsmKVReceiver,
        "BOOTSTRAP_SERVER": KvfsmKVBootstrapServer,
    }
    return classes.get(name)


def route_get_kv_class(
    original: Callable[..., Any], transfer_backend: Any, class_type: Any, *args: Any, **kw: Any
) -> Any:
    """The AROUND hook: kvfsm's class for the ``nixl`` backend while the switch is on, else
    whatever SGLang's own ``get_kv_class`` returns (the per-request ``fake`` backend of warmup
    and health checks stays SGLang's)."""
    if enabled() and getattr(transfer_backend, "value", transfer_backend) == BACKEND:
        cls = kv_class(class_type)
        if cls is not None:
            return cls
    return original(transfer_backend, class_type, *args, **kw)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Registers the hook only when the switch is on, so
    an installed but unused kvfsm leaves SGLang untouched."""
    if not enabled():
        _log.debug("kvfsm installed but %s is not set: SGLang's backends unchanged", ENV_SWITCH)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    HookRegistry.register(GET_KV_CLASS, route_get_kv_class, HookType.AROUND)
    _log.info("kvfsm: SGLang's %r transfer backend is served by kvfsm", BACKEND)
