"""The registry: spawns, routes and reaps rooms by (room id, generation). Loop thread only.

It is each room's :class:`~kvfsm.rooms._ports.RoomHost` and every sink's
:class:`~kvfsm.rooms._ports.Inbox`; rooms and sinks know it only through those ports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from kvfsm.rooms._actor import Room
from kvfsm.rooms._config import RoomConfig
from kvfsm.rooms._deadlines import DeadlineQueue
from kvfsm.rooms._owners import DestinationOwners
from kvfsm.rooms._ports import CommandSink, Observer, Publication, RoomKey
from kvfsm.rooms._scheduler import RoomScheduler
from kvfsm.rooms._stats import RoomStats
from kvfsm.rooms._timeline import (
    Finished,
    PeerNamer,
    RoomRecord,
    dropped,
    entries,
    pack,
)
from kvfsm.states import (
    NON_TERMINAL,
    TERMINAL,
    AbortRequested,
    Event,
    KVPoll,
    Role,
    deadline_of,
    reason_kind,
)

__all__ = ["DuplicateRoomError", "Observer", "Registry"]

# Python 3.11's EnumType defines ``__getattr__``, which sends every attribute read on an enum
# class (``KVPoll.Failed``) through a slow slot hook: several times a module global's cost. What
# runs per room step reads these globals instead.
_FAILED: Final = KVPoll.Failed
_RECEIVER: Final = Role.RECEIVER

_log = logging.getLogger("kvfsm.rooms")


class DuplicateRoomError(RuntimeError):
    """A live (non-terminal) room with the same id and role already exists."""


class Registry:
    """All rooms of one engine.

    * ``_rooms`` maps every room that still has a task, terminal ones included (they may be
      draining handles), by its full key. Events are routed by full key, so an event for an
      older generation of a room id never reaches the new room (law 5): it is dropped and
      counted.
    * ``_current`` maps (role, room id) to the newest key, to refuse duplicates and to route
      messages that name only a room id (the control channel's).
    * ``owners`` holds each receiver room's destination pages, aux row and state rows from
      the moment its metadata is applied (a second room naming any of them is refused,
      :mod:`kvfsm.rooms._owners`) until it is reaped *settled*. A receiver reaped unsettled
      (settle timeout, or its task died) keeps them: a WRITE may still land there.
    """

    def __init__(
        self,
        sink: CommandSink,
        config: RoomConfig | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.sink = sink
        self.observer = observer
        self.config = config if config is not None else RoomConfig()
        self.stats = RoomStats()
        #: Exceptions raised inside room tasks (bugs, or a strict core's IllegalEventError).
        self.errors: list[tuple[RoomKey, BaseException]] = []
        #: One owner per destination among this engine's receiver rooms (loop thread only).
        self.owners = DestinationOwners()
        self._rooms: dict[RoomKey, Room] = {}
        #: (role, room id) or, for a leg other than 0, (role, room id, leg).
        self._current: dict[tuple[Role, int] | tuple[Role, int, int], RoomKey] = {}
        self._legs: dict[RoomKey, tuple[Role, int, int]] = {}  # legs other than 0
        self._closing = False
        #: The loop this registry lives on (rooms take it from here).
        self.loop = asyncio.get_running_loop()
        #: Runs every room's task (kvfsm.rooms._scheduler: a run queue, not a Task per room).
        self.tasks = RoomScheduler(self.loop)
        #: Every room's deadline, behind one loop timer (kvfsm.rooms._deadlines).
        self.deadlines = DeadlineQueue(self.loop)
        self._seconds: dict[
            tuple[Role, int], tuple[Mapping[KVPoll, float] | None, Mapping[KVPoll, float]]
        ] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        #: The last finished rooms, with their timelines (kvfsm.rooms._timeline).
        self.finished = Finished()
        #: KV bytes of one page, for the bytes timelines show (the manager sets it; 0: unknown).
        self.page_bytes = 0
        #: Names a room's peer when a timeline is read (the manager sets it from its control
        #: plane); None: a timeline shows what the room itself knows (agent, rank, fence).
        self.peer_namer: PeerNamer | None = None
        self._on_spawn: Callable[[RoomKey, Role], None] = sink.room_spawned
        self._on_reap: Callable[[RoomKey, Role], None] = sink.room_reaped
        # The sink may hold a batch's commands back to execute them together (NixlTransport
        # merges small chunks): it hears when each batch of room steps is over.
        self.tasks.after_batch = sink.rooms_ran
        sink.attach(self)

    def deadline_seconds(
        self, role: Role, overrides: Mapping[KVPoll, float] | None
    ) -> Mapping[KVPoll, float]:
        """Each non-terminal state's deadline for ``role`` rooms, computed once per role and
        overrides (a room re-arms its deadline on every state change)."""
        cache_key = (role, id(overrides))
        cached = self._seconds.get(cache_key)
        if cached is None or cached[0] is not overrides:
            table = {state: deadline_of(role, state, overrides) for state in NON_TERMINAL}
            cached = self._seconds[cache_key] = (overrides, table)
        return cached[1]

    # -- spawning ------------------------------------------------------------------------------

    def spawn(
        self,
        key: RoomKey,
        role: Role,
        publication: Publication | None = None,
        *,
        leg: int = 0,
        group: int | None = None,
    ) -> Room:
        """Start a room task. Raises :class:`DuplicateRoomError` if a non-terminal room with the
        same id, role and leg is alive, and ``RuntimeError`` once the registry is closing.

        ``leg`` and ``group``: a decode request fed by several prefill ranks (unequal TP) is
        one receiver room per prefill rank, its *legs*, numbered by that rank; they share the
        request's pages (``DestinationOwners.claim``'s ``group``)."""
        if self._closing:
            raise RuntimeError("engine is shutting down; no new rooms")
        ident = (role, key.room) if not leg else (role, key.room, leg)
        current = self._current.get(ident)
        if current is not None:
            live = self._rooms.get(current)
            # A room with an abort queued is ending: its id may be reused now, as SGLang does
            # right after abort() (the two generations never meet: law 5).
            if live is not None and live.core.state not in TERMINAL and not live.ending:
                self.stats.duplicates_refused += 1
                raise DuplicateRoomError(
                    f"{role.value} room {key.room} is already live "
                    f"(generation {current.generation}, {live.core.state.name})"
                )
        if key in self._rooms:
            raise DuplicateRoomError(f"room key {key} is already registered")
        room = Room(
            key,
            role,
            publication if publication is not None else Publication(),
            self,
            deadlines=self.config.deadlines.get(role),
            mailbox_size=self.config.mailbox_size,
            strict=self.config.strict,
            group=group,
        )
        self._rooms[key] = room
        self._current[ident] = key
        if leg:
            self._legs[key] = (role, key.room, leg)
        self._idle.clear()
        self.stats.spawned += 1
        if self.observer is not None:
            try:
                self.observer.spawned(role)
            except Exception as exc:  # a metric must not leave a room without its task
                self.record_error(key, exc)
        self.tasks.start(room)
        # The control plane may hold a message that arrived before this room existed.
        try:
            self._on_spawn(key, role)
        except Exception as exc:  # the room is running: a bug in a hook must not hide it
            self.record_error(key, exc)
        return room

    def spawn_or_refuse(
        self,
        key: RoomKey,
        role: Role,
        publication: Publication,
        leg: int = 0,
        group: int | None = None,
    ) -> None:
        """Spawn for a caller on another thread: a refusal is published as Failed on the
        caller's publication instead of raised (the caller has already returned)."""
        try:
            self.spawn(key, role, publication, leg=leg, group=group)
        except (DuplicateRoomError, RuntimeError) as exc:
            publication.reason = f"refused: {exc}"
            publication.status = _FAILED
            publication.settled = True  # the refused room never exposed a page
            _log.warning("room %s gen %s refused: %s", key.room, key.generation, exc)

    # -- routing -------------------------------------------------------------------------------

    def deliver(self, key: RoomKey, event: Event) -> bool:
        """Route ``event`` to the room ``key``. Unknown or old keys: dropped, counted, False."""
        room = self._rooms.get(key)
        if room is None:
            self.stats.stale_events += 1
            return False
        room.deliver(event)
        return True

    def run_woken(self) -> None:
        """Run the rooms that deliveries so far woke, now (``RoomScheduler.run_woken``): a
        sink calls it at the end of a callback that delivered a batch of events."""
        self.tasks.run_woken()

    def rooms_ran_soon(self) -> None:
        """The sink's ``rooms_ran`` after the running step (``RoomScheduler.rooms_ran_soon``)."""
        self.tasks.rooms_ran_soon()

    def current(self, role: Role, room_id: int) -> RoomKey | None:
        """The newest key for ``room_id`` in ``role`` that still has a task, if any."""
        key = self._current.get((role, room_id))
        return key if key is not None and key in self._rooms else None

    def leg_of(self, key: RoomKey) -> int:
        """The leg a live room was spawned as (0 for most)."""
        ident = self._legs.get(key)
        return 0 if ident is None else ident[2]

    def role_of(self, key: RoomKey) -> Role | None:
        """The role of room ``key`` while it has a task; None once it has none."""
        room = self._rooms.get(key)
        return None if room is None else room.role

    def ended(self, key: RoomKey) -> bool:
        """True once room ``key`` is terminal or has no task (nothing is left to tell it)."""
        room = self._rooms.get(key)
        return room is None or room.core.terminal

    def get(self, key: RoomKey) -> Room | None:
        return self._rooms.get(key)

    def rooms(self) -> list[Room]:
        return list(self._rooms.values())

    def snapshot(self) -> list[dict[str, object]]:
        """Every room that still has a task, as rows for an operator (loop thread)."""
        now = asyncio.get_running_loop().time()
        return [room.info(now) for room in self._rooms.values()]

    def __len__(self) -> int:
        return len(self._rooms)

    # -- rooms' stories (operators; loop thread) -------------------------------------------------

    def name_peer(self, room: Room) -> dict[str, Any] | None:
        """Who ``room``'s peer is: what the peer namer knows, else what the room knows."""
        core = room.core
        return self._name(room.role, core.peer_agent, core.peer_rank, core.fence)

    def _name(self, role: Role, agent: str, rank: int, fence: int) -> dict[str, Any] | None:
        if not agent and rank < 0:
            return None
        namer = self.peer_namer
        if namer is not None:
            try:
                named = namer(role, agent, rank, fence)
            except Exception:  # an operator's view must not fail on a vanished link
                _log.exception("naming the peer of a %s room failed", role.value)
                named = None
            if named is not None:
                return named
        peer: dict[str, Any] = {}
        if agent:
            peer["agent"] = agent
        if rank >= 0:
            peer["rank"] = rank
        if fence:
            peer["fence"] = fence
        return peer

    def story(self, room_id: int) -> list[dict[str, Any]]:
        """Every room with id ``room_id`` the engine knows, live ones first then finished ones,
        newest first: state, reason, age, peer and timeline."""
        now = self.loop.time()
        out: list[dict[str, Any]] = []
        live = [r for r in self._rooms.values() if r.key.room == room_id]
        for room in sorted(live, key=lambda r: r.key.generation, reverse=True):
            row: dict[str, Any] = dict(room.info(now))
            row["live"] = True
            peer = self.name_peer(room)
            row["peer"] = peer
            timeline = room.timeline
            if timeline is not None:
                row["dropped"] = dropped(timeline)
                row["timeline"] = entries(timeline, room.role, peer, self.page_bytes)
            out.append(row)
        out.extend(self._record_row(r, with_timeline=True) for r in self.finished.find(room_id))
        return out

    def failures(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The last ``limit`` failed rooms the engine remembers, newest first (no timelines)."""
        records = list(self.finished.failed)[-limit:]
        records.reverse()
        return [self._record_row(r, with_timeline=False) for r in records]

    def _record_row(self, record: RoomRecord, *, with_timeline: bool) -> dict[str, Any]:
        peer = self._name(record.role, record.agent, record.rank, record.fence)
        row: dict[str, Any] = {
            "room": record.room,
            "generation": record.generation,
            "role": record.role.value,
            "state": record.state.name,
            "live": False,
            "created": round(record.created, 3),
            "duration_s": round(record.duration_s, 6),
            "settled": record.settled,
            "reason": record.reason,
            "reason_kind": reason_kind(record.reason) if record.reason else "",
            "peer": peer,
        }
        if with_timeline:
            row["dropped"] = dropped(record.timeline)
            row["timeline"] = entries(record.timeline, record.role, peer, self.page_bytes)
        return row

    def _remember(self, room: Room) -> None:
        timeline = room.timeline
        if timeline is None:
            return
        core = room.core
        room_id, generation = room.key  # (a NamedTuple's field by name is a descriptor call)
        state = core.state
        # freeze(timeline), inline (a Python call per room on the hot path): one object for the
        # ring to drop later (kvfsm.rooms._timeline).
        frozen: list[object] | bytes
        try:
            frozen = pack(timeline)
        except (TypeError, OverflowError):  # not an event or command (a test's object): keep it
            frozen = timeline
        record = RoomRecord(
            room_id,
            generation,
            room.role,
            state,
            core.reason,
            room.publication.settled,
            frozen,
            self.tasks.now,  # the room's last step's time: it is reaped as that step ends
            core.peer_agent,  # (a receiver's is "", a sender's rank -1: no branch on the role)
            core.peer_rank,
            core.fence,
        )
        # Finished.add, inlined (a Python call per room on the hot path): failures apart.
        finished = self.finished
        (finished.failed if state is _FAILED else finished.recent).append(record)

    # -- reaping and errors --------------------------------------------------------------------

    def reap(self, key: RoomKey) -> None:
        """Called by a room's task as it ends."""
        room = self._rooms.pop(key, None)
        if room is None:
            return
        ident = self._legs.pop(room.key, None) or (room.role, room.key.room)
        if self._current.get(ident) == room.key:
            del self._current[ident]
        self.stats.reaped += 1
        self._remember(room)
        if room.role is _RECEIVER and room.key in self.owners:
            self._release_destinations(room)
        # The control plane drops every per-room entry it keeps for this room.
        try:
            self._on_reap(room.key, room.role)
        except Exception as exc:  # a bug in a hook must not stop reaping
            self.record_error(room.key, exc)
        if self.observer is not None:
            try:
                self.observer.reaped(room.role, room.core.state)
            except Exception as exc:
                self.record_error(room.key, exc)
        if not self._rooms:
            self._idle.set()

    def _release_destinations(self, room: Room) -> None:
        # The caller's view decides: pages it was told are settled are free again here too.
        if room.publication.settled:
            self.owners.release(room.key)
            return
        # Unsettled: a WRITE may still land in them, and the caller was told not to reuse them
        # (SGLang's adapter never frees them). Keep them held, so that a caller who reuses them
        # anyway is refused loudly, naming this room, instead of mixing two rooms' bytes. The
        # cost is a leak of these pages for the engine's life, counted and logged once here.
        self.stats.destinations_quarantined += 1
        if not self._closing:  # at shutdown the whole table goes away with the engine
            _log.error(
                "room %s gen %s: receiver reaped unsettled; its destinations stay held for "
                "the life of this engine (%d pages held in all)",
                room.key.room,
                room.key.generation,
                self.owners.held_pages,
            )

    def record_error(self, key: RoomKey, exc: BaseException) -> None:
        self.errors.append((key, exc))
        _log.error("room %s gen %s: internal error", key.room, key.generation, exc_info=exc)

    # -- shutdown ------------------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Wait until no room has a task (all reaped)."""
        await self._idle.wait()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Refuse new rooms, abort live ones, give them ``grace_s`` to settle, cancel the rest."""
        self._closing = True
        grace = self.config.shutdown_timeout_s if grace_s is None else grace_s
        for key in list(self._rooms):
            self.deliver(key, AbortRequested("engine shutting down"))
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            rooms = list(self._rooms.values())
            _log.warning("shutdown: cancelling %d rooms that did not settle", len(rooms))
            for room in rooms:  # each fails ("engine shut down") and is reaped, here and now
                self.tasks.cancel(room)
        self.deadlines.close()  # every room is reaped: nothing may fire after shutdown
