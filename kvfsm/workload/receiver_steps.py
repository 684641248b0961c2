"""The steps of a receiving (decode) room in a workload rank's loop: a table, and its driver.

``kvfsm demo``'s decode rank (:mod:`kvfsm.workload.ranks`) and the chaos campaign's decode rank
(:mod:`kvfsm.chaos._rank`) take each of their rooms through the same steps, the way SGLang's
decode scheduler does: create the receiver on pages from the free pools and ``init(0)``; poll it
until it is bootstrapped (WaitingForInput); send its page list (``send_metadata``); poll it once
an iteration until it is terminal, aborting it where the plan says; check the bytes of a room
that succeeded; clear it; and once it has settled, give its pages back. Where pages come from
and go back, what the byte check compares and which faults a rank adds are the rank's own, so
they are the hooks of :class:`ReceiverSteps`; the steps are here, once.

Rule 1: every change of a receiving room's step is an edge in ``RECEIVER_STEPS`` below, and the
        actions an edge lists are all the steps do to the room then (the loop's own abort and
        clear of a wedged room aside: it makes them for every role). ``RELEASED`` and
        ``WRITTEN_OFF`` map to empty tables: a room that left the loop has no way back.
Rule 2: the table is data. What the rank saw of the room (:class:`Seen`) picks the edge,
        :func:`follow` looks it up and :meth:`ReceiverSteps.receive` does its actions, in
        order. A pair missing from the table is a bug in the rank (it reported something the
        room's step cannot see), never the room's fault: it raises.

::

    start_receiver: pages taken, receiver created, init(0)
      |
      v
    BOOTSTRAPPING  (POLLED: stay)
      | BOOTSTRAPPED: SEND_PAGES, PLANNED_ABORT
      v
    RECEIVING      (POLLED, BOOTSTRAPPED: COUNT, PLANNED_ABORT; stay)
      | SUCCEEDED: CHECK_BYTES, CLEAR | FAILED: CLEAR | WEDGED
      v                                  (the same three from BOOTSTRAPPING)
    SETTLING
      | SETTLED: RELEASE       | UNSETTLED
      v                        v
    RELEASED               WRITTEN_OFF
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NamedTuple, TypeAlias, TypeVar, assert_never

import numpy as np
import numpy.typing as npt

from kvfsm.rooms import ReceiverRoom
from kvfsm.states import KVPoll
from kvfsm.workload.loop import LiveRoom, Phase, RoomLoop

__all__ = [
    "LOOP_PHASE",
    "RECEIVER_STEPS",
    "SEEN_IN_POLL",
    "Do",
    "Edge",
    "ReceiverSteps",
    "ReceivingRoom",
    "Seen",
    "Step",
    "StepTable",
    "follow",
]

Pages = npt.NDArray[np.int32]


class Step(enum.Enum):
    """Where a receiving room is, in the order it goes through them."""

    #: Created and ``init(0)``: waiting to be bootstrapped (to read WaitingForInput).
    BOOTSTRAPPING = "bootstrapping"
    #: Its page list went out: polled once an iteration until it is terminal.
    RECEIVING = "receiving"
    #: Terminal, its bytes checked if it succeeded, cleared: waiting for it to settle.
    SETTLING = "settling"
    #: Settled: its pages and aux row went back to the rank.
    RELEASED = "released"
    #: Not settled within the settle grace: its pages stay out of the pools for good (law 4).
    WRITTEN_OFF = "written_off"


class Seen(enum.Enum):
    """What the rank saw of a receiving room: a poll's status (:data:`SEEN_IN_POLL`), the
    loop's wedge timeout, or whether the room settled within its grace."""

    #: Polled Bootstrapping or Transferring.
    POLLED = "polled"
    #: Polled WaitingForInput.
    BOOTSTRAPPED = "bootstrapped"
    #: Polled Success.
    SUCCEEDED = "succeeded"
    #: Polled Failed.
    FAILED = "failed"
    #: Not terminal within the room timeout: the loop aborts and clears it.
    WEDGED = "wedged"
    #: Terminal and settled: no transfer touches its pages any more.
    SETTLED = "settled"
    #: Not settled within the settle grace.
    UNSETTLED = "unsettled"


class Do(enum.Enum):
    """What the steps do to a receiving room on an edge (the hook of the same name on
    :class:`ReceiverSteps`, or a call on the room)."""

    #: ``send_metadata`` with the room's destination pages and aux row.
    SEND_PAGES = "send_pages"
    #: Count one more iteration with the page list out (``LiveRoom.step``).
    COUNT = "count"
    #: Abort the room if its plan says so at this count (0: right after the page list).
    PLANNED_ABORT = "planned_abort"
    #: Compare what landed in its pages and aux row with prefill's sources.
    CHECK_BYTES = "check_bytes"
    #: ``clear()`` the room: its id is free for the next request.
    CLEAR = "clear"
    #: Give its pages and aux row back, watched for late writes.
    RELEASE = "release"


