"""How a serving stack that embeds kvfsm tests it: only ``kvfsm.testing``'s fixtures, a real
prefill/decode pair over NIXL on loopback, and one fault injected at a chosen place.

Run it with ``python -m pytest examples/test_with_kvfsm_testing.py`` wherever kvfsm is installed
(the plugin loads itself through its ``pytest11`` entry point). docs/testing.md walks through it.
"""

from __future__ import annotations

import pytest

from kvfsm import KVPoll
from kvfsm.testing import AbortAt, Faults, KvfsmPair


@pytest.mark.asyncio
async def test_a_request_moves_its_kv(kvfsm_pair: KvfsmPair) -> None:
    out = await kvfsm_pair.transfer(1, src_pages=[0, 1, 2, 3], dst_pages=[8, 9, 10, 11], chunks=2)
    assert out.succeeded
    assert out.landed  # every byte of every layer's pages, and the aux row


# The second WRITE prefill posts wedges (NIXL says "in progress" forever): the room must fail
# within its chunk deadline on both sides, and its decode pages must never be written once
# the scheduler reuses them. The fixture's teardown checks the canaries and for leaks.
@pytest.mark.asyncio
@pytest.mark.kvfsm(faults=Faults().stall_chunk(1), chunk_deadline_s=1.0)
async def test_a_wedged_write_fails_one_request_and_nothing_else(kvfsm_pair: KvfsmPair) -> None:
    out = await kvfsm_pair.transfer(2, src_pages=[0, 1, 2, 3], dst_pages=[8, 9, 10, 11], chunks=2)
    assert (out.prefill, out.decode) == (KVPoll.Failed, KVPoll.Failed)
    kvfsm_pair.release([8, 9, 10, 11])  # decode's scheduler reuses the pages: canaries
    assert (await kvfsm_pair.transfer(3, [4], [12])).succeeded  # the next request is fine


@pytest.mark.asyncio
async def test_a_client_abort_on_decode_ends_both_sides(kvfsm_pair: KvfsmPair) -> None:
    out = await kvfsm_pair.transfer(4, [5, 6], [13, 14], abort_at=AbortAt.DECODE_AFTER_METADATA)
    assert (out.prefill, out.decode) == (KVPoll.Failed, KVPoll.Failed)
    assert "decode aborts" in out.decode_reason
