"""``LoopbackSink``: pairs sender and receiver rooms of one engine with no data path at all.

Every chunk completes on the next loop iteration and control messages go straight to the peer
room of the same id. It measures and tests the room runtime itself (the benchmark's "null
transport"); it moves no bytes, so it is never evidence that data moves.
"""

from __future__ import annotations

import asyncio

from kvfsm.rooms._ports import CommandSink, Inbox, RoomKey
from kvfsm.states import (
    AbortRequested,
    ChunkDone,
    Command,
    DestinationReceived,
    Event,
    KVPoll,
    PeerFailed,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
    TransferConfirmed,
)

__all__ = ["LoopbackSink"]


class LoopbackSink(CommandSink):
    """Null transport plus in-process control channel, for one engine holding both roles."""

    def __init__(self) -> None:
        self._inbox: Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.commands = 0

    def attach(self, inbox: Inbox) -> None:
        self._inbox = inbox
        self._loop = asyncio.get_running_loop()

    def submit(self, key: RoomKey, command: Command) -> None:
        inbox, loop = self._inbox, self._loop
        if inbox is None or loop is None:
            raise RuntimeError("LoopbackSink.submit before attach()")
        self.commands += 1
        if isinstance(command, PostChunk):
            # Completes "asynchronously", like a pump that finds the handle done next round.
            loop.call_soon(inbox.deliver, key, ChunkDone(command.chunk))
        elif isinstance(command, ResolvePeer):
            inbox.deliver(key, PeerResolved(command.peer_rank))
        elif isinstance(command, SendMetadata):
            self._to_peer(
                key,
                Role.SENDER,
                DestinationReceived(
                    command.pages,
                    command.aux_index,
                    state=command.state,
                    part=command.part,
                    prefix=command.prefix,
                    rings=command.rings,
                ),
            )
        elif isinstance(command, ReportOutcome):
            self._report(key, command)
        elif isinstance(command, ReportSettled):
            self._to_peer(key, Role.RECEIVER, PeerSettled())
        elif isinstance(command, ReleaseHandles):
            pass  # nothing is ever in flight for longer than one loop iteration
        else:  # pragma: no cover - a new command type must be wired here
            raise TypeError(f"unknown command {command!r}")

    def _report(self, key: RoomKey, command: ReportOutcome) -> None:
        inbox = self._inbox
        assert inbox is not None
        role = inbox.role_of(key)
        if role is None:
            return
        if role is Role.SENDER:
            event: Event = (
                TransferConfirmed()
                if command.status is KVPoll.Success
                else PeerFailed(command.reason)
            )
            self._to_peer(key, Role.RECEIVER, event)
        else:
            self._to_peer(key, Role.SENDER, AbortRequested(command.reason, origin="peer"))

    def _to_peer(self, key: RoomKey, role: Role, event: Event) -> None:
        inbox = self._inbox
        assert inbox is not None
        peer = inbox.current(role, key.room)
        if peer is not None:
            inbox.deliver(peer, event)
        elif isinstance(event, DestinationReceived):
            # A receiver with no sender (never created, or failed and already reaped) would
            # wait for its deadline: fail it now. No sender means no write: its pages are safe.
            inbox.deliver(key, PeerFailed(f"no sender room {key.room} in this engine"))
            inbox.deliver(key, PeerSettled())
