"""A prefill room and a decode room, wired by a scripted link and transport, under drawn faults.

Hypothesis drives both schedulers (init, send, send_metadata, abort, poll), the control link
(deliver, drop, duplicate, reorder, delay each frame; lose the link), the transport (each chunk
completes, errors at post or at completion, stalls, or lands late) and the virtual clock, in any
interleaving, and shrinks a failure to the fewest steps and faults. After every step, and again
after :meth:`PairHarness.drain` finishes the episode, the pair must satisfy the laws of design
section 2 (see the invariants below).

The rooms are production :class:`RoomCore` objects behind production facades; only the actor's
loop, the control plane and NIXL are scripted (:mod:`kvfsm.chaos._scripted`). A failure here
reproduces with the ``@reproduce_failure`` blob hypothesis prints (``print_blob``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvfsm.chaos._scripted import (
    Abort,
    ChunkFate,
    ChunkPlan,
    Direction,
    Frame,
    FrameFate,
    PairConfig,
    PairHarness,
    Request,
    ScriptedRoom,
    Settled,
)
from kvfsm.rooms import SenderRoom
from kvfsm.states import TERMINAL, KVPoll, Role

POOL = 16
LOSSY = frozenset({FrameFate.DROP, FrameFate.REORDER})

# Each fault strategy is "the healthy choice, or any choice": half the draws are healthy, so
# episodes get far enough to transfer, and shrinking (towards the first branch and the first
# enum member) removes faults that a failure does not need.
#: A fault that would end most episodes at once if drawn often (an abort, an unreachable peer):
#: one draw in eight, shrinking towards "no".
rare = st.integers(0, 7).map(lambda x: x == 7)
frame_fates = st.one_of(st.just(FrameFate.DELIVER), st.sampled_from(FrameFate))
chunk_plans = st.builds(
    ChunkPlan,
    st.one_of(st.just(ChunkFate.COMPLETE), st.sampled_from(ChunkFate)),
    st.sampled_from([1.0, 5.0, 11.0]),  # 11 s is past the 10 s chunk deadline
)
# Clock steps: mostly sub-second (the transfer's own pace), sometimes across the interesting
# thresholds: the chunk deadline (10), the quarantine (2), the receiver's bootstrap deadline
# (60), the settle timeout (60), the longest state deadline (300). Big jumps end episodes by
# deadline, so they are the rare branch or no episode would ever transfer.
clock_steps = st.one_of(
    st.just(0.5), st.just(0.5), st.just(1.0), st.sampled_from([2.0, 11.0, 61.0, 130.0, 301.0])
)


class RoomPairMachine(RuleBasedStateMachine):
    """Both schedulers, the link, the transport and the clock, as rules."""

    harness_class: type[PairHarness] = PairHarness

    def __init__(self) -> None:
        super().__init__()
        self.h: PairHarness | None = None

    @initialize(
        n=st.integers(0, 5),
        src=st.permutations(range(POOL)),
        dst=st.permutations(range(POOL)),
        aux=st.tuples(st.integers(0, 3), st.integers(0, 3)),
        state=st.one_of(st.just(None), st.tuples(st.integers(0, 3), st.integers(0, 3))),
        lossy_link=st.booleans(),
    )
    def start(
        self,
        *,
        n: int,
        src: list[int],
        dst: list[int],
        aux: tuple[int, int],
        state: tuple[int, int] | None,
        lossy_link: bool,
    ) -> None:
        self.h = self.harness_class(
            Request(
                src_pages=tuple(src[:n]),
                dst_pages=tuple(dst[:n]),
                src_aux=aux[0],
                dst_aux=aux[1],
                src_state=() if state is None else (state[0],),
                dst_state=() if state is None else (state[1],),
            )
        )
        # Half the episodes keep the link a reliable FIFO stream (as TCP is), so the strong
        # end state ("both rooms settled") is checked often; the other half may lose frames.
        self.lossy_link = lossy_link
        self.sent = 0
        self.last_sent = False
        self.sender_init = False
        self.receiver_init = False
        self.metadata_sent = False

    @property
    def harness(self) -> PairHarness:
        assert self.h is not None
        return self.h

    # -- the schedulers ------------------------------------------------------------------------

    @rule(k=st.integers(0, 5), plan=chunk_plans)
    def prefill_iteration(self, k: int, plan: ChunkPlan) -> None:
        """One loop iteration of SGLang's prefill scheduler for this request: create the room,
        or poll it and make the next call its status allows."""
        h = self.harness
        if h.sender is None:
            h.spawn_sender()
            return
        status = h.sender.poll()
        if status in TERMINAL:
            return
        r = h.request
        n = len(r.src_pages)
        if not self.sender_init:
            if status is KVPoll.WaitingForInput:
                h.sender.init(n, r.src_aux)
                self.sender_init = True
            return
        if self.last_sent:
            return
        # The chunk that brings the count to n is the last one; it is empty only when n == 0.
        # Empty chunks before it are allowed too.
        k = min(k, n - self.sent)
        self.last_sent = self.sent + k == n
        h.send_chunk(
            r.src_pages[self.sent : self.sent + k], plan, r.src_state if self.last_sent else ()
        )
        self.sent += k

    @rule()
    def decode_iteration(self) -> None:
        """One loop iteration of SGLang's decode scheduler: init, then the page list once the
        room waits for input."""
        h = self.harness
        status = h.receiver.poll()
        if status in TERMINAL:
            return
        if not self.receiver_init:
            h.receiver.init(h.request.peer_rank)
            self.receiver_init = True
        elif status is KVPoll.WaitingForInput and not self.metadata_sent:
            r = h.request
            h.receiver.send_metadata(list(r.dst_pages), r.dst_aux, list(r.dst_state) or None)
            self.metadata_sent = True

    @rule(k=st.integers(0, 5), plan=chunk_plans)
    def both_iterations(self, k: int, plan: ChunkPlan) -> None:
        """Both schedulers take a turn: keeps episodes moving towards a transfer."""
        self.decode_iteration()
        self.prefill_iteration(k, plan)

    @rule(side=st.sampled_from(Role), act=rare)
    def abort(self, side: Role, act: bool) -> None:
        if not act:
            return
        h = self.harness
        facade = h.sender if side is Role.SENDER else h.receiver
        if facade is None:
            return
        before = facade.poll()
        facade.abort("chaos abort")
        if before not in TERMINAL:  # abort() is a no-op on a room already published terminal
            assert facade.poll() is KVPoll.Failed, "law 6: after abort() returns, poll() is Failed"

    # -- the world -----------------------------------------------------------------------------

    @precondition(lambda self: self.h is not None and self.h.resolving)
    @rule(unreachable=rare)
    def resolve(self, unreachable: bool) -> None:
        self.harness.resolve(ok=not unreachable)

    @precondition(lambda self: self.h is not None and any(self.h.can_step(d) for d in Direction))
    @rule(direction=st.sampled_from(Direction), fate=frame_fates, delay=st.sampled_from([0.5, 2.0]))
    def link(self, direction: Direction, fate: FrameFate, delay: float) -> None:
        h = self.harness
        if not h.can_step(direction):
            direction = next(d for d in Direction if h.can_step(d))
        if fate in LOSSY and not self.lossy_link:
            fate = FrameFate.DELIVER
        h.step_link(direction, fate, delay)

    @precondition(lambda self: self.h is not None and bool(self.h.queued()))
    @rule()
    def post_chunk(self) -> None:
        self.harness.post_next()

    @rule(seconds=clock_steps)
    def advance(self, seconds: float) -> None:
        self.harness.advance(seconds)

    @precondition(lambda self: self.h is not None and self.lossy_link and self.h.link_alive)
    @rule(data_path=st.booleans())
    def lose_peer(self, data_path: bool) -> None:
        self.harness.lose_link(data_path=data_path)

    # -- invariants: after every step ----------------------------------------------------------

    @invariant()
    def laws_hold(self) -> None:
        if self.h is not None:
            check_pair(self.h)

    def teardown(self) -> None:
        h = self.h
        if h is None:
            return
        h.drain()
        check_pair(h)
        check_drained(h)


def _terminal_is_final(room: ScriptedRoom) -> None:
    first = next((i for i, s in enumerate(room.history) if s in TERMINAL), None)
    if first is not None:
        tail = set(room.history[first:])
        assert tail == {room.history[first]}, f"{room.role.value} left a terminal state: {tail}"
    assert room.publication.status is room.core.state


def check_pair(h: PairHarness) -> None:
    """The laws, judged from the harness's facts. Holds at every step, whatever the faults."""
    expected = h.expected()
    for room in h.rooms():
        role = room.role.value
        assert not room.errors, f"{role} room raised: {room.errors!r}"
        _terminal_is_final(room)
        # Law 3: bounded time, measured on the virtual clock from the room's creation.
        budget = h.config.budget(room.role)
        end = room.terminal_at if room.terminal_at is not None else h.now
        assert end - room.born <= budget, f"{role} non-terminal for {end - room.born}s > {budget}s"
        if room.core.state is KVPoll.Failed:
            assert room.core.reason, f"{role} Failed without a reason"
            assert room.publication.reason, f"{role} published Failed without a reason"
    # Law 4: no byte read from freed source pages or written into freed destination pages.
    late = [w for w in h.writes if w.receiver_settled or w.sender_settled]
    assert not late, f"bytes landed after a room was settled: {late}"
    # Success means the bytes are there: for the sender (every chunk done) and the receiver.
    for role, kv, aux, state in h.success_snapshots:
        assert (kv == expected[0]).all(), f"{role.value} Success but destination pages differ"
        assert (aux == expected[1]).all(), f"{role.value} Success but the aux row differs"
        assert (state == expected[2]).all(), f"{role.value} Success but state rows differ"
    if h.receiver_room.core.state is KVPoll.Success:
        assert any(r.status is KVPoll.Success for r in h.sender_reported), (
            "receiver Success although the sender never reported success"
        )
    sender = h.sender_room
    if sender is not None:
        if sender.publication.settled:
            assert not h.outstanding(), f"sender settled with chunks in flight: {h.outstanding()}"
        if sender.core.state is KVPoll.Success:
            assert not h.outstanding()
    for number, chunk in h.chunks.items():
        assert len(chunk.finals) <= 1, f"chunk {number} reported final twice"


