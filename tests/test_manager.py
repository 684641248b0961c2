"""The engine API end to end in one test process: a real bootstrap registry, a PrefillManager and
a DecodeManager (each its own NIXL agent, loop thread and control channel; ``kvfsm.testing``'s
pair, whose teardown fails the test on anything left behind), rooms driven through both sides'
facades, bytes checked."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import numpy as np
import pytest

from kvfsm import KVPoll
from kvfsm.control import ChannelConfig
from kvfsm.explain import classify
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager, default_agent_name
from kvfsm.states import TERMINAL
from kvfsm.testing import KvfsmPair
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE
from tests.helpers.registry import running_registry
from tests.helpers.waiting import wait_until_sync

CONFIG = ManagerConfig(channel=ChannelConfig(heartbeat_s=0.25), register_interval_s=0.5)


def test_a_room_through_both_managers(kvfsm_pair: KvfsmPair) -> None:
    """Both facades driven by hand (kvfsm.testing's pair: a real registry, through which decode
    finds prefill, and both managers over real NIXL)."""
    prefill, decode = kvfsm_pair.prefill, kvfsm_pair.decode
    src, dst = [3, 4, 5, 6], [60, 50, 40, 30]
    receiver = decode.receiver(42)
    receiver.init(0)
    sender = prefill.sender(42)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    receiver.send_metadata(np.asarray(dst, np.int32), aux_index=7)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
    sender.init(len(src), aux_index=2)
    sender.send(np.asarray(src[:3], np.int32))
    sender.send(np.asarray(src[3:], np.int32))
    wait_until_sync(lambda: receiver.poll() in TERMINAL and sender.poll() in TERMINAL, timeout=10)
    assert receiver.poll() is KVPoll.Success, receiver.reason
    assert sender.poll() is KVPoll.Success, sender.reason
    assert kvfsm_pair.landed(src, dst, 2, 7)
    receiver.clear()
    sender.clear()
    wait_until_sync(lambda: prefill.stats()["rooms"]["live"] == 0, timeout=10)
    wait_until_sync(lambda: decode.stats()["rooms"]["live"] == 0, timeout=10)


def test_aborts_from_either_side_end_both_rooms(kvfsm_pair: KvfsmPair) -> None:
    prefill, decode = kvfsm_pair.prefill, kvfsm_pair.decode
    rooms = []
    for room in range(6):
        receiver = decode.receiver(room)
        receiver.init(0)
        sender = prefill.sender(room)
        rooms.append((sender, receiver))
    wait_until_sync(lambda: all(r.poll() is KVPoll.WaitingForInput for _, r in rooms), timeout=10)
    for room, (sender, receiver) in enumerate(rooms):
        receiver.send_metadata(np.asarray([room], np.int32), aux_index=room)
        (receiver if room % 2 else sender).abort(f"abort {room}")
    wait_until_sync(
        lambda: all(s.poll() is KVPoll.Failed and r.poll() is KVPoll.Failed for s, r in rooms),
        timeout=10,
    )
    wait_until_sync(lambda: all(r.settled and s.settled for s, r in rooms), timeout=10)
    for room, (sender, receiver) in enumerate(rooms):
        assert f"abort {room}" in (receiver.reason if room % 2 else sender.reason)
        sender.clear()
        receiver.clear()


def test_default_agent_names_are_unique_per_manager_and_name_the_process() -> None:
    async def resolve(peer_rank: int) -> tuple[str, int]:
        raise LookupError("no prefill in this test")

    managers = []
    try:
        for _ in range(2):  # same role, engine and rank, one process: NIXL needs two names
            kv, aux = make_buffers(SHAPE)
            managers.append(
                DecodeManager(make_layout(kv, aux), None, resolver=resolve, config=CONFIG)
            )
        first, second = (m.agent.name for m in managers)
        assert first != second
        for name in (first, second):
            assert name.startswith("kvfsm-decode-default-r0-")
            assert f"-pid{os.getpid()}-" in name
            assert socket.gethostname().split(".")[0] in name
    finally:
        for manager in managers:
            manager.close()


def test_a_default_agent_name_fits_the_hello_and_keeps_its_unique_part() -> None:
    name = default_agent_name("prefill", "e" * 400, 3)
    assert len(name) == 256
    assert name.startswith("kvfsm-prefill-eee")
    assert f"-pid{os.getpid()}-" in name
    assert default_agent_name("prefill", "x", 3) != default_agent_name("prefill", "x", 3)


def test_prefill_fences_each_link_by_the_margin_its_decode_told() -> None:
    """Decode settles a lost link's pages at its last grant + lease + *its* fence margin, so
    prefill's stale-progress gate must judge that link's writes by decode's margin, not by
    its own setting: decode's Hello says it, and every lease carries it (protocol 7)."""
    mine = dataclasses.replace(CONFIG, channel=ChannelConfig(heartbeat_s=0.25, fence_margin_s=1.0))
    theirs = dataclasses.replace(
        CONFIG, channel=ChannelConfig(heartbeat_s=0.25, fence_margin_s=0.3)
    )
    src_kv, src_aux = make_buffers(SHAPE)
    dst_kv, dst_aux = make_buffers(SHAPE)
    with running_registry(ttl_s=3) as url:
        prefill = PrefillManager(make_layout(src_kv, src_aux), url, engine_id="m", config=mine)
        decode = DecodeManager(make_layout(dst_kv, dst_aux), url, engine_id="m", config=theirs)
        try:
            receiver = decode.receiver(5)
            receiver.init(0)
            sender = prefill.sender(5)
            wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
            leases = prefill.transport.leases
            assert leases is not None
            wait_until_sync(lambda: leases.live == 1, timeout=10)
            (fence,) = leases._until
            assert leases.margin(fence) == 0.3  # decode's, not prefill's 1.0
            receiver.abort("done")
            sender.abort("done")
        finally:
            decode.close()
            prefill.close()


