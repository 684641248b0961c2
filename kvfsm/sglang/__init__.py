"""kvfsm as an SGLang 0.5.23 disaggregation transfer backend (docs/sglang.md).

Install ``kvfsm[sglang]``, set ``KVFSM_SGLANG=1`` and launch SGLang with
``--disaggregation-transfer-backend nixl``: the plugin (``kvfsm.sglang._plugin``) routes SGLang's
backend lookup to the classes here. They subclass SGLang's own base classes when SGLang is
installed (``BASES == "sglang"``) and a pinned copy of them otherwise (``"pinned"``).
"""

from __future__ import annotations

from kvfsm.sglang._args import Topology, UnsupportedError, layout_from_kv_args
from kvfsm.sglang._bases import BASES
from kvfsm.sglang._conn import KvfsmKVReceiver, KvfsmKVSender, SGLangTransferError
from kvfsm.sglang._manager import KvfsmKVManager, PrefillInfo
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
    "PrefillInfo",
    "SGLangTransferError",
    "Topology",
    "UnsupportedError",
    "configure",
    "layout_from_kv_args",
    "register",
]
