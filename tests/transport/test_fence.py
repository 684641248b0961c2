"""Write fencing (law 4): ``Leases`` on its own, then on real NIXL (UCX, DRAM into another
process) with a proxy around the agent that can hold the poster thread inside
``make_prepped_xfer`` while the test revokes or outlives a lease, and can make a posted part
report ``PROC`` (on this machine's CMA path every WRITE is over inside ``transfer()``)."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.manager import CommandRouter
from kvfsm.rooms import RoomConfig, RoomEngine, SenderRoom
from kvfsm.states import TERMINAL, DestinationReceived, KVPoll
from kvfsm.transport import Agent, AgentConfig, Leases, NixlTransport, TransferConfig
from kvfsm.transport._fence import REVOKED_KEPT
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, page_digests
from kvfsm.workload.peer import PeerProcess
from tests.helpers.interpose import Interposer
from tests.helpers.transport import RecordingControl
from tests.helpers.waiting import stays_true_sync, wait_until_sync

SHAPE = Shape(layers=2, num_pages=64, page_bytes=1024, aux_rows=8, aux_row_bytes=64)
CANARY = 0xAB
FENCE = 7

# -- Leases ----------------------------------------------------------------------------------


def test_a_grant_extends_and_never_shortens() -> None:
    leases = Leases()
    assert not leases.valid(1, 0.0)
    leases.grant(1, 10.0)
    assert leases.valid(1, 9.99)
    assert not leases.valid(1, 10.0)  # until is exclusive
    leases.grant(1, 5.0)
    assert leases.until(1) == 10.0
    leases.grant(1, 12.0)
    assert leases.until(1) == 12.0
    assert leases.describe(1, 13.0) == "expired 1s ago"
    leases.grant(1, 20.0)  # an expired lease may be extended by a (correctly anchored) grant
    assert leases.valid(1, 13.0)
    assert leases.stats.grants == 4


def test_a_revoked_fence_never_comes_back() -> None:
    leases = Leases()
    leases.grant(3, 10.0)
    leases.revoke(3)
    assert not leases.valid(3, 0.0)
    assert leases.until(3) == -math.inf
    leases.grant(3, 100.0)  # a late grant, say one that sat in a socket buffer
    assert not leases.valid(3, 0.0)
    assert leases.describe(3, 0.0) == "revoked"
    assert leases.stats.grants_refused == 1
    assert leases.live == 0


def test_a_fence_first_granted_after_a_newer_one_was_revoked_is_accepted() -> None:
    """Link 5's first grant takes a round trip; link 6 may be lost meanwhile."""
    leases = Leases()
    leases.grant(6, 10.0)
    leases.revoke(6)
    leases.grant(5, 10.0)
    assert leases.valid(5, 0.0)
    assert not leases.valid(6, 0.0)


def test_revoked_fences_stay_bounded_and_stay_revoked() -> None:
    leases = Leases()
    leases.grant(1, 10.0)
    leases.grant(2, 10.0)
    leases.revoke(2)
    leases.grant(1, 20.0)  # a live fence below a revoked one: untouched, still extendable
    assert leases.until(1) == 20.0
    first = 100
    for fence in range(first, first + 3 * REVOKED_KEPT):  # links over a process's life
        leases.grant(fence, 10.0)
        leases.revoke(fence)
    assert leases.live == 1  # only fence 1
    assert len(leases._until) == 1
    assert len(leases._revoked) == REVOKED_KEPT
    for fence in (2, first, first + 3 * REVOKED_KEPT - 1):  # folded into the watermark, or kept
        leases.grant(fence, 30.0)
        assert not leases.valid(fence, 0.0), fence
        assert leases.describe(fence, 0.0) == "revoked"
    assert leases.valid(1, 0.0)
    assert leases.describe(first + 3 * REVOKED_KEPT, 0.0) == "never granted"


