"""Shared helpers for room tests: packed pages and cores driven to a named situation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np

from kvfsm.rooms import CommandSink, Inbox, RoomCore, RoomKey, RoomStats
from kvfsm.states import (
    AbortRequested,
    ChunkDone,
    ChunkSubmitted,
    Command,
    DestinationReceived,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerResolved,
    Role,
    TransferConfirmed,
)


def pages(*indices: int) -> bytes:
    return np.asarray(indices, dtype=np.int32).tobytes()


DST = pages(10, 11, 12, 13, 14, 15, 16, 17)  # the receiver reserved 8 pages, aux row 5

#: Shutdown's grace (``RoomConfig.shutdown_timeout_s``) for an engine over a
#: :class:`ScriptedSink`: the sink answers nothing, so a room whose pages wait for its peer's
#: word never settles and a longer grace would only be waited out at every teardown; a room
#: that can settle on the shutdown's abort does so on the loop at once.
SCRIPTED_GRACE_S: Final = 0.5


def sender_at(context: str, stats: RoomStats | None = None, *, strict: bool = True) -> RoomCore:
    """A sender core in a named situation (each one a real path through the table)."""
    core = RoomCore(Role.SENDER, stats, strict=strict)
    steps: dict[str, list[object]] = {
        "bootstrapping": [],
        "waiting": [DestinationReceived(DST, 5)],
        "waiting+init": [DestinationReceived(DST, 5), Initialized(num_pages=4, aux_index=1)],
        # chunk 0 (2 of 4 pages) is in flight
        "transferring": [
            DestinationReceived(DST, 5),
            Initialized(num_pages=4, aux_index=1),
            ChunkSubmitted(pages(0, 1)),
        ],
        "success": [
            DestinationReceived(DST, 5),
            Initialized(num_pages=2, aux_index=1),
            ChunkSubmitted(pages(0, 1)),
            ChunkDone(0),
        ],
        "failed": [DestinationReceived(DST, 5), AbortRequested("test")],
    }
    for event in steps[context]:
        core.handle(event)  # type: ignore[arg-type]
    return core


def receiver_at(context: str, stats: RoomStats | None = None, *, strict: bool = True) -> RoomCore:
    core = RoomCore(Role.RECEIVER, stats, strict=strict)
    steps: dict[str, list[object]] = {
        "bootstrapping": [],
        "bootstrapping+init": [Initialized(peer_rank=0)],
        "waiting": [Initialized(peer_rank=0), PeerResolved(0)],
        "transferring": [Initialized(peer_rank=0), PeerResolved(0), MetadataSubmitted(DST, 5)],
        "success": [
            Initialized(peer_rank=0),
            PeerResolved(0),
            MetadataSubmitted(DST, 5),
            TransferConfirmed(0),
        ],
        "failed": [Initialized(peer_rank=0), AbortRequested("test")],
    }
    for event in steps[context]:
        core.handle(event)  # type: ignore[arg-type]
    return core


CoreFactory = Callable[..., RoomCore]

EXPECTED_STATE = {
    "bootstrapping": KVPoll.Bootstrapping,
    "bootstrapping+init": KVPoll.Bootstrapping,
    "waiting": KVPoll.WaitingForInput,
    "waiting+init": KVPoll.WaitingForInput,
    "transferring": KVPoll.Transferring,
    "success": KVPoll.Success,
    "failed": KVPoll.Failed,
}


class ScriptedSink(CommandSink):
    """A transport and control channel that only records commands. The test decides what
    happens next by delivering events itself: the way to force an interleaving."""

    def __init__(self) -> None:
        self.inbox: Inbox | None = None
        self.log: list[tuple[RoomKey, Command]] = []

    def attach(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def submit(self, key: RoomKey, command: Command) -> None:
        self.log.append((key, command))

    def of(self, key: RoomKey, kind: type[Command] | None = None) -> list[Command]:
        return [c for k, c in self.log if k == key and (kind is None or isinstance(c, kind))]


async def drain(rounds: int = 10) -> None:
    """Let room tasks run: a few loop iterations (virtual time does not move)."""
    import asyncio

    for _ in range(rounds):
        await asyncio.sleep(0)
