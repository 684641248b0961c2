"""``kvfsm.transport._pump``: the completion pump and the ledger's actions, driven on this test's
event loop with real NIXL handles (two agents in this process, DRAM to DRAM). A proxy around the
writer's agent can keep a posted WRITE reporting ``PROC``, make one release fail, or raise a
remote disconnect, so each path that ends a chunk is taken on purpose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from kvfsm.rooms import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed, ChunkStalled, Event, PeerLost
from kvfsm.transport import AgentConfig, Leases, TransferConfig
from kvfsm.transport._agent import Peer
from kvfsm.transport._chunks import Xfer, post_xfer
from kvfsm.transport._pump import Pump
from kvfsm.transport._slices import NO_KV
from tests.helpers.interpose import Interposer
from tests.helpers.nixl_pair import OWN_PEER, SHAPE, Pair, chunk
from tests.helpers.waiting import stays_true, wait_until

FENCE = 7


class nixlRemoteDisconnectError(Exception):  # noqa: N801 - NIXL's name is what is matched
    pass


class Proxy(Interposer):
    """Wraps the writer's raw NIXL agent (``AgentConfig.interpose``). ``stuck``: every handle
    reports PROC (its real transfer is over); ``refuse_release``: the next release raises;
    ``disconnect``: checking a handle raises NIXL's remote-disconnect error. Progressing the
    writer also progresses the receiver (``pair.progress``), which, in a process of its own,
    would progress itself."""

    def __init__(self) -> None:
        super().__init__()
        self.pair: Pair | None = None
        self.stuck = False
        self.refuse_release = False
        self.disconnect = False
        self.progresses = 0

    def transfer(self, handle: Any) -> str:
        state = str(self.inner.transfer(handle))
        return "PROC" if self.stuck and not self.is_flush(handle) else state

    def check_xfer_state(self, handle: Any) -> str:
        if self.disconnect:
            raise nixlRemoteDisconnectError("remote agent gone")
        state = str(self.inner.check_xfer_state(handle))
        return "PROC" if self.stuck and not self.is_flush(handle) else state

    def get_new_notifs(self) -> Any:
        self.progresses += 1
        if self.pair is not None:
            self.pair.progress()
        return self.inner.get_new_notifs()

    def release_xfer_handle(self, handle: Any) -> Any:
        if self.refuse_release:
            self.refuse_release = False
            raise RuntimeError("NIXL_ERR_BACKEND: release refused")
        return self.inner.release_xfer_handle(handle)


class Inbox:
    """The engine's side: what was delivered, with the handles released at that moment."""

    def __init__(self, pair: Pair, accepting: bool = True) -> None:
        self.pair = pair
        self.accepting = accepting
        self.got: list[tuple[Event, int]] = []
        self.runs = 0  # run_woken calls: the pump asks for woken rooms to run at once
        self.runs_at: list[int] = []  # ``runs`` at each delivery

    def deliver(self, key: RoomKey, event: Event) -> bool:
        self.got.append((event, self.pair.stats.handles_released))
        self.runs_at.append(self.runs)
        return self.accepting

    def events(self) -> list[type]:
        return [type(event) for event, _ in self.got]

    def run_woken(self) -> None:
        self.runs += 1


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[int, bool]] = []

    def chunk(self, nbytes: int, seconds: float, ok: bool) -> None:
        self.seen.append((nbytes, ok))


class World:
    """A pair, a ledger, and a started pump on the running loop; chunks posted as the poster
    would post them (here, on the loop thread)."""

    def __init__(self, config: TransferConfig, leases: Leases | None = None) -> None:
        self.proxy = Proxy()
        self.pair = Pair(AgentConfig(interpose=self.proxy))
        self.proxy.pair = self.pair
        self.ledger = self.pair.ledger_with(leases, config)
        self.inbox = Inbox(self.pair)
        self.observer = Observer()
        self.lost: list[tuple[Peer, str]] = []
        self.pump = Pump(
            self.pair.mine.agent.nixl,
            self.ledger,
            config,
            self.pair.stats,
            leases=leases,
            post=self.post,
            disconnected=self.disconnected,
            observer=self.observer,
        )
        self.pump.start(asyncio.get_running_loop(), self.inbox)

    def post(self, record: Any) -> None:
        try:
            post_xfer(self.pair.mine.agent, self.pair.leases, self.pair.stats, record)
        except Exception as exc:
            self.pump.posted([(record, exc)])
        else:
            self.pump.posted([(record, None)])

    def send(self, src: list[int], dst: list[int], peer: Peer | None = None, **kw: Any) -> Xfer:
        """Accept a chunk and execute what the ledger decides (a Post posts it)."""
        command = chunk(src, dst, **kw)
        actions = self.pair.accept(command, OWN_PEER if peer is None else peer)
        self.pump.execute(actions)
        record = actions[0].record
        assert isinstance(record, Xfer)
        return record

    def disconnected(self, peer: Peer, reason: str) -> None:
        self.lost.append((peer, reason))
        self.pump.execute(self.ledger.peer_lost(peer, reason, time.monotonic()))

    async def close(self) -> None:
        await self.pump.aclose()
        self.pump.close()
        self.pair.close()  # asserts every handle made was released


