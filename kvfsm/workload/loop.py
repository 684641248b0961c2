"""The scheduler loop of a workload rank, and the phases a room goes through in it.

``kvfsm run`` (prefill rooms in this process, a passive decode process) and ``kvfsm demo`` (a
prefill and a decode rank, each in its own process) drive their rooms the way SGLang's
scheduler does: every iteration admits new rooms up to a window, polls every live room once and
never blocks on one. What differs is only what a role does with a room, so :class:`RoomLoop`
holds the loop and the life of a room (admission, the wedge timeout, the settle grace) and its
hooks hold the rest. The chaos ranks (:mod:`kvfsm.chaos._rank`) time every call and account for
their own freezes, so they run their own loop, over the same :class:`Phase`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.states import TERMINAL, KVPoll

__all__ = ["LiveRoom", "Phase", "RoomLoop"]


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
    """A room in the loop and what the loop records about it."""

    room: SenderRoom | ReceiverRoom
    #: ``time.perf_counter()`` when it was created.
    started: float
    phase: Phase = Phase.BOOTSTRAP
    #: Prefill: chunks sent. Decode: iterations since its page list went out.
    step: int = 0
    #: Its terminal status (``int(KVPoll)``) and reason, once it has one.
    status: int = 0
    reason: str = ""
    #: ``time.perf_counter()`` when it was seen terminal (or wedged).
    ended: float = 0.0
    #: Not terminal within the room timeout: aborted by the loop.
    wedged: bool = False


PlanT = TypeVar("PlanT")
LiveT = TypeVar("LiveT", bound=LiveRoom)


class RoomLoop(Generic[PlanT, LiveT]):
    """Runs a plan of rooms, ``window`` at a time: poll all, never block on one.

    A room is admitted by :meth:`start` (``None``: not now, no free pages), moved on by
    :meth:`advance` until it is terminal, handed to :meth:`ended` (which records and clears it),
    and once settled (or past ``settle_grace_s``) to :meth:`retire`. A room not terminal within
    ``room_timeout_s`` is aborted as wedged. When nothing is live and nothing can start, the
    rest of the plan goes to :meth:`starved` instead of spinning."""

    window: int
    room_timeout_s: float
    settle_grace_s: float
    idle_sleep_s: float

    def run_plan(self, plan: Iterator[PlanT]) -> None:
        live: list[LiveT] = []
        pending = next(plan, None)
        while (pending is not None or live) and not self.stopping():
            progressed = False
            while pending is not None and len(live) < self.window:
                item = self.start(pending)
                if item is None and not live:
                    # Every free page is free for good: rooms written off as unsettled hold
                    # the rest. Stop rather than spin.
                    self.starved([pending, *plan])
                    pending = None
                    break
                if item is None:
                    break  # not enough free pages until a live room settles
                live.append(item)
                pending = next(plan, None)
                progressed = True
            self.admitted()
            now = time.perf_counter()
            for item in live:
                progressed |= self.step(item, now)
            self.iterated()
            live = [item for item in live if item.phase is not Phase.DONE]
            self.between(progressed)

    def step(self, item: LiveT, now: float) -> bool:
        """One look at one room; whether anything happened."""
        room = item.room
        if item.phase is Phase.SETTLING:
            settled = room.settled
            if settled or now - item.ended > self.settle_grace_s:
                self.retire(item, settled=settled, now=now)
                item.phase = Phase.DONE
                return True
            return False
        if item.phase is Phase.DONE:
            return False
        status = room.poll()
        if status in TERMINAL:
            item.status, item.reason, item.ended = int(status), room.reason, now
            self.ended(item, status)
            item.phase = Phase.SETTLING
            return True
        if now - item.started > self.room_timeout_s:
            self.wedging(item, status)
            room.abort("wedged")
            item.status, item.reason, item.ended = int(KVPoll.Failed), "wedged", now
            item.wedged = True
            room.clear()
            item.phase = Phase.SETTLING
            return True
        return self.advance(item, status)

    # -- the hooks -----------------------------------------------------------------------------

    def start(self, plan: PlanT) -> LiveT | None:
        """Create the room of ``plan``; ``None`` if it cannot start yet."""
        raise NotImplementedError

    def advance(self, item: LiveT, status: KVPoll) -> bool:
        """Move a live, non-terminal room on; whether anything happened."""
        raise NotImplementedError

    def ended(self, item: LiveT, status: KVPoll) -> None:
        """The room is terminal (``item.status``, ``item.reason``): check and count it, and
        clear it, now or by the end of the iteration (:meth:`iterated`)."""
        item.room.clear()

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
