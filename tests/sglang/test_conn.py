"""The adapter's own logic on a real pair: one prefill and one decode rank (TP 1), each a
``KvfsmKVManager`` with its own NIXL agent over UCX and DRAM buffers, and a real bootstrap server.

What the conformance suite covers (whole scheduler flows, MIN over ranks, byte checks) is not
repeated; these tests pin single calls: what ``poll`` says before ``init``, ``clear``/``abort``
idempotence, what ``failure_exception`` raises, the requests kvfsm refuses and why, the trailing
zero-page send, the metric, the deferred-release flags, the manager's lookups and the bootstrap
server serving the pair's ranks (the server on its own: ``test_server.py``).

Where a check must see a room before kvfsm's loop moved it on, the loop is held still
(:func:`frozen`): the scheduler-facing calls only post events, so what ``poll`` says then is the
adapter's own doing.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np
import pytest

import kvfsm.sglang._conn
from kvfsm.rooms import KVTransferError
from kvfsm.sglang import (
    KvfsmKVBootstrapServer,
    KvfsmKVManager,
    KvfsmKVReceiver,
    KvfsmKVSender,
    SGLangTransferError,
)
from kvfsm.sglang._args import UnsupportedError
from kvfsm.sglang._bases import DisaggregationMode, KVPoll, KVTransferDestination
from kvfsm.sglang._conn import prefix_problem
from kvfsm.sglang._manager import PrefillInfo
from kvfsm.testing import VirtualClock
from tests.helpers.http_json import get_json
from tests.helpers.sglang_replay import (
    AUX_ROWS,
    LAYERS,
    PAGE_BYTES,
    Instance,
    RankBuffers,
    server_args,
)
from tests.helpers.waiting import wait_until, wait_until_sync

PRE_INIT = {KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput}
#: Generous: every wait here is for something that takes milliseconds on an idle machine.
WAIT_S = 20.0
_rooms = count(1000)


def wait_poll(conn: Any, *values: int) -> int:
    wait_until_sync(
        lambda: conn.poll() in values, timeout=WAIT_S, message=f"{conn!r} to reach {values}"
    )
    return int(conn.poll())


@contextmanager
def frozen(mgr: KvfsmKVManager) -> Iterator[None]:
    """Hold ``mgr``'s kvfsm loop still: events posted meanwhile wait until the block ends."""
    engine = mgr.kvfsm.engine
    assert engine is not None
    entered, release = threading.Event(), threading.Event()

    def block() -> None:
        entered.set()
        release.wait(WAIT_S)

    engine.loop.call_soon_threadsafe(block)
    assert entered.wait(WAIT_S), "the loop did not run the block"
    try:
        yield
    finally:
        release.set()


def quiesced(*managers: KvfsmKVManager) -> None:
    """Every event already posted to these managers' loops has been handled: a round trip on
    each loop, twice (an event handled in the first may post another). What a test then reads
    is what the rooms decided, not a sample of how far they got in some time."""

    async def nothing() -> None:
        return None

    for _ in range(2):
        for mgr in managers:
            engine = mgr.kvfsm.engine
            assert engine is not None
            engine.call(nothing())


@dataclass
class Pair:
    prefill: Instance
    decode: Instance
    addr: str

    @property
    def pm(self) -> KvfsmKVManager:
        return self.prefill.managers[0]

    @property
    def dm(self) -> KvfsmKVManager:
        return self.decode.managers[0]

    def known(self) -> None:
        """Decode learned the prefill instance's sizes (``try_ensure_parallel_info``)."""
        wait_until_sync(
            lambda: self.dm.try_ensure_parallel_info(self.addr),
            timeout=WAIT_S,
            message="parallel info",
        )

    def sender(self, room: int) -> KvfsmKVSender:
        return KvfsmKVSender(self.pm, self.addr, room)

    def receiver(self, room: int | None) -> KvfsmKVReceiver:
        return KvfsmKVReceiver(self.dm, self.addr, room)

    def handshake(
        self, pages: int = 3
    ) -> tuple[KvfsmKVSender, KvfsmKVReceiver, np.ndarray, np.ndarray]:
        """A request up to the point where prefill may ``init``: both sides WaitingForInput."""
        self.known()
        room = next(_rooms)
        sender, receiver = self.sender(room), self.receiver(room)
        receiver.init(0)
        status = wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed)
        assert status == KVPoll.WaitingForInput, receiver.reason
        src = np.arange(pages, dtype=np.int32) + 10
        dst = np.arange(pages, dtype=np.int32) + 40
        receiver.send_metadata(dst, 3, [[4]], decode_prefix_len=0)
        status = wait_poll(sender, KVPoll.WaitingForInput, KVPoll.Failed)
        assert status == KVPoll.WaitingForInput, sender.reason
        return sender, receiver, src, dst

    def transfer(self, pages: int = 3) -> tuple[KvfsmKVSender, KvfsmKVReceiver]:
        """A request through to Success on both sides (not cleared)."""
        sender, receiver, src, _dst = self.handshake(pages)
        sender.init(pages, 5)
        sender.send(src, [[6]])
        assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, sender.reason
        assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, receiver.reason
        return sender, receiver


