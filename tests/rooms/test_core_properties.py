"""Random event sequences against a room core (hypothesis stateful testing).

Events are drawn with valid and invalid payloads alike, in any order, for both roles. Whatever
arrives, the room laws (docs/design.md, The laws) hold: a terminal state never changes, states move
only forward or into Failed, nothing is posted after a room is terminal, the ledger matches the
commands, and settled means terminal with nothing in flight.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvfsm.rooms import RoomCore, RoomStats
from kvfsm.states import (
    TERMINAL,
    AbortRequested,
    ChunkDone,
    ChunkFailed,
    ChunkStalled,
    ChunkSubmitted,
    Command,
    DeadlineExpired,
    DestinationReceived,
    Event,
    EventRejected,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerFailed,
    PeerLost,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReportOutcome,
    ReportSettled,
    Role,
    TransferCompleted,
    TransferConfirmed,
)

page_lists = st.lists(st.integers(0, 10_000), max_size=12).map(
    lambda xs: np.asarray(xs, dtype=np.int32).tobytes()
)
ragged = st.binary(max_size=9)
chunk_ids = st.integers(0, 6)
aux = st.integers(-2, 8)
text = st.text(max_size=8)


class RoomCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.stats = RoomStats()
        self.core = RoomCore(Role.SENDER, self.stats)
        self.history: list[KVPoll] = []
        self.posted: dict[int, PostChunk] = {}
        self.settled_chunks: set[int] = set()
        self.commands_after_terminal: list[tuple[type[Event], Command]] = []
        self.outcomes: list[ReportOutcome] = []
        self.settled_reports = 0

    @initialize(role=st.sampled_from(Role))
    def pick_role(self, role: Role) -> None:
        self.core = RoomCore(role, self.stats)
        self.history = [self.core.state]

    def fire(self, event: Event) -> None:
        was_terminal = self.core.state in TERMINAL
        late = self.stats.late_events
        commands = self.core.handle(event)
        if was_terminal:
            assert self.stats.late_events == late + 1, "a late event was not counted"
            self.commands_after_terminal += [(type(event), c) for c in commands]
        for command in commands:
            if isinstance(command, PostChunk):
                assert command.chunk not in self.posted, "chunk id reused"
                self.posted[command.chunk] = command
            elif isinstance(command, ReportOutcome) and not was_terminal:
                self.outcomes.append(command)
            elif isinstance(command, ReportSettled) and not was_terminal:
                self.settled_reports += 1
        if isinstance(event, (ChunkDone, ChunkFailed)) and event.chunk in self.posted:
            self.settled_chunks.add(event.chunk)
        self.history.append(self.core.state)

    # -- the callers' events --------------------------------------------------------------
    @rule(pages=st.one_of(page_lists, ragged), aux_index=aux)
    def destination(self, pages: bytes, aux_index: int) -> None:
        self.fire(DestinationReceived(pages, aux_index))

    @rule(num_pages=st.integers(-1, 14), aux_index=aux, peer=st.integers(0, 3))
    def init(self, num_pages: int, aux_index: int, peer: int) -> None:
        self.fire(Initialized(num_pages=num_pages, aux_index=aux_index, peer_rank=peer))

    @rule(pages=st.one_of(page_lists, ragged))
    def chunk(self, pages: bytes) -> None:
        self.fire(ChunkSubmitted(pages))

    @rule(pages=st.one_of(page_lists, ragged), aux_index=aux)
    def metadata(self, pages: bytes, aux_index: int) -> None:
        self.fire(MetadataSubmitted(pages, aux_index))

    @rule(reason=text, peer=st.booleans())
    def abort(self, reason: str, peer: bool) -> None:
        self.fire(AbortRequested(reason, origin="peer" if peer else "local"))

    # -- the transport's and the peer's events --------------------------------------------
    @rule(chunk=chunk_ids)
    def chunk_done(self, chunk: int) -> None:
        self.fire(ChunkDone(chunk))

    @rule(chunk=chunk_ids, reason=text)
    def chunk_failed(self, chunk: int, reason: str) -> None:
        self.fire(ChunkFailed(chunk, reason))

    @rule(chunk=chunk_ids)
    def chunk_stalled(self, chunk: int) -> None:
        self.fire(ChunkStalled(chunk, "slow"))

    @rule(peer=st.integers(0, 3))
    def resolved(self, peer: int) -> None:
        self.fire(PeerResolved(peer))

    @rule(peer=st.integers(0, 3))
    def confirmed(self, peer: int) -> None:
        self.fire(TransferConfirmed(peer))

    @rule(peer=st.integers(0, 3))
    def peer_settled(self, peer: int) -> None:
        self.fire(PeerSettled(peer))

    @rule(event=st.sampled_from([PeerLost("x"), PeerFailed("y"), EventRejected("z")]))
    def failure(self, event: Event) -> None:
        self.fire(event)

    @rule(state=st.sampled_from(KVPoll), current=st.booleans())
    def deadline(self, state: KVPoll, current: bool) -> None:
        self.fire(DeadlineExpired(self.core.state if current else state, 1.0))

    @rule()
    def completed(self) -> None:
        self.fire(TransferCompleted())

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def terminal_never_changes(self) -> None:
        first = next((i for i, s in enumerate(self.history) if s in TERMINAL), None)
        if first is not None:
            assert set(self.history[first:]) == {self.history[first]}

    @invariant()
    def only_forward_or_into_failed(self) -> None:
        for before, after in zip(self.history, self.history[1:], strict=False):
            assert after is KVPoll.Failed or after >= before, (before, after)

    @invariant()
    def nothing_is_posted_or_reported_after_terminal(self) -> None:
        # After a terminal state a room only settles, or answers a receiver that reserved
        # pages for a sender that had already failed.
        for event_type, command in self.commands_after_terminal:
            if event_type is DestinationReceived:
                assert self.core.state is KVPoll.Failed
                assert isinstance(command, (ReportOutcome, ReportSettled))
                assert not isinstance(command, ReportOutcome) or command.status is KVPoll.Failed
            else:
                assert isinstance(command, ReportSettled), (event_type, command)

    @invariant()
    def ledger_matches_commands(self) -> None:
        assert self.core.in_flight == frozenset(self.posted) - self.settled_chunks
        for post in self.posted.values():
            assert len(post.src) == len(post.dst)
            if not post.is_last:
                assert (post.src_aux, post.dst_aux) == (-1, -1)
        assert sum(p.is_last for p in self.posted.values()) <= 1

    @invariant()
    def settled_means_terminal_and_idle(self) -> None:
        if self.core.settled:
            assert self.core.state in TERMINAL
            assert not self.core.in_flight

    @invariant()
    def success_has_a_complete_transfer(self) -> None:
        if self.core.state is KVPoll.Success and self.core.role is Role.SENDER:
            assert any(p.is_last for p in self.posted.values())
            assert not self.core.in_flight
            assert self.outcomes == [ReportOutcome(KVPoll.Success)]

    @invariant()
    def failed_has_a_reason_and_one_outcome_at_most(self) -> None:
        if self.core.state is KVPoll.Failed:
            assert self.core.reason
        assert len(self.outcomes) <= 1
        assert self.settled_reports <= 1


RoomCoreMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None
)
TestRoomCore = RoomCoreMachine.TestCase