class Edge(NamedTuple):
    """Where a room goes on what it saw, and what is done to it then, in order."""

    to: Step
    do: tuple[Do, ...] = ()


StepTable: TypeAlias = Mapping[Step, Mapping[Seen, Edge]]

# --------------------------------------------------------------------------------------------
# The table: ``step -> {seen -> edge}``. A missing key is a missing edge; the two steps out of
# the loop map to empty tables on purpose.
# --------------------------------------------------------------------------------------------

#: How a room that is still in the loop ends, whichever of its two live steps it is in.
_ENDS: Final[Mapping[Seen, Edge]] = {
    # A Success before the page list went out cannot be right; its byte check says so.
    Seen.SUCCEEDED: Edge(Step.SETTLING, (Do.CHECK_BYTES, Do.CLEAR)),
    Seen.FAILED: Edge(Step.SETTLING, (Do.CLEAR,)),
    # The loop aborts and clears a wedged room itself, whatever the room's role.
    Seen.WEDGED: Edge(Step.SETTLING),
}

#: One more iteration with the page list out, and the plan's abort when it is due then.
_ITERATION: Final = Edge(Step.RECEIVING, (Do.COUNT, Do.PLANNED_ABORT))

RECEIVER_STEPS: Final[StepTable] = MappingProxyType(
    {
        Step.BOOTSTRAPPING: MappingProxyType(
            {
                Seen.POLLED: Edge(Step.BOOTSTRAPPING),
                Seen.BOOTSTRAPPED: Edge(Step.RECEIVING, (Do.SEND_PAGES, Do.PLANNED_ABORT)),
                **_ENDS,
            }
        ),
        Step.RECEIVING: MappingProxyType(
            {
                Seen.POLLED: _ITERATION,
                # The room reads WaitingForInput until its engine has taken the page list.
                Seen.BOOTSTRAPPED: _ITERATION,
                **_ENDS,
            }
        ),
        Step.SETTLING: MappingProxyType(
            {
                Seen.SETTLED: Edge(Step.RELEASED, (Do.RELEASE,)),
                Seen.UNSETTLED: Edge(Step.WRITTEN_OFF),
            }
        ),
        Step.RELEASED: MappingProxyType({}),
        Step.WRITTEN_OFF: MappingProxyType({}),
    }
)

#: What each status a poll can return is to the steps.
SEEN_IN_POLL: Final[Mapping[KVPoll, Seen]] = MappingProxyType(
    {
        KVPoll.Bootstrapping: Seen.POLLED,
        KVPoll.WaitingForInput: Seen.BOOTSTRAPPED,
        KVPoll.Transferring: Seen.POLLED,
        KVPoll.Success: Seen.SUCCEEDED,
        KVPoll.Failed: Seen.FAILED,
    }
)

#: The loop's phase of a room in each step: the loop settles and retires a room by its phase
#: (:meth:`~kvfsm.workload.loop.RoomLoop.step`), and the chaos rank reports it.
LOOP_PHASE: Final[Mapping[Step, Phase]] = MappingProxyType(
    {
        Step.BOOTSTRAPPING: Phase.BOOTSTRAP,
        Step.RECEIVING: Phase.SENDING,
        Step.SETTLING: Phase.SETTLING,
        Step.RELEASED: Phase.DONE,
        Step.WRITTEN_OFF: Phase.DONE,
    }
)


def follow(step: Step, seen: Seen) -> Edge:
    """The edge out of ``step`` on ``seen``; :class:`LookupError` if the table has none."""
    edge = RECEIVER_STEPS[step].get(seen)
    if edge is None:
        raise LookupError(f"a receiving room in step {step.name} cannot have {seen.name}")
    return edge


# --------------------------------------------------------------------------------------------
# The driver: a room loop whose receiving rooms follow the table.
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class ReceivingRoom(LiveRoom):
    """A room in the loop with what a receiver needs: its destination, what its byte check
    found, and its step. (A rank running both roles gives its sending rooms the same type;
    they leave these alone.)"""

    dst: Pages | None = None
    dst_aux: int = -1
    #: Bytes compared and bytes that differ (pages and aux row).
    checked: int = 0
    mismatched: int = 0
    receiver_step: Step = Step.BOOTSTRAPPING


PlanT = TypeVar("PlanT")
ItemT = TypeVar("ItemT", bound=ReceivingRoom)