def test_fence_zero_is_never_granted() -> None:
    leases = Leases()
    leases.grant(0, 10.0)
    assert not leases.valid(0, 0.0)
    assert leases.stats.grants_refused == 1


# -- the stale-progress gate (sans-IO: every call is given its ``now``) ------------------------

MARGIN = 1.0  # the gate refuses at lease end + 0.5 s if not progressed since lease end + 0.25 s


def gated(until: float = 10.0) -> Leases:
    """A gate with fence 1 granted until ``until`` and one record of it open, progressed at 9."""
    leases = Leases(margin_s=MARGIN)
    leases.grant(1, until)
    assert leases.progress_allowed(9.0)
    leases.opened(1)
    return leases


def test_a_writer_frozen_with_a_write_open_across_its_lease_end_is_fenced_out() -> None:
    leases = gated()
    assert leases.progress_allowed(9.5)  # last progress 9.5, before the lease ends at 10
    # Frozen until 10.5 = lease end + margin/2: bytes pushed now could land past decode's bound.
    assert not leases.progress_allowed(10.5)
    assert leases.fenced_out is not None
    assert "fence 1" in leases.fenced_out
    assert "restart this process" in leases.fenced_out
    # For ever, whatever happens next: the record's end, a grant, any later time.
    leases.closed(1)
    leases.grant(1, 100.0)
    leases.grant(2, 100.0)
    assert not leases.progress_allowed(10.6)
    assert not leases.progress_allowed(1e9)
    assert not leases.valid(1, 10.6)
    assert not leases.valid(2, 10.6)
    assert leases.describe(2, 10.6).startswith("void: NIXL agent fenced out")
    assert leases.stats.progress_refused == 3
    assert leases.stats.grants_refused == 2


def test_a_freeze_shorter_than_half_the_margin_past_the_lease_end_is_allowed() -> None:
    """Bytes pushed before lease end + margin/2 land (milliseconds) before decode's bound."""
    leases = gated()
    assert leases.progress_allowed(10.49)
    assert leases.fenced_out is None


def test_a_writer_that_kept_progressing_past_the_lease_end_is_never_fenced_out() -> None:
    """The normal end of a link: the lease runs out with a chunk in flight, the pump holds it
    (quarantine: the record stays open) and keeps progressing, so its bytes drained within
    milliseconds; a freeze after that moves nothing that could still be queued."""
    leases = gated()
    now = 9.0
    while now < 12.0:
        now += 0.02
        assert leases.progress_allowed(now), now
    assert leases.progress_allowed(60.0)  # frozen long after the drain: nothing queued then
    assert leases.fenced_out is None


def test_progress_a_quarter_margin_after_the_lease_end_counts_as_drained() -> None:
    leases = gated()
    assert leases.progress_allowed(10.25)
    assert leases.progress_allowed(30.0)
    other = gated()
    assert other.progress_allowed(10.24)
    assert not other.progress_allowed(30.0)


def test_nothing_open_nothing_to_fence() -> None:
    leases = gated()
    leases.closed(1)  # the record's final event came before the freeze
    assert leases.progress_allowed(1000.0)
    never = Leases(margin_s=MARGIN)
    never.grant(1, 10.0)
    assert never.progress_allowed(1000.0)
    assert leases.fenced_out is None
    assert never.fenced_out is None


def test_a_renewed_lease_moves_the_gate() -> None:
    leases = gated()
    leases.grant(1, 20.0)  # renewed while the record is open
    assert leases.progress_allowed(19.9)  # (the old lease end, 10, no longer counts)
    assert not leases.progress_allowed(20.5)


def test_a_revoked_fence_keeps_its_lease_end_for_the_gate() -> None:
    """Link loss revokes the fence at once; decode still settles at its last grant + lease +
    margin, so what counts is the lease end the writer was granted, not the revoke."""
    leases = gated()
    leases.revoke(1)
    assert not leases.valid(1, 9.1)
    assert leases.progress_allowed(10.4)  # progressed at 10.4: drained past lease end + 0.25
    other = gated()
    other.revoke(1)
    assert not other.progress_allowed(11.0)