@pytest.fixture
def pair(bootstrap: KvfsmKVBootstrapServer) -> Iterator[Pair]:
    prefill = Instance.start("prefill", bootstrap.port, 1)
    try:
        decode = Instance.start("decode", bootstrap.port, 1)
    except BaseException:
        prefill.close()
        raise
    yield Pair(prefill, decode, f"127.0.0.1:{bootstrap.port}")
    decode.close()
    prefill.close()


def raised(conn: Any) -> SGLangTransferError:
    with pytest.raises(SGLangTransferError) as info:
        conn.failure_exception()
    error = info.value
    assert isinstance(error, KVTransferError)
    assert error.room == conn.bootstrap_room
    assert error.failure_reason
    return error


# -- poll before init ------------------------------------------------------------------------------


def test_polls_before_init_are_pre_init_values(pair: Pair) -> None:
    pair.known()
    room = next(_rooms)
    sender = pair.sender(room)
    assert sender.poll() == KVPoll.Bootstrapping  # no decode has asked for the room yet
    receiver = pair.receiver(room)
    assert receiver.poll() == KVPoll.Bootstrapping  # not told its prefill rank yet
    receiver.init(0)
    assert wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed) == KVPoll.WaitingForInput
    assert sender.poll() in PRE_INIT
    receiver.send_metadata(np.array([1, 2], np.int32), 0, [[0]])
    assert wait_poll(sender, KVPoll.WaitingForInput, KVPoll.Failed) == KVPoll.WaitingForInput
    # Without init, prefill can go no further: once both loops handled everything they were
    # sent, the rooms are still where the page list left them.
    quiesced(pair.pm, pair.dm)
    assert sender.poll() == KVPoll.WaitingForInput
    assert receiver.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring)
    sender.clear()
    receiver.clear()


def test_receiver_polls_stay_pre_init_until_send_metadata(pair: Pair) -> None:
    pair.known()
    room = next(_rooms)
    sender, receiver = pair.sender(room), pair.receiver(room)
    receiver.init(0)
    assert wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed) == KVPoll.WaitingForInput
    quiesced(pair.pm, pair.dm)
    assert receiver.poll() == KVPoll.WaitingForInput
    assert sender.poll() in PRE_INIT
    receiver.clear()
    sender.clear()


# -- clear, abort, failure_exception ---------------------------------------------------------------


def test_clear_twice_before_init_fails_the_room_once(pair: Pair) -> None:
    room = next(_rooms)
    sender, receiver = pair.sender(room), pair.receiver(room)
    for conn in (sender, receiver):
        conn.clear()
        conn.clear()
        assert conn.poll() == KVPoll.Failed
        assert "cleared before completion" in conn.reason
        assert "cleared before completion" in raised(conn).failure_reason


def test_clear_after_success_keeps_success(pair: Pair) -> None:
    sender, receiver = pair.transfer()
    for conn in (sender, receiver):
        conn.clear()
        conn.clear()
        assert conn.poll() == KVPoll.Success
        assert conn.reason == ""
    assert receiver.conclude_state is None


def test_clear_after_failure_exception_is_a_noop(pair: Pair) -> None:
    sender, receiver, _src, _dst = pair.handshake()
    for conn in (sender, receiver):
        conn.abort()
        reason = raised(conn).failure_reason
        conn.clear()
        conn.clear()
        assert conn.poll() == KVPoll.Failed
        assert conn.reason == reason


def test_abort_makes_poll_failed_at_once(pair: Pair) -> None:
    sender, receiver, _src, _dst = pair.handshake()
    with frozen(pair.pm), frozen(pair.dm):
        sender.abort()
        receiver.abort()
        # kvfsm's loops have not seen the aborts yet: Failed is the adapter's own answer.
        assert sender.poll() == KVPoll.Failed
        assert receiver.poll() == KVPoll.Failed
        assert receiver.conclude_state == KVPoll.Failed
    for conn in (sender, receiver):
        conn.abort()  # again: no-op
        assert conn.poll() == KVPoll.Failed
        error = raised(conn)
        assert "AbortReq" in error.failure_reason
        assert error.is_from_another_rank is False