QUICK = TransferConfig(
    deadline_base_s=0.05,
    floor_bandwidth_bps=1e12,
    quarantine_s=0.05,
    linger_s=0.3,
    linger_interval_s=0.01,
)
SLOW = TransferConfig(deadline_base_s=60.0, quarantine_s=60.0, linger_s=0.0)


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Callable[..., World]]:
    made: list[World] = []

    def build(config: TransferConfig = SLOW, leases: Leases | None = None) -> World:
        world = World(config, leases)
        made.append(world)
        return world

    yield build
    for world in made:
        await world.close()


@pytest.mark.asyncio
async def test_a_write_in_flight_is_polled_until_done_then_released_and_delivered(
    make: Callable[..., World],
) -> None:
    world = make()
    world.proxy.stuck = True
    record = world.send([1, 2], [3, 4])
    await wait_until(lambda: world.pair.stats.pump_rounds > 2)
    assert world.inbox.got == []  # in flight: the pump polls it, nothing is over
    assert len(record.handles) == 1
    world.proxy.stuck = False
    await wait_until(lambda: bool(world.inbox.got))
    assert world.inbox.got == [(ChunkDone(0), 1)]  # its handle released before the delivery
    assert world.observer.seen == [(record.nbytes, True)]
    assert world.pair.theirs.pages([3, 4]) == world.pair.mine.pages([1, 2])
    assert world.ledger.in_flight == 0


@pytest.mark.asyncio
async def test_a_write_past_its_deadline_is_released_at_once_and_fails_after_quarantine(
    make: Callable[..., World],
) -> None:
    world = make(QUICK)
    world.proxy.stuck = True  # never completes
    world.send([5], [6])
    await wait_until(lambda: len(world.inbox.got) == 2)
    (stalled, released_then), (failed, _) = world.inbox.got
    assert type(stalled) is ChunkStalled
    assert "deadline; released" in stalled.reason
    assert released_then == 1  # released before the room was told, not after the quarantine
    assert type(failed) is ChunkFailed
    assert "quarantine of 0.05s over" in failed.reason
    assert world.observer.seen == [(SHAPE.page_bytes * 2 * SHAPE.layers, False)]
    # Idle now, the pump keeps progressing the agent for linger_s (a released WRITE's queued
    # bytes move only when it is progressed), then parks.
    progressed = world.proxy.progresses
    await wait_until(lambda: world.proxy.progresses > progressed + 2)
    assert world.pair.stats.linger_progresses > 0


@pytest.mark.asyncio
async def test_an_idle_pump_that_never_held_anything_does_not_progress(
    make: Callable[..., World],
) -> None:
    # Lingering would be on (linger_s > 0) had anything been held; the deadline is far.
    world = make(TransferConfig(deadline_base_s=60.0, linger_s=0.3, linger_interval_s=0.01))
    world.send([1], [1])
    await wait_until(lambda: bool(world.inbox.got))
    assert world.inbox.events() == [ChunkDone]
    progressed = world.proxy.progresses
    # Five linger intervals: a pump that lingered would have progressed in them.
    await stays_true(
        lambda: world.proxy.progresses == progressed,
        duration=0.05,
        interval=0.002,
        message="no progress from an idle pump that never held anything",
    )


@pytest.mark.asyncio
async def test_an_in_flight_write_whose_lease_goes_is_held_before_the_next_progress(
    make: Callable[..., World],
) -> None:
    leases = Leases()
    leases.grant(FENCE, 1e18)
    world = make(SLOW, leases)
    world.proxy.stuck = True
    world.send([2], [2], fence=FENCE)
    await wait_until(lambda: world.pair.stats.pump_rounds > 2)
    leases.revoke(FENCE)
    await wait_until(lambda: bool(world.inbox.got))
    ((stalled, released_then),) = world.inbox.got
    assert type(stalled) is ChunkStalled
    assert f"write lease of fence {FENCE} revoked" in stalled.reason
    assert released_then == 1
    assert world.pair.stats.chunks_fenced == 1
    assert world.ledger.held == 1  # quarantined until close (60 s): close releases nothing twice


