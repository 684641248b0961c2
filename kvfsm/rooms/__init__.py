"""The room actor runtime: room tasks, their registry, the loop thread and callers' facades.

Exported: the engine and the facades it hands out, their config and failure, the ports a sink
implements or uses (``CommandSink``, ``Inbox``, ``RoomKey``) and an engine's ``Observer``, the
sans-IO core that tests drive in virtual time (``RoomCore``, strict mode's
``IllegalEventError``), the counters an engine and a core keep (``RoomStats``), and the thread
names that the transport and the status server share.
"""

from __future__ import annotations

from kvfsm.rooms._config import RoomConfig
from kvfsm.rooms._core import IllegalEventError, RoomCore
from kvfsm.rooms._engine import RoomEngine
from kvfsm.rooms._facade import KVTransferError, ReceiverRoom, SenderRoom, StateRows
from kvfsm.rooms._ports import CommandSink, Inbox, Observer, RoomKey
from kvfsm.rooms._runtime import name_this_thread, thread_table
from kvfsm.rooms._stats import RoomStats

__all__ = [
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
]