def test_abort_after_success_is_a_noop(pair: Pair) -> None:
    sender, receiver = pair.transfer()
    sender.abort()
    receiver.abort()
    receiver.ensure_abort_notified(force_arm=True)
    assert sender.poll() == KVPoll.Success
    assert receiver.poll() == KVPoll.Success
    assert receiver.conclude_state is None
    assert receiver.abort_notified is False
    sender.clear()
    receiver.clear()


def test_failure_exception_on_a_live_room_says_another_rank_and_ends_it(pair: Pair) -> None:
    room = next(_rooms)
    sender = pair.sender(room)  # Bootstrapping: no decode asked for it
    error = raised(sender)
    assert error.is_from_another_rank is True
    assert "another rank" in error.failure_reason
    assert "Bootstrapping" in error.failure_reason
    assert sender.poll() == KVPoll.Failed  # cleared, so aborted: it does not wait out a deadline
    again = raised(sender)  # raises every time; now the room itself failed
    assert again.is_from_another_rank is False

    pair.known()
    receiver = pair.receiver(room + 1)
    receiver.init(0)
    assert wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed) == KVPoll.WaitingForInput
    error = raised(receiver)
    assert error.is_from_another_rank is True
    assert "WaitingForInput" in error.failure_reason
    assert receiver.poll() == KVPoll.Failed


def test_receiver_without_a_bootstrap_room_fails_with_a_reason(pair: Pair) -> None:
    receiver = pair.receiver(None)
    assert receiver.bootstrap_room == -1
    assert receiver.poll() == KVPoll.Failed
    assert receiver.conclude_state == KVPoll.Failed
    assert "no bootstrap_room" in receiver.reason
    pair.known()
    receiver.init(0)  # the scheduler goes on regardless; nothing changes
    assert receiver.poll() == KVPoll.Failed
    assert "no bootstrap_room" in raised(receiver).failure_reason


# -- requests kvfsm refuses ------------------------------------------------------------------------


def test_host_destination_fails_the_room(pair: Pair) -> None:
    pair.known()
    room = next(_rooms)
    sender, receiver = pair.sender(room), pair.receiver(room)
    receiver.init(0)
    wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed)
    receiver.send_metadata(np.array([1], np.int32), 0, None, destination=KVTransferDestination.HOST)
    assert receiver.poll() == KVPoll.Failed
    assert "destination" in receiver.reason
    assert "device KV only" in receiver.reason
    assert "device KV only" in raised(receiver).failure_reason
    sender.clear()


def test_an_unaligned_decode_prefix_fails_the_room(pair: Pair) -> None:
    pair.known()
    room = next(_rooms)
    sender, receiver = pair.sender(room), pair.receiver(room)
    receiver.init(0)
    wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed)
    receiver.send_metadata(np.array([1], np.int32), 0, [[0]], decode_prefix_len=24)
    assert receiver.poll() == KVPoll.Failed
    reason = raised(receiver).failure_reason
    assert "decode_prefix_len=24 is not a multiple of the page size (16 tokens)" in reason
    assert wait_poll(sender, KVPoll.Failed) == KVPoll.Failed  # told over the control link
    sender.clear()


@pytest.mark.parametrize("pages", [2, 0], ids=["suffix", "full-hit"])
def test_pop_decode_prefix_len_gives_decodes_prefix_once(pair: Pair, pages: int) -> None:
    """SGLang's Common pops ``req_to_decode_prefix_len``: 0 until decode's page list came, the
    prefix once it did, 0 after. The prefix is there at the sender's first WaitingForInput."""
    pair.known()
    room = next(_rooms)
    sender, receiver = pair.sender(room), pair.receiver(room)
    assert sender.pop_decode_prefix_len() == 0
    receiver.init(0)
    wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed)
    assert sender.pop_decode_prefix_len() == 0  # not consumed: nothing arrived yet
    dst = np.arange(pages, dtype=np.int32) + 40
    receiver.send_metadata(dst, 3, [[4]], decode_prefix_len=48)
    assert wait_poll(sender, KVPoll.WaitingForInput, KVPoll.Failed) == KVPoll.WaitingForInput
    assert sender.pop_decode_prefix_len() == 48
    assert sender.pop_decode_prefix_len() == 0
    sender.init(pages, 5)
    sender.send(np.arange(pages, dtype=np.int32) + 10, [[6]])
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, sender.reason
    assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, receiver.reason
    sender.clear()
    receiver.clear()


def test_without_a_decode_prefix_pop_gives_zero(pair: Pair) -> None:
    sender, receiver, _src, _dst = pair.handshake()
    assert sender.pop_decode_prefix_len() == 0
    sender.clear()
    receiver.clear()


def test_prefix_problem() -> None:
    assert prefix_problem(0, 16) is None
    assert prefix_problem(64, 16) is None
    assert prefix_problem(7, 1) is None
    assert prefix_problem(7, 0) is None  # page size unknown: nothing to check against
    assert "not a multiple of the page size (16 tokens)" in str(prefix_problem(8, 16))
    assert "negative" in str(prefix_problem(-16, 16))