def test_the_earliest_open_lease_is_not_the_only_one_judged() -> None:
    """Fence 2's lease ended later; progress between the two lease ends does not drain it."""
    leases = Leases(margin_s=MARGIN)
    leases.grant(1, 10.0)
    leases.grant(2, 12.0)
    assert leases.progress_allowed(9.0)
    leases.opened(1)
    leases.opened(2)
    assert leases.progress_allowed(10.3)  # fence 1 drained; fence 2 still valid
    assert not leases.progress_allowed(13.0)  # fence 2: last progress 10.3 < 12.25
    assert "fence 2" in (leases.fenced_out or "")


def test_open_records_are_counted() -> None:
    leases = gated()
    leases.opened(1)
    leases.closed(1)  # one of two is over
    assert not leases.progress_allowed(11.0)
    other = gated()
    other.opened(1)
    other.closed(1)
    other.closed(1)
    other.closed(1)  # (one too many is harmless)
    assert other.progress_allowed(11.0)


def test_each_fence_is_judged_by_the_margin_its_owner_told() -> None:
    """Decode's Hello tells its margin, and every grant carries it: a decode with a 0.2 s
    margin settles 0.2 s after the lease, whatever prefill's own setting (here 1 s) says."""
    for told in (True, False):
        leases = Leases(margin_s=MARGIN)
        leases.grant(1, 10.0, 0.2 if told else None)
        assert leases.margin(1) == (0.2 if told else MARGIN)
        assert leases.progress_allowed(9.0)
        leases.opened(1)
        # 10.1 = lease end + 0.2/2, not progressed since: refused only by the told margin.
        assert leases.progress_allowed(10.1) is not told
        if told:
            assert "margin 0.2s" in (leases.fenced_out or "")


def test_a_margin_told_later_moves_an_open_fence() -> None:
    leases = gated()  # fence 1 until 10, open, margin 1 (the default)
    leases.grant(1, 10.0, 0.2)  # the same lease, now with the owner's margin
    leases.revoke(1)  # the link is lost: the open record keeps the lease end and the margin
    assert not leases.progress_allowed(10.1)
    assert gated().progress_allowed(10.1)  # told nothing: judged by the default, 10 + 0.5


def test_without_a_margin_the_gate_never_refuses() -> None:
    leases = Leases()
    leases.grant(1, 10.0)
    leases.opened(1)
    assert leases.progress_allowed(1e9)
    with pytest.raises(ValueError, match="margin_s"):
        Leases(margin_s=-1.0)


# -- a NIXL proxy that holds the poster ---------------------------------------------------------


