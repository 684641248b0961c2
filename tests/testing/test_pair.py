"""``kvfsm.testing``: the pair, its faults, canaries and leak checks, through the plugin's own
fixtures (the way a user's tests use them), each check also shown to fail when it should."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from kvfsm.states import TERMINAL, KVPoll
from kvfsm.testing import CANARY, AbortAt, Faults, KvfsmPair
from tests.helpers.waiting import stays_true


@pytest.mark.asyncio
async def test_a_room_moves_and_every_byte_lands(kvfsm_pair: KvfsmPair) -> None:
    out = await kvfsm_pair.transfer(1, [3, 9, 4, 20], [7, 1, 30, 2], chunks=3, src_aux=5, dst_aux=2)
    assert out.succeeded, out
    assert out.landed
    # and the check is a real one: a page that did not land is told apart
    assert not kvfsm_pair.landed([3], [8], 5, 2)


@pytest.mark.asyncio
@pytest.mark.parametrize("where", list(AbortAt))
async def test_an_abort_at_each_point_fails_both_sides_and_nothing_writes_later(
    kvfsm_pair: KvfsmPair, where: AbortAt
) -> None:
    dst = [10, 11, 12, 13, 14, 15]
    out = await kvfsm_pair.transfer(2, [40, 41, 42, 43, 44, 45], dst, chunks=3, abort_at=where)
    assert (out.prefill, out.decode) == (KVPoll.Failed, KVPoll.Failed), out
    assert where.value in out.prefill_reason + out.decode_reason
    # both settled (transfer() waited for it): the pages go back to the pool, canaried
    kvfsm_pair.release(dst)
    # A late write would land in these 0.2 s (the teardown checks again).
    await stays_true(
        lambda: kvfsm_pair.canary_violations() == [],
        duration=0.2,
        message="no write into the released pages",
    )


@pytest.mark.asyncio
@pytest.mark.kvfsm(faults=Faults().stall_chunk(0), chunk_deadline_s=1.0)
async def test_a_stalled_chunk_fails_its_room_by_the_chunk_deadline(kvfsm_pair: KvfsmPair) -> None:
    out = await kvfsm_pair.transfer(3, [1, 2, 3], [4, 5, 6], chunks=3)
    assert (out.prefill, out.decode) == (KVPoll.Failed, KVPoll.Failed), out
    assert "stall" in out.prefill_reason or "deadline" in out.prefill_reason, out.prefill_reason
    assert kvfsm_pair.plan is not None
    assert kvfsm_pair.plan.injected_at == [("xfer", 0, "never_complete")]
    kvfsm_pair.release([4, 5, 6])
    # the next room is not affected
    assert (await kvfsm_pair.transfer(4, [7], [8])).succeeded


@pytest.mark.asyncio
@pytest.mark.kvfsm(faults=Faults().fail_chunk(1))
async def test_an_errored_chunk_fails_its_room_with_the_reason(kvfsm_pair: KvfsmPair) -> None:
    out = await kvfsm_pair.transfer(5, [1, 2, 3, 4], [4, 5, 6, 7], chunks=2)
    assert (out.prefill, out.decode) == (KVPoll.Failed, KVPoll.Failed), out
    assert out.prefill_reason
    assert kvfsm_pair.plan is not None
    assert kvfsm_pair.plan.injected_at == [("xfer", 1, "completion_error")]


@pytest.mark.asyncio
@pytest.mark.kvfsm(secret=secrets.token_bytes(32), faults=Faults().drop_frame("to_decode", 3))
async def test_a_dropped_frame_is_caught_and_the_link_comes_back(kvfsm_pair: KvfsmPair) -> None:
    """With a secret every frame carries a sequence number under its MAC: decode refuses the
    frame after the dropped one and drops the connection; the next room uses a new link."""
    first = await kvfsm_pair.transfer(6, [1], [2])
    decode = kvfsm_pair.decode
    assert decode.control is not None
    await kvfsm_pair.wait_until(lambda: decode.control.stats["links_lost"] > 0)
    assert kvfsm_pair.plan is not None
    assert ("to_decode", 3, "drop") in kvfsm_pair.plan.injected_at
    # whatever the first room met, a room after the reconnect moves
    assert first.decode in TERMINAL
    assert (await kvfsm_pair.transfer(7, [3, 4], [5, 6])).succeeded


@pytest.mark.asyncio
@pytest.mark.kvfsm(heartbeat_s=0.1, liveness_factor=3.0, lease_s=0.4)
async def test_a_frozen_prefill_loses_its_room_and_never_writes_released_pages(
    kvfsm_pair: KvfsmPair,
) -> None:
    receiver, sender = kvfsm_pair.receiver(8), kvfsm_pair.sender(8)
    receiver.init(0)
    await kvfsm_pair.wait_until(lambda: receiver.poll() is KVPoll.WaitingForInput)
    dst = [20, 21, 22]
    receiver.send_metadata(np.asarray(dst, np.int32), 1)
    await kvfsm_pair.wait_until(lambda: sender.poll() is KVPoll.WaitingForInput)
    with kvfsm_pair.freeze_prefill():
        sender.init(3, 1)
        sender.send(np.asarray([1, 2, 3], np.int32))  # queued on the frozen loop
        await kvfsm_pair.wait_until(lambda: receiver.settled)
        assert receiver.poll() is KVPoll.Failed
        assert "silent" in receiver.reason, receiver.reason
        kvfsm_pair.release(dst)
    await kvfsm_pair.wait_until(lambda: sender.poll() in TERMINAL and sender.settled)
    assert sender.poll() is KVPoll.Failed
    assert kvfsm_pair.canary_violations() == []
    for room in (sender, receiver):
        room.clear()


@pytest.mark.asyncio
async def test_the_checks_report_what_they_should(kvfsm_pair: KvfsmPair) -> None:
    sender = kvfsm_pair.sender(9)  # never finished: a live room
    engine = kvfsm_pair.prefill.engine
    assert engine is not None
    await kvfsm_pair.wait_until(lambda: engine.stats()["live"] > 0)  # spawned on the loop
    assert any("live rooms" in leak for leak in kvfsm_pair.leaks(timeout=0.2))
    sender.abort("the test is done with it")
    sender.clear()
    assert kvfsm_pair.leaks() == []
    kvfsm_pair.release([50])
    kvfsm_pair.decode_kv[1][50, 7] = CANARY ^ 0xFF  # a write into a released page
    assert kvfsm_pair.canary_violations() == [
        "decode KV buffer 1: released pages [50] were written"
    ]
    kvfsm_pair.decode_kv[1][50, 7] = CANARY  # (the fixture's teardown checks canaries too)


@pytest.mark.asyncio
async def test_pairs_from_the_factory_are_independent(kvfsm_pair_factory: object) -> None:
    make = kvfsm_pair_factory
    assert callable(make)
    one, two = make(pages=16), make(pages=32, layers=1)
    assert len(two.decode_kv) == 2
    assert two.decode_kv[0].shape[0] == 32
    assert (await one.transfer(1, [1], [2])).succeeded
    assert (await two.transfer(1, [3], [4])).succeeded  # the same id, another pair
