"""A prefill process and a decode process on the production cores, under drawn faults.

Hypothesis drives requests (room ids from a tiny set, so ids are reused while older generations
still drain; a request may reach only one side), callers' aborts, each chunk's fate in NIXL, the
control link (cut silently, reset with each side finding out at its own time, reconnected as a
new link id), remote disconnects of the data path, freezes of either process for any length of
time, and the virtual clock (:mod:`tests.helpers.model_pair`). Every room, routing decision,
lease and chunk outcome is the production code's: RoomCore, PrefillRouting / DecodeRouting,
Leases and ChunkLedger; nothing here restates their rules.

After every step the laws of docs/design.md hold (:func:`check_laws`); after the episode is
drained, nothing is left anywhere (:func:`check_drained`). The planted-bug tests below prove the
checks are not vacuous: each plants one bug in the IO around the cores and expects the same
machine (or, for the rarer interleavings, a spelled-out episode) to find the law it breaks. The
production bug this test found (fixed) is at the end, kept as regression tests; the checker
tolerates nothing.

``KVFSM_PROPERTY_EXAMPLES`` scales the number of episodes (default 500, about 15 s here; CI runs
the default, derandomized); ``KVFSM_PROPERTY_RANDOM=1`` draws new episodes on every run. A
failure reproduces with the ``@reproduce_failure`` blob hypothesis prints."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar, Final

import numpy as np
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

from kvfsm.control._frames import (
    Frame,
    LeaseRequest,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomSettled,
)
from kvfsm.control._routing import (
    Action,
    Deliver,
    GrantLease,
    PrefillRouting,
    RoutingConfig,
    Send,
)
from kvfsm.rooms._actor import RoomKey
from kvfsm.states import TERMINAL, KVPoll, PeerLost, Role
from tests.helpers.model_pair import (
    ORDER,
    Chunk,
    ChunkFate,
    ChunkPlan,
    DecodeProcess,
    LinkEnd,
    ModelRoom,
    Pair,
    PrefillProcess,
    Side,
    Transport,
    Who,
)

EXAMPLES = int(os.environ.get("KVFSM_PROPERTY_EXAMPLES", "500"))
ROOM_IDS = 3  # reused all the time
_BEFORE_INPUT = frozenset({KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput})

# -- strategies: the healthy choice first (shrinking goes there), faults as the other branch ------

#: A fault that ends most episodes at once if drawn often: one draw in eight.
rare = st.integers(0, 7).map(lambda x: x == 7)
#: One draw in four (aborts: they make a generation drain while its id is reused).
sometimes = st.integers(0, 3).map(lambda x: x == 3)
fates = st.one_of(st.just(ChunkFate.DONE_AT_POST), st.sampled_from(ChunkFate))
chunk_plans = st.builds(ChunkPlan, st.integers(0, 3), fates, st.sampled_from([0.3, 1.0, 5.0]))
whos = st.one_of(st.just(Who.BOTH), st.sampled_from(Who))
#: Clock steps: a millisecond (between a call and the poster), the transfer's pace, and across
#: the thresholds: silence (2), lease + margin (3), the chunk deadline (3), the receiver's
#: Bootstrapping deadline (8), pending TTL (6), the settle timeout (20).
clock_steps = st.sampled_from([0.001, 0.1, 0.5, 0.5, 1.0, 2.5, 6.0, 15.0])
#: Freezes: under the silence bound, just over it, past the lease-derived settle, far past.
freeze_steps = st.sampled_from([0.3, 1.2, 2.5, 6.0, 20.0])
eof_delays = st.sampled_from([0.002, 0.5, 3.0])


class RoomPairMachine(RuleBasedStateMachine):
    pair_class: ClassVar[type[Pair]] = Pair

    def __init__(self) -> None:
        super().__init__()
        self._pair: Pair | None = None
        self.sizes: list[int] = []
        self.states: list[bool] = []
        self.checked = Checked()

    @property
    def pair(self) -> Pair:
        assert self._pair is not None
        return self._pair

    @initialize(
        sizes=st.lists(st.integers(0, 3), min_size=ROOM_IDS, max_size=ROOM_IDS),
        states=st.lists(st.booleans(), min_size=ROOM_IDS, max_size=ROOM_IDS),
    )
    def start(self, sizes: list[int], states: list[bool]) -> None:
        # One request shape per room id, so whichever generations pair up agree on it.
        self._pair = self.pair_class()
        self.sizes, self.states = sizes, states

    # -- callers -------------------------------------------------------------------------------

    @rule(
        room=st.integers(0, ROOM_IDS - 1),
        who=whos,
        chunks=st.lists(chunk_plans, max_size=3),
        duplicate=rare,
    )
    def request(self, room: int, who: Who, chunks: list[ChunkPlan], duplicate: bool) -> None:
        """A new request. Its id is the first one not live on either side (an id whose older
        generations may still drain), or, rarely, a live one: a duplicate to refuse."""
        if not duplicate:
            free = [r for r in range(ROOM_IDS) if not self.pair.live_id(r)]
            if not free:
                return
            room = min(free, key=lambda r: (r - room) % ROOM_IDS)
        self.pair.new_request(room, who, self.sizes[room], self.states[room], chunks)

    @rule(
        room=st.integers(0, ROOM_IDS - 1),
        who=whos,
        chunks=st.lists(chunk_plans, max_size=3),
        seconds=st.sampled_from([0.5, 1.0, 2.0]),
    )
    def request_and_run(self, room: int, who: Who, chunks: list[ChunkPlan], seconds: float) -> None:
        """A new request, and time for it to get going (episodes reach their transfers)."""
        self.request(room, who, chunks, duplicate=False)
        self.pair.advance(seconds)

    @rule(side=st.sampled_from(Side), index=st.integers(0, 3), act=sometimes)
    def abort(self, side: Side, index: int, act: bool) -> None:
        if not act:
            return
        polls = self.pair.abort(side, index)
        if polls is not None:
            before, after = polls
            assert before in TERMINAL or after is KVPoll.Failed, (
                "law 6: after abort() returns, poll() is Failed"
            )

    # -- the world -----------------------------------------------------------------------------

    @rule(seconds=clock_steps)
    def advance(self, seconds: float) -> None:
        self.pair.advance(seconds)

    @rule(side=st.sampled_from(Side), seconds=freeze_steps, order=st.permutations(ORDER))
    def freeze(self, side: Side, seconds: float, order: list[str]) -> None:
        """The process freezes right after its scheduler's calls of this instant: a chunk the
        scheduler has just sent is still queued for the poster."""
        self.pair.schedulers()
        self.pair.run(self.pair.clock.now)
        self.pair.freeze(side, seconds, tuple(order))

    @rule(seconds=freeze_steps, order=st.permutations(ORDER))
    def freeze_at_next_chunk(self, seconds: float, order: list[str]) -> None:
        self.pair.freeze_at_next_chunk(seconds, tuple(order))

    @precondition(lambda self: self._pair is not None and self.pair.live_conn() is not None)
    @rule(reset=st.booleans(), prefill_after=eof_delays, decode_after=eof_delays)
    def break_link(self, reset: bool, prefill_after: float, decode_after: float) -> None:
        if reset:
            self.pair.reset(prefill_after, decode_after)
        else:
            self.pair.cut()

    @rule()
    def reconnect(self) -> None:
        self.pair.reconnect()

    @rule(act=rare)
    def remote_disconnect(self, act: bool) -> None:
        if act:
            self.pair.remote_disconnect()

    # -- the laws --------------------------------------------------------------------------------

    @invariant()
    def laws_hold(self) -> None:
        if self._pair is not None:
            check_laws(self.pair, self.checked)

    def teardown(self) -> None:
        if self._pair is None:
            return
        self.pair.drain()
        check_laws(self.pair, self.checked)
        check_drained(self.pair)


class Checked:
    """How far the checker has read the pair's append-only facts."""

    def __init__(self) -> None:
        self.landings = 0
        self.losses = 0