@pytest.mark.asyncio
async def test_a_remote_disconnect_reports_the_peer_before_the_chunk_fails(
    make: Callable[..., World],
) -> None:
    world = make()
    world.proxy.stuck = True
    world.send([3], [3])
    await wait_until(lambda: world.pair.stats.pump_rounds > 0)
    world.proxy.disconnect = True
    await wait_until(lambda: bool(world.inbox.got))
    assert [peer for peer, _ in world.lost] == [world.pair.peer]
    assert "NIXL remote disconnect from decode" in world.lost[0][1]
    # Its peer is lost with a part in flight: the room hears PeerLost, the chunk is held.
    assert world.inbox.events() == [PeerLost, ChunkStalled], world.inbox.got
    assert world.ledger.held == 1


@pytest.mark.asyncio
async def test_a_handle_nixl_refuses_to_release_is_released_at_close(
    make: Callable[..., World],
) -> None:
    world = make()
    world.proxy.stuck = True
    world.send([4], [4])
    await wait_until(lambda: world.pair.stats.pump_rounds > 0)
    world.proxy.refuse_release = True
    world.proxy.stuck = False
    await wait_until(lambda: bool(world.inbox.got))
    assert world.inbox.got == [(ChunkDone(0), 0)]  # over, but its handle is not released yet
    stats = world.pair.stats
    assert stats.handles_created == 1
    assert stats.handles_released == 0
    # The fixture's close() runs Pump.close(), and Pair.close() asserts the balance.


@pytest.mark.asyncio
async def test_close_releases_the_handles_of_chunks_still_in_flight(
    make: Callable[..., World],
) -> None:
    world = make()
    world.proxy.stuck = True
    records = [world.send([i], [i]) for i in range(3)]
    await wait_until(lambda: world.pair.stats.pump_rounds > 0)
    await world.pump.aclose()
    assert all(len(r.handles) == 1 for r in records)
    world.pump.close()
    assert all(r.handles == [] for r in records)
    assert world.pair.stats.handles_released == 3
    assert world.ledger.in_flight == 0
    assert world.inbox.got == []  # no final events: the rooms are gone


@pytest.mark.asyncio
async def test_bad_input_found_by_the_poster_fails_the_chunk_settled(
    make: Callable[..., World],
) -> None:
    world = make()
    world.send([1], [SHAPE.num_pages])  # out of range: only the poster checks page ranges
    dummy = world.pair.mine.agent.connect(
        "dummy", world.pair.theirs.agent.metadata(), world.pair.theirs.agent.layout.summary(), NO_KV
    )
    try:
        world.send([1], [1], peer=dummy)
        await wait_until(lambda: len(world.inbox.got) == 2)
    finally:
        world.pair.mine.agent.disconnect(dummy)
    reasons = [event.reason for event, _ in world.inbox.got if isinstance(event, ChunkFailed)]
    assert len(reasons) == 2
    assert f"destination page index {SHAPE.num_pages} out of range" in reasons[0]
    assert "writes no KV" in reasons[1]
    assert world.pair.stats.chunks_rejected == 2
    assert world.pair.stats.handles_created == 0


@pytest.mark.asyncio
async def test_an_event_for_a_room_that_is_gone_is_counted_stale(
    make: Callable[..., World],
) -> None:
    world = make()
    world.inbox.accepting = False
    world.send([1], [1])
    await wait_until(lambda: bool(world.inbox.got))
    assert world.pair.stats.stale_deliveries == 1


@pytest.mark.asyncio
async def test_the_rooms_a_batch_of_completions_woke_are_asked_to_run_in_the_same_callback(
    make: Callable[..., World],
) -> None:
    # The callback that delivers completions (the poster's hand-back, posted(); a polling round
    # of the pump) ends by asking the inbox to run the rooms it woke there and then, not on the
    # loop's next iteration.
    world = make()
    before = world.inbox.runs
    world.pump.posted([])  # the poster's hand-back, synchronously
    assert world.inbox.runs == before + 1
    world.proxy.stuck = True
    world.send([3], [4])
    await wait_until(lambda: world.pair.stats.pump_rounds > 1)
    world.proxy.stuck = False
    await wait_until(lambda: len(world.inbox.got) == 1)
    delivered_at = world.inbox.runs_at[0]
    await asyncio.sleep(0)  # let the round that delivered finish
    # Only the pump's rounds ask from here on (posted() is not called again): the round that
    # delivered asked after the delivery.
    assert world.inbox.runs > delivered_at