def test_a_registry_that_does_not_answer_fails_rooms_after_the_configured_timeout() -> None:
    """``registry_timeout_s`` bounds each registry request: a registry that takes connections
    and never answers fails a decode room's lookup with a timeout after it, and a rank given
    more time keeps waiting past the default 2 s instead."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)  # connections complete in the backlog; no request is ever read
    url = f"http://127.0.0.1:{mute.getsockname()[1]}"
    dst_kv, dst_aux = make_buffers(SHAPE)
    layout = make_layout(dst_kv, dst_aux)
    short = dataclasses.replace(CONFIG, registry_timeout_s=0.2)
    patient = dataclasses.replace(CONFIG, registry_timeout_s=60.0)
    try:
        decode = DecodeManager(layout, url, engine_id="m", config=short)
        try:
            receiver = decode.receiver(1)
            receiver.init(0)
            wait_until_sync(lambda: receiver.poll() is KVPoll.Failed, timeout=10)
            assert "unreachable: TimeoutError" in receiver.reason, receiver.reason
            # and ``kvfsm explain`` reads it as the registry's bound, naming the setting
            found = classify(receiver.reason, "receiver")
            assert found.rule.kind == "registry_timeout", found
            assert "registry_timeout_s" in found.rule.check
            receiver.clear()
        finally:
            decode.close()
        decode = DecodeManager(layout, url, engine_id="m", config=patient)
        try:
            receiver = decode.receiver(2)
            receiver.init(0)
            # Past the default timeout by a margin a loaded machine cannot eat: still looking.
            time.sleep(3.0)
            assert receiver.poll() is KVPoll.Bootstrapping, receiver.reason
            receiver.abort("done")
        finally:
            decode.close()
    finally:
        mute.close()


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan")])
def test_a_registry_timeout_that_bounds_nothing_is_refused(bound: float) -> None:
    # aiohttp reads 0 as no timeout: a mute registry would hold lookups until the deadline.
    with pytest.raises(ValueError, match="registry_timeout_s"):
        ManagerConfig(registry_timeout_s=bound)
