"""Transfer faults injected into real NIXL WRITEs (UCX, DRAM to DRAM into another process):
each kind fires, and the data path answers it as the design says (law 3: the room ends; law 4:
its pages are settled only when nothing can write them; every handle is released)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.chaos._plan import FaultPlan, TransferFault, TransferRates
from kvfsm.chaos._transport_faults import (
    InjectedTransferError,
    TransportFaults,
    faulty_agent_config,
)
from kvfsm.manager import CommandRouter
from kvfsm.rooms import RoomConfig, RoomEngine, SenderRoom
from kvfsm.states import TERMINAL, DestinationReceived, KVPoll
from kvfsm.transport import Agent, NixlTransport, TransferConfig
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, page_digests
from kvfsm.workload.peer import PeerProcess
from tests.helpers.transport import RecordingControl
from tests.helpers.waiting import wait_until_sync

SHAPE = Shape(layers=2, num_pages=64, page_bytes=1024, aux_rows=8, aux_row_bytes=64)
QUARANTINE_S = 3.0


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    process = PeerProcess(SHAPE, name=f"chaos-peer-{os.getpid()}")
    yield process
    process.close()


class FaultyPrefill:
    """A prefill engine whose agent goes through the fault proxy, every handle faulted by
    ``rates`` (rate 1.0: every handle)."""

    def __init__(
        self, peer: PeerProcess, rates: TransferRates, seed: int = 1, deadline_s: float = 0.5
    ) -> None:
        self.kv, self.aux = make_buffers(SHAPE)
        rng = np.random.default_rng(seed)
        for buf in (*self.kv, self.aux):
            buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
        self.faults = TransportFaults(FaultPlan(seed, rates))
        self.agent = Agent(
            f"chaos-prefill-{os.getpid()}-{id(self)}",
            make_layout(self.kv, self.aux),
            faulty_agent_config(self.faults),
        )
        # A short chunk deadline, so a never-completing handle stalls quickly.
        config = TransferConfig(deadline_base_s=deadline_s, quarantine_s=QUARANTINE_S)
        self.transport = NixlTransport(self.agent, config)
        router = CommandRouter(RecordingControl(), self.transport)
        self.engine = RoomEngine(router, RoomConfig()).start()
        self.engine.call(self.transport.connect_peer("decode", peer.metadata, peer.summary))

    def room(self, room: int, src: list[int], dst: list[int]) -> SenderRoom:
        sender = self.engine.sender(room)
        packed = np.asarray(dst, np.int32).tobytes()
        self.engine.post(sender.key, DestinationReceived(packed, 1, peer="decode"))
        wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
        sender.init(len(src), 0)
        sender.send(np.asarray(src, np.int32))
        return sender

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        stats = self.transport.snapshot()
        self.agent.close()
        assert stats["handles_created"] == stats["handles_released"], stats
        assert stats["in_flight"] == 0, stats
        assert self.faults.snapshot()["outstanding"] == 0
        assert self.agent.dlists_prepped == self.agent.dlists_released
        assert self.agent.peers_added == self.agent.peers_removed


@pytest.fixture
def make(peer: PeerProcess) -> Iterator[list[FaultyPrefill]]:
    made: list[FaultyPrefill] = []
    yield made
    for prefill in made:
        prefill.close()


def run_one(
    made: list[FaultyPrefill], peer: PeerProcess, rates: TransferRates, deadline_s: float = 0.5
) -> SenderRoom:
    prefill = FaultyPrefill(peer, rates, deadline_s=deadline_s)
    made.append(prefill)
    sender = prefill.room(1, [1, 2, 3], [10, 11, 12])
    wait_until_sync(lambda: sender.poll() in TERMINAL, timeout=30)
    wait_until_sync(lambda: sender.settled, timeout=30)
    return sender


@pytest.mark.parametrize(
    ("rates", "reason"),
    [
        (TransferRates(post_error=1.0), "(ERR)"),
        (TransferRates(post_raise=1.0), "InjectedTransferError"),
        (TransferRates(completion_error=1.0), "(ERR)"),
        (TransferRates(post_disconnect=1.0), "peer lost"),
    ],
    ids=["post_error", "post_raise", "completion_error", "post_disconnect"],
)
def test_an_errored_transfer_fails_its_room_settled(
    make: list[FaultyPrefill], peer: PeerProcess, rates: TransferRates, reason: str
) -> None:
    sender = run_one(make, peer, rates)
    assert sender.poll() is KVPoll.Failed
    assert reason in sender.reason
    injected = make[0].faults.plan.injected()
    assert sum(injected.values()) >= 1, injected


def test_a_never_completing_handle_stalls_then_settles_after_quarantine(
    make: list[FaultyPrefill], peer: PeerProcess
) -> None:
    prefill = FaultyPrefill(peer, TransferRates(never_complete=1.0))
    make.append(prefill)
    sender = prefill.room(2, [4, 5], [20, 21])
    wait_until_sync(lambda: sender.poll() in TERMINAL, timeout=30)
    # Failed at the chunk deadline, while the released WRITE is still quarantined: its pages
    # are not settled yet (the quarantine is 3 s; the room failed at most a moment ago).
    assert sender.poll() is KVPoll.Failed
    assert "stalled" in sender.reason
    assert not sender.settled
    wait_until_sync(lambda: sender.settled, timeout=30)
    assert prefill.transport.stats.chunks_stalled == 1


def test_a_delayed_completion_still_succeeds_with_the_bytes(
    make: list[FaultyPrefill], peer: PeerProcess
) -> None:
    # Delays of at most 0.3 s against a 5 s chunk deadline: a starved loop on a loaded machine
    # adds to how long the completion takes to be seen, and must not turn it into a stall.
    sender = run_one(make, peer, TransferRates(delay=1.0, delay_max_s=0.3), deadline_s=5.0)
    assert sender.poll() is KVPoll.Success, sender.reason
    prefill = make[0]
    want = page_digests(prefill.kv, np.asarray([1, 2, 3], np.int32))
    assert peer.ask("digests", np.asarray([10, 11, 12], np.int32).tobytes()) == want
    assert prefill.faults.snapshot()["injected_delay"] >= 1


def test_no_faults_is_a_plain_proxy(make: list[FaultyPrefill], peer: PeerProcess) -> None:
    sender = run_one(make, peer, TransferRates())
    assert sender.poll() is KVPoll.Success, sender.reason
    snapshot = make[0].faults.snapshot()
    assert snapshot["handles_made"] == snapshot["handles_released"] >= 1


def test_a_peer_connecting_when_the_engine_stops_is_released(peer: PeerProcess) -> None:
    """The cause of a flaky teardown after ``post_disconnect``: the remote disconnect makes the
    transport reload the peer on its worker thread; the engine stopped while that reload was
    connecting, the loop never adopted the new generation, and its two descriptor lists and
    remote agent were never released (``dlists_prepped`` 6, released 4). Forced here: the
    worker is held inside ``Agent.connect`` while the engine stops."""
    prefill = FaultyPrefill(peer, TransferRates())
    agent, transport = prefill.agent, prefill.transport
    entered, gate = threading.Event(), threading.Event()
    connect = agent.connect

    def held_connect(*args: Any) -> Any:
        entered.set()
        gate.wait(30)
        return connect(*args)

    agent.connect = held_connect  # type: ignore[method-assign]
    # NIXL reported the peer gone: the generation is dropped and reloaded on the worker (a
    # connect of the current generation's own metadata would keep it and connect nothing).
    current = transport.peer("decode")
    assert current is not None
    prefill.engine.loop.call_soon_threadsafe(
        transport._peers.lost, current, "NIXL remote disconnect (test)"
    )
    assert entered.wait(30)
    prefill.engine.close()  # the reconnect's task is cancelled with the loop
    gate.set()
    prefill.close()  # asserts every list and remote agent was released


class _FakeNixl:
    """Stands in for the raw agent: makes handles and reports each posted one done."""

    def __init__(self) -> None:
        self.posted: list[object] = []
        self.released: list[object] = []

    def make_prepped_xfer(self, operation: str, *args: Any) -> object:
        return object()

    def initialize_xfer(self, operation: str, *args: Any, **kwargs: Any) -> object:
        return object()

    def transfer(self, handle: object) -> str:
        self.posted.append(handle)
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)


def test_a_per_request_transfer_takes_its_fault_like_a_prepared_one() -> None:
    """``initialize_xfer`` (the remapped slots of DSA tail rings of different sizes) is faulted
    as ``make_prepped_xfer`` is: one decision per handle from the same draws in the same order,
    a READ exempt, and every fault kind answered by ``transfer``/``check_xfer_state``."""
    rates = TransferRates(post_error=0.2, post_raise=0.2, completion_error=0.2, never_complete=0.2)
    prepared = TransportFaults(FaultPlan(7, rates))(_FakeNixl())
    mixed_inner = _FakeNixl()
    mixed = TransportFaults(FaultPlan(7, rates))(mixed_inner)
    calls = [mixed.make_prepped_xfer, mixed.initialize_xfer] * 20
    handles = [make("WRITE", 0, 1, 2, 3) for make in calls]
    want = [prepared._entry(prepared.make_prepped_xfer("WRITE", 0, 1, 2, 3)) for _ in calls]
    got = [mixed._entry(handle) for handle in handles]
    assert [e.fault for e in got if e] == [e.fault for e in want if e]
    faults = {e.fault for e in got[1::2] if e}  # the initialize_xfer handles
    assert {TransferFault.POST_ERROR, TransferFault.POST_RAISE} <= faults

    answers = {
        TransferFault.POST_ERROR: ("ERR", "ERR"),
        TransferFault.COMPLETION_ERROR: ("PROC", "ERR"),
        TransferFault.NEVER_COMPLETE: ("PROC", "PROC"),
        TransferFault.NONE: ("PROC", "DONE"),
    }
    for handle, entry in zip(handles[1::2], got[1::2], strict=True):  # the initialize_xfer ones
        assert entry is not None
        if entry.fault is TransferFault.POST_RAISE:
            with pytest.raises(InjectedTransferError):
                mixed.transfer(handle)
            assert handle not in mixed_inner.posted
        else:
            posted, checked = answers[entry.fault]
            assert mixed.transfer(handle) == posted
            assert mixed.check_xfer_state(handle) == checked
        mixed.release_xfer_handle(handle)

    read = mixed.initialize_xfer("READ", 0, 1, "peer")
    entry = mixed._entry(read)
    assert entry is not None
    assert entry.fault is TransferFault.NONE
    keyword = mixed.initialize_xfer(
        operation="WRITE", local_descs=0, remote_descs=1, remote_agent="peer"
    )
    assert mixed._entry(keyword) is not None
    assert mixed.snapshot()["handles_made"] == len(handles) + 2
