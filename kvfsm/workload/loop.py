"""The scheduler loop of every workload rank, and the phases a room goes through in it.

``kvfsm run`` (prefill rooms in this process, a passive decode process), ``kvfsm demo`` (a
prefill and a decode rank, each in its own process) and the chaos ranks
(:mod:`kvfsm.chaos._rank`) drive their rooms the way SGLang's scheduler does: every iteration
admits new rooms up to a window, polls every live room once and never blocks on one. What
differs is only what a role does with a room, so :class:`RoomLoop` holds the loop and the life
of a room (admission, the wedge timeout, the settle grace, prefill's ``init`` and chunks in
:meth:`RoomLoop.advance_sender`) and its hooks hold the rest; decode's steps, from its page list
to giving its pages back, are the table of :mod:`kvfsm.workload.receiver_steps`, driven from
these hooks. :class:`ServedLoop` is the loop of a rank process driven over a pipe (the demo's
and the chaos campaign's).

Two hooks are for the chaos ranks, which are timed and stopped on purpose: :meth:`RoomLoop.call`,
through which the loop makes every call on a room (they time each one: never block), and
``stop_gap_s``: a gap that long between two iterations is time this process spent stopped,
when no timer of its own could fire either, so it is added to the wedge and settle bounds of
the rooms that were live then. Off for ``kvfsm run`` and the demo, whose ranks nobody stops."""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.states import TERMINAL, KVPoll

__all__ = ["LiveRoom", "Phase", "RoomLoop", "ServedLoop"]


class Phase(enum.IntEnum):
    """Where a live room is in its rank's loop."""

    #: Waiting for WaitingForInput (prefill: to ``init``; decode: to send its page list).
    BOOTSTRAP = 0
    #: Prefill: one chunk per iteration. Decode: its page list went out.
    SENDING = 1
    #: Prefill: every chunk handed over, waiting for a terminal status.
    FINISHING = 2
    #: Terminal, its outcome recorded and the room cleared: waiting for it to settle.
    SETTLING = 3
    #: Settled, or written off as unsettled: out of the loop.
    DONE = 4


@dataclass(slots=True)
class LiveRoom:
    """A room in the loop and what the loop records about it. Times are the loop's
    :meth:`RoomLoop.clock`."""

    room: SenderRoom | ReceiverRoom
    #: When it was created.
    started: float
    phase: Phase = Phase.BOOTSTRAP
    #: Prefill: chunks sent. Decode: iterations since its page list went out.
    step: int = 0
    #: Its terminal status (``int(KVPoll)``) and reason, once it has one.
    status: int = 0
    reason: str = ""
    #: When it was first seen past Bootstrapping (decode claimed it on the link); 0: not yet.
    bound_at: float = 0.0
    #: When it was seen terminal (or wedged).
    ended: float = 0.0
    #: Not terminal within the room timeout: aborted by the loop.
    wedged: bool = False
    #: The loop's ``stopped_s`` when the room joined it, and how long this process was stopped
    #: while the room was live (set when it ends).
    stopped_at_start: float = 0.0
    stopped_s: float = 0.0


PlanT = TypeVar("PlanT")
LiveT = TypeVar("LiveT", bound=LiveRoom)
T = TypeVar("T")


