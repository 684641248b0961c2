"""``PeerSet`` with a stand-in agent (the real NIXL connects are in test_transport and
test_agent): one attempt per peer and metadata, the old generation dropped before the new one
is connected, a lost peer dropped, disconnected and reloaded once, and every generation
disconnected exactly once, at close for whatever was left."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import pytest

from kvfsm.transport._agent import Peer
from kvfsm.transport._peers import PeerSet
from kvfsm.workload.buffers import Shape, make_buffers, make_layout
from tests.helpers.waiting import wait_until

SUMMARY = make_layout(*make_buffers(Shape(layers=1, num_pages=4))).summary()


class FakeAgent:
    """Connects instantly unless ``gate`` is cleared; records every connect and disconnect."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, bytes]] = []
        self.disconnected: Counter[int] = Counter()
        self.gate = threading.Event()
        self.gate.set()
        #: Set once the worker is inside a connect (held there while ``gate`` is cleared).
        self.entered = threading.Event()
        self.fail: set[bytes] = set()
        self._generation = 0

    def connect(
        self, peer_id: str, metadata: bytes, summary: Any, piece: Any = None, state: Any = None
    ) -> Peer:
        self.entered.set()
        self.gate.wait(10)
        self.connects.append((peer_id, metadata))
        if metadata in self.fail:
            raise ValueError(f"peer {peer_id}: layouts are incompatible")
        self._generation += 1
        n = self._generation
        return Peer(peer_id, n, name=f"d{n}", summary=summary, kv=None, aux=None, state=None)

    def disconnect(self, peer: Peer) -> None:
        self.disconnected[peer.generation] += 1


def make(agent: FakeAgent) -> tuple[PeerSet, list[tuple[int, str]], Counter[str]]:
    dropped: list[tuple[int, str]] = []
    counts: Counter[str] = Counter()
    peers = PeerSet(
        agent,  # type: ignore[arg-type]
        reconnect_interval_s=0.05,
        drop=lambda peer, reason: dropped.append((peer.generation, reason)),
        counters=lambda name: counts.update([name]),
    )
    return peers, dropped, counts


@pytest.mark.asyncio
async def test_concurrent_connects_with_the_same_metadata_share_one_attempt() -> None:
    agent = FakeAgent()
    peers, _dropped, counts = make(agent)
    try:
        agent.gate.clear()
        tasks = [asyncio.ensure_future(peers.connect("d", b"m1", SUMMARY)) for _ in range(5)]
        # Every task has asked (they all ran before this one checks again) and the one
        # attempt is held in the agent.
        await wait_until(agent.entered.is_set, message="the worker inside connect")
        agent.gate.set()
        got = await asyncio.gather(*tasks)
        assert len({id(p) for p in got}) == 1
        assert agent.connects == [("d", b"m1")]
        assert counts["peers_connected"] == 1
        assert peers.get("d") is got[0]
    finally:
        peers.close()


@pytest.mark.asyncio
async def test_a_reconnect_drops_the_old_generation_first_and_disconnects_it_once() -> None:
    agent = FakeAgent()
    peers, dropped, _counts = make(agent)
    try:
        first = await peers.connect("d", b"m1", SUMMARY)
        second = await peers.connect("d", b"m2", SUMMARY)
        assert second.generation == first.generation + 1
        assert dropped == [(first.generation, "peer d reconnected as a new generation")]
        assert agent.disconnected == Counter({first.generation: 1})
        assert len(peers) == 1
    finally:
        peers.close()
    assert agent.disconnected == Counter({1: 1, 2: 1})  # close: the adopted one, once


@pytest.mark.asyncio
async def test_a_failed_connect_is_raised_to_every_waiter_and_leaves_nothing() -> None:
    agent = FakeAgent()
    agent.fail.add(b"bad")
    peers, _dropped, counts = make(agent)
    try:
        agent.gate.clear()
        tasks = [asyncio.ensure_future(peers.connect("d", b"bad", SUMMARY)) for _ in range(3)]
        await wait_until(agent.entered.is_set, message="the worker inside connect")
        agent.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results)
        assert agent.connects == [("d", b"bad")]
        assert peers.get("d") is None
        assert counts["peers_connected"] == 0
    finally:
        peers.close()


@pytest.mark.asyncio
async def test_a_lost_peer_is_dropped_disconnected_and_reloaded_from_its_metadata() -> None:
    agent = FakeAgent()
    peers, dropped, counts = make(agent)
    try:
        first = await peers.connect("d", b"m1", SUMMARY)
        peers.lost(first, "NIXL remote disconnect from d")
        peers.lost(first, "again")  # the same generation twice: once only
        assert peers.get("d") is None
        assert dropped == [(first.generation, "NIXL remote disconnect from d")]
        assert counts["peers_lost"] == 1
        # The reload comes after reconnect_interval_s.
        await wait_until(lambda: peers.get("d") is not None, message="peer d reloaded")
        reloaded = peers.get("d")
        assert reloaded is not None
        assert reloaded.generation == first.generation + 1
        assert agent.connects == [("d", b"m1"), ("d", b"m1")]
        assert agent.disconnected[first.generation] == 1
        # a stale report about the old generation does not condemn the new one
        peers.lost(first, "late")
        assert peers.get("d") is reloaded
    finally:
        peers.close()


@pytest.mark.asyncio
async def test_close_disconnects_a_generation_the_worker_connected_but_nobody_adopted() -> None:
    agent = FakeAgent()
    peers, _dropped, _counts = make(agent)
    agent.gate.clear()
    task = asyncio.ensure_future(peers.connect("d", b"m1", SUMMARY))
    await wait_until(agent.entered.is_set, message="the worker inside connect")
    task.cancel()  # the engine stops while the worker is connecting
    agent.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    peers.close()
    assert agent.connects == [("d", b"m1")]
    assert agent.disconnected == Counter({1: 1})
    peers.close()  # idempotent
    assert agent.disconnected == Counter({1: 1})
