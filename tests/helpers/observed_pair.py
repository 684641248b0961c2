"""A real prefill-decode pair (both managers in this process, a registry in its own, real NIXL
over DRAM, the control channel over TCP), with status servers and metrics, that has run a few
rooms to known ends: what the operator's tools (status routes, metrics, ``kvfsm top``,
``kvfsm explain``) are tested against."""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfsm import KVPoll
from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.rooms import ReceiverRoom
from kvfsm.states import TERMINAL
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.registry import running_registry
from tests.helpers.waiting import wait_until_sync

CONFIG = ManagerConfig(
    channel=ChannelConfig(heartbeat_s=0.25), register_interval_s=0.5, status_port=0, metrics=True
)

#: Room ids and how each one ended.
DONE, PREFILL_ABORTED, DECODE_ABORTED, WAITING = 1, 3, 4, 2


@dataclass
class ObservedPair:
    prefill: PrefillManager
    decode: DecodeManager
    #: The JSON lines failed rooms logged (``kvfsm.rooms.failed``), as logged.
    failure_lines: list[str] = field(default_factory=list)
    waiting: ReceiverRoom | None = None

    @property
    def prefill_url(self) -> str:
        assert self.prefill.status is not None
        return self.prefill.status.url

    @property
    def decode_url(self) -> str:
        assert self.decode.status is not None
        return self.decode.status.url


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


class _Lines(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def observed_pair(config: ManagerConfig = CONFIG) -> Iterator[ObservedPair]:
    """The pair, after: room 1 done, room 3 aborted by prefill's caller, room 4 aborted by
    decode's caller mid-way (prefill sees the peer's abort), room 2 waiting on decode."""
    lines: list[str] = []
    handler = _Lines(lines)
    logger = logging.getLogger("kvfsm.rooms.failed")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with running_registry(ttl_s=3) as registry:
            src_kv, src_aux = make_buffers(SHAPE)
            fill_sources(src_kv, src_aux)
            dst_kv, dst_aux = make_buffers(SHAPE)
            prefill = PrefillManager(
                make_layout(src_kv, src_aux), registry, engine_id="t", config=config
            )
            decode = DecodeManager(
                make_layout(dst_kv, dst_aux), registry, engine_id="t", config=config
            )
            try:
                pair = ObservedPair(prefill, decode, lines)
                _run_rooms(pair)
                yield pair
            finally:
                decode.close()
                prefill.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def move_room(
    pair: ObservedPair,
    room: int,
    chunks: list[list[int]],
    dst: list[int],
    *,
    src_aux: int,
    dst_aux: int,
) -> tuple[KVPoll, KVPoll]:
    """Room ``room`` through the scheduler's calls on both sides: decode's pages ``dst`` and
    aux row, then prefill's ``chunks`` of source pages and aux row; (sender, receiver) status
    once both ended."""
    receiver, sender = pair.decode.receiver(room), pair.prefill.sender(room)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    receiver.send_metadata(np.asarray(dst, np.int32), dst_aux)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
    sender.init(sum(len(c) for c in chunks), src_aux)
    for chunk in chunks:
        sender.send(chunk)
    wait_until_sync(lambda: receiver.poll() in TERMINAL and sender.poll() in TERMINAL, timeout=10)
    return sender.poll(), receiver.poll()


def _run_rooms(pair: ObservedPair) -> None:
    prefill, decode = pair.prefill, pair.decode
    moved = move_room(pair, DONE, [[1, 2], [3, 4]], [5, 6, 7, 8], src_aux=1, dst_aux=0)
    assert moved[1] is KVPoll.Success
    failing = prefill.sender(PREFILL_ABORTED)
    failing.abort("operator test")
    # Decode aborts a room whose destination prefill already has: prefill's room fails with
    # the peer's abort (a frame in), decode's with its caller's.
    d_receiver, d_sender = decode.receiver(DECODE_ABORTED), prefill.sender(DECODE_ABORTED)
    d_receiver.init(0)
    wait_until_sync(lambda: d_receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    d_receiver.send_metadata(np.asarray([20, 21], np.int32), 2)
    wait_until_sync(lambda: d_sender.poll() is KVPoll.WaitingForInput, timeout=10)
    d_receiver.abort("client went away")
    wait_until_sync(lambda: d_sender.poll() is KVPoll.Failed, timeout=10)
    pair.waiting = decode.receiver(WAITING)
    pair.waiting.init(0)
    wait_until_sync(lambda: pair.waiting.poll() is KVPoll.WaitingForInput, timeout=10)
    wait_until_sync(lambda: prefill.stats()["rooms"]["live"] == 0, timeout=10)
    wait_until_sync(lambda: len(pair.failure_lines) >= 3, timeout=10)