class ReceiverSteps(RoomLoop[PlanT, ItemT]):
    """A room loop's receiving rooms, taken through ``RECEIVER_STEPS``.

    A rank calls :meth:`start_receiver`, :meth:`advance_receiver`, :meth:`receiver_ended`,
    :meth:`receiver_wedged` and :meth:`receiver_retired` from the loop's hooks of the same
    moments (``start``, ``advance``, ``ended``, ``wedging``, ``retire``), and provides what is
    its own: where pages come from (:meth:`pages_for`) and go back (:meth:`release_pages`), the
    receiver and the loop's record of it (:meth:`new_receiver`, :meth:`receiving_item`), when
    its plan aborts a room (:meth:`abort_due`, ``abort_planned``) and the byte check
    (:meth:`check_bytes`). Every call on a room goes through the loop's ``call``."""

    def start_receiver(self, plan: PlanT) -> ItemT | None:
        """Create ``plan``'s receiver on free pages and ``init(0)`` it: the room enters the
        table at ``BOOTSTRAPPING``. None when the rank has no pages for it now."""
        pages = self.pages_for(plan)
        if pages is None:
            return None
        dst, aux = pages
        receiver = self.call("create", self.new_receiver, plan)
        self.call("init", receiver.init, 0)
        item = self.receiving_item(plan, receiver, dst, aux)
        item.receiver_step = Step.BOOTSTRAPPING
        item.phase = LOOP_PHASE[Step.BOOTSTRAPPING]
        return item

    def advance_receiver(self, item: ItemT, status: KVPoll) -> bool:
        """The loop's ``advance`` for a receiving room; whether it moved to another step."""
        before = item.receiver_step
        return self.receive(item, SEEN_IN_POLL[status]).to is not before

    def receiver_ended(self, item: ItemT, status: KVPoll) -> None:
        """The loop's ``ended``: the room polled ``status``, a terminal one."""
        self.receive(item, SEEN_IN_POLL[status])

    def receiver_wedged(self, item: ItemT) -> None:
        """The loop's ``wedging``: the loop aborts and clears the room next."""
        self.receive(item, Seen.WEDGED)

    def receiver_retired(self, item: ItemT, *, settled: bool) -> None:
        """The loop's ``retire``: the room settled, or its settle grace is over."""
        self.receive(item, Seen.SETTLED if settled else Seen.UNSETTLED)

    def receive(self, item: ItemT, seen: Seen) -> Edge:
        """The one place a receiving room changes step: the table's edge for ``seen``, then
        its actions (the step first, so that an action sees where the room now is)."""
        edge = follow(item.receiver_step, seen)
        item.receiver_step = edge.to
        item.phase = LOOP_PHASE[edge.to]
        for do in edge.do:
            self._do(do, item)
        return edge

    def _do(self, do: Do, item: ItemT) -> None:
        match do:
            case Do.SEND_PAGES:
                self.send_pages(item)
            case Do.COUNT:
                item.step += 1
            case Do.PLANNED_ABORT:
                if self.abort_due(item):
                    self.abort_planned(item)
            case Do.CHECK_BYTES:
                self.check_bytes(item)
            case Do.CLEAR:
                self.call("clear", item.room.clear)
            case Do.RELEASE:
                self.release_pages(item)
            case _:
                assert_never(do)

    # -- the hooks -----------------------------------------------------------------------------

    def send_pages(self, item: ItemT) -> None:
        """Tell prefill where to write: the room's pages and aux row."""
        receiver = item.room
        assert isinstance(receiver, ReceiverRoom)
        assert item.dst is not None
        self.call("send_metadata", receiver.send_metadata, item.dst, item.dst_aux)

    def pages_for(self, plan: PlanT) -> tuple[Pages, int] | None:
        """Destination pages and an aux row for ``plan``, taken out of the rank's free pools
        and checked as they are handed out; None if there are not enough free now."""
        raise NotImplementedError

    def new_receiver(self, plan: PlanT) -> ReceiverRoom:
        """``plan``'s receiver, created by the rank's manager."""
        raise NotImplementedError

    def receiving_item(self, plan: PlanT, receiver: ReceiverRoom, dst: Pages, aux: int) -> ItemT:
        """The loop's record of a receiver just created on ``dst`` and ``aux``."""
        raise NotImplementedError

    def abort_due(self, item: ItemT) -> bool:
        """Whether the room's plan aborts it at this count (``item.step``: the iterations
        since its page list went out)."""
        raise NotImplementedError

    def check_bytes(self, item: ItemT) -> None:
        """The room succeeded: count the bytes of its pages and aux row, and those that differ
        from what prefill sent (``item.checked``, ``item.mismatched``)."""
        raise NotImplementedError

    def release_pages(self, item: ItemT) -> None:
        """The room settled: its pages and aux row are free again, to be watched for late
        writes until they are handed out."""
        raise NotImplementedError
