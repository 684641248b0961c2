"""``NixlPairSink``: one engine's sender and receiver rooms paired in-process, with every chunk a
real NIXL WRITE between two NIXL agents ("prefill" and "decode") over UCX, DRAM to DRAM.

Control messages take the :class:`~kvfsm.rooms._loopback.LoopbackSink` path unchanged (this sink
holds one and forwards every non-data command to it), so pairing semantics are the loopback's.
Only ``PostChunk`` and ``ReleaseHandles`` are handled here.

Layout (this slice): one source KV buffer and one destination KV buffer of ``num_pages`` pages
of ``page_bytes`` each, plus a source and a destination aux buffer of ``aux_rows`` rows of
``aux_row_bytes``. Each buffer is registered once. One prepped descriptor list per side holds
one descriptor per page followed by one per aux row, so a chunk, its aux row included, is one
``make_prepped_xfer``: indices ``0..num_pages-1`` are pages, ``num_pages + r`` is aux row ``r``.

Threads (NIXL thread-safety is undocumented, research ``nixl-and-peers.md`` §1.8):

* the constructor (caller's thread) creates both agents, registers memory, runs the
  ms-scale ``add_remote_agent`` and prepares the descriptor lists. Nothing blocking is left for
  the loop.
* one dedicated worker thread (a ``ThreadPoolExecutor(max_workers=1)`` owned by the sink) runs
  ``make_prepped_xfer`` + ``transfer`` + one ``check_xfer_state`` per chunk. On intra-node CMA
  ``transfer()`` copies inside the call (GIL released), so the loop never waits for a copy.
* the **pump** (one coroutine on the loop) polls every in-flight handle, releases it and
  delivers ``ChunkDone``/``ChunkFailed``. Handles belong to the pump, not to rooms.
* ``close()`` (caller's thread, after ``engine.close()``) releases whatever is left.

Two threads touch the prefill agent, so both agents run with ``NIXL_THREAD_SYNC_STRICT`` (one
mutex around each call; a pump check may wait for a concurrent ``transfer()`` copy, which is
bounded by the chunk size). Progress threads are off (on, each burns a core).

Measured while building this (UCX picks ``cma`` for the put and ``tcp/lo`` for active messages):
the data lands during ``transfer()``, and once the pair is wired up most chunks come back
``DONE`` from the worker's ``transfer()`` itself. But the first WRITE (endpoint wireup), and
some large ones, stay ``PROC`` forever unless the *target* agent's UCX worker is progressed
too: with no progress threads nobody answers the handshake/flush. The pump therefore calls the
decode agent's ``get_new_notifs()`` once per round (about 1 us). Two processes need the same
from the decode side's own poller.

ReleaseHandles (a room failed): chunks not yet posted are dropped and reported
``ChunkFailed(chunk, "released after abort (never posted)")``; chunks already posted are drained
to DONE or error and reported as such. Releasing a posted handle cannot stop bytes already on
their way (§0.3), so draining is what keeps law 4. A handle still ``PROC`` after
``stall_timeout_s`` is released (cancelled) and reported ``ChunkFailed`` only after a further
``quarantine_s``, so its pages stay unsettled for that grace period.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from nixl_cu12._api import (
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

from kvfsm.rooms._actor import Inbox, RoomKey
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.states import ChunkDone, ChunkFailed, Command, Event, PostChunk, ReleaseHandles

__all__ = ["NixlPairSink"]

_log = logging.getLogger("kvfsm.transport")

_MEM: Final = "DRAM"
_agent_names = itertools.count(1)

Indices = npt.NDArray[np.int32]


class _Xfer:
    """One posted chunk, from ``submit`` until its event is delivered (loop-side record).

    ``handle``, ``status`` and ``created`` are written by the worker thread before its future
    completes and read on the loop afterwards; ``cancelled`` is written on the loop and read by
    the worker (single reference stores, atomic under the GIL)."""

    __slots__ = ("key", "chunk", "src", "dst", "nbytes", "t0", "handle", "status", "cancelled")

    def __init__(
        self, key: RoomKey, chunk: int, *, src: Indices, dst: Indices, nbytes: int, t0: float
    ) -> None:
        self.key = key
        self.chunk = chunk
        self.src = src
        self.dst = dst
        self.nbytes = nbytes
        self.t0 = t0
        self.handle: nixl_xfer_handle | None = None
        self.status = ""
        self.cancelled = False


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_range(what: str, indices: Indices, bound: int) -> None:
    if indices.size == 0:
        return
    bad = (indices < 0) | (indices >= bound)
    if bad.any():
        first = int(indices[np.flatnonzero(bad)[0]])
        raise ValueError(f"{what} index {first} out of range [0, {bound})")


def _descs(base: int, rows: int, row_bytes: int) -> npt.NDArray[np.uint64]:
    """Nx3 ``(addr, len, devID)`` descriptors, one per row of a contiguous buffer."""
    out = np.zeros((rows, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)
    out[:, 1] = row_bytes
    return out


class NixlPairSink:
    """A ``CommandSink`` whose chunks are real NIXL WRITEs between two in-process agents.

    Buffers (numpy ``uint8``, DRAM): :attr:`src_kv` and :attr:`dst_kv` are
    ``(num_pages, page_bytes)``, :attr:`src_aux` and :attr:`dst_aux` are
    ``(aux_rows, aux_row_bytes)``. Callers fill the sources and read the destinations.

    Lifecycle: construct (blocking: agents, registration, metadata exchange), hand to a
    ``RoomEngine``, run rooms, ``engine.close()``, then :meth:`close` here. Also a context manager.
    """

    def __init__(
        self,
        *,
        num_pages: int = 4096,
        page_bytes: int = 16 * 1024,
        aux_rows: int = 256,
        aux_row_bytes: int = 4096,
        stall_timeout_s: float = 30.0,
        quarantine_s: float = 1.0,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_bytes", page_bytes),
            ("aux_rows", aux_rows),
            ("aux_row_bytes", aux_row_bytes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_pages + aux_rows > np.iinfo(np.int32).max:
            raise ValueError("num_pages + aux_rows must fit in int32")
        if not stall_timeout_s > 0 or quarantine_s < 0:
            raise ValueError("stall_timeout_s must be > 0 and quarantine_s >= 0")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.aux_rows = aux_rows
        self.aux_row_bytes = aux_row_bytes
        self.stall_timeout_s = stall_timeout_s
        self.quarantine_s = quarantine_s

        self.src_kv = np.zeros((num_pages, page_bytes), dtype=np.uint8)
        self.dst_kv = np.zeros((num_pages, page_bytes), dtype=np.uint8)
        self.src_aux = np.zeros((aux_rows, aux_row_bytes), dtype=np.uint8)
        self.dst_aux = np.zeros((aux_rows, aux_row_bytes), dtype=np.uint8)

        # -- counters (plain ints; each is written by one thread at a time) --
        self.handles_created = 0  # worker thread
        self.handles_released = 0  # loop thread, then close()
        self.chunks_posted = 0
        self.chunks_done = 0
        self.chunks_failed = 0
        self.chunks_rejected = 0  # failed before NIXL was called (bad indices)
        self.chunks_cancelled = 0  # dropped before posting after ReleaseHandles
        self.done_at_post = 0  # DONE already in the worker (transfer + one check)
        self.stalls = 0
        self.bytes_done = 0
        self.pump_rounds = 0
        self.stale_deliveries = 0

        self._control = LoopbackSink()
        self._inbox: Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._records: set[_Xfer] = set()  # accepted and not yet reported: in flight
        self._active: list[_Xfer] = []  # posted and PROC: the pump's list
        self._leaked: list[nixl_xfer_handle] = []  # release refused; retried in close()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfsm-nixl")
        self._closed = False

        self._prefill: nixl_agent | None = None
        self._decode: nixl_agent | None = None
        self._regs: list[tuple[nixl_agent, Any]] = []
        self._remote_name: str | None = None
        self._local_dlist: nixl_prepped_dlist_handle | None = None
        self._remote_dlist: nixl_prepped_dlist_handle | None = None
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise

    # -- setup and teardown (caller's thread) --------------------------------------------------

    def _setup(self) -> None:
        tag = f"{os.getpid()}-{next(_agent_names)}"
        config = functools.partial(
            nixl_agent_config,
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._prefill = prefill = nixl_agent(f"kvfsm-prefill-{tag}", config())
        self._decode = decode = nixl_agent(f"kvfsm-decode-{tag}", config())
        for agent, buffer in (
            (prefill, self.src_kv),
            (prefill, self.src_aux),
            (decode, self.dst_kv),
            (decode, self.dst_aux),
        ):
            reg = agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], _MEM)
            self._regs.append((agent, reg))
        # The decode agent's metadata carries its registrations, so it is read after them.
        self._remote_name = prefill.add_remote_agent(decode.get_agent_metadata())
        self._local_dlist = prefill.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._layout(self.src_kv, self.src_aux), _MEM
        )
        self._remote_dlist = prefill.prep_xfer_dlist(
            self._remote_name, self._layout(self.dst_kv, self.dst_aux), _MEM
        )

    def _layout(
        self, kv: npt.NDArray[np.uint8], aux: npt.NDArray[np.uint8]
    ) -> npt.NDArray[np.uint64]:
        return np.concatenate(
            (
                _descs(kv.ctypes.data, self.num_pages, self.page_bytes),
                _descs(aux.ctypes.data, self.aux_rows, self.aux_row_bytes),
            )
        )

    def close(self) -> None:
        """Release every handle, the prepped lists and the remote agent; deregister memory.

        Call after ``engine.close()`` (the pump must have stopped). Idempotent."""
        if self._closed:
            return
        loop = self._loop
        if loop is not None and loop.is_running():
            raise RuntimeError("close the RoomEngine before its NixlPairSink")
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._teardown()

    def _teardown(self) -> None:
        # Order (NIXL's own guidance): xfer handles, dlists, remote agent, memory.
        prefill = self._prefill
        for record in list(self._records):
            if record.handle is not None:
                self._release(record.handle)
                record.handle = None
        self._records.clear()
        self._active.clear()
        if self._leaked:
            leaked, self._leaked = self._leaked, []
            for handle in leaked:
                self._release(handle)
        for dlist in (self._local_dlist, self._remote_dlist):
            if dlist is not None and prefill is not None:
                try:
                    prefill.release_dlist_handle(dlist)
                except Exception:
                    _log.exception("release_dlist_handle failed")
        self._local_dlist = self._remote_dlist = None
        if prefill is not None and self._remote_name is not None:
            try:
                prefill.remove_remote_agent(self._remote_name)
            except Exception:
                _log.exception("remove_remote_agent failed")
        self._remote_name = None
        for agent, reg in reversed(self._regs):
            try:
                agent.deregister_memory(reg)
            except Exception:
                _log.exception("deregister_memory failed")
        self._regs.clear()

    def __enter__(self) -> NixlPairSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- reads (any thread) --------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Chunks accepted for NIXL and not yet reported to their room."""
        return len(self._records)

    def stats(self) -> dict[str, int]:
        return {
            "handles_created": self.handles_created,
            "handles_released": self.handles_released,
            "in_flight": self.in_flight,
            "chunks_posted": self.chunks_posted,
            "chunks_done": self.chunks_done,
            "chunks_failed": self.chunks_failed,
            "chunks_rejected": self.chunks_rejected,
            "chunks_cancelled": self.chunks_cancelled,
            "done_at_post": self.done_at_post,
            "stalls": self.stalls,
            "bytes_done": self.bytes_done,
            "pump_rounds": self.pump_rounds,
            "stale_deliveries": self.stale_deliveries,
        }

    # -- CommandSink (loop thread) -------------------------------------------------------------

    def attach(self, inbox: Inbox) -> None:
        if self._closed:
            raise RuntimeError("NixlPairSink is closed")
        if self._loop is not None:
            raise RuntimeError("NixlPairSink is already attached to an engine")
        self._control.attach(inbox)  # raises TypeError unless it is the engine's Registry
        self._inbox = inbox
        self._loop = loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._pump_task = loop.create_task(self._pump(), name="kvfsm-nixl-pump")
        self._pump_task.add_done_callback(_pump_ended)

    def submit(self, key: RoomKey, command: Command) -> None:
        if isinstance(command, PostChunk):
            self._post(key, command)
        elif isinstance(command, ReleaseHandles):
            for record in self._records:
                if record.key == key:
                    record.cancelled = True  # the worker skips it if it has not posted it yet
        else:
            self._control.submit(key, command)

    def _post(self, key: RoomKey, command: PostChunk) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("NixlPairSink.submit before attach()")
        self.chunks_posted += 1
        try:
            src, dst, aux = self._indices(command)
        except ValueError as exc:
            self.chunks_rejected += 1
            self.chunks_failed += 1
            loop.call_soon(self._deliver, key, ChunkFailed(command.chunk, str(exc)))
            return
        if src.size == 0:  # an empty chunk (and no aux row): nothing to move
            self.chunks_done += 1
            loop.call_soon(self._deliver, key, ChunkDone(command.chunk))
            return
        nbytes = (src.size - aux) * self.page_bytes + aux * self.aux_row_bytes
        record = _Xfer(key, command.chunk, src=src, dst=dst, nbytes=nbytes, t0=loop.time())
        self._records.add(record)
        future = loop.run_in_executor(self._executor, self._post_in_worker, record)
        future.add_done_callback(functools.partial(self._posted, record))

    def _indices(self, command: PostChunk) -> tuple[Indices, Indices, int]:
        """Validated, dst-sorted index arrays (aux row appended); raises ``ValueError``."""
        src = np.frombuffer(command.src, dtype=np.int32)
        dst = np.frombuffer(command.dst, dtype=np.int32)
        if src.size != dst.size:
            raise ValueError(f"{src.size} source pages but {dst.size} destination pages")
        _check_range("source page", src, self.num_pages)
        _check_range("destination page", dst, self.num_pages)
        if dst.size > 1:
            # Sorting by destination makes contiguous runs consecutive; NIXL merges them.
            order = np.argsort(dst, kind="stable")
            src, dst = src[order], dst[order]
        with_aux = command.is_last and command.src_aux >= 0 and command.dst_aux >= 0
        if not with_aux:
            return src, dst, 0
        _check_range("source aux row", np.array([command.src_aux], np.int32), self.aux_rows)
        _check_range("destination aux row", np.array([command.dst_aux], np.int32), self.aux_rows)
        src = np.append(src, np.int32(self.num_pages + command.src_aux)).astype(np.int32)
        dst = np.append(dst, np.int32(self.num_pages + command.dst_aux)).astype(np.int32)
        return src, dst, 1

    def _post_in_worker(self, record: _Xfer) -> None:
        """Worker thread: create, post and check once. Raises what NIXL raised."""
        if record.cancelled:
            return
        agent, local, remote = self._prefill, self._local_dlist, self._remote_dlist
        assert agent is not None
        assert local is not None
        assert remote is not None
        handle = agent.make_prepped_xfer("WRITE", local, record.src, remote, record.dst)
        record.handle = handle
        self.handles_created += 1
        status: str = agent.transfer(handle)
        if status == "PROC":
            status = agent.check_xfer_state(handle)
        record.status = status

    def _posted(self, record: _Xfer, future: Future[None] | asyncio.Future[None]) -> None:
        """Loop thread: the worker is done with ``record``."""
        if future.cancelled():
            self._finish(record, ChunkFailed(record.chunk, "not posted: transport closing"))
            return
        exc = future.exception()
        if exc is not None:
            self._finish(record, ChunkFailed(record.chunk, _describe(exc)))
        elif record.handle is None:
            self.chunks_cancelled += 1
            self._finish(record, ChunkFailed(record.chunk, "released after abort (never posted)"))
        elif record.status == "DONE":
            self.done_at_post += 1
            self._finish(record, ChunkDone(record.chunk))
        elif record.status == "PROC":
            self._active.append(record)
            assert self._wake is not None
            self._wake.set()
        else:
            self._finish(record, ChunkFailed(record.chunk, f"transfer state {record.status}"))

    # -- the pump (loop thread) ----------------------------------------------------------------

    async def _pump(self) -> None:
        prefill, decode, wake = self._prefill, self._decode, self._wake
        assert prefill is not None
        assert decode is not None
        assert wake is not None
        loop = asyncio.get_running_loop()
        check = prefill.check_xfer_state
        progress_target = decode.get_new_notifs
        while True:
            if not self._active:
                wake.clear()
                await wake.wait()
                continue
            try:
                progress_target()  # see the module docstring: the flush needs the target
            except Exception:
                _log.exception("decode agent progress failed")
            batch, self._active = self._active, []
            now = loop.time()
            for record in batch:
                handle = record.handle
                assert handle is not None
                try:
                    status = check(handle)
                except Exception as exc:
                    self._finish(record, ChunkFailed(record.chunk, _describe(exc)))
                    continue
                if status == "DONE":
                    self._finish(record, ChunkDone(record.chunk))
                elif status != "PROC":
                    self._finish(record, ChunkFailed(record.chunk, f"transfer state {status}"))
                elif now - record.t0 > self.stall_timeout_s:
                    self._stall(record, loop)
                else:
                    self._active.append(record)
            self.pump_rounds += 1
            await asyncio.sleep(0)

    def _stall(self, record: _Xfer, loop: asyncio.AbstractEventLoop) -> None:
        self.stalls += 1
        handle, record.handle = record.handle, None
        if handle is not None:
            self._release(handle)
        reason = f"stalled in flight for more than {self.stall_timeout_s:g}s; released"
        _log.warning("room %s chunk %s: %s", record.key.room, record.chunk, reason)
        # Bytes of a cancelled WRITE may still land: report only after the quarantine.
        loop.call_later(self.quarantine_s, self._finish, record, ChunkFailed(record.chunk, reason))

    def _finish(self, record: _Xfer, event: ChunkDone | ChunkFailed) -> None:
        handle, record.handle = record.handle, None
        if handle is not None:
            self._release(handle)
        self._records.discard(record)
        if isinstance(event, ChunkDone):
            self.chunks_done += 1
            self.bytes_done += record.nbytes
        else:
            self.chunks_failed += 1
        self._deliver(record.key, event)

    def _release(self, handle: nixl_xfer_handle) -> None:
        prefill = self._prefill
        assert prefill is not None
        try:
            prefill.release_xfer_handle(handle)
        except Exception:
            _log.exception("release_xfer_handle failed; retrying at close()")
            self._leaked.append(handle)
            return
        self.handles_released += 1

    def _deliver(self, key: RoomKey, event: Event) -> None:
        inbox = self._inbox
        if inbox is None or not inbox.deliver(key, event):
            self.stale_deliveries += 1


def _pump_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("NIXL pump crashed", exc_info=task.exception())