def _where(room: ModelRoom) -> str:
    return f"{room.role.value} room {room.key.room} gen {room.key.generation}"


def check_laws(pair: Pair, checked: Checked | None = None) -> None:
    """The laws, judged from the pair's facts. They hold at every step, whatever the faults."""
    checked = checked if checked is not None else Checked()
    assert not pair.errors, pair.errors
    now, config, clock = pair.clock.now, pair.config, pair.clock
    for room in pair.all_rooms:
        where = _where(room)
        assert not room.errors, f"{where} raised: {room.errors!r}"
        # Law 1: a published terminal status never changes.
        statuses = room.statuses
        first = next((i for i, s in enumerate(statuses) if s in TERMINAL), None)
        if first is not None:
            assert len(statuses) == first + 1, f"law 1: {where} published {statuses}"
        assert room.publication.status is room.core.state, f"{where}: publication out of date"
        if room.core.state is KVPoll.Failed:
            assert room.publication.reason, f"{where} published Failed without a reason"
        # Law 3: terminal within the sum of its state deadlines, plus the time its own
        # process was frozen (a frozen process's timers cannot fire).
        side = Side.PREFILL if room.role is Role.SENDER else Side.DECODE
        end = room.terminal_at if room.terminal_at is not None else now
        frozen = clock.frozen_for(side, room.born, end)
        budget = config.budget(room.role) + frozen
        assert end - room.born <= budget + 1e-9, (
            f"law 3: {where} non-terminal for {end - room.born:.3f}s > {budget:.3f}s "
            f"({frozen:.3f}s of it frozen)"
        )
        # Law 5: an event caused by a frame about (room, gen) reaches that generation only.
        if room.role is Role.RECEIVER:
            wrong = {
                c
                for c in room.causes
                if c[0] != room.key.room or c[1] not in (None, room.key.generation)
            }
            assert not wrong, f"law 5: {where} got events of frames about {sorted(wrong, key=str)}"
        else:
            gens = {c for c in room.causes if c[1] is not None}
            assert all(c[0] == room.key.room for c in room.causes), (
                f"law 5: {where} got events of frames about other rooms: {room.causes}"
            )
            assert len(gens) <= 1, f"law 5: {where} got events of several decode rooms: {gens}"
    # Law 6: polls read legal values; before init / send_metadata only the early ones.
    for poll in pair.polls:
        assert isinstance(poll.status, KVPoll), f"law 6: poll returned {poll.status!r}"
        if poll.before_input:
            assert poll.status in _BEFORE_INPUT, (
                f"law 6: {poll.side.value} {poll.key} polled {poll.status.name} before its input"
            )
    pair.polls.clear()
    # Law 3, liveness: a room claimed on a link is failed the moment its side loses the link
    # (no waiting for a deadline).
    for loss in pair.losses[checked.losses :]:
        for key in loss.claimed:
            room = pair.rooms_by[(loss.side, key)]
            assert room.terminal_at is not None, (
                f"law 3: {_where(room)} was claimed on {loss.side.value} link {loss.gen}, lost at "
                f"{loss.at:.3f}, and never failed"
            )
            assert room.terminal_at <= loss.at + 1e-9, (
                f"law 3: {_where(room)} was claimed on {loss.side.value} link {loss.gen}, lost at "
                f"{loss.at:.3f}, and is {room.core.state.name} (terminal at {room.terminal_at})"
            )
    checked.losses = len(pair.losses)
    # Law 4: prefill never hands out the page list of a decode room it told RoomSettled; no
    # byte lands in a page that is free (declared settled, maybe reused) or that another room
    # holds, nor from a sender whose source pages were declared free; a Success has exactly
    # the source bytes.
    for sender, decode_room in pair.settled_pages_given:
        raise AssertionError(
            f"law 4: prefill gave sender {sender} the page list of decode room {decode_room} "
            "after it told decode that room was settled"
        )
    for landing in pair.landings[checked.landings :]:
        # A landing across a prefill freeze is judged like any other: the stale-progress gate
        # refuses the progress that would have moved it late.
        who = f"room {landing.sender.room} gen {landing.sender.generation} chunk {landing.chunk}"
        for kind, index, owner in landing.written:
            assert owner is not None, (
                f"law 4: {who} landed in {kind} {index} at {landing.at:.3f} after decode declared "
                f"it settled (posted under a lease {landing.lease})"
            )
            assert owner == landing.target, (
                f"law 4: {who} landed in {kind} {index} of decode {owner}, not of its own "
                f"decode room {landing.target}"
            )
        assert not landing.sender_settled, f"law 4: {who} read source pages declared settled"
    checked.landings = len(pair.landings)
    assert not pair.canary_errors, f"law 4: {pair.canary_errors}"
    assert not pair.success_checks, f"law 4: {pair.success_checks}"