def check_drained(h: PairHarness) -> None:
    """After the drain: nothing left in flight, everything terminal, and settled (strictly,
    unless the link broke its FIFO promise; then a receiver may only *keep* its pages)."""
    assert not h.outstanding(), f"chunks never reported: {h.outstanding()}"
    assert all(len(c.finals) == 1 for c in h.chunks.values())
    assert not any(h.queues.values()), "frames left on the link"
    for room in h.rooms():
        assert room.core.state in TERMINAL, f"{room.role.value} wedged in {room.core.state.name}"
        assert not room.core.in_flight
    sender = h.sender_room
    assert sender is not None
    assert sender.publication.settled, "sender never settled (its transport always answers)"
    receiver = h.receiver_room
    if not h.frames_lost:
        # A reliable stream, or one that was lost (decode settles the grace period after).
        assert receiver.publication.settled, "receiver never settled although no frame was lost"
    else:
        # The settle message may be lost: the receiver gives up and its pages stay
        # quarantined. Never reused early (checked above); never silently forgotten.
        assert receiver.publication.settled or receiver.gave_up


RoomPairMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRoomPair = RoomPairMachine.TestCase


# -- the checker is not vacuous: plant bugs in the harness, expect the invariants to fire -------


class _NoBytesHarness(PairHarness):
    """A transport that reports every chunk done without moving a byte."""

    def land(self, chunk: object, fraction: float) -> None:  # type: ignore[override]
        pass


