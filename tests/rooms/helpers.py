"""Shared helpers for room tests: packed pages and cores driven to a named situation."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from kvfsm.rooms import RoomCore, RoomStats
from kvfsm.states import (
    AbortRequested,
    ChunkDone,
    ChunkSubmitted,
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