def check_drained(pair: Pair) -> None:
    """After the drain: every room terminal and settled, every core empty."""
    for room in pair.all_rooms:
        where = _where(room)
        assert room.core.state in TERMINAL, f"{where} wedged in {room.core.state.name}"
        assert not room.gave_up, (
            f"{where} gave up settling ({room.core.state.name}, in flight "
            f"{sorted(room.core.in_flight)}): its pages leak"
        )
        assert room.publication.settled, f"{where} never settled"
        assert room.reaped, f"{where} was never reaped"
    transport = pair.prefill.transport
    assert transport.ledger.in_flight == 0, transport.ledger.records()
    assert transport.ledger.held == 0
    assert transport.leases.live == 0, "a lease outlived its link"
    for side, proc in pair.procs.items():
        entries = {k: v for k, v in proc.core.entries().items() if v}
        assert not entries, f"{side.value} routing still keeps {entries}"
        assert not proc.rooms, f"{side.value} registry still has {list(proc.rooms)}"
    for kind, owners in pair.owner.items():
        held = [(i, o) for i, o in enumerate(owners) if o is not None]
        assert not held, f"decode {kind} still held: {held}"


#: The same episodes on every run, so CI is deterministic; KVFSM_PROPERTY_RANDOM=1 explores
#: new ones (and keeps failures in hypothesis's example database).
_EXPLORE = bool(os.environ.get("KVFSM_PROPERTY_RANDOM"))
RoomPairMachine.TestCase.settings = settings(
    settings(derandomize=True, database=None) if not _EXPLORE else settings(),
    max_examples=EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRoomPair = RoomPairMachine.TestCase


# -- the checker is not vacuous: plant one bug in the IO around the cores, expect the law --------


class _UnfencedTransport(Transport):
    """The poster posts without checking the lease (it was checked at acceptance only)."""

    def lease_valid(self, record: Chunk) -> bool:
        return True


class _UnfencedPrefill(PrefillProcess):
    transport_class = _UnfencedTransport


class _ReceiptLeasePrefill(PrefillProcess):
    """A grant counted from its receipt, not from when its request was sent: a grant that sat
    in the socket while prefill was frozen extends the lease past decode's view of it."""

    def grant(self, action: GrantLease) -> None:
        now = self.clock.now
        super().grant(GrantLease(action.fence, max(action.until, now + self.config.lease_s)))


class _NewestGenerationDecode(DecodeProcess):
    """Decode's plane delivers a frame to the newest room of its id, not to the one it names."""

    def deliver_action(self, action: Deliver, cause: tuple[int, int | None] | None) -> None:
        key = self.current.get(action.key.room, action.key)
        super().deliver_action(Deliver(key, action.event), cause)


class _NoPeerLostPrefill(PrefillProcess):
    """Prefill's plane does not tell bound rooms that their decode link is lost."""

    def link_lost(self, end: LinkEnd, reason: str) -> None:
        actions: list[Action] = self.routing.link_lost(end.gen, reason, self.clock.now)
        self.do(
            a for a in actions if not (isinstance(a, Deliver) and isinstance(a.event, PeerLost))
        )


class _EagerAckPrefill(PrefillProcess):
    """Prefill's plane acknowledges decode's abort at once, before the room's handles settled:
    the seed incident's class of bug (pages freed while a WRITE is live)."""

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        super().on_frame(end, frame)
        if isinstance(frame, RoomAbort):
            self.send(end, RoomSettled(frame.room, frame.generation))


class _NoBytesPair(Pair):
    """A data path that reports chunks done without moving a byte."""

    def land(self, record: Chunk, parts: object = None, fraction: float = 1.0) -> None:
        pass


def _pair(**classes: type) -> type[Pair]:
    return type("PlantedPair", (Pair,), classes)


@pytest.mark.parametrize(
    ("planted", "message"),
    [
        pytest.param(
            _pair(prefill_class=_UnfencedPrefill),
            r"law 4: .* after decode declared it settled \(posted under a lease (expired|revoked)",
            id="no-fence-at-post",
        ),
        pytest.param(
            _pair(decode_class=_NewestGenerationDecode),
            "law 5: receiver .* got events of frames about",
            id="newest-generation",
        ),
        pytest.param(
            _pair(prefill_class=_NoPeerLostPrefill),
            "law 3: sender .* was claimed on prefill link",
            id="no-peer-lost",
        ),
        pytest.param(_NoBytesPair, "law 4: .*Success but", id="no-bytes"),
    ],
)
def test_planted_bug_is_caught(planted: type[Pair], message: str) -> None:
    machine = type("PlantedMachine", (RoomPairMachine,), {"pair_class": planted})
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=2000,
                stateful_step_count=40,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],  # finding it is the point; shrinking costs time
                suppress_health_check=list(HealthCheck),
            ),
        )


