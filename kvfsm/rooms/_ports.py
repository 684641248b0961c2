"""The ports of the rooms layer: the types that rooms, their registry and the sinks share.

Nothing here does anything; each type says what one side may ask of another, so that no side
needs the other's class:

* :class:`RoomKey` and :class:`Publication`: a room's identity and what it shows callers.
* :class:`Inbox`: what a sink (the transport, the control channel, a test's script) may ask of
  the engine's rooms: deliver an event, and the few reads that routing by room id needs. The
  registry is the one implementation; a sink never sees it whole (it cannot spawn or reap).
* :class:`CommandSink`: what executes rooms' commands, with its optional hooks as typed no-op
  methods (subclass it to inherit them) rather than attributes probed by name.
* :class:`RoomHost`: what one :class:`~kvfsm.rooms._actor.Room` needs from whoever spawned it.
  The registry implements it; the room module imports only this one, so the actor and the
  registry do not import each other.
* :class:`Observer`: what is told about rooms for metrics.

Loop thread only, except :class:`Publication` (read from any thread) and :class:`RoomKey`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from kvfsm.rooms._config import RoomConfig
from kvfsm.rooms._deadlines import DeadlineQueue
from kvfsm.rooms._scheduler import RoomScheduler
from kvfsm.rooms._stats import RoomStats
from kvfsm.states import Command, Event, KVPoll, Role

__all__ = [
    "Claims",
    "CommandSink",
    "Inbox",
    "Observer",
    "Publication",
    "RoomHost",
    "RoomKey",
]


class RoomKey(NamedTuple):
    """A room's identity: SGLang's ``bootstrap_room`` plus the engine-wide generation that
    tells a reused room id from its predecessor (law 5)."""

    room: int
    generation: int


class Publication:
    """What a room shows the outside world. Written only on the loop thread (by the room's task,
    or by the registry for a room it refused); read from any thread without a lock.

    Each field is a single reference store, atomic under the GIL. ``reason`` is written before
    ``status`` so a reader that sees Failed also sees why, and ``prefix`` before a sender's
    WaitingForInput so a reader that sees that status also sees the receiver's prefix.
    Terminal statuses are never overwritten, so a reader that once saw one may cache it.
    """

    __slots__ = ("legs", "part", "prefix", "reason", "settled", "status")

    def __init__(self) -> None:
        self.status: KVPoll = KVPoll.Bootstrapping
        self.reason: str = ""
        #: Sender: prompt tokens the receiver already holds (``RoomCore.prefix``), set once its
        #: destination arrived; 0 before, and for receivers.
        self.prefix: int = 0
        #: True once the room is terminal and no transfer can still touch its pages.
        self.settled: bool = False
        #: Sender: which part of the decode request it carries (``Part``), published with
        #: ``prefix``.
        self.part: int = 0
        #: Sender: how many decode ranks its request goes to (one sender room each), likewise.
        self.legs: int = 1


class Inbox(Protocol):
    """Where sinks deliver events, and what they may read about rooms (loop thread only).

    ``deliver`` is all a data path needs. A control channel routes frames that name a room id
    (not a generation) and hooks that name a key, so it also reads which room is current for an
    id, which leg a room was spawned as, its role, and whether it has ended.
    """

    def deliver(self, key: RoomKey, event: Event) -> bool:
        """Route ``event`` to room ``key``; False (dropped, counted) for an unknown or old
        key."""
        ...

    def run_woken(self) -> None:
        """Run the rooms woken by the deliveries so far, now rather than on the loop's next
        iteration: call it at the end of a callback that delivered a batch. Optional for
        correctness (woken rooms run soon anyway), never harmful."""
        ...

    def rooms_ran_soon(self) -> None:
        """Ask for the sink's ``rooms_ran`` right after the room step that is running, not
        only at the end of its batch: a sink that holds commands back has a full batch of
        work to hand over already. Optional for correctness, never harmful."""
        ...

    def current(self, role: Role, room_id: int) -> RoomKey | None:
        """The newest key for ``room_id`` in ``role`` that still has a task, if any."""
        ...

    def leg_of(self, key: RoomKey) -> int:
        """The leg a live room was spawned as (0 for most, and for unknown keys)."""
        ...

    def role_of(self, key: RoomKey) -> Role | None:
        """The role of room ``key`` while it has a task; None once it has none."""
        ...

    def ended(self, key: RoomKey) -> bool:
        """True once room ``key`` is terminal or has no task (nothing is left to tell it)."""
        ...


class CommandSink(Protocol):
    """Executes rooms' commands: the transport and the control channel, behind one router.

    ``attach`` is called once on the loop thread before any room exists; ``submit`` is called on
    the loop thread and must not block (queue the work, answer later with events).

    The hooks below are called for every sink, always; these bodies do nothing. A sink that
    subclasses this class inherits them and overrides the ones it needs (a sink that does not
    subclass it must define all of them: mypy holds it to that where it is handed to an engine).
    """

    def attach(self, inbox: Inbox) -> None: ...

    def submit(self, key: RoomKey, command: Command) -> None: ...

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        """Right after room ``key``'s task is created: a control channel may hold a message
        that arrived before the room existed."""
        del key, role

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        """As room ``key``'s task ends: drop every per-room entry kept for it."""
        del key, role

    def rooms_ran(self) -> None:
        """After each batch of room steps (a scheduler's calls, a transport's completions): a
        sink that held the batch's commands back, to execute them together, does it now."""
        return

    async def aclose(self) -> None:
        """At engine shutdown, after the rooms, on the loop: stop background tasks."""
        return


class Observer(Protocol):
    """Told about every room event worth a metric (loop thread; must be cheap, never raise)."""

    def spawned(self, role: Role) -> None: ...

    def transition(
        self, role: Role, before: KVPoll, after: KVPoll, reason: str, seconds: float
    ) -> None:
        """The room went from ``before`` to ``after``, after ``seconds`` in ``before``."""
        ...

    def reaped(self, role: Role, state: KVPoll) -> None: ...


class Claims(Protocol):
    """One owner per destination (:class:`~kvfsm.rooms._owners.DestinationOwners`): what a
    receiver room asks when its metadata is applied."""

    def claim(
        self,
        owner: RoomKey,
        pages: bytes,
        aux_index: int,
        state: bytes = b"",
        group: int | None = None,
    ) -> str | None: ...


class RoomHost(Protocol):
    """What a room needs from whoever spawned it (the registry), and nothing more.

    A room takes its loop, the scheduler that runs its task, the deadline queue, its sink, the
    engine's counters, settings, destination owners and observer, and its role's deadline table
    once; it reports its errors, asks who its peer is when it logs its failure, and asks to be
    reaped as its task ends.
    """

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def tasks(self) -> RoomScheduler: ...

    @property
    def deadlines(self) -> DeadlineQueue: ...

    @property
    def sink(self) -> CommandSink: ...

    @property
    def stats(self) -> RoomStats: ...

    @property
    def config(self) -> RoomConfig: ...

    @property
    def owners(self) -> Claims: ...

    @property
    def observer(self) -> Observer | None: ...

    def deadline_seconds(
        self, role: Role, overrides: Mapping[KVPoll, float] | None
    ) -> Mapping[KVPoll, float]: ...

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page (0: unknown), for the bytes a timeline shows."""
        ...

    def name_peer(self, room: Any) -> dict[str, Any] | None:
        """Who ``room``'s peer is (engine, rank, incarnation, agent), as far as the engine
        knows; read only when a timeline is shown or logged."""
        ...

    def record_error(self, key: RoomKey, exc: BaseException) -> None: ...

    def reap(self, key: RoomKey) -> None: ...
