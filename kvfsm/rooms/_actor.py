"""The room actor: one task per room, a bounded mailbox, deadlines, a published status.

The task (``Room.run``, a coroutine resumed by the engine's :class:`RoomScheduler`, see
:mod:`kvfsm.rooms._scheduler` for why not an ``asyncio.Task``) is the room's only writer
(law 2). It takes events from its mailbox, hands each to the
sans-IO :class:`RoomCore`, publishes the status when it changes, re-arms the deadline of the new
state, and then hands the core's commands to the sink (decide, then do IO). After the room is
terminal the task keeps draining settlement events until its pages are settled, then exits and
the registry reaps it.

Nothing kills a room task silently (law 3):

* A command the sink cannot execute (``submit`` raises: a frame too large to encode, a bug)
  fails that room with "could not execute <Command>: <error>", the error is recorded
  (``Registry.errors``), and the commands of that failure are executed too. Their own errors
  are recorded but fail nothing more: the room is terminal by then, so ``core.fail`` returns
  no commands and the recursion stops one level down. A command whose ``submit`` raised may
  still have taken effect (a chunk posted, a frame queued), so the ledger keeps counting it:
  its room settles when the peer or the transport says so, or its settle timeout gives up.
* Any other exception in the task (a bug in the loop, a raising observer) fails the room,
  publishes Failed and reaps it. Its task is gone, so nothing will drain its settlement
  events: unless it was already settled it stays *unsettled* (``settled`` False, logged,
  counted in ``task_errors``), and a receiver's destinations stay held
  (:mod:`kvfsm.rooms._owners`). Claiming settle for pages a transfer may still touch would
  break law 4; a leak the operator can see is the lesser harm.

Everything here runs on the engine's loop thread. Other threads never touch a ``Room``; they
read its :class:`Publication` and post events through the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine, Mapping
from typing import Any, Final

from kvfsm.rooms._core import Claim, RoomCore
from kvfsm.rooms._deadlines import FIRE_SLACK_S, Entry
from kvfsm.rooms._ports import CommandSink, Inbox, Publication, RoomHost, RoomKey
from kvfsm.rooms._scheduler import SUSPEND
from kvfsm.rooms._timeline import (
    _CHUNK_BITS,
    _DESTINATION,
    _LEASE,
    _POST,
    PAGED,
    SLOTS,
    STATE_MARKS,
    compact,
    failure_line,
)
from kvfsm.states import (
    SETTLEMENT_EVENTS,
    TERMINAL,
    AbortRequested,
    Command,
    DeadlineExpired,
    Event,
    EventRejected,
    KVPoll,
    MetadataSubmitted,
    Role,
    deadline_of,
)

# The ports are defined in kvfsm.rooms._ports and re-exported from here, their first home.
__all__ = ["CommandSink", "Inbox", "Publication", "Room", "RoomKey"]

# Python 3.11's EnumType defines ``__getattr__``, which sends every attribute read on an enum
# class (``KVPoll.Failed``) through a slow slot hook: several times a module global's cost. What
# runs per room step reads these globals instead.
_FAILED: Final = KVPoll.Failed
_SUCCESS: Final = KVPoll.Success
_WAITING: Final = KVPoll.WaitingForInput
_RECEIVER: Final = Role.RECEIVER
_SENDER: Final = Role.SENDER

_log = logging.getLogger("kvfsm.rooms")
_monotonic = time.monotonic
# CPython 3.11 compiles ``NAME.method(...)`` as an attribute load then a call, not as a method
# call, when NAME was imported (its compiler's ``is_import_originated``): each call would build
# and free a bound method. The recorder looks up a code per event and per command, so it holds
# the bound ``get`` itself.
_paged_code: Final = PAGED.get
#: One JSON line per failed room, with its timeline (``kvfsm explain`` reads them back).
_failures = logging.getLogger("kvfsm.rooms.failed")


class Room:
    """One room's task and mailbox. Created and driven by its :class:`RoomHost` (the registry),
    whose members it uses are all that protocol names."""

    __slots__ = (
        "key",
        "role",
        "core",
        "publication",
        "task",
        "_host",
        "_sink",
        "_deadlines",
        "_seconds",
        "_shortest",
        "_mailbox",
        "_bound",
        "_tasks",
        "coro",
        "suspended",
        "done",
        "_deadlines_queue",
        "_timer",
        "_due",
        "born",
        "_overflowed",
        "_settle_expired",
        "_loop",
        "ending",
        "timeline",
        "_since",
    )

    def __init__(
        self,
        key: RoomKey,
        role: Role,
        publication: Publication,
        host: RoomHost,
        *,
        deadlines: Mapping[KVPoll, float] | None,
        mailbox_size: int,
        strict: bool,
        group: int | None = None,
    ) -> None:
        self.key = key
        self.role = role
        claim: Claim | None = None
        if role is _RECEIVER:
            owners = host.owners

            def claim(event: MetadataSubmitted) -> str | None:
                return owners.claim(key, event.pages, event.aux_index, event.state, group)

        self.core = RoomCore(role, host.stats, strict=strict, claim=claim)
        self.publication = publication
        self._host = host
        self._sink = host.sink
        self._deadlines = deadlines
        #: Each non-terminal state's deadline in seconds (the host's table for this role).
        self._seconds = host.deadline_seconds(role, deadlines)
        self._shortest = min(self._seconds.values())
        self._mailbox: deque[Event] = deque()
        #: An abort (or a rejection) is queued: the room is as good as Failed, and a new room
        #: may reuse its id at once (the caller's abort() already reads Failed).
        self.ending = False
        self._bound = mailbox_size
        self._tasks = host.tasks
        #: The task: set by the scheduler's ``start``, None once it finished (RoomScheduler).
        self.coro: Coroutine[Any, Any, None] | None = None
        self.suspended = False
        #: True once the task ended (the room is reaped).
        self.done = False
        self._deadlines_queue = host.deadlines
        self._timer: Entry | None = None
        self._due = 0.0

        self._overflowed = False
        self._settle_expired = False
        self._loop = host.loop
        self.born = self._loop.time()
        #: When the room entered its state (``time.monotonic()``: the loop's clock may tick in
        #: milliseconds), for the time in each state its observer is told (moved only then).
        self._since = now = _monotonic()
        #: The flight recorder (kvfsm.rooms._timeline); None when the engine runs without it.
        #: ``new_timeline()`` inlined, its time the one above: a call and a clock read less.
        self.timeline: list[object] | None = [now] if host.config.flight_recorder else None

    def __repr__(self) -> str:
        return f"<Room {self.role.value} {self.key.room} gen {self.key.generation}>"

    # -- the mailbox (loop thread) -------------------------------------------------------------

    def deliver(self, event: Event) -> None:
        """Queue ``event``. Never blocks, never raises. A full mailbox fails the room instead
        of growing, except for settlement events, which are always kept (law 4)."""
        mailbox, kind = self._mailbox, type(event)
        if len(mailbox) >= self._bound and kind not in SETTLEMENT_EVENTS:
            if not self._overflowed:
                self._overflowed = True
                self._host.stats.mailbox_overflows += 1
        else:
            mailbox.append(event)
            if kind is AbortRequested or kind is EventRejected:
                self.ending = True
        if self.suspended:  # a queued or running room drains its mailbox before suspending
            self._tasks.wake(self)

    # -- the task ------------------------------------------------------------------------------

    async def run(self) -> None:
        core = self.core
        try:
            self._arm_deadline(core.state)
            while True:
                mailbox = self._mailbox
                while mailbox:
                    self._apply(mailbox.popleft())
                if self._overflowed and not core.terminal:
                    self._fail(f"mailbox overflow (> {self._bound})")
                if core.state in TERMINAL and core.settled:
                    break
                if core.terminal and self._settle_expired:
                    self._host.stats.settle_timeouts += 1
                    _log.error(
                        "room %s gen %s: %s room not settled after %.1fs; in flight: %s",
                        self.key.room,
                        self.key.generation,
                        self.role.value,
                        self._host.config.settle_timeout_s,
                        sorted(core.in_flight),
                    )
                    break
                if not self._mailbox:  # an event its own commands delivered: go on
                    await SUSPEND
        except asyncio.CancelledError:
            # Engine shutdown. Cleanup below is synchronous, so it cannot be cancelled halfway.
            try:
                self._fail("engine shut down")
            except Exception as exc:  # a raising observer must not swallow the cancellation
                self._host.record_error(self.key, exc)
            raise
        except Exception as exc:  # a bug: this room ends, nothing else does
            self._died(exc)
        finally:
            if self._timer is not None:
                self._deadlines_queue.cancel(self._timer)
                self._timer = None
            self.done = True
            self._host.reap(self.key)

    def _died(self, exc: Exception) -> None:
        """The task raised: fail the room, publish Failed, leave settle as it was (see the
        module docstring). Never raises."""
        host = self._host
        host.stats.task_errors += 1
        host.record_error(self.key, exc)
        core, pub = self.core, self.publication
        reason = f"internal error: {type(exc).__name__}: {exc}"
        try:
            self._fail(reason)
        except Exception as again:
            host.record_error(self.key, again)
        if pub.status not in TERMINAL:  # publishing itself is what failed
            pub.reason = core.reason or reason
            pub.status = _FAILED
        if not pub.settled:
            _log.error(
                "room %s gen %s: %s room task died in %s; its pages are left unsettled",
                self.key.room,
                self.key.generation,
                self.role.value,
                core.state.name,
            )

    def _apply(self, event: Event) -> None:
        core = self.core
        before = core.state
        timeline = self.timeline
        if timeline is not None:  # the step's time, then the event (encoded if it has pages)
            if len(timeline) >= SLOTS:
                compact(timeline)
            # The scheduler's clock, read once per few steps (RoomScheduler.now); two appends:
            # cheaper than extending by a tuple.
            timeline.append(self._tasks.now)
            code = _paged_code(type(event))
            if code is None:
                timeline.append(event)
            else:  # ENCODERS' encoding, inline: no Python call per event
                fence = event.fence if code == _DESTINATION else 0  # type: ignore[attr-defined]
                pages: bytes = event.pages  # type: ignore[attr-defined]
                timeline.append(_LEASE | fence << 6 if fence else code | len(pages) >> 2 << 6)
        try:
            commands = core.handle(event)
        except Exception as exc:  # a strict core's IllegalEventError, or a bug: fail this room only
            self._host.record_error(self.key, exc)
            # (an exception's message may be empty: its type names it then)
            cause = str(exc) or type(exc).__name__
            commands = core.fail(f"internal error on {type(event).__name__}: {cause}")
        # _execute has nothing to do for an event that neither changed the state nor commanded
        # anything, unless the room is terminal: it may just have settled (published there).
        if commands or core.state is not before or before in TERMINAL:
            self._execute(before, commands)

    def _execute(self, before: KVPoll, commands: tuple[Command, ...]) -> None:
        core = self.core
        state = core.state
        if state is not before:
            self._entered(before, state)
        if state in TERMINAL and not self.publication.settled and core.settled:
            self.publication.settled = True
        sink = self._sink
        key = self.key
        timeline = self.timeline
        for command in commands:
            if timeline is not None:
                code = _paged_code(type(command))
                if code is None:
                    timeline.append(command)
                elif code == _POST:  # ENCODERS' encoding, inline
                    chunk: int = command.chunk  # type: ignore[attr-defined]
                    src: bytes = command.src  # type: ignore[attr-defined]
                    timeline.append(_POST | (chunk & 0xFFFFF | len(src) >> 2 << _CHUNK_BITS) << 6)
                else:
                    pages: bytes = command.pages  # type: ignore[attr-defined]
                    timeline.append(code | len(pages) >> 2 << 6)
            try:
                sink.submit(key, command)
            except Exception as exc:
                self._not_executed(command, exc)
        # After the failure's own commands (its abort report, its release), so the line tells
        # what the room did about it.
        if state is _FAILED and before is not _FAILED and timeline is not None:
            self._log_failure(timeline)

    def _log_failure(self, timeline: list[object]) -> None:
        """One structured line (JSON) for a failed room. Formatting happens only here, once per
        failed room, and only if someone listens."""
        # The caller's own abort is routine (a client went away): INFO. Anything else is
        # something an operator may be asked about: WARNING.
        reason = self.core.reason
        level = logging.INFO if reason.startswith("aborted (local)") else logging.WARNING
        if not _failures.isEnabledFor(level):
            return
        host = self._host
        try:
            line = failure_line(
                self.key.room,
                self.key.generation,
                self.role,
                reason=reason,
                duration_s=self._loop.time() - self.born,
                timeline=timeline,
                peer=host.name_peer(self),
                page_bytes=host.page_bytes,
            )
        except Exception as exc:  # a log line must not cost the room its settle
            host.record_error(self.key, exc)
            return
        _failures.log(level, "%s", line)

    def _not_executed(self, command: Command, exc: Exception) -> None:
        """``submit`` raised: fail this room and execute what that failure commands (see the
        module docstring for why this cannot recurse further than once)."""
        self._host.record_error(self.key, exc)
        cause = str(exc) or type(exc).__name__  # never an empty cause
        self._fail(f"could not execute {type(command).__name__}: {cause}")

    def _fail(self, reason: str) -> None:
        """Fail the room without an event, and execute what that commands."""
        core = self.core
        before = core.state
        commands = core.fail(reason)
        timeline = self.timeline
        if timeline is not None and core.state is not before:  # no event: the time alone
            timeline.append(self._tasks.now)
        self._execute(before, commands)

    def _entered(self, before: KVPoll, state: KVPoll) -> None:
        pub = self.publication
        if state is _FAILED:
            pub.reason = self.core.reason
        elif state is _WAITING and self.role is _SENDER:
            core = self.core
            pub.prefix, pub.part, pub.legs = core.prefix, core.part, core.legs
        pub.status = state
        self._arm_deadline(state)
        timeline = self.timeline
        if timeline is not None:
            timeline.append(STATE_MARKS[state])
        host = self._host
        stats = host.stats
        if state is _SUCCESS:
            stats.succeeded += 1
        elif state is _FAILED:
            stats.failed += 1
        observer = host.observer
        if observer is not None:
            now = _monotonic()
            spent, self._since = now - self._since, now
            try:
                observer.transition(self.role, before, state, self.core.reason, spent)
            except Exception as exc:  # a metric must not cost the room its commands
                host.record_error(self.key, exc)
        # Structured: every record carries the room's identity and the edge as attributes
        # (``extra``), for a JSON log formatter; the message reads well on its own too.
        if state is _FAILED:
            _log.info(
                "room %s gen %s: %s %s -> Failed: %s",
                self.key.room,
                self.key.generation,
                self.role.value,
                before.name,
                self.core.reason,
                extra=self._log_fields(before, state),
            )
        elif _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "room %s gen %s: %s %s -> %s",
                self.key.room,
                self.key.generation,
                self.role.value,
                before.name,
                state.name,
                extra=self._log_fields(before, state),
            )

    def _log_fields(self, before: KVPoll, state: KVPoll) -> dict[str, object]:
        return {
            "room": self.key.room,
            "generation": self.key.generation,
            "role": self.role.value,
            "from_state": before.name,
            "to_state": state.name,
            "reason": self.core.reason,
        }

    def info(self, now: float) -> dict[str, object]:
        """A row for an operator's view of live rooms (loop thread)."""
        core = self.core
        return {
            "room": self.key.room,
            "generation": self.key.generation,
            "role": self.role.value,
            "state": core.state.name,
            "age_s": round(now - self.born, 3),
            "deadline_in_s": None if core.terminal else round(self._due - now, 3),
            "in_flight": len(core.in_flight),
            "settled": core.settled,
            "reason": core.reason,
        }

    # -- timers --------------------------------------------------------------------------------
    #
    # One deadline per room in the engine's DeadlineQueue (one loop timer for all rooms), re-armed
    # lazily. Deadlines are seconds to minutes while rooms live for milliseconds, so nearly every
    # deadline is cancelled unfired. Entering a state only records when its deadline falls due
    # (``_due``); the armed entry is replaced only if it would fire *later* than that. An entry
    # that fires early re-arms for the remainder. This saves a cancel and a new entry per state
    # change without ever firing late. A new entry is armed no later than the shortest deadline
    # of the role's states from now, so that a later state with a shorter deadline (a sender's
    # Transferring, 120 s after WaitingForInput's 300 s) still finds it early enough.

    def _arm_deadline(self, state: KVPoll) -> None:
        deadlines = self._deadlines_queue
        if state in TERMINAL:
            if self._timer is not None:
                deadlines.cancel(self._timer)
                self._timer = None
            if not self.core.settled:
                self._due = self._loop.time() + self._host.config.settle_timeout_s
                self._timer = deadlines.arm(self._due, self._on_timer)
            return
        now = self._loop.time()
        self._due = due = now + self._seconds[state]
        timer = self._timer
        if timer is not None:
            if timer[0] <= due:
                return
            deadlines.cancel(timer)
        self._timer = deadlines.arm(min(due, now + self._shortest), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        # Armed for an earlier state and not due yet. (The millisecond of slack absorbs timer
        # granularity: loops may fire a timer a little before its time.)
        if self._due - self._loop.time() > FIRE_SLACK_S:
            self._timer = self._deadlines_queue.arm(self._due, self._on_timer)
            return
        state = self.core.state
        if state in TERMINAL:
            self._settle_expired = True
        else:
            seconds = deadline_of(self.role, state, self._deadlines)
            # Bypass the mailbox bound: a deadline must never be lost to a flood.
            self._mailbox.append(DeadlineExpired(state, seconds))
        if self.suspended:
            self._tasks.wake(self)