# -- episodes spelled out: the scenarios the laws are about, and the planted bugs on them -------


def _run_until(
    pair: Pair, done: Callable[[], bool], step: float = 0.001, limit: float = 30.0
) -> None:
    end = pair.clock.now + limit
    while not done():
        assert pair.clock.now < end, f"not reached in {limit:g}s: {pair.describe()}"
        pair.advance(step)


def _settled(room: ModelRoom) -> bool:
    return room.publication.settled


def _checked(pair: Pair) -> bool:
    check_laws(pair)
    return True


def _first(pair: Pair, side: Side) -> ModelRoom:
    return next(r for r in pair.all_rooms if r.role is side.role)


#: On resume the poster thread goes first: it posts before the loop hears of the lost link
#: (which would fail the room and drop the chunk), so only the lease can stop it.
POSTER_FIRST: Final = ("poster", "reader", "timer")


def _queued_then_frozen(pair: Pair, seconds: float, order: tuple[str, ...] = POSTER_FIRST) -> None:
    """A request whose last chunk the scheduler has just sent: the poster has not taken it
    when the prefill process freezes for ``seconds``."""
    pair.new_request(0, Who.BOTH, 3, True, [ChunkPlan(1), ChunkPlan(2)])
    job = pair.sender_jobs[RoomKey(0, 1)]
    _run_until(pair, lambda: job.sent == len(job.chunks))
    assert pair.prefill.transport.ledger.in_flight == 1  # accepted, queued for the poster
    pair.freeze(Side.PREFILL, seconds, order)


