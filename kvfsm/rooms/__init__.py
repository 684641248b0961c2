"""The room actor runtime: room tasks, their registry, the loop thread and callers' facades."""

from __future__ import annotations

from kvfsm.rooms._actor import Room
from kvfsm.rooms._config import DEFAULT_MAX_PAGES, RoomConfig
from kvfsm.rooms._core import Claim, IllegalEventError, RoomCore, page_count
from kvfsm.rooms._engine import RoomEngine
from kvfsm.rooms._facade import KVTransferError, ReceiverRoom, SenderRoom, pack_pages
from kvfsm.rooms._machine import MACHINES, build_machine, machine_edges
from kvfsm.rooms._owners import DestinationOwners
from kvfsm.rooms._ports import (
    Claims,
    CommandSink,
    Inbox,
    Observer,
    Publication,
    RoomHost,
    RoomKey,
)
from kvfsm.rooms._registry import DuplicateRoomError, Registry
from kvfsm.rooms._runtime import LoopThread, name_this_thread, thread_table
from kvfsm.rooms._stats import RoomStats

__all__ = [
    "DEFAULT_MAX_PAGES",
    "MACHINES",
    "Claim",
    "Claims",
    "CommandSink",
    "DestinationOwners",
    "DuplicateRoomError",
    "IllegalEventError",
    "Inbox",
    "KVTransferError",
    "LoopThread",
    "Observer",
    "Publication",
    "ReceiverRoom",
    "Registry",
    "Room",
    "RoomConfig",
    "RoomCore",
    "RoomEngine",
    "RoomHost",
    "RoomKey",
    "RoomStats",
    "SenderRoom",
    "build_machine",
    "machine_edges",
    "name_this_thread",
    "pack_pages",
    "page_count",
    "thread_table",
]