class _EagerAckHarness(PairHarness):
    """A prefill control plane that acknowledges decode's abort at once, before the room's
    handles settle: the seed incident's class of bug (pages freed while a WRITE is live)."""

    def on_prefill_frame(self, frame: Frame) -> None:
        super().on_prefill_frame(frame)
        if isinstance(frame, Abort):
            self.send(Direction.TO_DECODE, Settled())


class _RewritingHarness(PairHarness):
    """A transport that writes each finished chunk's bytes once more at the next clock tick,
    after reporting it done: bytes land after the pages were declared free."""

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self._again: list[object] = []

    def land(self, chunk: object, fraction: float) -> None:  # type: ignore[override]
        super().land(chunk, fraction)  # type: ignore[arg-type]
        self._again.append(chunk)

    def advance(self, seconds: float) -> None:
        again, self._again = self._again, []
        for chunk in again:
            PairHarness.land(self, chunk, 1.0)  # type: ignore[arg-type]
        super().advance(seconds)


@pytest.mark.parametrize(
    ("harness", "message"),
    [
        (_NoBytesHarness, "Success but"),
        (_RewritingHarness, "after a room was settled"),
    ],
)
def test_planted_bug_is_caught(harness: type[PairHarness], message: str) -> None:
    machine = type(f"Buggy{harness.__name__}", (RoomPairMachine,), {"harness_class": harness})
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=300,
                stateful_step_count=40,
                deadline=None,
                database=None,
                phases=[Phase.generate],  # finding it is the point; shrinking costs time
                suppress_health_check=list(HealthCheck),
            ),
        )