def test_a_clean_request_moves_the_bytes() -> None:
    pair = Pair()
    pair.new_request(0, Who.BOTH, 3, True, [ChunkPlan(1), ChunkPlan(2, ChunkFate.DONE_LATER)])
    _run_until(pair, pair.idle, step=0.25)
    sender, receiver = _first(pair, Side.PREFILL), _first(pair, Side.DECODE)
    assert (sender.core.state, receiver.core.state) == (KVPoll.Success, KVPoll.Success)
    assert len(pair.landings) == 2
    check_laws(pair)
    pair.drain()
    check_laws(pair)
    check_drained(pair)


def test_a_frozen_prefill_cannot_post_into_reused_pages() -> None:
    """The incident: prefill freezes with a chunk queued for its poster. Decode declares the
    link lost after ``silence_s``, settles the room's pages at the lease-derived time and
    reuses them (canaries). When prefill wakes, its poster's lease check refuses the chunk."""
    pair = Pair()
    _queued_then_frozen(pair, 30.0)
    pair.advance(10.0)
    receiver = _first(pair, Side.DECODE)
    assert receiver.core.state is KVPoll.Failed
    assert receiver.settled_at is not None
    lease_end = pair.config.silence_s + pair.config.lease_s + pair.config.fence_margin_s
    assert receiver.settled_at < lease_end + 1.0  # well before prefill wakes
    assert all(o is None for o in pair.owner["kv"])  # free, canaries written
    landed = len(pair.landings)
    pair.advance(25.0)  # prefill wakes at 30 s
    assert len(pair.landings) == landed, "nothing may land after the pages were reused"
    assert pair.prefill.transport.ledger.stats.chunks_fenced == 1
    assert _first(pair, Side.PREFILL).core.state is KVPoll.Failed
    check_laws(pair)
    pair.drain()
    check_laws(pair)
    check_drained(pair)


def test_planted_unfenced_poster_writes_into_reused_pages() -> None:
    pair = _pair(prefill_class=_UnfencedPrefill)()
    _queued_then_frozen(pair, 30.0)
    pair.advance(35.0)
    with pytest.raises(AssertionError, match=r"law 4: .* after decode declared it settled"):
        check_laws(pair)