def test_no_state_rows_from_prefill_for_a_decode_state_slot_fails_the_room(pair: Pair) -> None:
    """SGLang skips a state type with no entry; decode named a slot for it (handshake: row 4),
    so nothing would ever write that slot: the room fails, it does not succeed without it."""
    sender, receiver, src, _dst = pair.handshake()
    sender.init(len(src), 0)
    sender.send(src, [])  # one state type registered, no entry for it
    assert wait_poll(sender, KVPoll.Failed, KVPoll.Success) == KVPoll.Failed
    assert "state rows" in raised(sender).failure_reason
    receiver.clear()


def _stateless(mode: str, port: int, keep: list[RankBuffers]) -> KvfsmKVManager:
    buffers = RankBuffers.make(1 if mode == "prefill" else None)
    keep.append(buffers)
    args = buffers.kv_args(0)
    args.state_types = []
    args.state_data_ptrs = []
    args.state_data_lens = []
    args.state_item_lens = []
    return KvfsmKVManager(args, DisaggregationMode(mode), server_args(port, 1), False)


def test_state_indices_for_a_rank_without_state_buffers(bootstrap: KvfsmKVBootstrapServer) -> None:
    keep: list[RankBuffers] = []
    pm = _stateless("prefill", bootstrap.port, keep)
    try:
        dm = _stateless("decode", bootstrap.port, keep)
    except BaseException:
        pm.close()
        raise
    try:
        assert pm.states.names == ()
        assert pm.layout.state == ()
        addr = f"127.0.0.1:{bootstrap.port}"
        wait_until_sync(
            lambda: dm.try_ensure_parallel_info(addr), timeout=WAIT_S, message="parallel info"
        )
        # Entries that name no rows are fine: the whole transfer succeeds.
        room = next(_rooms)
        sender, receiver = KvfsmKVSender(pm, addr, room), KvfsmKVReceiver(dm, addr, room)
        receiver.init(0)
        wait_poll(receiver, KVPoll.WaitingForInput, KVPoll.Failed)
        receiver.send_metadata(np.array([7, 8], np.int32), 1, [None])
        assert wait_poll(sender, KVPoll.WaitingForInput, KVPoll.Failed) == KVPoll.WaitingForInput
        sender.init(2, 2)
        sender.send(np.array([3, 4], np.int32), [[]])
        assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success
        np.testing.assert_array_equal(keep[1].kv[0][[7, 8]], keep[0].kv[0][[3, 4]])
        sender.clear()
        receiver.clear()
        # Rows the rank has no buffers for: refused on either side.
        room = next(_rooms)
        receiver = KvfsmKVReceiver(dm, addr, room)
        receiver.send_metadata(np.array([1], np.int32), 0, [[5]])
        assert receiver.poll() == KVPoll.Failed
        assert "this rank registered no buffers of it" in raised(receiver).failure_reason
        sender = KvfsmKVSender(pm, addr, room)
        sender.init(1, 0)
        sender.send(np.array([1], np.int32), [[5]])
        assert sender.poll() == KVPoll.Failed
        assert "this rank registered no buffers of it" in raised(sender).failure_reason
    finally:
        dm.close()
        pm.close()


# -- the last chunk --------------------------------------------------------------------------------


def test_trailing_zero_page_send_after_the_last_chunk_is_ignored(pair: Pair) -> None:
    sender, receiver, src, _dst = pair.handshake()
    sender.init(len(src), 5)
    sender.send(src, [[6]])
    sender.send(np.array([], np.int32), None)  # SGLang's empty "last" segment
    sender.send(np.array([], np.int32), [[]])
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, sender.reason
    assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, receiver.reason


def test_state_rows_after_the_last_chunk_fail_the_room(pair: Pair) -> None:
    sender, receiver, src, _dst = pair.handshake()
    with frozen(pair.pm):  # the first send cannot have completed the room yet
        sender.init(len(src), 5)
        sender.send(src, None)  # reaches the page count: kvfsm sends it as the last chunk
        sender.send(np.array([], np.int32), [[6]])
        assert sender.poll() == KVPoll.Failed
    assert "state rows arrived after the last chunk" in raised(sender).failure_reason
    receiver.clear()


def test_a_zero_page_request_sends_its_empty_last_chunk(pair: Pair) -> None:
    sender, receiver, _src, _dst = pair.handshake(pages=0)
    assert sender.should_send_kv_chunk(0, last_chunk=True)
    sender.init(0, 5)
    sender.send(np.array([], np.int32), [[6]])
    assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, receiver.reason
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success
    metric = sender.get_transfer_metric()
    assert metric.transfer_total_bytes == pair.pm.layout.aux_row_bytes()