# -- two episodes spelled out: the harness itself does what it says ------------------------------


def _request(n: int = 3) -> Request:
    return Request(src_pages=(1, 2, 3)[:n], dst_pages=(9, 8, 7)[:n], src_aux=0, dst_aux=2)


def _bootstrap(h: PairHarness) -> None:
    h.receiver.init(0)
    h.resolve()
    h.receiver.send_metadata([9, 8, 7], 2)
    sender = h.spawn_sender()
    h.step_link(Direction.TO_PREFILL, FrameFate.DELIVER)
    assert sender.poll() is KVPoll.WaitingForInput
    sender.init(3, 0)


def test_clean_episode_moves_the_bytes() -> None:
    h = PairHarness(_request())
    _bootstrap(h)
    h.send_chunk((1, 2), ChunkPlan())
    h.send_chunk((3,), ChunkPlan(ChunkFate.DELAYED, 1.0))
    h.post_all()
    h.advance(1.0)
    assert h.sender is not None
    assert h.sender.poll() is KVPoll.Success
    h.step_link(Direction.TO_DECODE, FrameFate.DELIVER)
    assert h.receiver.poll() is KVPoll.Success
    kv, aux, _ = h.destination()
    assert (kv == h.expected()[0]).all()
    assert (aux == h.expected()[1]).all()
    assert h.sender_room is not None
    assert h.sender_room.publication.settled
    assert h.receiver_room.publication.settled
    check_pair(h)


def test_seed_race_abort_while_a_non_last_chunk_is_in_flight() -> None:
    """The incident: decode aborts while chunk 0 of 2 is in flight. The receiver fails at once
    but its pages are declared free only after the chunk's bytes landed and it was reported."""
    h = PairHarness(_request())
    _bootstrap(h)
    h.send_chunk((1, 2), ChunkPlan(ChunkFate.DELAYED, 5.0))
    h.post_all()
    h.receiver.abort("client went away")
    assert h.receiver.poll() is KVPoll.Failed
    h.step_link(Direction.TO_PREFILL, FrameFate.DELIVER)  # RoomAbort reaches prefill
    assert h.sender is not None
    assert h.sender.poll() is KVPoll.Failed
    assert not h.receiver_room.publication.settled  # chunk 0 may still write
    h.advance(5.0)  # chunk 0 lands, then ReportSettled goes out
    assert h.writes
    assert not h.writes[-1].receiver_settled
    h.step_link(Direction.TO_DECODE, FrameFate.DELIVER)
    assert h.receiver_room.publication.settled
    h.drain()
    check_pair(h)
    check_drained(h)


def test_planted_eager_ack_is_caught_in_the_seed_race() -> None:
    """The seed race against a plane that acknowledges an abort before the handles settle:
    chunk 0 lands after the receiver was told its pages are free, and the checker says so."""
    h = _EagerAckHarness(_request())
    _bootstrap(h)
    h.send_chunk((1, 2), ChunkPlan(ChunkFate.DELAYED, 5.0))
    h.post_all()
    h.receiver.abort("client went away")
    h.advance(5.0)
    with pytest.raises(AssertionError, match="after a room was settled"):
        check_pair(h)


def _exposed(h: PairHarness) -> SenderRoom:
    """Decode's page list is out and prefill's room is bound to it, waiting for input."""
    h.receiver.init(0)
    h.resolve()
    h.receiver.send_metadata([9, 8, 7], 2)
    sender = h.spawn_sender()
    h.step_link(Direction.TO_PREFILL, FrameFate.DELIVER)
    assert sender.poll() is KVPoll.WaitingForInput
    return sender


def test_expired_metadata_settles_the_receiver() -> None:
    """Found by this property test (shrunk by hypothesis): decode sends its page list, prefill
    never creates the room, the plane expires the held metadata after ``pending_ttl_s``. The
    receiver fails on the peer's word, so it sends no abort prefill could acknowledge: the
    plane must say RoomSettled itself (nothing was ever written), or the pages leak."""
    h = PairHarness(_request())
    h.receiver.init(0)
    h.resolve()
    h.receiver.send_metadata([9, 8, 7], 2)
    h.advance(h.config.pending_ttl_s + 1.0)
    assert h.receiver.poll() is KVPoll.Failed
    assert h.receiver_room.publication.settled, "no sender ever had these pages"
    check_pair(h)