def test_planted_lease_from_receipt_writes_into_reused_pages() -> None:
    """A LeaseGrant sits in prefill's socket while it is frozen; the link is cut meanwhile.
    Prefill wakes, reads the grant first, then its poster posts. Counted from the request's
    send time the grant is long over; counted from its receipt it would allow the write."""
    requests: list[float] = []

    class Recording(PrefillProcess):
        def send(self, end: LinkEnd, frame: Frame) -> None:
            if isinstance(frame, LeaseRequest):
                requests.append(self.clock.now)
            super().send(end, frame)

    class Planted(Recording, _ReceiptLeasePrefill):
        pass

    def episode(prefill_class: type[PrefillProcess]) -> Pair:
        requests.clear()
        pair = _pair(prefill_class=prefill_class)()
        pair.new_request(0, Who.BOTH, 2, False, [ChunkPlan(2)])
        job = pair.sender_jobs[RoomKey(0, 1)]
        _run_until(pair, lambda: job.inited)
        pair.senders.remove(job)  # the scheduler's next call waits for the right instant
        # The instant a LeaseRequest has gone out (its grant still on the way), the
        # scheduler sends the chunk and prefill freezes; the grant arrives into its socket,
        # then the link is cut.
        start = len(requests)
        _run_until(pair, lambda: len(requests) > start)
        pair.senders.append(job)
        pair.schedulers()
        pair.run(pair.clock.now)
        pair.freeze(Side.PREFILL, 30.0, ("reader", "poster", "timer"))
        pair.advance(0.01)
        pair.cut()
        pair.advance(35.0)
        return pair

    check_laws(episode(Recording))  # production: the grant grants nothing, the chunk is fenced
    with pytest.raises(AssertionError, match=r"law 4: .* after decode declared it settled"):
        check_laws(episode(Planted))


def test_a_write_in_flight_across_a_freeze_is_fenced_out_not_landed() -> None:
    """A WRITE posted before the freeze and still in progress would move its bytes at the first
    progress after the resume (even its release flushes them), after decode reused the pages.
    The stale-progress gate (``Leases.progress_allowed``, asked before every progress) refuses
    that progress: the agent is fenced out, the chunk fails, and nothing lands, ever."""
    pair = Pair()
    pair.new_request(0, Who.BOTH, 2, False, [ChunkPlan(2, ChunkFate.DONE_LATER, 1.0)])
    job = pair.sender_jobs[RoomKey(0, 1)]
    _run_until(pair, lambda: job.sent == 1)
    pair.advance(0.01)  # posted, in progress
    pair.freeze(Side.PREFILL, 20.0)
    pair.advance(25.0)
    assert pair.landings == []
    transport = pair.prefill.transport
    assert transport.fenced
    reason = transport.leases.fenced_out
    assert reason is not None
    assert reason.startswith("NIXL agent fenced out")
    sender = job.facade
    assert sender.poll() is KVPoll.Failed
    check_laws(pair)


def test_a_write_in_flight_across_a_short_freeze_lands_within_the_bound() -> None:
    """Frozen for less than half the margin past the lease's end: the gate lets the pump
    progress, and the WRITE lands while decode still holds the pages."""
    pair = Pair()
    pair.new_request(0, Who.BOTH, 2, False, [ChunkPlan(2, ChunkFate.DONE_LATER, 1.0)])
    job = pair.sender_jobs[RoomKey(0, 1)]
    _run_until(pair, lambda: job.sent == 1)
    pair.advance(0.01)
    pair.freeze(Side.PREFILL, 0.3)
    pair.advance(5.0)
    assert not pair.prefill.transport.fenced
    assert pair.landings
    assert all(owner is not None for landing in pair.landings for _, _, owner in landing.written)
    check_laws(pair)


def _seed_race(pair: Pair) -> ModelRoom:
    """The incident: decode aborts while chunk 0 of 2 is in flight (in progress in NIXL)."""
    pair.new_request(0, Who.BOTH, 3, False, [ChunkPlan(2, ChunkFate.DONE_LATER, 1.0)])
    job = pair.sender_jobs[RoomKey(0, 1)]
    _run_until(pair, lambda: job.sent == 1)
    pair.advance(0.01)  # chunk 0 posted, in progress
    pair.abort(Side.DECODE, 0)
    receiver = _first(pair, Side.DECODE)
    assert pair.receivers[0].facade.poll() is KVPoll.Failed  # at once, for its caller
    return receiver