def test_should_send_kv_chunk_truth_table(pair: Pair) -> None:
    sender = pair.sender(next(_rooms))
    table = {(n, last): sender.should_send_kv_chunk(n, last) for n in (0, 1, 5) for last in (0, 1)}
    assert table == {
        (0, False): False,
        (0, True): True,
        (1, False): True,
        (1, True): True,
        (5, False): True,
        (5, True): True,
    }
    sender.clear()


def test_transfer_metric(pair: Pair) -> None:
    sender, receiver, src, _dst = pair.handshake(pages=4)
    assert sender.get_transfer_metric().transfer_latency_s is None
    sender.init(4, 5)
    sender.send(src[:3], None)
    sender.send(src[3:], [[6]])
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success
    metric = sender.get_transfer_metric()
    page_bytes = 2 * LAYERS * PAGE_BYTES
    aux_row_bytes = (16 * 4 * AUX_ROWS + 8 * 8 * AUX_ROWS) // AUX_ROWS  # output ids + rooms
    assert pair.pm.layout.page_bytes() == page_bytes
    assert metric.transfer_total_bytes == 4 * page_bytes + aux_row_bytes
    assert metric.transfer_latency_s is not None
    assert metric.transfer_latency_s >= 0
    assert sender.get_transfer_metric() == metric  # fixed once Success was seen
    receiver.clear()
    sender.clear()


def test_sglangs_own_transfer_figures_from_the_adapters_metric(pair: Pair) -> None:
    """SGLang 0.5.23's prefill scheduler hands every request that succeeded, unless its
    ``kv_mgr.is_dummy_cp_rank``, to ``compute_and_observe_kv_transfer_metrics`` with its
    sender's ``get_transfer_metric()`` (disaggregation/prefill.py, lines 1245-1263): that is all
    it reads from a backend for ``sglang:kv_transfer_latency_ms``, ``_total_mb`` and
    ``_speed_gb_s``, and nothing is observed while ``transfer_total_bytes`` is None. SGLang's
    own function, fed the adapter's metric after a real transfer, gives figures above zero."""
    if os.environ.get("KVFSM_NO_SGLANG") == "1":
        pytest.skip("KVFSM_NO_SGLANG=1: SGLang's own metric code is not importable")
    # Importing it imports SGLang's GPU kernels' modules, which warn that this machine has none.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

    sender, receiver = pair.transfer(pages=4)
    assert pair.pm.is_dummy_cp_rank is False
    metric = sender.get_transfer_metric()
    stats = SchedulerReqTimeStats(disagg_mode=DisaggregationMode.PREFILL)
    figures = stats.compute_and_observe_kv_transfer_metrics(metric)
    assert figures is not None
    assert figures["latency_ms"] > 0
    assert figures["speed_gb_s"] > 0
    assert metric.transfer_total_bytes is not None
    assert figures["total_mb"] == metric.transfer_total_bytes / 2**20 > 0
    receiver.clear()
    sender.clear()


