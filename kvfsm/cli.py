"""The ``kvfsm`` command line.

``kvfsm run`` is the main job: prefill rooms in this process move real KV bytes over NIXL (UCX,
DRAM to DRAM) into a decode rank that runs in its own OS process with its own agent and pages.
One caller thread drives many rooms the way SGLang's scheduler does: every iteration it polls
every live room and never blocks on one. Each room takes decode pages from a free pool (live rooms
never share one; pages come back only once the room is terminal and settled), sends random source
pages in 1..4 chunks, and on success is checked against the decode process's per-page digests.
With --abort-rate, some rooms are aborted at a random point; they must fail with the abort
reason, or succeed if the abort lost the race, and never wedge.
The exit status is 1 if a room failed for any other reason, mismatched, wedged or left its pages
unsettled, and 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm import KVPoll
from kvfsm import diagram as diagram_cli
from kvfsm.bootstrap import Fingerprint
from kvfsm.bootstrap import _cli as bootstrap_cli
from kvfsm.rooms import RoomEngine, SenderRoom
from kvfsm.states import DestinationReceived

# NIXL binds its log handler to sys.stdout when first imported, and logs there at once if
# NIXL_LOG_LEVEL is set; stdout is the summary's (--json), so bind it to stderr instead.
with contextlib.redirect_stdout(sys.stderr):
    from kvfsm._child import spawn_quietly
    from kvfsm.transport import Agent, NixlTransport
    from kvfsm.transport._peer import PeerProcess, Shape, make_buffers, make_layout, page_digests

__all__ = ["RunOptions", "WorkloadOptions", "main", "run_job"]

_log = logging.getLogger("kvfsm.cli")

Pages = npt.NDArray[np.int32]

#: Bytes per element of the KV dtypes ``--dtype`` accepts.
DTYPES: Final = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
#: The reason the run gives the rooms it aborts on purpose (``--abort-rate``).
ABORT_REASON: Final = "requested by --abort-rate"
_PEER_ID: Final = "decode"
#: ``NIXL_LOG_LEVEL`` for the decode process, by the level name of our ``nixl`` logger.


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """The layout and the load, shared by ``kvfsm run`` and ``kvfsm demo``."""

    concurrency: int = 16
    #: Pages in each side's pool (decode's free pool, prefill's source pages).
    num_pages: int = 1024
    #: Each layer has a K and a V buffer; a page spans all of them.
    layers: int = 8
    page_tokens: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bf16"
    #: Bytes of one page in one K or V buffer; ``None``: tokens x heads x head_dim x dtype.
    page_bytes: int | None = None
    aux_rows: int = 256
    aux_row_bytes: int = 4096
    max_room_pages: int = 32
    max_chunks: int = 4
    #: Probability that a room is aborted at a random point of its life.
    abort_rate: float = 0.0
    #: A room not terminal this long after it started is counted wedged and aborted.
    room_timeout_s: float = 30.0
    #: Extra time a terminal room gets to settle before its pages are written off as unsettled.
    settle_grace_s: float = 30.0
    #: Scheduler nap when an iteration found nothing to do (0: just yield the GIL).
    idle_sleep_s: float = 0.0
    seed: int | None = None

    @property
    def buffer_page_bytes(self) -> int:
        """Bytes of one page in one K or V buffer."""
        if self.page_bytes is not None:
            return self.page_bytes
        return self.page_tokens * self.kv_heads * self.head_dim * DTYPES.get(self.dtype, 0)

    @property
    def total_page_bytes(self) -> int:
        """Bytes one page moves: its slice of every layer's K and V buffer."""
        return 2 * self.layers * self.buffer_page_bytes

    def fingerprint(self) -> Fingerprint:
        """What the ranks of this workload declare in their handshakes."""
        return Fingerprint(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_bytes=self.head_dim * DTYPES.get(self.dtype, 0),
            dtype=self.dtype,
            page_tokens=self.page_tokens,
        )

    def shape(self) -> Shape:
        return Shape(
            layers=self.layers,
            num_pages=self.num_pages,
            page_bytes=self.buffer_page_bytes,
            aux_rows=self.aux_rows,
            aux_row_bytes=self.aux_row_bytes,
        )

    def validate_workload(self, count_flag: str, count: int) -> None:
        """Raise ``ValueError`` naming the flag that is out of range."""
        if count < 0 or self.concurrency < 1:
            raise ValueError(f"{count_flag} must be >= 0 and --concurrency >= 1")
        for flag, value in (
            ("--layers", self.layers),
            ("--pages", self.num_pages),
            ("--page-tokens", self.page_tokens),
            ("--kv-heads", self.kv_heads),
            ("--head-dim", self.head_dim),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for flag, value in (
            ("--page-bytes", self.buffer_page_bytes),
            ("--aux-row-bytes", self.aux_row_bytes),
        ):
            if value < 8 or value % 8:
                raise ValueError(f"{flag} must be a positive multiple of 8, got {value}")
        if not 1 <= self.max_room_pages <= self.num_pages:
            raise ValueError("--max-room-pages must be in [1, --pages]")
        if self.max_chunks < 1:
            raise ValueError("--max-chunks must be >= 1")
        if self.aux_rows < self.concurrency:
            raise ValueError("--aux-rows must be >= --concurrency (one live row per room)")
        if not 0.0 <= self.abort_rate <= 1.0:
            raise ValueError(f"--abort-rate must be in [0, 1], got {self.abort_rate}")
        if not (self.room_timeout_s > 0 and self.settle_grace_s > 0 and self.idle_sleep_s >= 0):
            raise ValueError("--room-timeout must be > 0 and --idle-sleep >= 0")


def workload_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The ``WorkloadOptions`` fields from the flags ``kvfsm run`` and ``kvfsm demo`` share."""
    return {
        "concurrency": args.concurrency,
        "num_pages": args.pages,
        "layers": args.layers,
        "page_tokens": args.page_tokens,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "aux_rows": args.aux_rows,
        "aux_row_bytes": args.aux_row_bytes,
        "max_room_pages": args.max_room_pages,
        "max_chunks": args.max_chunks,
        "abort_rate": args.abort_rate,
        "room_timeout_s": args.room_timeout,
        "idle_sleep_s": args.idle_sleep,
        "seed": args.seed,
    }


@dataclass(frozen=True, slots=True)
class RunOptions(WorkloadOptions):
    rooms: int = 200

    def validate(self) -> None:
        self.validate_workload("--rooms", self.rooms)


class _Phase(enum.IntEnum):
    BOOTSTRAP = 0  # destination pages posted, waiting for WaitingForInput to init
    SENDING = 1  # one chunk per scheduler iteration
    FINISHING = 2  # all chunks sent, waiting for a terminal status
    SETTLING = 3  # outcome recorded and room cleared, waiting for it to settle
    DONE = 4


@dataclass(slots=True)
class _Room:
    rid: int
    sender: SenderRoom
    src: Pages
    dst: Pages
    src_aux: int
    dst_aux: int
    chunks: list[Pages]
    started: float
    #: Chunks sent before the run aborts this room (-1: before its destination arrives,
    #: len(chunks): right after the last chunk, the seed race); None: never.
    abort_at: int | None
    phase: _Phase = _Phase.BOOTSTRAP
    next_chunk: int = 0
    aborted: bool = False
    ended: float = 0.0


@dataclass(slots=True)
class _Tally:
    succeeded: int = 0
    failed: int = 0
    #: Failures that are not the run's own aborts: these make the exit status non-zero.
    failed_unexpectedly: int = 0
    failed_by_reason: Counter[str] = field(default_factory=Counter)
    aborts_requested: int = 0
    #: Rooms the run aborted that had reached Success first (checked like any other).
    aborts_too_late: int = 0
    mismatched: int = 0
    wedged: int = 0
    unsettled: int = 0
    #: Rooms never started because unsettled rooms kept too many pages out of the pool.
    not_started: int = 0
    bytes: int = 0
    verify_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class _Scheduler:
    """Drives prefill rooms from the calling thread like SGLang's scheduler: poll all, never
    block on one. The decode side is passive: this thread hands each sender its destination
    pages (``DestinationReceived``, standing in for the control channel) and asks the decode
    process what landed."""

    def __init__(
        self,
        engine: RoomEngine,
        peer: PeerProcess,
        opts: RunOptions,
        rng: np.random.Generator,
        *,
        src_kv: list[npt.NDArray[np.uint8]],
        src_aux: npt.NDArray[np.uint8],
    ) -> None:
        self.engine = engine
        self.peer = peer
        self.opts = opts
        self.rng = rng
        self.src_aux = src_aux
        #: Digest of every source page, computed once: verification then only asks decode.
        self.src_digests = np.asarray(
            page_digests(src_kv, np.arange(opts.num_pages, dtype=np.int32)), dtype=np.uint32
        )
        self.free_pages = np.ones(opts.num_pages, dtype=bool)
        self.free_aux = np.ones(opts.aux_rows, dtype=bool)
        self.tally = _Tally()
        self._landed: list[_Room] = []  # Success seen this iteration, verified at its end

    def run(self) -> None:
        opts = self.opts
        live: list[_Room] = []
        next_id = 0
        while next_id < opts.rooms or live:
            progressed = False
            while len(live) < opts.concurrency and next_id < opts.rooms:
                room = self._start(next_id)
                if room is None and not live:
                    # Every free page is free for good: rooms written off as unsettled hold
                    # the rest. Stop rather than spin; the summary shows what did not run.
                    self.tally.not_started = opts.rooms - next_id
                    self._note_text("pool exhausted by unsettled rooms' pages")
                    return
                if room is None:
                    break  # not enough free pages until a live room settles
                live.append(room)
                next_id += 1
                progressed = True
            now = time.perf_counter()
            for room in live:
                progressed |= self._step(room, now)
            if self._landed:
                self._verify()
            live = [room for room in live if room.phase is not _Phase.DONE]
            if not progressed:
                time.sleep(opts.idle_sleep_s)

    # -- one room ------------------------------------------------------------------------------

    def _pick(self, free: npt.NDArray[np.bool_], n: int) -> Pages | None:
        """``n`` free indices from a random offset: mostly contiguous like a fresh allocator,
        shuffled half the time like a fragmented one."""
        if n == 0:
            return np.empty(0, dtype=np.int32)
        candidates = np.flatnonzero(free)
        if candidates.size < n:
            return None
        start = int(self.rng.integers(candidates.size))
        picked = np.roll(candidates, -start)[:n].astype(np.int32)
        if self.rng.random() < 0.5:
            self.rng.shuffle(picked)
        return picked

    def _start(self, rid: int) -> _Room | None:
        opts, rng = self.opts, self.rng
        n = int(rng.integers(0, opts.max_room_pages + 1))  # 0: an aux-only room
        dst = self._pick(self.free_pages, n)
        aux = self._pick(self.free_aux, 1)
        if dst is None or aux is None:
            return None
        dst_aux = int(aux[0])
        self.free_pages[dst] = False
        self.free_aux[dst_aux] = False
        src = ((int(rng.integers(opts.num_pages)) + np.arange(n)) % opts.num_pages).astype(np.int32)
        if rng.random() < 0.5:
            rng.shuffle(src)
        # Cuts below n: middle chunks may be empty, the last one is not (the chunk that brings
        # the count to n is the last one; anything after it would be refused), unless n == 0.
        extra = int(rng.integers(opts.max_chunks)) if n > 0 else 0
        cuts = np.sort(rng.integers(0, max(n, 1), size=extra))
        chunks = np.split(src, cuts)
        abort_at = None
        if opts.abort_rate > 0 and rng.random() < opts.abort_rate:
            abort_at = int(rng.integers(-1, len(chunks) + 1))
        sender = self.engine.sender(rid)
        room = _Room(
            rid=rid,
            sender=sender,
            src=src,
            dst=dst,
            src_aux=int(rng.integers(opts.aux_rows)),
            dst_aux=dst_aux,
            chunks=chunks,
            started=time.perf_counter(),
            abort_at=abort_at,
        )
        # What decode's control frame would deliver: its pages, its aux row, its agent.
        self.engine.post(sender.key, DestinationReceived(dst.tobytes(), dst_aux, peer=_PEER_ID))
        if abort_at == -1:
            self._abort(room)
        return room

    def _abort(self, room: _Room) -> None:
        room.aborted = True
        self.tally.aborts_requested += 1
        room.sender.abort(ABORT_REASON)

    def _step(self, room: _Room, now: float) -> bool:
        s = room.sender
        if room.phase is _Phase.SETTLING:
            if s.settled:
                self.free_pages[room.dst] = True
                self.free_aux[room.dst_aux] = True
                room.phase = _Phase.DONE
                return True
            if now - room.ended > self.opts.settle_grace_s:
                self.tally.unsettled += 1  # its pages stay reserved: never reused
                self._note(room, f"unsettled {now - room.ended:.1f}s after it ended")
                room.phase = _Phase.DONE
                return True
            return False
        if room.phase is _Phase.DONE:
            return False
        status = s.poll()
        if status is KVPoll.Success:
            room.ended = now
            room.phase = _Phase.SETTLING  # after verification, which needs the pages unfreed
            self._landed.append(room)
            return True
        if status is KVPoll.Failed:
            self._failed(room)
            self._end(room, now)
            return True
        if now - room.started > self.opts.room_timeout_s:
            self.tally.wedged += 1
            self._note(room, f"wedged: {status.name} after {room.phase.name}")
            s.abort("wedged")
            self._end(room, now)
            return True
        if room.phase is _Phase.BOOTSTRAP:
            if status is KVPoll.WaitingForInput:
                if room.abort_at == 0:
                    self._abort(room)
                else:
                    s.init(room.src.size, room.src_aux)
                    room.phase = _Phase.SENDING
                return True
        elif room.phase is _Phase.SENDING:
            if room.abort_at == room.next_chunk:  # between two chunks
                self._abort(room)
                return True
            s.send(room.chunks[room.next_chunk])
            room.next_chunk += 1
            if room.next_chunk == len(room.chunks):
                room.phase = _Phase.FINISHING
                if room.abort_at == room.next_chunk:  # while the last chunk is in flight
                    self._abort(room)
            return True
        return False

    def _failed(self, room: _Room) -> None:
        reason = room.sender.reason or "failed without a reason"
        self.tally.failed += 1
        self.tally.failed_by_reason[_reason_class(reason)] += 1
        if not (room.aborted and ABORT_REASON in reason):
            self.tally.failed_unexpectedly += 1
            self._note(room, f"failed: {reason}")

    def _verify(self) -> None:
        """Check every room that succeeded this iteration: one digest request to decode for all
        their pages, one aux request per room. Then clear them; their pages return to the pool
        once settled. A room whose abort lost the race is checked too: Success means landed."""
        rooms, self._landed = self._landed, []
        t0 = time.perf_counter()
        dst = np.concatenate([room.dst for room in rooms])
        got = np.asarray(self.peer.ask("digests", dst.tobytes()), dtype=np.uint32)
        want = self.src_digests[np.concatenate([room.src for room in rooms])]
        offset = 0
        for room in rooms:
            n = room.src.size
            pages_ok = bool(np.array_equal(got[offset : offset + n], want[offset : offset + n]))
            offset += n
            aux_ok = self.peer.ask("aux", room.dst_aux) == self.src_aux[room.src_aux].tobytes()
            if pages_ok and aux_ok:
                self.tally.succeeded += 1
                self.tally.aborts_too_late += room.aborted
                self.tally.bytes += n * self.opts.total_page_bytes + self.opts.aux_row_bytes
                self.tally.latencies_ms.append((room.ended - room.started) * 1e3)
            else:
                self.tally.mismatched += 1
                pages = "ok" if pages_ok else "differ"
                aux = "ok" if aux_ok else "differs"
                self._note(room, f"mismatch: pages {pages}, aux row {aux}")
            room.sender.clear()
        self.tally.verify_s += time.perf_counter() - t0

    def _end(self, room: _Room, now: float) -> None:
        room.sender.clear()
        room.ended = now
        room.phase = _Phase.SETTLING

    def _note(self, room: _Room, text: str) -> None:
        self._note_text(f"room {room.rid}: {text}")

    def _note_text(self, text: str) -> None:
        if len(self.tally.failures) < 10:
            self.tally.failures.append(text)


def _reason_class(reason: str) -> str:
    """A failure reason with its numbers (chunk ids, sizes, seconds) blanked, for counting."""
    return re.sub(r"\d+(\.\d+)?", "#", reason)


def _fill_random(rng: np.random.Generator, array: npt.NDArray[np.uint8]) -> None:
    """Random bytes in place (random doubles when the size allows: ~8x faster than bytes)."""
    flat = array.reshape(-1)
    if flat.size % 8 == 0:
        rng.random(out=flat.view(np.float64))
    else:
        flat[:] = np.frombuffer(rng.bytes(flat.size), dtype=np.uint8)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


# -- process plumbing --------------------------------------------------------------------------


def _start_peer(shape: Shape) -> PeerProcess:
    """The decode process, started deaf to the terminal's Ctrl-C and off our stdout (this
    process stops it, after the engine and the transport; NIXL logs to stdout, which would
    corrupt ``--json``): see :func:`kvfsm._child.spawn_quietly`."""
    name = f"{_PEER_ID}-{os.getpid()}"
    (peer,) = spawn_quietly([lambda: PeerProcess(shape, name=name)])
    return peer


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Teardown is bounded (engine and peer joins have timeouts); a Ctrl-C during it waits
    until it is over instead of leaving the agent registered or the peer running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        hits.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if hits:
        raise KeyboardInterrupt


def _shutdown(
    engine: RoomEngine | None,
    transport: NixlTransport | None,
    agent: Agent | None,
    peer: PeerProcess | None,
) -> None:
    """Engine, then transport, then agent, then the decode process. Each step runs even if an
    earlier one failed, except the agent: with the transport not cleanly closed, handles may
    still use its registrations, so it is left to process exit."""
    clean = True
    for name, close in (
        ("engine", engine.close if engine is not None else None),
        ("transport", transport.close if transport is not None else None),
    ):
        if close is None:
            continue
        try:
            close()
        except Exception:
            clean = False
            _log.exception("closing the %s failed", name)
    if agent is not None and clean:
        try:
            agent.close()
        except Exception:
            _log.exception("closing the agent failed")
    if peer is not None:
        try:
            peer.close()
        except Exception:
            _log.exception("stopping the decode process failed")


def run_job(opts: RunOptions) -> dict[str, Any]:
    """Run the main job and return its summary as a JSON-able dict.

    Counts: ``succeeded`` (Success and every page digest and the aux row checked), ``failed``
    (Failed; ``failed_by_reason`` counts them by reason, numbers blanked;
    ``failed_unexpectedly`` those that are not the run's own aborts), ``mismatched`` (Success but
    the bytes differ), ``wedged`` (not terminal within ``room_timeout_s``), ``unsettled``
    (terminal but not settled within the grace). Rates: ``gbps`` (alias ``gb_per_s``) over the
    bytes of succeeded rooms and the run's wall time; ``p50_ms``/``p99_ms`` from a room's
    creation to its Success. Plus the transport's (``nixl``) and engine's counters.
    Closes the engine, the transport, the agent and the decode process in that order, whatever
    happens (Ctrl-C included)."""
    opts.validate()
    seed = (
        opts.seed if opts.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    )
    rng = np.random.default_rng(seed)
    peer: PeerProcess | None = None
    agent: Agent | None = None
    transport: NixlTransport | None = None
    engine: RoomEngine | None = None
    t_setup = time.perf_counter()
    try:
        shape = opts.shape()
        peer = _start_peer(shape)
        src_kv, src_aux = make_buffers(shape)
        for buf in [*src_kv, src_aux]:
            _fill_random(rng, buf)
        agent = Agent(  # host, pid, random incarnation: unique without configuration
            f"prefill-{os.uname().nodename}-pid{os.getpid()}-{os.urandom(4).hex()}",
            make_layout(src_kv, src_aux),
        )
        transport = NixlTransport(agent)  # no control channel yet: outcomes go nowhere
        engine = RoomEngine(transport).start()
        engine.call(transport.connect_peer(_PEER_ID, peer.metadata, peer.summary))
        scheduler = _Scheduler(engine, peer, opts, rng, src_kv=src_kv, src_aux=src_aux)
        setup_s = time.perf_counter() - t_setup
        t0 = time.perf_counter()
        scheduler.run()
        seconds = time.perf_counter() - t0
        engine_stats = engine.stats()
        nixl = transport.snapshot()
        peer_pid = peer.pid
    finally:
        with _sigint_deferred():
            _shutdown(engine, transport, agent, peer)
    tally = scheduler.tally
    gbps = round(tally.bytes / seconds / 1e9, 4) if seconds > 0 else 0.0
    return {
        "rooms": opts.rooms,
        "succeeded": tally.succeeded,
        "failed": tally.failed,
        "failed_by_reason": dict(tally.failed_by_reason.most_common()),
        "failed_unexpectedly": tally.failed_unexpectedly,
        "aborts_requested": tally.aborts_requested,
        "aborts_too_late": tally.aborts_too_late,
        "mismatched": tally.mismatched,
        "wedged": tally.wedged,
        "unsettled": tally.unsettled,
        "not_started": tally.not_started,
        "seconds": round(seconds, 4),
        "setup_seconds": round(setup_s, 4),
        "verify_seconds": round(tally.verify_s, 4),
        "bytes": tally.bytes,
        "gbps": gbps,
        "gb_per_s": gbps,
        "rooms_per_s": round(opts.rooms / seconds, 1) if seconds > 0 else 0.0,
        "p50_ms": round(_percentile(tally.latencies_ms, 50), 3),
        "p99_ms": round(_percentile(tally.latencies_ms, 99), 3),
        "concurrency": opts.concurrency,
        "abort_rate": opts.abort_rate,
        "layers": opts.layers,
        "num_pages": opts.num_pages,
        "buffer_page_bytes": opts.buffer_page_bytes,
        "page_bytes": opts.total_page_bytes,
        "aux_row_bytes": opts.aux_row_bytes,
        "layout": _describe_layout(opts),
        "peer_pid": peer_pid,
        "seed": seed,
        "handles_created": nixl["handles_created"],
        "handles_released": nixl["handles_released"],
        "in_flight": nixl["in_flight"],
        "nixl": nixl,
        "engine": engine_stats,
        "failures": tally.failures,
    }


def _ok(summary: dict[str, Any]) -> bool:
    return bool(
        summary["succeeded"] + summary["failed"] == summary["rooms"]
        and summary["failed_unexpectedly"] == summary["mismatched"] == 0
        and summary["wedged"] == summary["unsettled"] == 0
        and summary["handles_created"] == summary["handles_released"]
        and summary["in_flight"] == 0
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % (scale // 16) == 0:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _describe_layout(opts: RunOptions) -> str:
    per_buffer = (
        f"{_size(opts.buffer_page_bytes)}"
        if opts.page_bytes is not None
        else f"{opts.page_tokens} tokens x {opts.kv_heads} KV heads x {opts.head_dim} dims "
        f"{opts.dtype} = {_size(opts.buffer_page_bytes)}"
    )
    pool = opts.num_pages * opts.total_page_bytes
    return (
        f"{opts.layers} layers x K,V; a page is {per_buffer} per buffer, "
        f"{_size(opts.total_page_bytes)} in all; {opts.num_pages} pages "
        f"({_size(pool)} of KV per side); aux {opts.aux_rows} x {_size(opts.aux_row_bytes)}"
    )


def _print_text(summary: dict[str, Any]) -> None:
    s = summary
    aborts = f", abort rate {s['abort_rate']:g}" if s["abort_rate"] else ""
    print(
        f"kvfsm run: {s['rooms']} rooms, {s['concurrency']} in flight{aborts}, real NIXL WRITEs "
        f"(UCX, DRAM->DRAM) from this process into a decode process (pid {s['peer_pid']}), "
        f"seed {s['seed']}"
    )
    print(f"  layout: {s['layout']}")
    print(
        f"  succeeded {s['succeeded']}  failed {s['failed']}  mismatched {s['mismatched']}  "
        f"wedged {s['wedged']}  unsettled {s['unsettled']}"
        + (f"  not started {s['not_started']}" if s["not_started"] else "")
    )
    for reason, count in s["failed_by_reason"].items():
        print(f"    failed {count}: {reason}")
    print(
        f"  moved {s['bytes'] / 1e9:.3f} GB in {s['seconds']:.2f} s: {s['gbps']:.2f} GB/s, "
        f"{s['rooms_per_s']:.0f} rooms/s; per room p50 {s['p50_ms']:.2f} ms, "
        f"p99 {s['p99_ms']:.2f} ms (setup {s['setup_seconds']:.2f} s, "
        f"verify {s['verify_seconds']:.2f} s)"
    )
    print(
        f"  nixl: {s['handles_created']} handles created, {s['handles_released']} released, "
        f"{s['in_flight']} in flight"
    )
    for line in s["failures"]:
        print(f"  {line}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfsm",
        description="kvfsm: KV-cache transfer for prefill-decode disaggregation, "
        "one typed state machine per room, over NIXL.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    bootstrap_cli.add_parser(sub)
    diagram_cli.add_parser(sub)
    rooms = sub.add_parser(
        "rooms", help="show a running rank's live rooms (state, age, deadline, reason)"
    )
    rooms.add_argument("--url", required=True, help="the rank's status server, http://host:port")
    rooms.add_argument("--json", action="store_true", help="print the rows as JSON")
    from kvfsm import demo  # noqa: PLC0415 (not at the top: kvfsm.demo imports from here)

    demo.add_parser(sub)
    from kvfsm.chaos import _cli as chaos_cli  # noqa: PLC0415 (it imports from here, lazily)

    chaos_cli.add_parser(sub)
    d = RunOptions()
    run = sub.add_parser(
        "run",
        help="the main job: many rooms moving real KV over NIXL (DRAM) into a decode process, "
        "every byte checked",
        description=__doc__.split("\n\n")[1],
    )
    run.add_argument("--rooms", type=int, default=d.rooms, help="rooms to run (%(default)s)")
    run.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="rooms in flight (%(default)s)"
    )
    run.add_argument(
        "--pages", type=int, default=d.num_pages, help="KV pages per side (%(default)s)"
    )
    run.add_argument(
        "--layers", type=int, default=d.layers, help="layers, each a K and a V buffer (%(default)s)"
    )
    run.add_argument(
        "--page-tokens", type=int, default=d.page_tokens, help="tokens per page (%(default)s)"
    )
    run.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads (%(default)s)")
    run.add_argument("--head-dim", type=int, default=d.head_dim, help="head dim (%(default)s)")
    run.add_argument(
        "--dtype", choices=tuple(DTYPES), default=d.dtype, help="KV dtype (%(default)s)"
    )
    run.add_argument(
        "--page-bytes",
        type=int,
        default=None,
        help="bytes of one page in one K or V buffer (default: tokens x heads x dim x dtype)",
    )
    run.add_argument("--aux-rows", type=int, default=d.aux_rows, help="aux rows (%(default)s)")
    run.add_argument("--aux-row-bytes", type=int, default=d.aux_row_bytes, help="bytes per aux row")
    run.add_argument(
        "--max-room-pages", type=int, default=d.max_room_pages, help="pages per room, at most"
    )
    run.add_argument(
        "--max-chunks", type=int, default=d.max_chunks, help="chunks per room, at most"
    )
    run.add_argument(
        "--abort-rate",
        type=float,
        default=d.abort_rate,
        help="probability that a room is aborted at a random point (%(default)s)",
    )
    run.add_argument(
        "--room-timeout",
        type=float,
        default=d.room_timeout_s,
        help="seconds after which a non-terminal room counts as wedged (%(default)s)",
    )
    run.add_argument(
        "--idle-sleep",
        type=float,
        default=d.idle_sleep_s,
        help="seconds the caller thread naps when an iteration did nothing (%(default)s)",
    )
    run.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    # Also after ``run``; SUPPRESS keeps a count given before ``run`` from being reset.
    run.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging"
    )
    return parser


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else 10
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    # NIXL's Python logger prints INFO lines to stdout; keep stdout for the summary.
    nixl = logging.getLogger("nixl")
    nixl.setLevel(level)
    for handler in nixl.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


def _show_rooms(url: str, *, as_json: bool) -> int:
    """``kvfsm rooms``: one GET of ``/rooms`` from a rank's status server, as a table."""
    import urllib.request  # noqa: PLC0415 - only this subcommand needs it

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/rooms", timeout=5) as response:
            rows: list[dict[str, Any]] = json.loads(response.read())
    except OSError as exc:
        print(f"kvfsm rooms: cannot read {url}/rooms: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(rows))
        return 0
    columns = (
        "room",
        "generation",
        "role",
        "state",
        "age_s",
        "deadline_in_s",
        "in_flight",
        "settled",
        "reason",
    )
    table = [[str("" if row.get(c) is None else row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    print(f"{len(rows)} live rooms")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.command == "bootstrap":
        return bootstrap_cli.run(args)
    if args.command == "diagram":
        return diagram_cli.run(args)
    if args.command == "rooms":
        return _show_rooms(args.url, as_json=args.json)
    if args.command == "demo":
        from kvfsm import demo  # noqa: PLC0415

        return demo.run(args)
    if args.command == "chaos":
        from kvfsm.chaos import _cli as chaos_cli  # noqa: PLC0415

        return chaos_cli.run(args)
    if args.command != "run":  # pragma: no cover - argparse enforces the choices
        return 2
    opts = RunOptions(rooms=args.rooms, page_bytes=args.page_bytes, **workload_arguments(args))
    return run_command(
        "run", opts.validate, lambda: run_job(opts), _print_text, _ok, as_json=args.json
    )


def run_command(
    name: str,
    validate: Callable[[], None],
    job: Callable[[], dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
    ok: Callable[[dict[str, Any]], bool],
    *,
    as_json: bool,
) -> int:
    """The shape of ``kvfsm run`` and ``kvfsm demo``: validate (2 on a bad flag), run the job
    (130 on Ctrl-C, 1 on an error, without a traceback unless -vv), print the summary (one JSON
    object on stdout with ``--json``), and exit 0 only if the summary is clean."""
    try:
        validate()
    except ValueError as exc:
        print(f"kvfsm {name}: {exc}", file=sys.stderr)
        return 2
    try:
        summary = job()
    except KeyboardInterrupt:
        print(f"kvfsm {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        _log.debug("%s failed", name, exc_info=True)
        print(
            f"kvfsm {name}: error: {type(exc).__name__}: {exc} (-vv for the traceback)",
            file=sys.stderr,
        )
        return 1
    if as_json:
        print(json.dumps(summary))
    else:
        show(summary)
    return 0 if ok(summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