def test_the_seed_race_settles_only_after_the_in_flight_chunk() -> None:
    """The receiver fails at once but its pages are declared free only after chunk 0 landed
    and prefill, its handles settled, acknowledged the abort."""
    pair = Pair()
    receiver = _seed_race(pair)
    pair.advance(0.5)
    assert receiver.core.state is KVPoll.Failed
    assert not receiver.publication.settled, "chunk 0 may still write"
    pair.advance(1.0)  # chunk 0 lands, then RoomSettled comes
    assert receiver.settled_at is not None
    assert pair.landings
    assert all(landing.at < receiver.settled_at for landing in pair.landings)
    check_laws(pair)
    pair.drain()
    check_laws(pair)
    check_drained(pair)


def test_planted_eager_abort_ack_is_caught_in_the_seed_race() -> None:
    pair = _pair(prefill_class=_EagerAckPrefill)()
    _seed_race(pair)
    pair.advance(1.5)
    with pytest.raises(AssertionError, match=r"law 4: .* after decode declared it settled"):
        check_laws(pair)


def test_a_held_page_list_expires_with_an_answer() -> None:
    """Decode's page list for a room prefill never creates: after ``pending_ttl_s`` prefill
    answers Failed and RoomSettled (nothing was written), so the receiver fails and settles."""
    pair = Pair()
    pair.new_request(0, Who.DECODE_ONLY, 2, False, [])
    receiver_job = pair.receivers[0]
    _run_until(pair, lambda: receiver_job.pages is not None, step=0.05)
    pair.advance(pair.config.pending_ttl_s + 1.0)
    receiver = _first(pair, Side.DECODE)
    assert receiver.core.state is KVPoll.Failed
    assert receiver.publication.settled
    assert pair.prefill.routing.stats["pending_dropped"] == 1
    check_laws(pair)


def test_a_claimed_sender_fails_within_the_liveness_bound() -> None:
    """Decode claims the room before it has pages; the link is cut. The sender fails when
    prefill finds the link silent, not at its Bootstrapping deadline."""
    pair = Pair()
    pair.new_request(0, Who.BOTH, 2, False, [])
    receiver_job = pair.receivers[0]
    pair.receivers.clear()  # decode's scheduler never sends the page list
    receiver_job.facade.init(0)
    _run_until(pair, lambda: bool(pair.prefill.routing.bound_to(1)))
    cut_at = pair.clock.now
    pair.cut()
    sender = _first(pair, Side.PREFILL)
    _run_until(pair, lambda: sender.core.terminal, step=0.05)
    assert sender.core.reason.startswith("peer lost")
    assert sender.terminal_at is not None
    assert sender.terminal_at - cut_at <= pair.config.silence_s + pair.config.tick_s
    check_laws(pair)


def test_planted_missing_peer_lost_is_caught() -> None:
    pair = _pair(prefill_class=_NoPeerLostPrefill)()
    pair.new_request(0, Who.BOTH, 2, False, [])
    receiver_job = pair.receivers[0]
    pair.receivers.clear()
    receiver_job.facade.init(0)
    _run_until(pair, lambda: bool(pair.prefill.routing.bound_to(1)))
    pair.cut()
    pair.advance(5.0)
    with pytest.raises(AssertionError, match=r"law 3: .* was claimed on prefill link 1"):
        check_laws(pair)


def test_an_id_reused_while_its_older_generation_drains() -> None:
    """Generation 1 fails with its pages exposed when the link is cut; generation 2 of the id
    starts at once, on a new link. Generation 1's pages still settle (Reconcile, or the
    lease), nothing of it reaches generation 2, and generation 2 succeeds."""
    pair = Pair()
    pair.new_request(0, Who.BOTH, 2, False, [ChunkPlan(2, ChunkFate.STALL)])
    job = pair.sender_jobs[RoomKey(0, 1)]
    _run_until(pair, lambda: job.sent == 1)
    pair.advance(0.01)
    pair.cut()
    _run_until(pair, lambda: _first(pair, Side.DECODE).core.terminal, step=0.05)
    first = _first(pair, Side.DECODE)
    assert first.settled_at is None
    pair.new_request(0, Who.BOTH, 2, False, [])
    _run_until(pair, pair.idle, step=0.25)
    second = next(r for r in pair.all_rooms if r.role is Role.RECEIVER and r is not first)
    assert second.key == RoomKey(0, 2)
    assert second.core.state is KVPoll.Success
    assert _settled(first)
    check_laws(pair)
    pair.drain()
    check_drained(pair)