def test_transfer_latency_starts_at_the_first_send_not_at_init(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGLang's senders time "first enqueue -> Success"; the prefill forward between init() and
    # the first send() is not transfer time (it made kv_transfer_speed_gb_s read ~0 on CPU).
    # The adapter's clock is a virtual one here: the figure is exact, whatever the machine does.
    sender, receiver, src, _dst = pair.handshake(pages=2)
    clock = VirtualClock()
    monkeypatch.setattr(kvfsm.sglang._conn, "_now", clock)
    sender.init(2, 5)
    clock.advance(30.0)  # the "forward pass"
    sender.send(src, [[6]])
    clock.advance(0.25)  # the transfer, as far as the clock is concerned
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success
    assert sender.get_transfer_metric().transfer_latency_s == 0.25
    receiver.clear()
    sender.clear()


# -- an early send's event (prefix pages a forward may still be writing) ---------------------------


class ForwardEvent:
    """Stands in for the ``torch.cuda.Event`` SGLang records on the forward stream before an
    early send: done once ``finish()`` is called (the forward wrote the pages)."""

    def __init__(self, *, done: bool = False, error: Exception | None = None) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()
        self.error = error
        #: The threads that waited on it.
        self.waited_by: list[str] = []

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waited_by.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        assert self._done.wait(WAIT_S), "the forward never finished"

    def finish(self) -> None:
        self._done.set()


def _pages_equal(pair: Pair, src: np.ndarray, dst: np.ndarray) -> bool:
    ours, theirs = pair.prefill.buffers[0], pair.decode.buffers[0]
    return all(np.array_equal(a[src], b[dst]) for a, b in zip(ours.kv, theirs.kv, strict=True))


def _untouched(pair: Pair, dst: np.ndarray) -> bool:
    return all(not b[dst].any() for b in pair.decode.buffers[0].kv)


def test_an_early_send_waits_for_its_forward_and_later_chunks_wait_behind_it(pair: Pair) -> None:
    sender, receiver, src, dst = pair.handshake(pages=4)
    assert _untouched(pair, dst)
    event = ForwardEvent()
    try:
        _early_send_then_rest(pair, sender=sender, receiver=receiver, event=event, src=src, dst=dst)
    finally:
        event.finish()  # the worker thread is shared: never leave it waiting
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, sender.reason
    assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, receiver.reason
    assert _pages_equal(pair, src, dst)


def _early_send_then_rest(
    pair: Pair,
    *,
    sender: KvfsmKVSender,
    receiver: KvfsmKVReceiver,
    event: ForwardEvent,
    src: np.ndarray,
    dst: np.ndarray,
) -> None:
    sender.init(len(src), 5)
    # SGLang's early send of two prefix pages, then the rest as the last chunk.
    sender._early_send_wait_event = event
    sender.send(src[:2], None)
    assert sender._early_send_wait_event is None  # it belongs to that one chunk
    sender.send(src[2:], [[6]])
    # Both chunks wait for the forward: decode's pages stay as they were, nothing ends.
    wait_until_sync(lambda: event.waited_by != [], timeout=WAIT_S, message="the wait to begin")
    quiesced(pair.pm, pair.dm)
    assert _untouched(pair, dst)
    assert sender.poll() == KVPoll.WaitingForInput
    assert receiver.poll() == KVPoll.Transferring
    # Waited for off the scheduler's thread.
    assert event.waited_by == ["kvfsm-early-send_0"]


def test_an_early_send_whose_forward_is_done_goes_at_once(pair: Pair) -> None:
    sender, receiver, src, dst = pair.handshake(pages=3)
    event = ForwardEvent(done=True)
    sender.init(len(src), 5)
    sender._early_send_wait_event = event
    sender.send(src[:1], None)
    sender.send(src[1:], [[6]])
    assert wait_poll(sender, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, sender.reason
    assert wait_poll(receiver, KVPoll.Success, KVPoll.Failed) == KVPoll.Success, receiver.reason
    assert event.waited_by == []
    assert _pages_equal(pair, src, dst)


def test_a_request_aborted_while_its_chunk_waits_skips_the_wait(pair: Pair) -> None:
    sender, receiver, src, dst = pair.handshake(pages=3)
    first, second = ForwardEvent(), ForwardEvent()
    sender.init(len(src), 5)
    try:
        sender._early_send_wait_event = first
        sender.send(src[:1], None)
        wait_until_sync(lambda: first.waited_by != [], timeout=WAIT_S, message="the wait")
        # A second held chunk (its own event, for the test's sake) behind the first.
        sender._early_send_wait_event = second
        sender.send(src[1:], [[6]])
        sender.abort()
        assert sender.poll() == KVPoll.Failed
    finally:
        first.finish()
    wait_until_sync(lambda: not sender._gate.holding, timeout=WAIT_S, message="the drain")
    quiesced(pair.pm, pair.dm)
    # Its room had ended: the worker did not wait for the second forward, and nothing was
    # written (the first chunk reached a room that had already ended).
    assert second.waited_by == []
    assert _untouched(pair, dst)
    receiver.clear()


def test_a_forward_event_that_fails_fails_its_request_and_posts_nothing(pair: Pair) -> None:
    sender, receiver, src, dst = pair.handshake(pages=2)
    event = ForwardEvent(error=RuntimeError("CUDA error: an illegal memory access"))
    sender.init(len(src), 5)
    sender._early_send_wait_event = event
    sender.send(src, [[6]])
    assert wait_poll(sender, KVPoll.Failed) == KVPoll.Failed
    reason = raised(sender).failure_reason
    assert "waiting for the forward that writes its prefix pages failed" in reason, reason
    assert "illegal memory access" in reason, reason
    quiesced(pair.pm, pair.dm)
    assert _untouched(pair, dst)
    receiver.clear()


# -- decode: conclude_state, abort notification, deferred release ----------------------------------


def test_conclude_state(pair: Pair) -> None:
    pair.known()
    room = next(_rooms)
    receiver = pair.receiver(room)
    assert receiver.conclude_state is None
    receiver.init(0)
    assert receiver.conclude_state is None
    receiver.abort()
    assert receiver.conclude_state == KVPoll.Failed
    bad = pair.receiver(room + 1)
    bad.init(5)  # DP rank out of range: refused in init, seen right after it
    assert bad.conclude_state == KVPoll.Failed
    assert "out of range" in bad.reason
    assert bad.bootstrap_infos == []


def test_abort_notified_and_bootstrap_infos(pair: Pair) -> None:
    pair.known()
    room = next(_rooms)
    early = pair.receiver(room)
    assert early.bootstrap_infos == []
    assert early.abort_notified is False
    early.abort()  # failed before naming a prefill rank: nobody to tell
    assert early.abort_notified is False

    sender, receiver, _src, _dst = pair.handshake()
    assert receiver.bootstrap_infos == [(pair.addr, 0)]
    assert receiver.abort_notified is False  # live
    receiver.ensure_abort_notified(force_arm=True)
    assert receiver.poll() == KVPoll.Failed
    assert "deferred release" in receiver.reason
    assert receiver.abort_notified is True
    receiver.ensure_abort_notified(force_arm=True)  # again: no-op
    assert "deferred release" in raised(receiver).failure_reason
    wait_until_sync(receiver.is_abort_release_safe, timeout=WAIT_S, message="the room to settle")
    assert pair.dm.is_abort_release_safe(receiver.bootstrap_room, 1)
    wait_poll(sender, KVPoll.Failed)


def test_is_abort_release_safe_only_once_prefill_can_no_longer_write(pair: Pair) -> None:
    sender, receiver, _src, _dst = pair.handshake()
    room = receiver.bootstrap_room
    # Prefill holds decode's page list; while it cannot answer, decode may not reuse the pages.
    with frozen(pair.pm):
        receiver.abort()
        receiver.clear()  # the scheduler clears before it asks (failure_exception does)
        quiesced(pair.dm)  # decode has handled the abort and everything it led to
        assert not pair.dm.is_abort_release_safe(room, 1)
        assert not receiver.is_abort_release_safe()
        assert pair.dm.tracked_rooms() == 1
    wait_until_sync(
        lambda: pair.dm.is_abort_release_safe(room, 1),
        timeout=WAIT_S,
        message="the release to be safe",
    )
    assert receiver.is_abort_release_safe()
    pair.dm.clear_deferred_abort_state(room)
    assert pair.dm.tracked_rooms() == 0
    assert pair.dm.is_abort_release_safe(room, 1)  # forgotten rooms are safe
    assert pair.dm.is_abort_release_safe(123456789)
    wait_poll(sender, KVPoll.Failed)


def test_tracked_rooms_return_to_zero_once_cleared_and_settled(pair: Pair) -> None:
    dm = pair.dm
    assert dm.tracked_rooms() == 0
    done_sender, done = pair.transfer()
    aborted_sender, aborted, _src, _dst = pair.handshake()
    aborted.abort()
    never = pair.receiver(next(_rooms))
    nameless = pair.receiver(None)
    receivers = [done, aborted, never, nameless]
    assert dm.tracked_rooms() == len(receivers)
    for receiver in receivers:
        receiver.clear()
    done_sender.clear()
    aborted_sender.clear()
    wait_until_sync(
        lambda: dm.tracked_rooms() == 0, timeout=WAIT_S, message="tracked rooms to drain"
    )
    for receiver in receivers:
        assert dm.is_abort_release_safe(receiver.bootstrap_room, 1)


# -- manager ---------------------------------------------------------------------------------------


def test_try_ensure_parallel_info_never_blocks(pair: Pair) -> None:
    """The lookup runs on kvfsm's loop: with the registry's answer held back, the call still
    returns (False), as many times as the scheduler asks, and True once the answer landed."""
    dm = pair.dm
    assert pair.addr not in dm.prefill_info_table
    client = dm._client(pair.addr)
    real_rank = client.rank
    answer = threading.Event()

    async def held_back(engine: str, rank: int) -> Any:
        # An answer that has not come: the test's thread lets it through.
        await wait_until(answer.is_set, timeout=WAIT_S, message="the test to release the answer")
        return await real_rank(engine, rank)

    client.rank = held_back  # type: ignore[method-assign]
    try:
        assert [dm.try_ensure_parallel_info(pair.addr) for _ in range(5)] == [False] * 5
        assert pair.addr in dm._fetching  # one lookup in flight, not five
        answer.set()
        wait_until_sync(
            lambda: dm.try_ensure_parallel_info(pair.addr),
            timeout=WAIT_S,
            message="the parallel info",
        )
    finally:
        client.rank = real_rank  # type: ignore[method-assign]
    assert dm.prefill_info_table[pair.addr] == PrefillInfo(dp_size=1, tp_size=1)
    assert dm.prefill_info_table[pair.addr].follow_bootstrap_room is True
    assert dm.try_ensure_parallel_info(pair.addr) is True


def test_try_ensure_parallel_info_for_an_unreachable_instance_stays_false(pair: Pair) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{probe.getsockname()[1]}"
    dm = pair.dm
    assert dm.try_ensure_parallel_info(addr) is False
    wait_until_sync(
        lambda: addr not in dm._fetching, timeout=WAIT_S, message="the lookup to give up"
    )
    assert dm.try_ensure_parallel_info(addr) is False  # and a new lookup starts
    assert addr not in dm.prefill_info_table
    assert isinstance(dm.peer_for(addr, 0), str)


def test_peer_for_reasons_and_peer_ids(pair: Pair) -> None:
    dm = pair.dm
    reason = dm.peer_for("10.0.0.1:8998", 0)
    assert isinstance(reason, str)
    assert "unknown" in reason
    dm.prefill_info_table["10.0.0.2:8998"] = PrefillInfo(dp_size=1, tp_size=2)
    reason = dm.peer_for("10.0.0.2:8998", 0, 2)
    assert reason == "prefill attention-TP rank 2 out of range (attention TP 2)"
    assert isinstance(dm.peer_for("10.0.0.2:8998", 0, 1), int)
    dm.prefill_info_table["10.0.0.3:8998"] = PrefillInfo(dp_size=2, tp_size=1)
    for dp_rank in (2, -1):
        reason = dm.peer_for("10.0.0.3:8998", dp_rank)
        assert isinstance(reason, str)
        assert f"prefill DP rank {dp_rank} out of range (dp_size 2)" in reason
    first, second = dm.peer_for("10.0.0.3:8998", 0), dm.peer_for("10.0.0.3:8998", 1)
    assert isinstance(first, int)
    assert isinstance(second, int)
    assert first != second
    assert dm.peer_for("10.0.0.3:8998", 0) == first  # one peer id per prefill rank


def test_manager_surface_the_scheduler_reads(pair: Pair) -> None:
    for mgr in (pair.pm, pair.dm):
        assert mgr.is_dummy_cp_rank is False
        assert mgr.enable_all_cp_ranks_for_transfer is False
        assert mgr.enable_deferred_decode_kv_release is True
        assert mgr.supports_host_destination is False
        assert mgr.supports_role_switch is False
        assert mgr.should_verify_kv_checksum(pair.addr) is True
        assert mgr.transfer_infos == {}
        mgr.register_to_bootstrap()
    assert (pair.pm.mode, pair.dm.mode) == ("prefill", "decode")
    with pytest.raises(RuntimeError, match="no receivers"):
        pair.pm.new_receiver(1)
    with pytest.raises(RuntimeError, match="no senders"):
        pair.dm.new_sender(1)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_the_deferred_decode_allocation_policy_is_refused_by_name(
    bootstrap: KvfsmKVBootstrapServer, mode: str
) -> None:
    buffers = RankBuffers.make(None)
    args = server_args(bootstrap.port, 1)
    args.disaggregation_decode_allocation_policy = "prefill_complete"
    with pytest.raises(UnsupportedError, match="allocation-policy prefill_complete is not"):
        KvfsmKVManager(buffers.kv_args(0), DisaggregationMode(mode), args, False)


def test_decode_lends_the_scheduler_an_executor_and_shuts_it_down_on_close(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """SGLang's decode scheduler runs its DP-rank lookups on the manager's executor
    (``prefetch_prefill_dp_rank_queries`` calls ``_ensure_prefill_recompute_executor()``): one
    per manager, made on first use, usable, and gone with the manager."""
    keep: list[RankBuffers] = []  # the pools the manager registered live as long as it
    mgr = _stateless("decode", bootstrap.port, keep)
    try:
        executor = mgr._ensure_prefill_recompute_executor()
        assert mgr._ensure_prefill_recompute_executor() is executor
        assert executor.submit(lambda: 6 * 7).result(timeout=10) == 42
    finally:
        mgr.close()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(lambda: None)


def test_conn_surface_the_scheduler_reads(pair: Pair) -> None:
    room = next(_rooms)
    sender, receiver = pair.sender(room), pair.receiver(room)
    assert sender.kv_mgr is pair.pm
    assert receiver.kv_mgr is pair.dm
    assert sender.supports_host_tensor_indices is False
    assert sender._early_send_wait_event is None
    assert receiver.require_staging is False
    assert f"room={room}" in repr(sender)
    sender.clear()
    receiver.clear()


# -- bootstrap server ------------------------------------------------------------------------------


def test_bootstrap_server_serves_the_registry(
    pair: Pair, bootstrap: KvfsmKVBootstrapServer
) -> None:
    assert bootstrap.url == f"http://127.0.0.1:{bootstrap.port}"
    assert bootstrap.port > 0
    get_json(f"{bootstrap.url}/health")
    rank = get_json(f"{bootstrap.url}/v1/ranks/sglang/0")
    assert (rank["rank"], rank["tp_size"], rank["dp_size"]) == (0, 1, 1)
