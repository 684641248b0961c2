"""kvfsm as an SGLang 0.5.23 disaggregation transfer backend (docs/sglang.md).

Install ``kvfsm[sglang]``, set ``KVFSM_SGLANG=1`` and launch SGLang with
``--disaggregation-transfer-backend nixl``: the plugin (``kvfsm.sglang._plugin``) routes SGLang's
backend lookup to the classes here. They subclass SGLang's own base classes when SGLang is
installed (``BASES == "sglang"``) and a pinned copy of them otherwise (``"pinned"``).

The names below are imported on first use: SGLang loads the plugin in every one of its processes
(the detokenizer too), and only the schedulers and the bootstrap server need NIXL and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfsm.sglang._args import UnsupportedError
    from kvfsm.sglang._bases import BASES
    from kvfsm.sglang._conn import KvfsmKVReceiver, KvfsmKVSender, SGLangTransferError
    from kvfsm.sglang._manager import KvfsmKVManager
    from kvfsm.sglang._plugin import ENV_SWITCH, register
    from kvfsm.sglang._server import KvfsmKVBootstrapServer
    from kvfsm.sglang._settings import configure

__all__ = [
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
]

_HOMES = {
    "UnsupportedError": "_args",
    "BASES": "_bases",
    "KvfsmKVReceiver": "_conn",
    "KvfsmKVSender": "_conn",
    "SGLangTransferError": "_conn",
    "KvfsmKVManager": "_manager",
    "ENV_SWITCH": "_plugin",
    "register": "_plugin",
    "KvfsmKVBootstrapServer": "_server",
    "configure": "_settings",
}


# Hidden from the type checker, which reads the TYPE_CHECKING imports instead (a __getattr__ it
# could see would type every misspelt name as Any).
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'kvfsm.sglang' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"kvfsm.sglang.{home}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