def test_planted_newest_generation_routing_is_caught() -> None:
    pair = _pair(decode_class=_NewestGenerationDecode)()
    pair.new_request(0, Who.BOTH, 2, False, [ChunkPlan(2, ChunkFate.STALL)])
    job = pair.sender_jobs[RoomKey(0, 1)]
    _run_until(pair, lambda: job.sent == 1)
    pair.advance(0.01)
    pair.cut()
    _run_until(pair, lambda: _first(pair, Side.DECODE).core.terminal, step=0.05)
    pair.new_request(0, Who.BOTH, 2, False, [])
    with pytest.raises(AssertionError, match="law 5"):
        _run_until(pair, lambda: _checked(pair) and pair.idle(), step=0.25)


# -- production bugs this test found (fixed; kept as regression tests) ---------------------------

#: Found by this test, fixed in PrefillRouting._claim (a frame of a decode room prefill already
#: answered is stale): kept to say what the regression tests below guard.
_FINISHED_PAGE_LIST = (
    "PrefillRouting: once prefill has answered a decode room (link, room, gen) with "
    "RoomOutcome(Failed) + RoomSettled (its sender failed before the page list came: "
    "sender_outcome; a tombstone; a refusal), a RoomMetadata or RoomClaim of that same decode "
    "room arriving afterwards (decode sends its page list right behind its claim) is held as a "
    "new claim, and the id's next sender gets it: it writes into pages decode has settled and "
    "reused (law 4), for a generation that is over (law 5). _claim never consults _finished, "
    "and the tombstone and refusal answers do not even mark the room finished"
)


def _frames(actions: list[Action]) -> list[object]:
    return [a.frame for a in actions if isinstance(a, Send)]


def _claimed_then_failed(core: PrefillRouting, sender: RoomKey) -> list[object]:
    """Decode room (7, 1) claims the sender, which fails before the page list arrives."""
    core.sender_spawned(sender, 0.0)
    core.on_claim(1, RoomClaim(7, 1), 0.0)
    return _frames(core.sender_outcome(sender, KVPoll.Failed, "aborted", 0.1))


def _failed_then_claimed(core: PrefillRouting, sender: RoomKey) -> list[object]:
    """The sender fails before any claim (a tombstone), then decode room (7, 1) claims."""
    core.sender_spawned(sender, 0.0)
    core.sender_outcome(sender, KVPoll.Failed, "aborted", 0.0)
    return _frames(core.on_claim(1, RoomClaim(7, 1), 0.1))


@pytest.mark.parametrize("answered", [_claimed_then_failed, _failed_then_claimed])
def test_a_late_page_list_of_a_settled_room_is_stale(
    answered: Callable[[PrefillRouting, RoomKey], list[object]],
) -> None:
    """The routing core alone, in the orders the pair found."""
    core = PrefillRouting(RoutingConfig())
    core.link_opened(1, "decode-0-22", now=0.0, hello_sent=0.0)
    first, second = RoomKey(7, 101), RoomKey(7, 102)  # two senders of id 7, one after the other
    # Decode is told its room failed and that nothing was written: its pages are free.
    assert RoomSettled(7, 1) in answered(core, first)
    core.sender_reaped(first)
    # The page list decode sent right behind its claim arrives now, then the id's next sender.
    pages = np.arange(2, dtype="<i4").tobytes()
    core.on_metadata(1, RoomMetadata(7, 1, pages, 3), 0.2)
    assert core.sender_spawned(second, 0.3) == [], "the next sender got settled pages"


def test_an_aborted_senders_late_page_list_is_not_written_into() -> None:
    """The same through the pair: prefill aborts its room while decode's page list is on the
    wire; the id's next request gets those pages after decode settled and reused them."""
    pair = Pair()
    pair.new_request(0, Who.BOTH, 1, False, [ChunkPlan(1)])
    receiver = pair.receivers[0]
    _run_until(pair, lambda: receiver.pages is not None)  # the page list is on its way
    pair.abort(Side.PREFILL, 0)
    pair.advance(0.5)
    pair.new_request(0, Who.BOTH, 1, False, [ChunkPlan(1)])
    pair.drain()
    assert not pair.settled_pages_given, pair.settled_pages_given
    violations = [
        landing
        for landing in pair.landings
        if any(owner != landing.target for _, _, owner in landing.written)
    ]
    assert not violations, f"written into pages decode had settled and reused: {violations}"
