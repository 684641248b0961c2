"""Minimal reproductions of what ``kvfsm chaos`` found in kvfsm itself, on a real pair.

Each reproduces a bug the campaign found, in the control channel's routing or in the room core;
these are their regression tests, and each fails on the code that had the bug.
``docs/reliability.md`` says which campaign found each one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm import KVPoll
from kvfsm.chaos._plan import FaultPlan, TransferRates
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.rooms import RoomConfig
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.registry import running_registry
from tests.helpers.waiting import wait_until_sync

CHANNEL = ChannelConfig(heartbeat_s=0.25, connect_timeout_s=2.0)
#: Short, so that a room that cannot settle gives up within the test.
SETTLE_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    with running_registry(ttl_s=3) as url:
        yield url


@contextlib.contextmanager
def _managers(
    registry: str,
    engine_id: str,
    config: ManagerConfig,
    prefill_config: ManagerConfig | None = None,
) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    """A real prefill/decode manager pair (decode reaches prefill's port directly)."""
    src_kv, src_aux = make_buffers(SHAPE)
    fill_sources(src_kv, src_aux)
    dst_kv, dst_aux = make_buffers(SHAPE)
    prefill = PrefillManager(
        make_layout(src_kv, src_aux), registry, engine_id=engine_id, config=prefill_config or config
    )
    port = prefill.port

    async def direct(rank: int) -> tuple[str, int]:
        return ("127.0.0.1", port)

    try:
        decode = DecodeManager(
            make_layout(dst_kv, dst_aux),
            registry,
            engine_id=engine_id,
            resolver=direct,
            config=config,
        )
    except BaseException:
        prefill.close()
        raise
    try:
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


@pytest.fixture
def pair(registry: str) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    config = ManagerConfig(
        channel=CHANNEL,
        rooms=RoomConfig(settle_timeout_s=SETTLE_TIMEOUT_S),
        register_interval_s=0.5,
    )
    with _managers(registry, "fb", config) as managers:
        yield managers


def test_a_page_list_applied_after_its_link_was_lost_still_settles(
    pair: tuple[PrefillManager, DecodeManager],
) -> None:
    """Campaign seed 20260507, ``--episodes 2 --rooms 24 --reuse-rate 0.2 --oversized-rate 0.15
    --long-freeze-rate 1``: decode room 24 failed 15 ms after it started (``peer lost:
    connection to prefill ... closed``) and never settled.

    The race, made deterministic: ``send_metadata`` queues ``MetadataSubmitted`` for the room;
    the link is lost in the same loop callback, before the room's task runs (the engine drains
    posts in order, and the task is only woken by the delivery). The link loss delivers
    ``PeerLost`` and, the room not being exposed yet, forgets it. Then the task applies
    ``MetadataSubmitted`` (the room marks its pages exposed and sends ``SendMetadata``, which
    ``DecodeRouting.metadata`` drops, the receiver being unknown) and then ``PeerLost``. Nothing
    was sent, so nothing can ever be written, but no ``PeerSettled`` is delivered: the room is
    reaped unsettled at its settle timeout and its destinations stay held for the engine's
    life (a new room naming them is refused as "already held")."""
    _, decode = pair
    receiver = decode.receiver(3)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    control, engine = decode.control, decode.engine
    assert control is not None
    assert engine is not None

    def lose_links() -> None:
        for link in list(control._links.values()):
            control._lose(link, "cut by the test")

    receiver.send_metadata(np.asarray([5, 6], np.int32), aux_index=1)
    engine._thread.post(lose_links)  # the same drain as the delivery, after it
    wait_until_sync(lambda: receiver.poll() is KVPoll.Failed, timeout=5)
    assert "peer lost" in receiver.reason
    # Nothing went out: it could settle at once; at the latest when a lost link's rooms do.
    wait_until_sync(lambda: receiver.settled, timeout=CHANNEL.settle_after_loss_s + 2.0)


@pytest.fixture
def raised_pair(registry: str) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    """A pair whose decode may name more pages than one control frame holds (as the campaign's
    decode rank does), so a page list can pass the facade and fail at the frame limit."""
    config = ManagerConfig(
        channel=CHANNEL,
        rooms=RoomConfig(settle_timeout_s=SETTLE_TIMEOUT_S, max_pages=4_400_000),
        register_interval_s=0.5,
        secret=b"found-by-campaign-secret-0123456789",
    )
    with _managers(registry, "fr", config) as managers:
        yield managers


def test_a_page_list_over_the_frame_limit_settles_when_prefill_has_claimed_the_room(
    raised_pair: tuple[PrefillManager, DecodeManager],
) -> None:
    """Campaign seed 5, ``CampaignOptions(episodes=2, rooms=40, control=ControlRates(), ...)``
    (no frame faults): decode room 12, an oversized ``send_metadata`` of 4 250 000 pages
    (``kind="frame"``), failed at once with ``cannot send: RoomMetadata of 17000105 bytes
    exceeds the frame limit`` and was reaped unsettled, holding 4.25 M page indices.

    Decode's core marks its pages exposed when it applies the page list; the control plane
    cannot encode it and fails the room (``EventRejected``); the failure goes to prefill as a
    ``RoomAbort``. Prefill's sender, bound by decode's claim but without a page list
    (``binding.destination`` False), fails with ``AbortRequested(origin="peer")``, and a core
    does not report a failure back to the peer that caused it, so ``sender_outcome`` (which
    would have answered ``RoomSettled``: nothing was posted) never runs. Without a sender yet
    the same abort is acknowledged at once (``on_abort``, not bound) and the room settles."""
    prefill, decode = raised_pair
    sender = prefill.sender(4)
    receiver = decode.receiver(4)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    pages = np.arange(SHAPE.num_pages, SHAPE.num_pages + 4_250_000, dtype=np.int32)
    receiver.send_metadata(pages, aux_index=1)
    wait_until_sync(lambda: receiver.poll() is KVPoll.Failed, timeout=5)
    assert "frame limit" in receiver.reason
    wait_until_sync(lambda: sender.poll() is KVPoll.Failed, timeout=5)
    # Nothing was sent and nothing written: it can settle as soon as prefill has heard.
    wait_until_sync(lambda: receiver.settled, timeout=3.0)


@pytest.fixture
def disconnecting_pair(registry: str) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    """Prefill's NIXL agent reports a remote disconnect at every post (the campaign's injected
    ``post_disconnect``), while the control link stays up."""
    config = ManagerConfig(channel=CHANNEL, register_interval_s=0.5)
    faults = TransportFaults(FaultPlan(1, TransferRates(post_disconnect=1.0)))
    prefill_config = dataclasses.replace(config, agent=faulty_agent_config(faults, config.agent))
    with _managers(registry, "fd", config, prefill_config=prefill_config) as managers:
        yield managers


def test_a_data_path_disconnect_tells_decode_why_its_room_failed(
    disconnecting_pair: tuple[PrefillManager, DecodeManager],
) -> None:
    """The 3-minute campaign ``--seed 11 --duration 180 --rooms 40``: 16 decode rooms failed with
    ``rejected: PeerSettled in Transferring``, next to 24 prefill rooms failed with ``peer lost:
    NIXL remote disconnect from decode-...``. Safe (the room settles once prefill drained its
    chunks), but law 3 wants the reason: ``RoomCore._fail`` reports a failure to the peer
    unless the event came from the peer, and the transport's ``PeerLost`` is taken for one,
    though the decode room is alive and its control link up."""
    prefill, decode = disconnecting_pair
    sender = prefill.sender(4)
    receiver = decode.receiver(4)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    receiver.send_metadata(np.asarray([3, 4], np.int32), aux_index=1)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
    sender.init(2, aux_index=0)
    sender.send(np.asarray([1, 2], np.int32))
    wait_until_sync(lambda: sender.poll() is KVPoll.Failed, timeout=10)
    assert "remote disconnect" in sender.reason
    wait_until_sync(lambda: receiver.poll() is KVPoll.Failed, timeout=10)
    wait_until_sync(lambda: receiver.settled, timeout=10)  # safe either way
    assert "remote disconnect" in receiver.reason, receiver.reason