def test_planted_expiry_without_settle_leaks_the_pages() -> None:
    """The same episode on the plane before the fix: the receiver gives up unsettled, and the
    drained check (no frame was lost, so the receiver must settle) says so."""
    h = PairHarness(_request())
    h.expiry_settles = False
    h.receiver.init(0)
    h.resolve()
    h.receiver.send_metadata([9, 8, 7], 2)
    h.advance(h.config.pending_ttl_s + h.config.settle_timeout_s + 1.0)
    assert h.receiver_room.gave_up
    h.drain()  # prefill's room comes late, finds nothing held, times out
    with pytest.raises(AssertionError, match="receiver never settled"):
        check_drained(h)


def test_a_retransmitted_page_list_is_ignored() -> None:
    """The campaign's law-4 finding: the page list arrives twice on the same link. The copy
    must change nothing (counted stale); the transfer completes and both rooms settle."""
    h = PairHarness(_request())
    h.receiver.init(0)
    h.resolve()
    h.receiver.send_metadata([9, 8, 7], 2)
    sender = h.spawn_sender()
    h.step_link(Direction.TO_PREFILL, FrameFate.DUPLICATE)
    assert sender.poll() is KVPoll.WaitingForInput
    stale = h.stale_events
    h.step_link(Direction.TO_PREFILL, FrameFate.DELIVER)  # the copy
    assert h.stale_events == stale + 1
    assert not h.queues[Direction.TO_DECODE]  # nothing said to decode
    sender.init(3, 0)
    h.send_chunk((1, 2, 3), ChunkPlan(ChunkFate.DELAYED, 1.0))
    h.drain()
    assert (sender.poll(), h.receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    check_pair(h)
    check_drained(h)


def test_planted_retransmission_refused_is_caught() -> None:
    """The plane before the fix refuses the copy as a duplicate room (Failed + RoomSettled):
    decode is told its pages are free, and the sender's write lands in them afterwards."""
    h = PairHarness(_request())
    h.retransmission_ignored = False
    h.receiver.init(0)
    h.resolve()
    h.receiver.send_metadata([9, 8, 7], 2)
    sender = h.spawn_sender()
    h.step_link(Direction.TO_PREFILL, FrameFate.DUPLICATE)
    h.step_link(Direction.TO_PREFILL, FrameFate.DELIVER)  # the copy: refused
    h.deliver_ready()
    assert h.receiver_room.publication.settled
    sender.init(3, 0)
    h.send_chunk((1, 2, 3), ChunkPlan())
    h.post_all()
    with pytest.raises(AssertionError, match="after a room was settled"):
        check_pair(h)


@pytest.mark.parametrize("data_path", [False, True])
def test_a_lost_link_settles_the_receiver_after_the_grace(data_path: bool) -> None:
    """The link dies while a chunk is in flight (with ``data_path``, NIXL reports the peer gone
    too). Decode fails at once, keeps its pages until ``peer_lost_grace_s`` has passed, then
    settles; the chunk that was still on the way landed before that."""
    h = PairHarness(_request())
    sender = _exposed(h)
    sender.init(3, 0)
    h.send_chunk((1, 2, 3), ChunkPlan(ChunkFate.STALL_LANDS))
    h.post_all()
    h.lose_link(data_path=data_path)
    assert h.receiver.poll() is KVPoll.Failed
    assert not h.receiver_room.publication.settled
    h.advance(h.config.peer_lost_grace_s - 0.5)
    assert not h.receiver_room.publication.settled
    h.advance(1.0)
    assert h.receiver_room.publication.settled
    h.drain()
    check_pair(h)
    check_drained(h)


def test_planted_short_grace_is_caught() -> None:
    """A grace shorter than the chunk deadline and quarantine: decode frees its pages while a
    stalled WRITE (cancelled too late) can still land, and it does."""
    h = PairHarness(_request(), PairConfig(peer_lost_grace_s=1.0))
    sender = _exposed(h)
    sender.init(3, 0)
    h.send_chunk((1, 2, 3), ChunkPlan(ChunkFate.STALL_LANDS))
    h.post_all()
    h.lose_link()
    h.advance(h.config.chunk_deadline_s + h.config.quarantine_s)
    with pytest.raises(AssertionError, match="after a room was settled"):
        check_pair(h)
