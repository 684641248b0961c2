"""``NixlTransport``: the rooms' data path over NIXL, as a ``CommandSink``.

Prefill rooms emit ``PostChunk`` and ``ReleaseHandles``; this module turns them into NIXL WRITEs
from the local layout into a peer's pages and answers with ``ChunkDone``, ``ChunkFailed``,
``ChunkStalled`` and ``PeerLost``. Every other command is the control channel's: a rank's
router (``kvfsm.manager.CommandRouter``) sends it there, never here; used alone, as the engine's
only sink, this transport drops them (outcomes go nowhere).

The rules (which chunk ends how, quarantines, lost peers, fences) live in one place, the
sans-IO :class:`~kvfsm.transport._ledger.ChunkLedger`; this module executes its actions (NIXL
calls, timers, deliveries) and owns the threads:

* the **loop thread** validates each chunk (page indices against both layouts: an out-of-range
  index fails that chunk with a reason and never reaches NIXL), hands it to the ledger, and
  runs the **pump**: one coroutine that polls every in-flight handle while anything is in
  flight, paced by :class:`~kvfsm.transport._pacer.PollPacer` (it polls without sleeping only
  around a chunk's expected completion, for a bounded stretch, and sleeps ``poll_max_wait_s``
  otherwise), and parked on an event when nothing is. The pump also progresses the agent
  (``get_new_notifs``): with progress threads off, nobody else answers a peer's handshakes.
* the **poster thread** (:mod:`kvfsm.transport._poster`) makes and posts the transfers
  (``make_prepped_xfer`` + lease check + ``transfer`` + one check), and the peer set's thread
  (:mod:`kvfsm.transport._peers`) connects peers. ``transfer()`` copies synchronously on
  shared-memory paths, and ``add_remote_agent`` takes milliseconds: neither may run on the loop.

Handles belong to the pump, not to rooms. A room that fails still has its posted handles
drained; a chunk not yet posted when its room asks to release is dropped. Each chunk has a
deadline, ``deadline_base_s + bytes / floor_bandwidth``. A handle past it is released and
reported ``ChunkStalled`` (the room fails at once), and ``ChunkFailed`` follows only after
``quarantine_s``: bytes of a cancelled WRITE may still land, so its pages stay unsettled that
long (law 4). Every handle is released explicitly, on every path.

Write fencing (law 4, :mod:`kvfsm.transport._fence`). With ``leases`` set, every chunk names
a fence (``PostChunk.fence``) and is written only under a valid lease on it: checked when the
chunk is accepted, again on the poster thread immediately before each ``transfer()`` (a writer
frozen for any length of time with chunks queued re-checks on waking, with a fresh
``time.monotonic()``), and by the pump before each progress of the agent (an in-flight chunk
whose lease went away is released and held). Fence 0 on a fenced transport is refused. Without
``leases`` nothing is fenced (direct users, benchmarks).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvfsm.rooms import CommandSink, Inbox, RoomKey
from kvfsm.states import (
    ChunkDone,
    ChunkFailed,
    Command,
    Event,
    PostChunk,
    ReleaseHandles,
)
from kvfsm.transport._agent import Agent, Peer
from kvfsm.transport._config import ChunkObserver, TransferConfig, TransportStats
from kvfsm.transport._fence import FenceError, Leases
from kvfsm.transport._layout import LayoutError, LayoutSummary
from kvfsm.transport._ledger import (
    ACTIVE,
    Action,
    ChunkLedger,
    Deliver,
    Finish,
    Post,
    Record,
    Release,
    StartQuarantine,
)
from kvfsm.transport._nixl import describe, is_remote_disconnect
from kvfsm.transport._pacer import PollPacer
from kvfsm.transport._peers import PeerSet
from kvfsm.transport._poster import Poster
from kvfsm.transport._slices import NO_KV, KvPiece, sliced_index

# TransferConfig, TransportStats and ChunkObserver live in _config; re-exported here, where
# callers have always imported them from.
__all__ = ["ChunkObserver", "NixlTransport", "TransferConfig", "TransportStats"]

_log = logging.getLogger("kvfsm.transport")
Indices = npt.NDArray[np.int32]


class _Xfer(Record):
    """A record plus what the poster needs to post it (the ledger never reads these)."""

    __slots__ = ("dst", "dst_aux", "dst_state", "src", "src_aux", "src_state")

    def __init__(
        self,
        key: RoomKey,
        chunk: int,
        *,
        peer: Peer,
        fence: int,
        src: Indices,
        dst: Indices,
        src_aux: Indices | None,
        dst_aux: Indices | None,
        src_state: Indices,
        dst_state: Indices,
        nbytes: int,
    ) -> None:
        super().__init__(key, chunk, peer, nbytes, fence)
        self.src = src
        self.dst = dst
        self.src_aux = src_aux
        self.dst_aux = dst_aux
        self.src_state = src_state
        self.dst_state = dst_state


class NixlTransport(CommandSink):
    """A ``CommandSink`` for a prefill engine: chunks become NIXL WRITEs into peers' pages.

    Lifecycle: build an :class:`Agent` (blocking), wrap it here, hand this (or a router in
    front of it and a control channel) to a ``RoomEngine`` (``attach`` starts the pump),
    connect peers with :meth:`connect_peer`, run rooms;
    ``engine.close()``, then :meth:`close` (releases anything left, then the agent's peers).
    With ``leases`` (granted and revoked by the control plane on the loop thread) every chunk
    is fenced by its ``PostChunk.fence``; without, nothing is.
    """

    def __init__(
        self,
        agent: Agent,
        config: TransferConfig | None = None,
        observer: ChunkObserver | None = None,
        leases: Leases | None = None,
    ) -> None:
        self.agent = agent
        #: Told about every finished chunk (metrics); loop thread.
        self.observer = observer
        self.config = config if config is not None else TransferConfig()
        self.stats = TransportStats()
        #: Write leases every chunk is fenced by; None: nothing is fenced.
        self.leases = leases
        self._ledger = ChunkLedger(
            deadline_s=self.config.deadline_s,
            quarantine_s=self.config.quarantine_s,
            leases=leases,
            stats=self.stats,
        )
        self._inbox: Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        #: Until when an idle pump keeps progressing the agent (``TransferConfig.linger_s``).
        self._linger_until = 0.0
        self._pump_task: asyncio.Task[None] | None = None
        # Peer set-up (milliseconds per add_remote_agent) and chunk posting (copies on shared
        # memory) are both blocking; each gets its own thread (the peer set's, the poster) so a
        # connecting peer never delays another peer's chunks.
        self._poster: Poster[_Xfer] = Poster(self._post_blocking, self._posted)
        self._peers = PeerSet(
            agent,
            reconnect_interval_s=self.config.reconnect_interval_s,
            drop=self._drop_generation,
            counters=self._count,
        )
        self._leaked: list[Any] = []  # handles whose release NIXL refused; retried at close
        self._closed = False

    # -- CommandSink (loop thread) -------------------------------------------------------------

    def attach(self, inbox: Inbox) -> None:
        if self._loop is not None or self._closed:
            raise RuntimeError("a NixlTransport serves one engine, once")
        self._inbox = inbox
        self._loop = loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._poster.start(loop)
        self._pump_task = loop.create_task(self._pump(), name="kvfsm-nixl-pump")
        self._pump_task.add_done_callback(_pump_ended)

    def submit(self, key: RoomKey, command: Command) -> None:
        if isinstance(command, PostChunk):
            self._accept(key, command)
        elif isinstance(command, ReleaseHandles):
            self._ledger.release_requested(key)  # marks only: no actions
        # Anything else is the control channel's (see the module docstring): dropped here.

    # -- peers ---------------------------------------------------------------------------------

    async def connect_peer(
        self,
        peer_id: str,
        metadata: bytes,
        summary: LayoutSummary,
        piece: KvPiece | None = None,
    ) -> Peer:
        """Connect (or reconnect, as a new generation) the peer ``peer_id``. Loop thread; the
        blocking work runs on the peer set's worker. Concurrent calls for one peer share one
        attempt. ``piece``: the head slice of each KV page this rank writes into the peer
        (unequal attention TP), None for whole pages."""
        self._running_loop()
        return await self._peers.connect(peer_id, metadata, summary, piece)

    def peer(self, peer_id: str) -> Peer | None:
        return self._peers.get(peer_id)

    def _drop_generation(self, peer: Peer, reason: str) -> None:
        """A peer generation goes (replaced, or lost): hold its chunks first, before its remote
        agent goes (NIXL's word on a handle whose agent was removed says nothing about the
        WRITE; Agent.disconnect wants its handles released), and keep progressing what its
        endpoint still has queued (it closes in flush mode)."""
        self._execute(self._ledger.peer_lost(peer, reason, time.monotonic()))
        self._linger()

    def _count(self, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    # -- accepting a chunk (loop thread) -------------------------------------------------------

    def _accept(self, key: RoomKey, command: PostChunk) -> None:
        loop = self._running_loop()
        stats = self.stats
        stats.chunks_posted += 1
        peer = self._peers.get(command.peer)
        try:
            if peer is None:
                raise LayoutError(f"no connected peer {command.peer!r}")
            record = self._record(key, command, peer)
        except LayoutError as exc:
            stats.chunks_rejected += 1
            stats.chunks_failed += 1
            loop.call_soon(self._deliver, key, ChunkFailed(command.chunk, str(exc)))
            return
        if record is None:  # nothing to move: an empty chunk without an aux row
            stats.chunks_done += 1
            loop.call_soon(self._deliver, key, ChunkDone(command.chunk))
            return
        actions = self._ledger.accepted(record, time.monotonic())
        if len(actions) == 1 and type(actions[0]) is Post:
            self._poster.submit(record)
        else:  # refused: told after this callback, the room is in the middle of a command
            loop.call_soon(self._execute, actions)

    def _record(self, key: RoomKey, command: PostChunk, peer: Peer) -> _Xfer | None:
        """The chunk as a record, after the O(1) checks; raise ``LayoutError`` on bad input.
        Page ranges are checked (and pages sorted) on the poster thread: for a chunk of
        thousands of pages that is a millisecond the loop thread should not spend."""
        local, remote = self.agent.layout, peer.summary
        src = np.frombuffer(command.src, dtype=np.int32)
        dst = np.frombuffer(command.dst, dtype=np.int32)
        if src.size != dst.size:
            raise LayoutError(f"{src.size} source pages but {dst.size} destination pages")
        src_aux = dst_aux = None
        aux_bytes = 0
        if command.is_last and command.src_aux >= 0 and command.dst_aux >= 0:
            local.check_row(command.src_aux, "source aux row")
            remote.check_row(command.dst_aux, "destination aux row")
            src_aux = local.aux_index(command.src_aux)
            dst_aux = remote.aux_index(command.dst_aux)
            aux_bytes = local.aux_row_bytes()
        src_state = np.frombuffer(command.src_state, dtype=np.int32)
        dst_state = np.frombuffer(command.dst_state, dtype=np.int32)
        if src_state.size != dst_state.size:
            raise LayoutError(
                f"{src_state.size} source state rows but {dst_state.size} destination"
            )
        if src.size == 0 and src_aux is None and src_state.size == 0:
            return None
        piece = peer.piece
        page_bytes = local.page_bytes() if piece is None else piece.page_bytes(len(local.kv))
        nbytes = (
            src.size * page_bytes
            + aux_bytes
            + (src_state.size * local.state_row_bytes() if src_state.size else 0)
        )
        return _Xfer(
            key,
            command.chunk,
            peer=peer,
            fence=command.fence,
            src=src,
            dst=dst,
            src_aux=src_aux,
            dst_aux=dst_aux,
            src_state=src_state,
            dst_state=dst_state,
            nbytes=nbytes,
        )

    # -- posting (worker thread) ---------------------------------------------------------------

    def _post_blocking(self, record: _Xfer) -> None:
        """Make and post the chunk's transfers; check each once. Raises what NIXL raised,
        ``LayoutError`` for bad input (nothing posted), ``FenceError`` when the lease is not
        valid before a part (that part and the later ones not posted)."""
        if record.dropped:
            return
        nixl, peer, agent = self.agent.nixl, record.peer, self.agent
        parts: list[tuple[Any, Indices, Any, Indices]] = []
        src, dst = record.src, record.dst
        if src.size:
            layout, remote = agent.layout, peer.summary
            # Bad input fails this chunk (LayoutError) before anything reaches NIXL.
            layout.check_pages(src, "source page")
            remote.check_pages(dst, "destination page")
            if src.size > 1:
                # Destination order makes contiguous runs consecutive, and NIXL merges them.
                order = np.argsort(dst, kind="stable")
                src, dst = src[order], dst[order]
            piece = peer.piece
            if piece is NO_KV:
                raise LayoutError(
                    f"{src.size} pages for peer {peer.peer_id}, which this rank writes no KV "
                    "into (its heads come from another rank: a dummy link)"
                )
            if piece is None:
                parts.append(
                    (agent.local("kv"), layout.page_index(src), peer.kv, remote.page_index(dst))
                )
            else:  # a head slice: one descriptor per row of each page (pages checked above)
                rows = piece.rows
                local_idx = sliced_index(len(layout.kv), layout.num_pages, rows, src)
                remote_idx = sliced_index(len(remote.kv), remote.num_pages, rows, dst)
                parts.append((peer.local_kv, local_idx, peer.kv, remote_idx))
        if record.src_aux is not None and record.dst_aux is not None:
            parts.append((agent.local("aux"), record.src_aux, peer.aux, record.dst_aux))
        if record.src_state.size:
            layout, remote = agent.layout, peer.summary
            local_rows = [layout.state_index(int(r)) for r in record.src_state]
            remote_rows = [remote.state_index(int(r)) for r in record.dst_state]
            parts.append(
                (
                    agent.local("state"),
                    np.concatenate(local_rows).astype(np.int32),
                    peer.state,
                    np.concatenate(remote_rows).astype(np.int32),
                )
            )
        leases, fence = self.leases, record.fence
        for part, (local_list, local_idx, remote_list, remote_idx) in enumerate(parts):
            handle = nixl.make_prepped_xfer("WRITE", local_list, local_idx, remote_list, remote_idx)
            record.handles.append(handle)
            self.stats.handles_created += 1
            # The fence: checked here, after the handle is made and right before the post, so
            # the window between the check and transfer() is a few bytecodes. A writer that
            # was frozen with this chunk queued gets here first after waking, with a fresh
            # clock.
            if leases is not None and not leases.valid(fence, time.monotonic()):
                raise FenceError(_fenced_reason(leases, fence, part, len(parts)))
            state = nixl.transfer(handle)
            if state == "PROC":
                state = nixl.check_xfer_state(handle)
            record.states.append(state)
        if all(state == "DONE" for state in record.states):
            # The common case on shared memory: the copy finished inside transfer(). Release
            # here: release_xfer_handle holds the GIL, and freeing a large handle's
            # descriptors is work the loop thread should not do.
            while record.handles:
                nixl.release_xfer_handle(record.handles[-1])  # if it raises, the loop retries
                record.handles.pop()
                self.stats.handles_released_at_post += 1

    def _posted(self, batch: list[tuple[_Xfer, BaseException | None]]) -> None:
        """Loop thread: the poster is done with these records."""
        ledger = self._ledger
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
                self._execute(actions)
        if ledger.busy:
            wake = self._wake
            assert wake is not None
            wake.set()

    # -- the pump (loop thread) ----------------------------------------------------------------

    async def _pump(self) -> None:
        wake = self._wake
        assert wake is not None
        ledger, leases = self._ledger, self.leases
        nixl = self.agent.nixl
        check, progress = nixl.check_xfer_state, nixl.get_new_notifs
        clock = time.monotonic
        interval = self.config.linger_interval_s
        pacer = PollPacer(self.config.poll_spin_s, self.config.poll_max_wait_s)
        stats = self.stats
        while True:
            if not ledger.busy:
                wake.clear()
                linger = self._linger_until - clock()
                if linger <= 0:
                    await wake.wait()
                else:
                    # Bytes of a held WRITE (or of a dropped generation's endpoint) may still
                    # be queued in the agent: keep moving them (TransferConfig.linger_s).
                    try:
                        progress()
                    except Exception:
                        _log.exception("agent progress failed")
                    self.stats.linger_progresses += 1
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(interval, linger)):
                            await wake.wait()
                continue
            if leases is not None:
                # Before progressing: an in-flight chunk whose lease is gone is released now
                # (see the module docstring for why progress itself is not withheld).
                actions = ledger.leases_checked(clock())
                if actions:
                    self._execute(actions)
            try:
                progress()  # answers peers' handshakes and flushes (no progress thread)
            except Exception:
                _log.exception("agent progress failed")
            batch = ledger.take_active()
            now = clock()
            for record in batch:
                if record.phase != ACTIVE:
                    continue  # held or over meanwhile (peer lost, lease gone)
                try:
                    states = [check(h) for h in record.handles]
                except Exception as exc:
                    actions = self._errored(record, exc, now)
                else:
                    actions = ledger.polled(record, states, now)
                    if "PROC" not in states:
                        pacer.finished(record.nbytes, now - record.t0)
                if actions:
                    self._execute(actions)
            stats.pump_rounds += 1
            # Poll where completions are due, sleep elsewhere (bounded: see _pacer): a pump
            # that spins costs the scheduler thread its GIL. Held records (nothing expected)
            # are progressed once per poll_max_wait_s. New chunks posted meanwhile wake it.
            wait = pacer.wait(clock(), ledger.pending())
            if wait <= 0:
                await asyncio.sleep(0)
                continue
            stats.pump_sleeps += 1
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await wake.wait()

    # -- executing the ledger's actions (loop thread) ------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Finish):
                self._finish(action.record, action.event)
            elif isinstance(action, Deliver):
                self._deliver(action.key, action.event)
            elif isinstance(action, Release):
                self._release_all(action.record)
            elif isinstance(action, StartQuarantine):
                delay = max(0.0, action.until - time.monotonic())
                self._running_loop().call_later(delay, self._quarantine_over, action.record)
                # Progress-driven transports (UCX over TCP) move a released WRITE's queued
                # bytes only when the agent is progressed: the pump keeps progressing while
                # anything is held and lingers after, so those bytes land as soon as the
                # link lets them, not whenever the next transfer comes.
                self._linger()
            else:
                self._poster.submit(cast("_Xfer", action.record))

    def _linger(self) -> None:
        self._linger_until = time.monotonic() + self.config.linger_s
        if self._wake is not None:
            self._wake.set()

    def _errored(self, record: Record, exc: BaseException, now: float) -> list[Action]:
        if is_remote_disconnect(exc):
            # The peer is reported gone: its rooms fail with a peer-lost reason first.
            self._peers.lost(record.peer, f"NIXL remote disconnect from {record.peer.peer_id}")
        return self._ledger.errored(record, describe(exc), now)

    def _quarantine_over(self, record: Record) -> None:
        self._execute(self._ledger.quarantine_over(record))

    def _finish(self, record: Record, event: ChunkDone | ChunkFailed) -> None:
        self._release_all(record)
        if self.observer is not None:
            ok = type(event) is ChunkDone
            self.observer.chunk(record.nbytes, time.monotonic() - record.t0, ok)
        self._deliver(record.key, event)

    def _release_all(self, record: Record) -> None:
        handles, record.handles = record.handles, []
        for handle in handles:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        try:
            self.agent.nixl.release_xfer_handle(handle)
        except Exception:
            _log.exception("release_xfer_handle failed; retrying at close()")
            self._leaked.append(handle)
            return
        self.stats.handles_released += 1

    def _deliver(self, key: RoomKey, event: Event) -> None:
        inbox = self._inbox
        if inbox is None or not inbox.deliver(key, event):
            self.stats.stale_deliveries += 1

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("NixlTransport is not attached to an engine")
        return self._loop

    # -- reads and teardown --------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Chunks accepted and not yet reported final (quarantined ones included)."""
        return self._ledger.in_flight

    def snapshot(self) -> dict[str, int]:
        out = asdict(self.stats)
        out["handles_released"] += out.pop("handles_released_at_post")
        out["in_flight"] = self.in_flight
        out["held"] = self._ledger.held
        out["peers"] = len(self._peers)
        if self.leases is not None:
            out["leases_live"] = self.leases.live
        return out

    async def aclose(self) -> None:
        """Engine shutdown hook (loop thread): stop the pump; handles are released in close()."""
        task = self._pump_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def close(self) -> None:
        """After ``engine.close()``: release what is left, drop peers, stop the worker.
        The agent itself is the caller's to close. Idempotent."""
        if self._closed:
            return
        loop = self._loop
        if loop is not None and loop.is_running():
            raise RuntimeError("close the RoomEngine before its NixlTransport")
        self._closed = True
        self._poster.close()
        self._peers.stop_worker()
        for record in self._ledger.drain():
            self._release_all(record)
        leaked, self._leaked = self._leaked, []
        for handle in leaked:
            self._release(handle)
        # Handles first, then the peers' lists and remote agents (Agent.disconnect wants that).
        self._peers.close()


def _fenced_reason(leases: Leases, fence: int, part: int, parts: int) -> str:
    why = leases.describe(fence, time.monotonic())
    if part == 0:
        return f"write lease of fence {fence} {why}: not posted"
    return f"write lease of fence {fence} {why} before part {part + 1} of {parts}"


def _pump_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("NIXL pump crashed", exc_info=task.exception())