class Gate(Interposer):
    """Wraps the raw NIXL agent (``AgentConfig.interpose``). ``hold_at`` = n holds the poster
    thread in the n-th ``make_prepped_xfer`` (1-based) until ``release()``; ``stuck`` makes
    every posted handle report PROC (its real transfer is over) until ``unstick()``."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_at = 0
        self.made = 0
        self.transfers = 0
        self.progresses = 0
        self.checks = 0
        self.flush_calls = 0  # posts and checks of flushes (READs)
        self.calls: list[str] = []
        self.stuck = False
        self.holding = threading.Event()
        self._open = threading.Event()

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().make_prepped_xfer(*args, **kwargs)
        if self.is_flush(handle):
            return handle  # a held chunk's flush: counted nowhere, never stuck
        self.made += 1
        if self.made == self.hold_at:
            self.holding.set()
            assert self._open.wait(30), "the test never released the poster"
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> str:
        if self.is_flush(handle):
            self.flush_calls += 1
            return str(self.inner.transfer(handle, *args, **kwargs))
        self.transfers += 1
        state = str(self.inner.transfer(handle, *args, **kwargs))
        return "PROC" if self.stuck else state

    def check_xfer_state(self, handle: Any) -> str:
        if self.is_flush(handle):
            self.flush_calls += 1
            return str(self.inner.check_xfer_state(handle))
        self.checks += 1
        state = str(self.inner.check_xfer_state(handle))
        return "PROC" if self.stuck else state

    def get_new_notifs(self) -> Any:
        self.progresses += 1
        return self.inner.get_new_notifs()

    # The order in which handles, lists and remote agents go (``calls``).
    def release_xfer_handle(self, handle: Any) -> Any:
        self.calls.append("release_xfer_handle")
        return self.inner.release_xfer_handle(handle)

    def release_dlist_handle(self, dlist: Any) -> Any:
        self.calls.append("release_dlist_handle")
        return self.inner.release_dlist_handle(dlist)

    def remove_remote_agent(self, name: str) -> Any:
        self.calls.append("remove_remote_agent")
        return self.inner.remove_remote_agent(name)

    def release(self) -> None:
        self._open.set()

    def touched(self) -> tuple[int, ...]:
        """How many times the agent was called, by kind (a fenced-out agent's stay put)."""
        return (
            self.made,
            self.transfers,
            self.progresses,
            self.checks,
            self.flush_calls,
            len(self.calls),
        )

    def unstick(self) -> None:
        self.stuck = False


class FencedPrefill:
    """A prefill engine whose transport is fenced by ``leases``, through a :class:`Gate`."""

    def __init__(
        self, peer: PeerProcess, config: TransferConfig | None = None, margin_s: float = 1.0
    ) -> None:
        self.kv, self.aux = make_buffers(SHAPE)
        rng = np.random.default_rng(5)
        for buf in (*self.kv, self.aux):
            buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
        self.gate = Gate()
        self.agent = Agent(
            f"fenced-prefill-{os.getpid()}-{id(self)}",
            make_layout(self.kv, self.aux),
            AgentConfig(interpose=self.gate),
        )
        self.leases = Leases(margin_s=margin_s)
        self.transport = NixlTransport(self.agent, config or TransferConfig(), leases=self.leases)
        router = CommandRouter(RecordingControl(), self.transport)
        self.engine = RoomEngine(router, RoomConfig()).start()
        self.engine.call(self.transport.connect_peer("decode", peer.metadata, peer.summary))

    def on_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (where leases are granted and revoked)."""

        async def call() -> None:
            fn(*args)

        self.engine.call(call())

    def grant(self, fence: int, seconds: float) -> None:
        self.on_loop(self.leases.grant, fence, time.monotonic() + seconds)

    def revoke(self, fence: int) -> None:
        self.on_loop(self.leases.revoke, fence)

    def room(
        self, room: int, src: list[int], dst: list[int], *, fence: int = FENCE, aux: bool = False
    ) -> SenderRoom:
        """One room, one chunk; with ``aux`` its last chunk also writes aux row 1 -> row 2."""
        sender = self.engine.sender(room)
        packed = np.asarray(dst, np.int32).tobytes()
        self.engine.post(sender.key, DestinationReceived(packed, 2, "decode", fence=fence))
        wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
        sender.init(len(src), 1 if aux else -1)
        sender.send(np.asarray(src, np.int32))
        return sender

    def close(self) -> None:
        self.gate.release()
        self.engine.close()
        self.transport.close()
        stats = self.transport.snapshot()
        self.agent.close()
        if self.transport.fenced_out is not None:
            return  # its handles and peers are left as they are, on purpose
        assert stats["handles_created"] == stats["handles_released"], stats
        assert stats["in_flight"] == 0, stats
        assert self.agent.peers_added == self.agent.peers_removed


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    process = PeerProcess(SHAPE, name=f"fence-peer-{os.getpid()}")
    yield process
    process.close()


@pytest.fixture
def make(peer: PeerProcess) -> Iterator[list[FencedPrefill]]:
    made: list[FencedPrefill] = []
    yield made
    for prefill in made:
        prefill.close()


def untouched(peer: PeerProcess, pages: list[int]) -> bool:
    """Every byte of decode's ``pages`` (all K and V buffers) is still the canary."""
    filled = [np.full((1, SHAPE.page_bytes), CANARY, np.uint8)] * (2 * SHAPE.layers)
    canary = page_digests(filled, np.zeros(1, np.int32))[0]
    return bool(peer.ask("digests", np.asarray(pages, np.int32).tobytes()) == [canary] * len(pages))


def landed(prefill: FencedPrefill, peer: PeerProcess, src: list[int], dst: list[int]) -> bool:
    got = peer.ask("digests", np.asarray(dst, np.int32).tobytes())
    return bool(got == page_digests(prefill.kv, np.asarray(src, np.int32)))


def test_a_valid_lease_lets_the_chunk_through(make: list[FencedPrefill], peer: PeerProcess) -> None:
    prefill = FencedPrefill(peer)
    make.append(prefill)
    prefill.grant(FENCE, 30.0)
    sender = prefill.room(1, [3, 4], [10, 11], aux=True)
    wait_until_sync(lambda: sender.poll() in TERMINAL)
    assert sender.poll() is KVPoll.Success, sender.reason
    assert landed(prefill, peer, [3, 4], [10, 11])
    assert peer.ask("aux", 2) == prefill.aux[1].tobytes()
    assert prefill.transport.stats.chunks_fenced == 0


@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_a_chunk_whose_lease_goes_while_it_is_queued_is_never_written(
    make: list[FencedPrefill], peer: PeerProcess, how: str
) -> None:
    """The incident: the writer is held (here: inside make_prepped_xfer, deterministically)
    with a chunk it accepted under a valid lease; meanwhile the lease goes. When the writer
    moves again, nothing is posted, and the chunk fails settled."""
    prefill = FencedPrefill(peer)
    make.append(prefill)
    assert peer.ask("fill", CANARY)
    prefill.grant(FENCE, 1.0 if how == "expired" else 30.0)
    prefill.gate.hold_at = 1
    sender = prefill.room(2, [5, 6, 7], [20, 21, 22])
    assert prefill.gate.holding.wait(10)  # accepted, and the poster is inside the first part
    if how == "revoked":
        prefill.revoke(FENCE)
    else:
        wait_until_sync(  # the lease is over on the real clock: the leases' own time
            lambda: not prefill.leases.valid(FENCE, time.monotonic()),
            timeout=5,
            message=f"the lease of fence {FENCE} to expire",
        )
    prefill.gate.release()
    wait_until_sync(lambda: sender.poll() in TERMINAL)
    assert sender.poll() is KVPoll.Failed
    assert f"write lease of fence {FENCE} {how}" in sender.reason, sender.reason
    assert "not posted" in sender.reason
    wait_until_sync(lambda: sender.settled)  # nothing was written: settled at once, no quarantine
    assert prefill.gate.transfers == 0
    assert untouched(peer, [20, 21, 22])
    stats = prefill.transport.stats
    assert stats.chunks_fenced == 1
    assert stats.chunks_quarantined == 0


def test_a_chunk_without_a_valid_lease_is_refused_before_the_poster(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    prefill = FencedPrefill(peer)
    make.append(prefill)
    assert peer.ask("fill", CANARY)
    prefill.grant(FENCE, 30.0)
    prefill.revoke(FENCE)
    sender = prefill.room(3, [1], [30])
    unfenced = prefill.room(4, [2], [31], fence=0)
    wait_until_sync(lambda: sender.poll() in TERMINAL and unfenced.poll() in TERMINAL)
    assert "write lease of fence 7 revoked: not posted" in sender.reason
    assert "unfenced chunk on a fenced transport" in unfenced.reason
    wait_until_sync(lambda: sender.settled and unfenced.settled)
    assert prefill.gate.made == 0  # not even a handle
    assert untouched(peer, [30, 31])


def test_a_lease_gone_after_one_part_is_posted_holds_the_chunk(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    """The kv part is posted and (as the proxy says) still in flight when the lease goes before
    the aux part: the aux part is never posted, and the chunk is released and quarantined,
    because the kv part's bytes may still move."""
    config = TransferConfig(deadline_base_s=30.0, quarantine_s=0.5)
    prefill = FencedPrefill(peer, config)
    make.append(prefill)
    assert peer.ask("fill", CANARY)
    prefill.grant(FENCE, 30.0)
    prefill.gate.stuck = True
    prefill.gate.hold_at = 2  # the aux part's handle
    sender = prefill.room(5, [8], [40], aux=True)
    assert prefill.gate.holding.wait(10)
    prefill.revoke(FENCE)
    prefill.gate.release()
    wait_until_sync(lambda: sender.poll() in TERMINAL)
    assert sender.poll() is KVPoll.Failed
    assert "stalled" in sender.reason, sender.reason
    assert f"write lease of fence {FENCE} revoked before part 2 of 2" in sender.reason
    assert not sender.settled  # quarantined: the kv part may still be moving
    wait_until_sync(lambda: sender.settled, timeout=10)
    assert prefill.gate.transfers == 1
    assert peer.ask("aux", 2) == bytes([CANARY]) * SHAPE.aux_row_bytes  # never posted
    assert prefill.transport.stats.chunks_quarantined == 1


def test_an_in_flight_chunk_whose_lease_goes_is_released_before_its_deadline(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    config = TransferConfig(deadline_base_s=30.0, quarantine_s=0.5)
    prefill = FencedPrefill(peer, config)
    make.append(prefill)
    prefill.grant(FENCE, 30.0)
    prefill.gate.stuck = True  # posted, and in flight for as long as the proxy says so
    sender = prefill.room(6, [9], [41])
    wait_until_sync(lambda: prefill.transport.stats.pump_rounds > 3)
    assert sender.poll() is KVPoll.Transferring
    prefill.revoke(FENCE)
    wait_until_sync(lambda: sender.poll() in TERMINAL)
    # Ended by the pump's lease check (the reason, and no stall counted below), not by the
    # chunk's 30 s deadline.
    assert f"write lease of fence {FENCE} revoked" in sender.reason, sender.reason
    assert "stalled" in sender.reason
    assert not sender.settled
    wait_until_sync(lambda: sender.settled, timeout=10)
    stats = prefill.transport.stats
    assert stats.chunks_fenced == 1
    assert stats.chunks_stalled == 0  # not a deadline


def test_after_a_hold_an_idle_pump_keeps_progressing_the_agent_then_parks(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    """Bytes of a released WRITE still queued in the agent move only when it is progressed. On
    a cut link they can move only once the link is back, long after the quarantine; if the
    pump parked, they would land with the next transfer, after their pages were settled and
    reused (the two-host cut test showed it). So after a hold an idle pump keeps progressing
    every ``linger_interval_s`` for ``linger_s``, and only then parks."""
    config = TransferConfig(
        deadline_base_s=30.0, quarantine_s=0.2, linger_s=1.5, linger_interval_s=0.01
    )
    prefill = FencedPrefill(peer, config)
    make.append(prefill)
    gate, stats = prefill.gate, prefill.transport.stats
    prefill.grant(FENCE, 30.0)
    quiet = gate.progresses
    # Nothing ever held: an idle pump does not progress (30 linger intervals to show it).
    stays_true_sync(lambda: gate.progresses == quiet, duration=0.3, message="no progress")
    gate.stuck = True
    sender = prefill.room(7, [10], [42])
    wait_until_sync(lambda: stats.pump_rounds > 3)
    prefill.revoke(FENCE)
    wait_until_sync(
        lambda: sender.settled, timeout=10
    )  # quarantine over: nothing in flight or held
    assert prefill.transport.snapshot()["in_flight"] == 0
    lingering = gate.progresses
    wait_until_sync(  # idle, and still progressing
        lambda: gate.progresses >= lingering + 2, timeout=0.3, interval=0.005
    )
    assert stats.linger_progresses > 0
    # Then it parks: no progress for 30 linger intervals, once the linger is over.
    wait_until_sync(
        unchanged_for(lambda: gate.progresses, 0.3),
        timeout=config.linger_s + 10,
        interval=0.01,
        message="the pump to park after its linger",
    )


def unchanged_for(read: Callable[[], object], seconds: float) -> Callable[[], bool]:
    """A predicate for ``wait_until_sync``: true once ``read()`` has given the same value for
    ``seconds`` (a change starts the count again)."""
    last: list[object] = [read(), time.monotonic()]

    def check() -> bool:
        value, now = read(), time.monotonic()
        if value != last[0]:
            last[:] = [value, now]
        return now - float(last[1]) >= seconds  # type: ignore[arg-type]

    return check


def in_flight_for_good(
    make: list[FencedPrefill], peer: PeerProcess
) -> tuple[FencedPrefill, SenderRoom]:
    """A fenced prefill with one room whose chunk is posted and in flight for as long as the
    proxy says so (``gate.unstick()`` ends that)."""
    prefill = FencedPrefill(peer, TransferConfig(deadline_base_s=30.0, quarantine_s=0.5))
    make.append(prefill)
    prefill.grant(FENCE, 30.0)
    prefill.gate.stuck = True
    sender = prefill.room(8, [11], [43])
    wait_until_sync(lambda: prefill.transport.stats.pump_rounds > 3)
    return prefill, sender


def test_a_reconnect_of_the_same_process_keeps_its_generation_and_the_write_in_flight(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    """The same peer process connected again (its control link came back, same metadata):
    its generation is kept, and so is its chunk in flight. Replacing it would remove the
    remote agent, and with it the endpoint whose flush is the only proof that a WRITE to it
    is over (``remove_remote_agent`` returns at once; queued bytes still land later)."""
    prefill, sender = in_flight_for_good(make, peer)
    gate = prefill.gate
    gate.calls.clear()
    before = prefill.transport.peer("decode")
    prefill.engine.call(prefill.transport.connect_peer("decode", peer.metadata, peer.summary))
    assert prefill.transport.peer("decode") is before
    assert "remove_remote_agent" not in gate.calls
    assert sender.poll() is KVPoll.Transferring
    gate.unstick()
    wait_until_sync(lambda: sender.poll() in TERMINAL, timeout=10)
    assert sender.poll() is KVPoll.Success


def test_a_restarted_peer_holds_the_old_generations_writes_before_its_agent_goes(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    """The peer id connected again by another process (a restart: other metadata): the old
    generation's lists and remote agent go. A chunk still in flight to it must be released
    and held first, as for a lost peer: removing the agent under a live handle makes NIXL say
    ERR for reasons that say nothing about the WRITE."""
    prefill, sender = in_flight_for_good(make, peer)
    gate = prefill.gate
    assert sender.poll() is KVPoll.Transferring
    gate.calls.clear()
    restarted = PeerProcess(SHAPE, name=f"fence-peer-restarted-{os.getpid()}")
    try:
        prefill.engine.call(
            prefill.transport.connect_peer("decode", restarted.metadata, restarted.summary)
        )
        wait_until_sync(lambda: sender.poll() in TERMINAL, timeout=5)  # at once, not at 30 s
        assert "reconnected" in sender.reason, sender.reason
        assert not sender.settled  # held: the old WRITE may still be moving
        assert gate.calls.index("release_xfer_handle") < gate.calls.index("remove_remote_agent")
        gate.unstick()
        wait_until_sync(lambda: sender.settled, timeout=10)
        assert prefill.transport.stats.chunks_quarantined == 1
    finally:
        prefill.close()
        make.remove(prefill)
        restarted.close()


def freeze(prefill: FencedPrefill, seconds: float) -> tuple[int, ...]:
    """Stop the loop thread (the pump) for ``seconds``, the poster being idle: the process
    calls NIXL no more than a SIGSTOPped one would. Returns what the agent had been asked when
    the freeze began."""

    async def frozen() -> tuple[int, ...]:
        touched = prefill.gate.touched()
        time.sleep(seconds)  # noqa: ASYNC251 - blocking the loop is the point: a freeze
        return touched

    result: tuple[int, ...] = prefill.engine.call(frozen())
    return result


def test_a_writer_frozen_with_a_write_in_flight_past_its_lease_is_fenced_out(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    """Over TCP a posted WRITE moves only when the writer progresses its agent
    (``fence_probe --probes queued``), and releasing it does not cancel it: progressed after
    a freeze that outlived its lease, it would land in pages decode already settled. So the
    pump's first act after such a freeze is the gate's refusal: every posted chunk fails
    without another NIXL call, and the agent is never called again, not even at close."""
    config = TransferConfig(deadline_base_s=30.0, quarantine_s=0.5)
    prefill = FencedPrefill(peer, config, margin_s=0.4)
    make.append(prefill)
    prefill.grant(FENCE, 0.6)
    prefill.gate.stuck = True  # in flight for as long as the proxy says so
    sender = prefill.room(8, [11], [43])
    wait_until_sync(lambda: prefill.transport.stats.pump_rounds > 3)
    assert sender.poll() is KVPoll.Transferring
    before = freeze(prefill, 1.5)  # the lease ends 0.6 s in, decode's bound 0.4 s later
    wait_until_sync(lambda: sender.poll() in TERMINAL)
    reason = prefill.transport.fenced_out
    assert reason is not None
    assert reason in sender.reason, sender.reason
    assert sender.settled  # nothing it posted can move: the agent is never progressed again
    assert prefill.transport.snapshot()["fenced_out"] == 1
    assert prefill.agent.abandoned is not None
    # A new room fails at once: no lease is valid on a fenced-out agent.
    prefill.grant(FENCE, 30.0)
    later = prefill.room(9, [12], [44])
    wait_until_sync(lambda: later.poll() in TERMINAL)
    assert later.poll() is KVPoll.Failed
    assert "void: NIXL agent fenced out" in later.reason
    prefill.close()
    make.remove(prefill)
    assert prefill.gate.touched() == before  # not one NIXL call since the freeze began


def test_a_short_freeze_past_the_lease_end_only_holds_the_chunk(
    make: list[FencedPrefill], peer: PeerProcess
) -> None:
    """Woken before the lease's end + margin/2, the writer may still progress: what it had
    queued lands well inside decode's bound. The chunk is held as usual, nothing fenced out."""
    config = TransferConfig(deadline_base_s=30.0, quarantine_s=0.3)
    prefill = FencedPrefill(peer, config, margin_s=4.0)
    make.append(prefill)
    prefill.grant(FENCE, 0.5)
    prefill.gate.stuck = True
    sender = prefill.room(10, [13], [45])
    wait_until_sync(lambda: prefill.transport.stats.pump_rounds > 3)
    freeze(prefill, 1.0)  # lease end + 0.5 s < + margin/2 = 2 s
    wait_until_sync(lambda: sender.settled, timeout=10)
    assert sender.poll() is KVPoll.Failed
    assert "expired" in sender.reason, sender.reason
    assert prefill.transport.fenced_out is None
    prefill.gate.unstick()
    prefill.grant(FENCE, 30.0)
    again = prefill.room(11, [14], [46])
    wait_until_sync(lambda: again.poll() in TERMINAL)
    assert again.poll() is KVPoll.Success, again.reason