class RoomLoop(Generic[PlanT, LiveT]):
    """Runs a plan of rooms, ``window`` at a time: poll all, never block on one.

    A room is admitted by :meth:`start` (``None``: not now, no free pages), moved on by
    :meth:`advance` until it is terminal, handed to :meth:`ended` (which records and clears it),
    and once settled (or past ``settle_grace_s``) to :meth:`retire`. A room not terminal within
    ``room_timeout_s`` is aborted as wedged. Both bounds are stretched by the time this process
    was seen stopped while the room was live (``stop_gap_s``; never, by default). When nothing
    is live and nothing can start, the rest of the plan goes to :meth:`starved` instead of
    spinning.

    :meth:`run_plan` runs one plan to its end; a rank that is fed plans while it runs (the chaos
    ranks: an episode may start while the last one's rooms still settle) calls :meth:`feed` and
    :meth:`iterate` itself."""

    window: int
    room_timeout_s: float
    settle_grace_s: float
    idle_sleep_s: float
    #: A gap longer than this between two iterations is counted as time this process was
    #: stopped (SIGSTOP: its timers could not fire either). Off unless a rank is stopped on
    #: purpose: for ``kvfsm run`` and the demo, a long gap is a hiccup that counts against
    #: the room like any other delay.
    stop_gap_s: float = math.inf

    def __init__(self) -> None:
        self.live: list[LiveT] = []
        #: Rooms started during an iteration, outside admission: they join after its steps.
        self._spawned: list[LiveT] = []
        self._plan: Iterator[PlanT] = iter(())
        self._next: PlanT | None = None
        #: How long this process was seen stopped, in all.
        self.stopped_s = 0.0
        #: The clock at the start of this iteration.
        self.now = 0.0
        self._last: float | None = None  # the clock at the start of the last iteration

    @property
    def busy(self) -> bool:
        """Whether rooms of the plan are still to start or live."""
        return self._next is not None or bool(self.live)

    def feed(self, plan: Iterable[PlanT]) -> None:
        """Rooms to start from now on, in place of what was left of the previous plan."""
        self._plan = iter(plan)
        self._next = next(self._plan, None)

    def run_plan(self, plan: Iterable[PlanT]) -> None:
        self.feed(plan)
        while self.busy and not self.stopping():
            self.between(self.iterate())

    def iterate(self) -> bool:
        """One iteration: admit, then one step per live room; whether anything happened."""
        now = self.clock()
        if self._last is not None and now - self._last > self.stop_gap_s:
            self.stopped_s += now - self._last
        self._last = self.now = now
        progressed = False
        while self._next is not None and len(self.live) < self.window:
            item = self.start(self._next)
            if item is None and not self.live:
                # Every free page is free for good: rooms written off as unsettled hold the
                # rest. Stop rather than spin.
                rest, self._next = [self._next, *self._plan], None
                self.starved(rest)
                break
            if item is None:
                break  # not enough free pages until a live room settles
            item.stopped_at_start = self.stopped_s
            self.live.append(item)
            self._next = next(self._plan, None)
            progressed = True
        self.admitted()
        for item in self.live:
            progressed |= self.step(item, now)
        self.iterated()
        self.live = [item for item in self.live if item.phase is not Phase.DONE]
        if self._spawned:
            self.live += self._spawned
            self._spawned = []
        return progressed

    def spawn(self, item: LiveT) -> None:
        """A room started by a hook during the iteration (the next generation of a reused id):
        it joins the loop once every live room had its step, whatever the window."""
        item.stopped_at_start = self.stopped_s
        self._spawned.append(item)

    def stopped_since(self, item: LiveT) -> float:
        """How long this process was seen stopped since ``item`` joined the loop."""
        return self.stopped_s - item.stopped_at_start

    def step(self, item: LiveT, now: float) -> bool:
        """One look at one room; whether anything happened."""
        room = item.room
        if item.phase is Phase.SETTLING:
            settled = room.settled
            if settled or now - item.ended > self.settle_grace_s + self.stopped_since(item):
                self.retire(item, settled=settled, now=now)
                item.phase = Phase.DONE
                return True
            return False
        if item.phase is Phase.DONE:
            return False
        status: KVPoll = self.call("poll", room.poll)
        if not item.bound_at and status is not KVPoll.Bootstrapping:
            item.bound_at = now
        if status in TERMINAL:
            item.status, item.reason, item.ended = int(status), room.reason, now
            item.stopped_s = self.stopped_since(item)
            self.ended(item, status)
            item.phase = Phase.SETTLING
            return True
        if now - item.started > self.room_timeout_s + self.stopped_since(item):
            self.wedging(item, status)
            self.call("abort", room.abort, "wedged")
            item.status, item.reason, item.ended = int(KVPoll.Failed), "wedged", now
            item.stopped_s = self.stopped_since(item)
            item.wedged = True
            self.call("clear", room.clear)
            item.phase = Phase.SETTLING
            return True
        return self.advance(item, status)

    def advance_sender(
        self,
        item: LiveT,
        status: KVPoll,
        chunks: Sequence[npt.NDArray[np.int32]],
        src_aux: int,
        abort_at: int | None,
    ) -> bool:
        """Prefill's part of a room (for :meth:`advance`), as SGLang's scheduler plays it: once
        the room is WaitingForInput, ``init`` (its page count and ``src_aux``), then one chunk
        per iteration; every chunk handed over, FINISHING. A planned abort (``abort_at``,
        :meth:`abort_planned`) comes at 0 instead of ``init``, at k in 1..len(chunks) right after
        chunk k was handed over: in flight, the seed race when it is not the last one. (-1,
        before the room's destination arrives, is for :meth:`start`.)"""
        sender = item.room
        assert isinstance(sender, SenderRoom)
        if item.phase is Phase.BOOTSTRAP and status is KVPoll.WaitingForInput:
            if abort_at == 0:
                self.abort_planned(item)
            else:
                self.call("init", sender.init, sum(len(c) for c in chunks), src_aux)
                item.phase = Phase.SENDING
            return True
        if item.phase is Phase.SENDING:
            self.call("send", sender.send, chunks[item.step])
            item.step += 1
            if item.step == abort_at:
                self.abort_planned(item)
                item.phase = Phase.FINISHING
            elif item.step == len(chunks):
                item.phase = Phase.FINISHING
            return True
        return False

    # -- the hooks -----------------------------------------------------------------------------

    def clock(self) -> float:
        """The loop's clock: ``now`` in :meth:`step` and every time a room records."""
        return time.perf_counter()

    def call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """Make one call on a room (``name``: which, e.g. ``"poll"``)."""
        return fn(*args)

    def start(self, plan: PlanT) -> LiveT | None:
        """Create the room of ``plan``; ``None`` if it cannot start yet."""
        raise NotImplementedError

    def advance(self, item: LiveT, status: KVPoll) -> bool:
        """Move a live, non-terminal room on; whether anything happened."""
        raise NotImplementedError

    def abort_planned(self, item: LiveT) -> None:
        """Abort the room as its plan says (see :meth:`advance_sender`)."""
        raise NotImplementedError

    def ended(self, item: LiveT, status: KVPoll) -> None:
        """The room is terminal (``item.status``, ``item.reason``): check and count it, and
        clear it, now or by the end of the iteration (:meth:`iterated`)."""
        self.call("clear", item.room.clear)

    def wedging(self, item: LiveT, status: KVPoll) -> None:
        """The room is past the timeout in ``status``; the loop aborts and clears it next."""

    def retire(self, item: LiveT, *, settled: bool, now: float) -> None:
        """The room settled (``settled``) or its grace is over: give back or write off its
        pages and report it."""

    def starved(self, rest: Sequence[PlanT]) -> None:
        """Nothing is live and ``rest`` (the rest of the plan) cannot start."""

    def admitted(self) -> None:
        """This iteration's new rooms exist."""

    def iterated(self) -> None:
        """Every live room had its step this iteration."""

    def between(self, progressed: bool) -> None:
        """Between two iterations: nap if nothing happened."""
        if not progressed:
            time.sleep(self.idle_sleep_s)

    def stopping(self) -> bool:
        """Whether to stop before the plan is done."""
        return False


class ServedLoop(RoomLoop[PlanT, LiveT]):
    """A :class:`RoomLoop` in a rank process that its parent drives over ``conn`` (the demo's
    ranks, the chaos ranks): between two iterations it answers one request (:meth:`answer`)
    or, when nothing happened, naps (:meth:`nap_s`). It stops when told to (``quit``) or
    orphaned: with its parent gone, no one is left to tell it."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.parent = os.getppid()
        self.quit = False
        self.orphaned = False

    def between(self, progressed: bool) -> None:
        if self.conn.poll(0):
            self.answer(self.conn.recv())
        elif not progressed:
            if os.getppid() != self.parent:
                self.orphaned = True
                return
            time.sleep(self.nap_s())

    def stopping(self) -> bool:
        return self.quit or self.orphaned

    def answer(self, request: Any) -> None:
        """Answer one request from the parent (``(op, *args)``)."""
        raise NotImplementedError

    def nap_s(self) -> float:
        """How long to nap after an iteration in which nothing happened."""
        return self.idle_sleep_s
