"""kvfsm: KV-cache transfer for prefill-decode disaggregation, one state machine per room.

The names a rank needs are here: the managers and their config (with the config of each part
they own), the layout and what it is built from, the rooms' facades and states, the failures a
caller catches, and the registry that pairs prefill ranks with decode ranks::

    from kvfsm import DecodeManager, KVPoll, Layout, PrefillManager

They are imported on first use (PEP 562): ``import kvfsm`` runs for every ``kvfsm.*`` import,
the pytest plugin and ``kvfsm --help`` included, and must not pull in NIXL, aiohttp or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfsm.control import ChannelConfig
    from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
    from kvfsm.registry import BootstrapError, BootstrapServer
    from kvfsm.rooms import KVTransferError, ReceiverRoom, RoomConfig, SenderRoom
    from kvfsm.states import TERMINAL, KVPoll, Role
    from kvfsm.transport import AgentConfig, Layout, LayoutError, MemKind, Region, TransferConfig

__version__ = "0.1.0"

__all__ = [
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
]

#: The module each lazy name comes from (the TYPE_CHECKING imports above, for the type checker).
_HOMES: dict[str, str] = {
    "ChannelConfig": "kvfsm.control",
    "DecodeManager": "kvfsm.manager",
    "ManagerConfig": "kvfsm.manager",
    "PrefillManager": "kvfsm.manager",
    "BootstrapError": "kvfsm.registry",
    "BootstrapServer": "kvfsm.registry",
    "KVTransferError": "kvfsm.rooms",
    "ReceiverRoom": "kvfsm.rooms",
    "RoomConfig": "kvfsm.rooms",
    "SenderRoom": "kvfsm.rooms",
    "TERMINAL": "kvfsm.states",
    "KVPoll": "kvfsm.states",
    "Role": "kvfsm.states",
    "AgentConfig": "kvfsm.transport",
    "Layout": "kvfsm.transport",
    "LayoutError": "kvfsm.transport",
    "MemKind": "kvfsm.transport",
    "Region": "kvfsm.transport",
    "TransferConfig": "kvfsm.transport",
}

# Hidden from the type checker, which reads the TYPE_CHECKING imports instead: a module
# __getattr__ it could see would type every misspelt ``kvfsm.X`` as Any rather than an error.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            # Also how ``from kvfsm import demo`` falls through to importing the submodule.
            raise AttributeError(f"module 'kvfsm' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # the next lookup is a plain global, without this call
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
