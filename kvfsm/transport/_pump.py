"""``Pump``: the loop side of the data path after a chunk is accepted. It runs the ledger's
actions (release handles, deliver events, quarantine timers, hand records to the poster) and
the completion pump, and it owns every posted handle until it is released.

The pump is one coroutine that polls every in-flight handle while anything is in flight, paced
by :class:`~kvfsm.transport._pacer.PollPacer` (it polls without sleeping only around a chunk's
expected completion, for a bounded stretch, and sleeps ``poll_max_wait_s`` otherwise), and
parks on an event when nothing is. It also progresses the agent (``get_new_notifs``): with
progress threads off, nobody else answers a peer's handshakes.

Handles belong to the pump, not to rooms: a room that fails still has its posted handles
drained. Every handle is released explicitly, on every path: when its chunk ends, when it is
held, when the poster hands back a record the ledger forgot, and at :meth:`Pump.close` (what
the ledger still holds, and handles whose release NIXL refused earlier).

Leases (law 4). Before each progress of the agent the pump asks the ledger
(``leases_checked``): an in-flight chunk whose lease went away is released and held. And
before every NIXL call that can progress the agent it asks the stale-progress gate
(``Leases.progress_allowed``, see ``_fence``): after a freeze that left a WRITE queued past
its lease, the gate fences the agent out, and the pump fails every posted chunk without
another NIXL call and stops (``fenced_out``).

Progress after a lease is gone. On progress-driven transports (UCX over TCP) a posted WRITE's
queued bytes move only while the agent is progressed, so not progressing looks like a fence.
It is not one: ``check_xfer_state`` of *any* handle progresses the whole worker
(``nixlUcxBackendH::status``: "Maximum progress"), as does the next ``transfer()``, and
``remove_remote_agent`` closes the endpoint in flush mode (``closeImpl(flags=0)``), completing
outstanding puts rather than discarding them. Stopping progress would only postpone those bytes
to the next progress for any reason, arbitrarily late and after the owner's grace. So the pump
keeps progressing while anything is held, and an idle pump lingers after a hold (or a dropped
peer generation), progressing every ``linger_interval_s`` for ``linger_s``: released bytes land
within milliseconds of the release on a healthy link, and as soon as a cut link is back, not
when the next transfer happens to progress the agent (found by the two-host cut test: bytes
queued before a 4 s cut landed 16 s later, in pages decode had settled and handed out again).
What stays unfenced: ``docs/reliability.md``, Write fencing.

Flushes (the ledger's rule 2). Progress makes a released WRITE's bytes move only if the target
takes them: a target that is frozen takes nothing, and its socket and this agent's queue hold
them until it resumes, however long that is. So a held chunk is not final on a timer alone:
the pump posts a flush of its peer generation (a ``FLUSH_BYTES`` READ from the peer's memory,
``Peer.flush``) and polls it with the other handles each round; its DONE, which NIXL's UCX
backend gives only after flushing the endpoint, means every WRITE posted there before it has
completed at the target. A flush that raises a remote disconnect loses its peer generation, as
a chunk's would; any other error is the ledger's ``flush_failed`` (posted again later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from kvfsm._tasks import cancel_and_wait
from kvfsm.rooms import Inbox, RoomKey
from kvfsm.states import ChunkDone, Event
from kvfsm.transport._agent import Peer
from kvfsm.transport._config import ChunkObserver, TransferConfig, TransportStats
from kvfsm.transport._fence import FenceError, Leases
from kvfsm.transport._layout import LayoutError
from kvfsm.transport._ledger import (
    ACTIVE,
    Action,
    CancelFlush,
    ChunkLedger,
    Deliver,
    Finish,
    PostFlush,
    Record,
    Release,
    StartQuarantine,
)
from kvfsm.transport._nixl import describe, is_remote_disconnect
from kvfsm.transport._pacer import PollPacer

__all__ = ["Pump"]

_log = logging.getLogger("kvfsm.transport")
#: The one descriptor of both flush lists (``Peer.flush``).
_FIRST: Final = np.zeros(1, np.int32)


class Pump:
    """Loop thread only, except :meth:`close` (after the loop stopped).

    ``nixl``: the agent's NIXL object; ``post(record)``: queue a record for the poster thread;
    ``disconnected(peer, reason)``: NIXL reported ``peer`` gone (a remote disconnect), called
    before the ledger hears of the error, so its rooms fail with a peer-lost reason first.
    """

    def __init__(
        self,
        nixl: Any,
        ledger: ChunkLedger,
        config: TransferConfig,
        stats: TransportStats,
        *,
        leases: Leases | None,
        post: Callable[[Record], None],
        disconnected: Callable[[Peer, str], None],
        observer: ChunkObserver | None = None,
        fenced_out: Callable[[str], None] | None = None,
    ) -> None:
        self.nixl = nixl
        self.ledger = ledger
        self.config = config
        self.stats = stats
        self.leases = leases
        #: Told about every finished chunk (metrics).
        self.observer = observer
        self._post = post
        self._disconnected = disconnected
        self._fenced_out = fenced_out
        #: Handles of a fenced-out agent: never released (that would touch the agent), kept
        #: referenced so nothing frees them either.
        self._abandoned: list[Any] = []
        self._inbox: Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        #: Until when an idle pump keeps progressing the agent (``TransferConfig.linger_s``).
        self._linger_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._leaked: list[Any] = []  # handles whose release NIXL refused; retried at close
        #: Flushes in flight: peer generation -> (its handle, its number).
        self._flushing: dict[Any, tuple[Any, int]] = {}
        #: Flushes the ledger asked for later (a retry after a refusal), in no order.
        self._flushes_due: list[PostFlush] = []

    def start(self, loop: asyncio.AbstractEventLoop, inbox: Inbox) -> None:
        """Start the pump coroutine on ``loop`` (running, this thread's); events go to
        ``inbox``."""
        self._inbox = inbox
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="kvfsm-nixl-pump")
        self._task.add_done_callback(_pump_ended)

    # -- what happened -------------------------------------------------------------------------

    def posted(self, batch: Sequence[tuple[Record, BaseException | None]]) -> None:
        """The poster is done with these records: each was posted, or raised."""
        ledger = self.ledger
        now = time.monotonic()
        for record, exc in batch:
            if exc is None:
                actions = ledger.posted(record, now)
            elif isinstance(exc, LayoutError):
                actions = ledger.rejected(record, str(exc))
            elif isinstance(exc, FenceError):
                actions = ledger.fenced(record, str(exc), now)
            else:
                actions = self._errored(record, exc, now)
            if actions:
                self.execute(actions)
        leases = self.leases
        if ledger.busy or (leases is not None and leases.fenced_out is not None):
            wake = self._wake  # (fenced out by the poster: the pump fails what is posted)
            assert wake is not None
            wake.set()
        self.run_woken()

    def linger(self) -> None:
        """Bytes of a released WRITE may still be queued in the agent: keep progressing it for
        ``linger_s`` even when idle (see the module docstring)."""
        self._linger_until = time.monotonic() + self.config.linger_s
        if self._wake is not None:
            self._wake.set()

    # -- executing the ledger's actions --------------------------------------------------------

    def execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Finish):
                self._finish(action)
            elif isinstance(action, Deliver):
                self._deliver(action.key, action.event)
            elif isinstance(action, Release):
                self._release_all(action.record)
            elif isinstance(action, PostFlush):
                self._post_flush(action)
            elif isinstance(action, CancelFlush):
                self._cancel_flush(action.peer)
            elif isinstance(action, StartQuarantine):
                loop = self._loop
                assert loop is not None  # actions come only after start()
                delay = max(0.0, action.until - time.monotonic())
                loop.call_later(delay, self._quarantine_over, action.record)
                # Progress-driven transports (UCX over TCP) move a released WRITE's queued
                # bytes only when the agent is progressed: the pump keeps progressing while
                # anything is held and lingers after, so those bytes land as soon as the
                # link lets them, not whenever the next transfer comes.
                self.linger()
            else:
                self._post(action.record)

    def _errored(self, record: Record, exc: BaseException, now: float) -> list[Action]:
        if is_remote_disconnect(exc):
            # The peer is reported gone: its rooms fail with a peer-lost reason first.
            self._disconnected(record.peer, f"NIXL remote disconnect from {record.peer.peer_id}")
        return self.ledger.errored(record, describe(exc), now)

    # -- flushes (the ledger's rule 2) ----------------------------------------------------------

    def _post_flush(self, action: PostFlush) -> None:
        now = time.monotonic()
        if action.not_before > now:
            self._flushes_due.append(action)
            return
        peer, seq = action.peer, action.seq
        lists = getattr(peer, "flush", None)
        if lists is None:
            # Nothing to flush with (its lists went with a disconnect): it waits for its
            # generation to be lost, which settles it (rule 6), or for close().
            _log.warning("%r cannot be flushed; its held chunks wait for it to go", peer)
            return
        leases = self.leases
        if leases is not None and not leases.progress_allowed(now):
            self._wake_up()  # fenced out: the pump's next round abandons everything
            return
        nixl = self.nixl
        try:
            handle = nixl.make_prepped_xfer("READ", lists[0], _FIRST, lists[1], _FIRST)
        except Exception as exc:
            self._flush_raised(peer, seq, exc, now)
            return
        self.stats.flush_handles_created += 1
        try:
            state = nixl.transfer(handle)
        except Exception as exc:
            self._release(handle)
            self._flush_raised(peer, seq, exc, now)
            return
        if state == "DONE":
            self._release(handle)
            self.execute(self.ledger.flushed(peer, seq, now))
        else:
            self._flushing[peer] = (handle, seq)
            self._wake_up()

    def _poll_flushes(self, now: float) -> None:
        """One round's check of every flush in flight (each check also progresses the agent)."""
        check = self.nixl.check_xfer_state
        for peer, (handle, seq) in list(self._flushing.items()):
            if self._flushing.get(peer) != (handle, seq):
                continue  # cancelled or replaced by an earlier one's actions this round
            try:
                state = check(handle)
            except Exception as exc:
                del self._flushing[peer]
                self._release(handle)
                self._flush_raised(peer, seq, exc, now)
                continue
            if state == "PROC":
                continue
            del self._flushing[peer]
            self._release(handle)
            if state == "DONE":
                self.execute(self.ledger.flushed(peer, seq, now))
            else:
                self.execute(self.ledger.flush_failed(peer, seq, f"flush state {state}", now))
        if self._flushes_due:
            due = [a for a in self._flushes_due if a.not_before <= now]
            if due:
                self._flushes_due = [a for a in self._flushes_due if a.not_before > now]
                for action in due:
                    self._post_flush(action)

    def _flush_raised(self, peer: Any, seq: int, exc: BaseException, now: float) -> None:
        if is_remote_disconnect(exc):
            # The endpoint failed: its generation is lost, which settles its held chunks
            # (rule 6) and cancels this flush's bookkeeping.
            self._disconnected(peer, f"NIXL remote disconnect from {peer.peer_id} (flush)")
            return
        _log.warning("flush of %r failed: %s", peer, describe(exc))
        self.execute(self.ledger.flush_failed(peer, seq, describe(exc), now))

    def _cancel_flush(self, peer: Any) -> None:
        """Its generation is lost: release the flush's handle before its agent goes."""
        flushing = self._flushing.pop(peer, None)
        if flushing is not None:
            self._release(flushing[0])
        self._flushes_due = [a for a in self._flushes_due if a.peer is not peer]

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _quarantine_over(self, record: Record) -> None:
        self.execute(self.ledger.quarantine_over(record))

    def _finish(self, finish: Finish) -> None:
        record = finish.record
        self._release_all(record)
        if record.opened:
            leases = self.leases
            if leases is not None:
                leases.closed(record.fence)
        observer = self.observer
        if observer is not None:
            ok = type(finish.event) is ChunkDone
            seconds = time.monotonic() - record.t0
            for _, _, nbytes in record.members:  # a metric per chunk, as posted by its room
                observer.chunk(nbytes, seconds, ok)
        for key, event in finish.events():
            self._deliver(key, event)

    def _release_all(self, record: Record) -> None:
        handles, record.handles = record.handles, []
        for handle in handles:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        leases = self.leases
        if leases is not None and leases.fenced_out is not None:
            self._abandoned.append(handle)
            return
        try:
            self.nixl.release_xfer_handle(handle)
        except Exception:
            _log.exception("release_xfer_handle failed; retrying at close()")
            self._leaked.append(handle)
            return
        self.stats.handles_released += 1

    def run_woken(self) -> None:
        """The rooms this batch's events woke run now, in this loop iteration
        (``Inbox.run_woken``)."""
        inbox = self._inbox
        if inbox is not None:
            inbox.run_woken()

    def _deliver(self, key: RoomKey, event: Event) -> None:
        inbox = self._inbox
        if inbox is None or not inbox.deliver(key, event):
            self.stats.stale_deliveries += 1

    # -- the pump ------------------------------------------------------------------------------

    def _abandon(self, reason: str) -> None:
        """The gate fenced the agent out: fail every posted chunk, touch NIXL no more."""
        _log.critical("%s", reason)
        self.execute(self.ledger.abandon(reason))
        self.run_woken()
        if self._fenced_out is not None:
            self._fenced_out(reason)

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        ledger, leases = self.ledger, self.leases
        check, progress = self.nixl.check_xfer_state, self.nixl.get_new_notifs
        clock = time.monotonic
        interval = self.config.linger_interval_s
        pacer = PollPacer(self.config.poll_spin_s, self.config.poll_max_wait_s)
        stats = self.stats
        # The stale-progress gate (_fence): asked right before every call that can progress
        # the agent; always yes without leases.
        allowed = leases.progress_allowed if leases is not None else _always
        while True:
            if leases is not None and leases.fenced_out is not None:
                self._abandon(leases.fenced_out)  # (the poster or the worker found it first)
                return
            if not ledger.busy:
                wake.clear()
                linger = self._linger_until - clock()
                if linger <= 0:
                    await wake.wait()
                elif not allowed(clock()):
                    continue
                else:
                    # Bytes of a held WRITE (or of a dropped generation's endpoint) may still
                    # be queued in the agent: keep moving them (TransferConfig.linger_s).
                    try:
                        progress()
                    except Exception:
                        _log.exception("agent progress failed")
                    stats.linger_progresses += 1
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(interval, linger)):
                            await wake.wait()
                continue
            if not allowed(clock()):
                continue
            if leases is not None:
                # Before progressing: an in-flight chunk whose lease is gone is released now
                # (see the module docstring for why progress itself is not withheld).
                actions = ledger.leases_checked(clock())
                if actions:
                    self.execute(actions)
            try:
                progress()  # answers peers' handshakes and flushes (no progress thread)
            except Exception:
                _log.exception("agent progress failed")
            batch = ledger.take_active()
            now = clock()
            for record in batch:
                if record.phase != ACTIVE:
                    continue  # held or over meanwhile (peer lost, lease gone)
                if not allowed(clock()):
                    break  # fenced out mid-round: the loop's top abandons every record
                try:
                    states = [check(h) for h in record.handles]
                except Exception as exc:
                    actions = self._errored(record, exc, now)
                else:
                    actions = ledger.polled(record, states, now)
                    if "PROC" not in states:
                        pacer.finished(record.nbytes, now - record.t0)
                if actions:
                    self.execute(actions)
            if (self._flushing or self._flushes_due) and allowed(clock()):
                self._poll_flushes(clock())
            self.run_woken()
            stats.pump_rounds += 1
            if leases is not None and leases.fenced_out is not None:
                continue
            # Poll where completions are due, sleep elsewhere (bounded: see _pacer): a pump
            # that spins costs the scheduler thread its GIL. Held records (nothing expected)
            # are progressed once per poll_max_wait_s. New chunks posted meanwhile wake it.
            wait = pacer.wait(clock(), ledger.pending())
            if not ledger.active and wait > 0:
                # Only held chunks: nothing completes soon, and a flush may wait for a frozen
                # peer for minutes; polling every 1 ms for that long would cost the scheduler
                # thread its GIL for nothing (a resumed peer is found within this interval).
                wait = max(wait, self.config.linger_interval_s)
            if wait <= 0:
                await asyncio.sleep(0)
                continue
            stats.pump_sleeps += 1
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await wake.wait()

    # -- teardown ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop the pump coroutine (loop thread); handles are released in :meth:`close`."""
        await cancel_and_wait(self._task)

    def close(self) -> None:
        """After the loop stopped and the poster thread is done: release every handle the
        ledger still holds (no final events: the rooms are gone), then retry the releases
        NIXL refused earlier. A fenced-out agent's handles are kept, never released."""
        for record in self.ledger.drain():
            self._release_all(record)
        flushing, self._flushing = self._flushing, {}
        for handle, _seq in flushing.values():
            self._release(handle)
        self._flushes_due.clear()
        leaked, self._leaked = self._leaked, []
        for handle in leaked:
            self._release(handle)


def _always(now: float) -> bool:
    return True


def _pump_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("NIXL pump crashed", exc_info=task.exception())
