"""KV transfer, side by side in one run: the same layout and the same pages through each runner.

Runners (rows), each moving exactly the (source page, destination page) pairs of a case from the
benchmark's source buffer to a destination buffer:

* copy     - the memory-bandwidth ceiling, numpy in this process: ``np.copyto`` where both
             sides of a chunk are contiguous runs, fancy indexing (``dst[perm] = src``) otherwise.
* raw_nixl - the minimal raw-NIXL loop in this process against the peer process
             (``_nixl_peer.py``, the "decode" side): source registered once, ``add_remote_agent``
             once, ``prep_xfer_dlist`` once per side per case (one descriptor per page), then per
             chunk ``make_prepped_xfer("WRITE", ...)`` with int32 indices sorted by destination
             (NIXL merges contiguous runs), ``transfer()``, busy ``check_xfer_state`` until DONE,
             ``release_xfer_handle``. Up to ``window`` rooms have their chunks in flight at once
             (posted together, then polled round-robin). No actors, no asyncio.
* kvfsm    - kvfsm end to end against the same peer: sender rooms driven through the public
             facade from this thread (create, decode's pages, ``init``, a ``send`` per chunk,
             ``poll``), the room actors on the engine's loop thread, ``NixlTransport`` posting
             from its worker thread and the pump polling. ``cpu_us_per_chunk`` is the *loop
             thread's* CPU (the thread that shares the GIL with a scheduler), per chunk.
             Whenever a case has both a kvfsm and a raw_nixl row the report prints the ratios.
             Its caller spins (``sleep(0)`` when an iteration moved nothing) unless
             ``--caller-step-us N``: then every iteration ends in an N us GIL-free wait, like a
             scheduler's forward pass.
* kvfsm_spin - kvfsm with the pump's pacing off (``TransferConfig(poll_max_wait_s=0)``: it
             polls every loop iteration while chunks are in flight): the baseline for what
             bounded adaptive polling saves in CPU and costs in latency. Not run by default.
* kvfsm_unfenced - kvfsm without write leases (``NixlTransport(leases=None)``; kvfsm itself
             posts under one long lease, as a production prefill does): what the fence and
             the stale-progress gate cost. Not run by default.
* kvfsm_alone - kvfsm posting every chunk alone (``TransferConfig(merge_max_chunks=1)``): the
             baseline for what merging the small chunks of one loop callback into one NIXL
             request (the ledger's rule 8) is worth. Not run by default.
* actor_floor - the hand-off floor (:class:`ActorFloor`): kvfsm's event loop on its own
             thread with no room logic, behind the kvfsm runner's caller and its two round trips
             per room (the room published waiting, then its chunks handed over), posting each
             chunk through raw NIXL. What any engine whose ``init``/``send`` only enqueue
             (design law 6) can reach behind this caller; ``kvfsm/actor_floor`` is what kvfsm's
             room logic costs beyond that. ``actor_floor_1trip`` hands a room and its chunks
             over in one post. Not run by default.
* kvfsm_ahead - kvfsm with bootstrap ahead of sending, as SGLang's bootstrap queue runs ahead
             of its forward passes: up to ``window`` rooms wait for their destinations while up
             to ``window`` others send, so a room's send-to-Success path is the only round trip
             on the critical path (compare ``actor_floor_1trip``). Not run by default.

Every row also reports its process CPU over the best repetition (all threads of this process;
the peer's are not counted) and, for rooms, the per-room latency p50/p99 (first post to done
seen). For kvfsm against raw NIXL the ratios add ``non_copy_cpu_ms_per_room``: kvfsm's process
CPU minus raw NIXL's for the same rooms (which is the copies on the CMA path, plus its minimal
loop), per room. ``--mem vram`` puts both sides' buffers on CUDA device 0 (torch; the copy
runner is host only): what ``benchmarks/gpu/run.sh`` runs.

Cases (sizes are options; the defaults run everything in well under two minutes on 2 vCPUs):

* contiguous     - 4096 x 64 KiB pages, source and destination both one contiguous run.
* scattered_64k  - 4096 x 64 KiB pages, destination pages a random permutation.
* scattered_4k   - 16384 x 4 KiB pages, destination pages a random permutation.
* rooms_1/16/256 - 4096 x 64 KiB pages split into rooms of 16 pages (256 rooms); each room's
                   source pages are a contiguous run, its destination pages random (one
                   permutation over all rooms), and it is sent in 1 to 4 chunks (random cuts).
                   1, 16 or 256 rooms in flight at once. The three cases share the same rooms.

* tp2to1_rooms_1/16/64, tp2to1_large - unequal attention TP, head-sliced: MHA with
                   8 KV heads of 256 bytes (128 dims bf16), prefill TP 2 into decode TP 1.
                   Prefill rank 1's pages hold 4 heads a row (token), 16 rows a page (16 KiB);
                   decode's hold 8 (32 KiB pages), and rank 1 writes its whole rows into the
                   second half of each decode row. 8 KV buffers (4 layers x K/V) of 1024 pages
                   a side, back to back in each process's buffer: 128 MiB moved, and one
                   descriptor per (buffer, page, row), 131,072 per side (NIXL 1.5.1 expands
                   strided descriptors into one per row anyway). The rooms cases are the
                   rooms_* shape (16 pages a room, 1-4 chunks, 1/16/64 in flight: 64 rooms);
                   ``large`` is one room of all 1024 pages, destination permuted, one chunk.
                   raw_nixl prepares the per-row lists itself (``_row_descs``) and expands each
                   chunk's pages to row indices (``_row_index``) inside the timed loop; kvfsm
                   connects its peer with the ``KvPiece`` that ``link_piece`` plans, so its
                   transport builds both (``sliced_descs``, ``sliced_index``). The peer checks
                   the CRC of the slice of every row and that no byte outside it was written.
                   The ``--kv-heads``, ``--prefill-tp/--prefill-rank``, ``--decode-tp/
                   --decode-rank``, ``--head-bytes``, ``--page-tokens``, ``--tp-regions``,
                   ``--tp-pages`` and ``--tp-windows`` options change the shape (and the names).

The first three and ``tp*_large`` are one room of one chunk by default (``--chunk-pages`` splits
them).

Figures: ``seconds`` is the best of ``--repeat`` repetitions (each one every chunk of the case,
end to end: for raw_nixl, create + post + poll to DONE + release). GB/s is decimal (1e9 bytes/s).
``cpu_us_per_chunk`` (raw_nixl) is ``time.thread_time()`` of the posting thread over the best
repetition divided by its chunks: user and system time, so on the intra-node CMA path it includes
the kernel copy that ``transfer()`` performs synchronously. Before every repetition the
destination is zeroed; after it, the destination pages are checksummed (CRC32, in pair order) and
compared with the source pages; a mismatch aborts the run. Zeroing and checking are not timed.

Plug-in point. ``RUNNERS`` maps a name to ``Runner = Callable[[Case, Bench], Result]``:

* ``case`` holds the page pairs, per room and per chunk, in the order a caller (SGLang) would
  hand them over, plus ``window`` (rooms in flight at once). A runner moves exactly these pairs
  from rows of ``bench.source(case)`` to the same-numbered rows of its destination. With
  ``case.heads`` (unequal TP) each side has ``heads.regions`` buffers back to back and a
  destination page is ``case.dst_page_bytes``: a runner moves every row of each source page
  into its slice of the same row of the destination page, in every buffer.
* ``bench.peer`` is the shared "decode" process: one per run, started before the first runner and
  stopped after the last; its agent metadata (``peer.metadata``), its registered destination
  buffer (``peer.base``, ``peer.nbytes``: large enough for every selected case), and
  ``peer.clear()`` / ``peer.checksum(case)`` (for ``case.heads``: the rows' slices, after
  checking that nothing outside them was written). Runners must leave no remote state behind in it
  (it has none of its own: it only registers memory and progresses its worker). A runner that
  needs its own decode-side process (kvfsm's receiver rooms) starts it through
  ``bench.resource`` and checksums there with ``_nixl_peer.checksum_pages`` over
  ``case.pairs()[1]``: the same function over the same order, so the same expected value.
* ``bench.resource(key, factory)`` builds long-lived state (agents, registrations, processes) once
  per run; anything with a ``close()`` is closed at the end, in reverse order, before the peer
  stops, also on errors and Ctrl-C.
* Build the ``Result`` with :func:`measure` so timing, best-of, zeroing and verification are the
  same for every row. ``go()`` may return ``{"cpu_s": ...}`` to report the CPU of a thread other
  than the caller (kvfsm's loop thread); other entries are reported as extras.

Run: ``python benchmarks/transfer.py`` (``--json`` for one JSON object, ``--cases``, ``--runners``,
``--repeat``; ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import multiprocessing
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
from _nixl_peer import RowGeometry, checksum_pages, checksum_rows, serve, stray_bytes

if TYPE_CHECKING:
    from nixl_cu12._api import nixl_agent, nixl_prepped_dlist_handle, nixl_xfer_handle

Indices = npt.NDArray[np.int32]
Chunk = tuple[Indices, Indices]  # (source pages, destination pages), pair order as handed over
Room = tuple[Chunk, ...]
T = TypeVar("T")

KIB: Final = 1024
STALL_S: Final = 30.0  # a chunk still PROC after this long aborts the run (NIXL has no timeout)
PEER_TIMEOUT_S: Final = 120.0
ROOMS_PREFIX: Final = "rooms_"


class BenchError(RuntimeError):
    """The benchmark cannot go on (peer died, bytes did not verify, a transfer stalled)."""


# -- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heads:
    """Unequal attention TP for MHA: prefill rank ``prefill_rank`` of ``prefill_tp``
    holds ``total // prefill_tp`` KV heads, decode rank ``decode_rank`` of ``decode_tp`` holds
    ``total // decode_tp``, and ``prefill_tp`` is a multiple of ``decode_tp``. Each side's KV is
    ``regions`` buffers (layers x K/V) back to back, each ``pages`` pages of ``rows`` tokens, a
    token's row its heads side by side (SGLang's token-major pool). The prefill rank writes its
    whole rows into its heads' run inside each decode row: ``src_row`` bytes at ``dst_offset``
    of ``dst_row``, one descriptor per (region, page, row) on both sides."""

    regions: int
    rows: int  # tokens per page
    head_bytes: int
    total: int
    prefill_tp: int
    prefill_rank: int
    decode_tp: int
    decode_rank: int = 0

    def __post_init__(self) -> None:
        if min(self.regions, self.rows, self.head_bytes, self.total) < 1:
            raise ValueError(f"{self}: sizes must be >= 1")
        if not (
            0 <= self.prefill_rank < self.prefill_tp and 0 <= self.decode_rank < self.decode_tp
        ):
            raise ValueError(f"{self}: a rank out of range")
        if self.prefill_tp % self.decode_tp or self.total % self.prefill_tp:
            raise ValueError(
                f"{self}: prefill TP must divide the heads and be a multiple of decode's"
            )
        if self.dst_offset < 0 or self.dst_offset + self.src_row > self.dst_row:
            raise ValueError(
                f"{self}: prefill rank {self.prefill_rank} writes no decode rank's heads"
            )

    @property
    def src_row(self) -> int:
        return self.total // self.prefill_tp * self.head_bytes

    @property
    def dst_row(self) -> int:
        return self.total // self.decode_tp * self.head_bytes

    @property
    def dst_offset(self) -> int:
        """Where the prefill rank's heads start in a decode row, in bytes."""
        first = self.prefill_rank * (self.total // self.prefill_tp)
        return (first - self.decode_rank * (self.total // self.decode_tp)) * self.head_bytes

    def src_geometry(self, pages: int) -> RowGeometry:
        return (self.regions, pages, self.rows, self.src_row, 0, self.src_row)

    def dst_geometry(self, pages: int) -> RowGeometry:
        return (self.regions, pages, self.rows, self.dst_row, self.dst_offset, self.src_row)

    def descriptors(self, pages: int) -> int:
        """Descriptors in either side's prepared list (NIXL 1.5 has no strided descriptors)."""
        return self.regions * pages * self.rows


@dataclass(frozen=True, eq=False)
class Case:
    name: str
    page_bytes: int  # of one source page, per region
    pages: int  # pages in every source and destination region this case uses
    rooms: tuple[Room, ...]
    window: int  # rooms in flight at once
    note: str
    #: Unequal TP: several regions per side, a head slice of each destination row. None: one
    #: region, whole pages on both sides.
    heads: Heads | None = None

    @property
    def regions(self) -> int:
        return 1 if self.heads is None else self.heads.regions

    @property
    def dst_page_bytes(self) -> int:
        """One destination page, per region (wider than a source page with unequal TP)."""
        heads = self.heads
        return self.page_bytes if heads is None else heads.rows * heads.dst_row

    @property
    def nbytes(self) -> int:
        pages = sum(int(src.size) for room in self.rooms for src, _ in room)
        return pages * self.regions * self.page_bytes

    @property
    def src_bytes(self) -> int:
        return self.regions * self.pages * self.page_bytes

    @property
    def dst_bytes(self) -> int:
        return self.regions * self.pages * self.dst_page_bytes

    @property
    def chunks(self) -> int:
        return sum(len(room) for room in self.rooms)

    def pairs(self) -> tuple[Indices, Indices]:
        """All (source, destination) pages of the case, concatenated in room and chunk order."""
        chunks = [chunk for room in self.rooms for chunk in room]
        return (
            np.concatenate([src for src, _ in chunks]).astype(np.int32, copy=False),
            np.concatenate([dst for _, dst in chunks]).astype(np.int32, copy=False),
        )


def _split(src: Indices, dst: Indices, chunk_pages: int) -> Room:
    if chunk_pages <= 0 or chunk_pages >= src.size:
        return ((src, dst),)
    cuts = range(chunk_pages, src.size, chunk_pages)
    return tuple(zip(np.split(src, cuts), np.split(dst, cuts), strict=True))


def _rooms(
    pages: int, room_pages: int, max_chunks: int, rng: np.random.Generator
) -> tuple[Room, ...]:
    dst_all = rng.permutation(pages).astype(np.int32)
    rooms: list[Room] = []
    for lo in range(0, pages, room_pages):
        src = np.arange(lo, min(lo + room_pages, pages), dtype=np.int32)
        dst = dst_all[lo : lo + src.size]
        k = int(rng.integers(1, min(max_chunks, src.size) + 1))
        cuts = np.sort(rng.choice(np.arange(1, src.size), size=k - 1, replace=False))
        rooms.append(tuple(zip(np.split(src, cuts), np.split(dst, cuts), strict=True)))
    return tuple(rooms)


def build_cases(args: argparse.Namespace) -> dict[str, Case]:
    rng = np.random.default_rng(args.seed)
    big, small, page, small_page = args.pages, args.small_pages, 64 * KIB, 4 * KIB
    arange_big = np.arange(big, dtype=np.int32)
    arange_small = np.arange(small, dtype=np.int32)
    cases = [
        Case(
            "contiguous",
            page,
            big,
            (_split(arange_big, arange_big.copy(), args.chunk_pages),),
            1,
            "both sides one run",
        ),
        Case(
            "scattered_64k",
            page,
            big,
            (_split(arange_big, rng.permutation(big).astype(np.int32), args.chunk_pages),),
            1,
            "dst permuted",
        ),
        Case(
            "scattered_4k",
            small_page,
            small,
            (_split(arange_small, rng.permutation(small).astype(np.int32), args.chunk_pages),),
            1,
            "dst permuted",
        ),
    ]
    rooms = _rooms(big, args.room_pages, args.max_chunks, rng)
    cases += [
        Case(
            f"{ROOMS_PREFIX}{window}",
            page,
            big,
            rooms,
            window,
            f"{args.room_pages} pages/room, 1-{args.max_chunks} chunks, {window} in flight",
        )
        for window in args.windows
    ]
    return {case.name: case for case in cases + _tp_cases(args, rng)}


def _tp_cases(args: argparse.Namespace, rng: np.random.Generator) -> list[Case]:
    """Unequal TP, head-sliced: prefill TP ``--prefill-tp`` into decode TP ``--decode-tp``."""
    heads = Heads(
        regions=args.tp_regions,
        rows=args.page_tokens,
        head_bytes=args.head_bytes,
        total=args.kv_heads,
        prefill_tp=args.prefill_tp,
        prefill_rank=args.prefill_rank,
        decode_tp=args.decode_tp,
        decode_rank=args.decode_rank,
    )
    pages, page = args.tp_pages, heads.rows * heads.src_row
    prefix = f"tp{heads.prefill_tp}to{heads.decode_tp}_"
    what = (
        f"{heads.regions} x {heads.rows} x {heads.src_row} B rows into {heads.dst_row} B "
        f"at {heads.dst_offset}"
    )
    rooms = _rooms(pages, args.room_pages, args.max_chunks, rng)
    cases = [
        Case(
            f"{prefix}rooms_{window}",
            page,
            pages,
            rooms,
            window,
            f"{what}; {args.room_pages} pages/room, 1-{args.max_chunks} chunks, "
            f"{min(window, len(rooms))} in flight",
            heads,
        )
        for window in args.tp_windows
    ]
    arange = np.arange(pages, dtype=np.int32)
    perm = rng.permutation(pages).astype(np.int32)
    cases.append(
        Case(
            f"{prefix}large",
            page,
            pages,
            (_split(arange, perm, args.chunk_pages),),
            1,
            f"{what}; dst permuted",
            heads,
        )
    )
    return cases


# -- the peer process -------------------------------------------------------------------------


class Peer:
    """The shared "decode" process (``_nixl_peer.serve``): a NIXL agent and a registered buffer."""

    def __init__(self, nbytes: int, name: str, mem: str = "DRAM", agents: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, nbytes, name, mem, agents), name="nixl-peer", daemon=True
        )
        self.process.start()
        child.close()
        try:
            reply = self._recv(PEER_TIMEOUT_S)
            if not (isinstance(reply, tuple) and reply[0] == "ready"):
                raise BenchError(f"peer did not start: {reply!r:.200}")
        except BaseException:
            self.close()
            raise
        # With agents > 1, agent i has slice i of the buffer registered (benchmarks/scaling.py).
        _, self.metadata, self.base, self.nbytes, self.metadatas = reply

    def _recv(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.05):
            if not self.process.is_alive():
                raise BenchError(f"peer process exited (code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise BenchError(f"peer did not answer within {timeout:g}s")
        try:
            return self._conn.recv()
        except EOFError:
            self.process.join(1)
            raise BenchError(f"peer process exited (code {self.process.exitcode})") from None

    def request(self, *command: object, timeout: float = PEER_TIMEOUT_S) -> Any:
        self._conn.send(command)
        status, value = self._recv(timeout)
        if status != "ok":
            raise BenchError(f"peer: {value}")
        return value

    def clear(self) -> None:
        self.request("clear")

    def checksum(self, case: Case) -> int:
        dst = case.pairs()[1].tobytes()
        if case.heads is not None:  # the slice of every row, and nothing outside it
            return int(self.request("checksum_rows", case.heads.dst_geometry(case.pages), dst))
        return int(self.request("checksum", case.page_bytes, dst))

    def close(self) -> None:
        """Ask the peer to quit, then terminate (and kill) it if it does not. Idempotent."""
        process = self.process
        if process.is_alive():
            with contextlib.suppress(Exception):
                self.request("quit", timeout=10)
            process.join(5)
        if process.is_alive():
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
        self._conn.close()


# -- the shared context and the measurement ---------------------------------------------------


@dataclass
class Result:
    runner: str
    case: str
    bytes: int
    chunks: int
    window: int
    rooms: int
    seconds: float  # best repetition
    gbps: float
    samples: list[float]
    cpu_us_per_chunk: float | None  # posting/loop thread, best repetition
    extra: dict[str, float]
    verified: bool


@dataclass
class Bench:
    """What every runner shares in one run (see "Plug-in point" in the module docstring)."""

    peer: Peer
    src: npt.NDArray[np.uint8]  # the source buffer: every 8-byte word distinct
    repeat: int
    #: "DRAM", or "VRAM": then ``src_addr`` is a copy of ``src`` on CUDA device 0 (torch).
    mem: str = "DRAM"
    src_addr: int = 0
    gpu_src: Any = None
    caller_idle_s: float = 0.0
    #: kvfsm's ``TransferConfig.merge_max_bytes`` for the run; None: its default.
    merge_max_bytes: int | None = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _resources: dict[str, Any] = field(default_factory=dict)
    _expected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.src_addr:  # host memory: the numpy buffer itself
            self.src_addr = self.src.ctypes.data

    def resource(self, key: str, factory: Callable[[], T]) -> T:
        """``factory()`` once per run; closed (if it has ``close()``) when the run ends."""
        if key not in self._resources:
            value = factory()
            close = getattr(value, "close", None)
            if callable(close):
                self.stack.callback(close)
            self._resources[key] = value
        return self._resources[key]  # type: ignore[no-any-return]

    def source(self, case: Case) -> npt.NDArray[np.uint8]:
        """The source buffer as ``(case.pages, case.page_bytes)`` rows (one region)."""
        return self.src[: case.src_bytes].reshape(case.pages, case.page_bytes)

    def expected(self, case: Case) -> int:
        """CRC32 of the source pages in pair order: what every destination must checksum to
        (with unequal TP: every row of those pages, region-major)."""
        if case.name not in self._expected:
            src_pages, _ = case.pairs()
            if case.heads is not None:
                crc = checksum_rows(self.src, case.heads.src_geometry(case.pages), src_pages)
            else:
                crc = checksum_pages(self.src, case.page_bytes, src_pages)
            self._expected[case.name] = crc
        return self._expected[case.name]


def measure(
    runner: str,
    case: Case,
    bench: Bench,
    *,
    reset: Callable[[], None],
    go: Callable[[], dict[str, float]],
    checksum: Callable[[], int],
    report_cpu: bool = True,
) -> Result:
    """Best of ``bench.repeat``: ``reset()`` (untimed), ``go()`` (timed), ``checksum()``
    (untimed, must equal ``bench.expected(case)``). CPU is the calling thread's unless ``go()``
    returns ``cpu_s``."""
    expected = bench.expected(case)
    best: tuple[float, float, dict[str, float]] | None = None
    samples: list[float] = []
    for rep in range(bench.repeat):
        reset()
        pcpu0, cpu0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        counters = go()
        t1, cpu1, pcpu1 = time.perf_counter(), time.thread_time(), time.process_time()
        counters["process_cpu_s"] = pcpu1 - pcpu0
        got = checksum()
        if got != expected:
            raise BenchError(
                f"{runner}/{case.name} repetition {rep}: destination CRC {got:#010x}, "
                f"expected {expected:#010x}"
            )
        seconds = t1 - t0
        samples.append(seconds)
        cpu = counters.pop("cpu_s", cpu1 - cpu0)
        if best is None or seconds < best[0]:
            best = (seconds, cpu, counters)
    assert best is not None
    seconds, cpu, counters = best
    return Result(
        runner=runner,
        case=case.name,
        bytes=case.nbytes,
        chunks=case.chunks,
        window=case.window,
        rooms=len(case.rooms),
        seconds=seconds,
        gbps=case.nbytes / seconds / 1e9,
        samples=samples,
        cpu_us_per_chunk=cpu / case.chunks * 1e6 if report_cpu else None,
        extra=counters,
        verified=True,
    )


# -- runner: copy (the memory-bandwidth ceiling) ----------------------------------------------


def _run(idx: Indices) -> slice | None:
    """``idx`` as a slice if it is one ascending run of consecutive pages, else None."""
    if idx.size == 0:
        return slice(0, 0)
    lo = int(idx[0])
    if int(idx[-1]) - lo + 1 == idx.size and (idx.size == 1 or bool((np.diff(idx) == 1).all())):
        return slice(lo, lo + idx.size)
    return None


def run_copy(case: Case, bench: Bench) -> Result:
    if bench.mem != "DRAM":
        raise BenchError("the copy runner is host memory only: pass --runners raw_nixl,kvfsm")
    if case.heads is not None:
        return _copy_sliced(case, bench, case.heads)
    dst_buf = bench.resource("copy.dst", lambda: _prefaulted(bench.src.nbytes))
    src = bench.source(case)
    dst = dst_buf[: case.src_bytes].reshape(case.pages, case.page_bytes)
    # Which numpy operation each chunk takes is decided once, outside the timing.
    plan = [(chunk, _run(chunk[0]), _run(chunk[1])) for room in case.rooms for chunk in room]

    def go() -> dict[str, float]:
        for (s_idx, d_idx), s_run, d_run in plan:
            if s_run is not None and d_run is not None:
                np.copyto(dst[d_run], src[s_run])
            elif s_run is not None:
                dst[d_idx] = src[s_run]
            elif d_run is not None:
                np.take(src, s_idx, axis=0, out=dst[d_run])
            else:
                dst[d_idx] = src[s_idx]
        return {}

    def checksum() -> int:
        return checksum_pages(dst_buf, case.page_bytes, case.pairs()[1])

    return measure(
        "copy",
        case,
        bench,
        reset=lambda: dst_buf.fill(0),
        go=go,
        checksum=checksum,
        report_cpu=False,
    )


def _copy_sliced(case: Case, bench: Bench, heads: Heads) -> Result:
    """Unequal TP: each chunk's source rows into their slice of the destination rows, one
    fancy-indexed assignment per chunk over all regions."""
    nbytes = max(bench.src.nbytes, case.dst_bytes)
    key = "copy.dst" if nbytes == bench.src.nbytes else f"copy.dst.{nbytes}"  # share if it fits
    dst_buf = bench.resource(key, lambda: _prefaulted(nbytes))
    shape = (heads.regions, case.pages, heads.rows)
    src = bench.src[: case.src_bytes].reshape(*shape, heads.src_row)
    dst = dst_buf[: case.dst_bytes].reshape(*shape, heads.dst_row)
    lo, hi = heads.dst_offset, heads.dst_offset + heads.src_row
    chunks = [chunk for room in case.rooms for chunk in room]

    def go() -> dict[str, float]:
        for s_idx, d_idx in chunks:
            dst[:, d_idx, :, lo:hi] = src[:, s_idx]
        return {}

    def checksum() -> int:
        geometry = heads.dst_geometry(case.pages)
        stray = stray_bytes(dst_buf, geometry)
        if stray:
            raise BenchError(f"copy/{case.name}: {stray} bytes outside the head slice")
        return checksum_rows(dst_buf, geometry, case.pairs()[1])

    return measure(
        "copy",
        case,
        bench,
        reset=lambda: dst_buf.fill(0),
        go=go,
        checksum=checksum,
        report_cpu=False,
    )


# -- runner: raw NIXL -------------------------------------------------------------------------


def _descs(base: int, rows: int, row_bytes: int) -> npt.NDArray[np.uint64]:
    out = np.zeros((rows, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)
    out[:, 1] = row_bytes
    return out


def _row_descs(base: int, geometry: RowGeometry) -> npt.NDArray[np.uint64]:
    """Unequal TP: one descriptor per row of every page of every region (regions back to back
    from ``base``), each the slice ``(offset, length)`` of its row. Descriptor
    ``(b * pages + p) * rows + t`` is row ``t`` of page ``p`` of region ``b``."""
    regions, pages, rows, row_bytes, offset, length = geometry
    n = regions * pages * rows
    out = np.zeros((n, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base + offset) + np.arange(n, dtype=np.uint64) * np.uint64(row_bytes)
    out[:, 1] = length
    return out


def _row_index(heads: Heads, pages: int, idx: Indices) -> Indices:
    """Indices into :func:`_row_descs` for pages ``idx``: region-major, then the pages in the
    given order, each page's rows consecutive (adjacent rows of the source merge)."""
    page = np.arange(heads.regions, dtype=np.int64)[:, None] * pages + idx[None, :]
    rows = page[:, :, None] * heads.rows + np.arange(heads.rows, dtype=np.int64)
    return rows.reshape(-1).astype(np.int32)


def _request_indices(case: Case, src: Indices, dst: Indices) -> tuple[Indices, Indices]:
    """One chunk's request indices: sorted by destination (NIXL merges contiguous runs) and,
    with unequal TP, expanded to the rows of those pages."""
    if dst.size > 1:
        order = np.argsort(dst, kind="stable")
        src, dst = src[order], dst[order]
    if case.heads is not None:
        src, dst = _row_index(case.heads, case.pages, src), _row_index(case.heads, case.pages, dst)
    return src, dst


@contextlib.contextmanager
def _prepped(
    raw: RawNixl, case: Case
) -> Iterator[tuple[nixl_prepped_dlist_handle, nixl_prepped_dlist_handle]]:
    """``raw``'s agent's (local, remote) descriptor lists for ``case``: one descriptor per page
    (per row with unequal TP), released on exit."""
    bench, agent, heads = raw.bench, raw.agent, case.heads
    assert raw.remote is not None
    if heads is None:
        local_descs = _descs(bench.src_addr, case.pages, case.page_bytes)
        remote_descs = _descs(bench.peer.base, case.pages, case.page_bytes)
    else:
        local_descs = _row_descs(bench.src_addr, heads.src_geometry(case.pages))
        remote_descs = _row_descs(bench.peer.base, heads.dst_geometry(case.pages))
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, bench.mem)
    try:
        remote = agent.prep_xfer_dlist(raw.remote, remote_descs, bench.mem)
        try:
            yield local, remote
        finally:
            agent.release_dlist_handle(remote)
    finally:
        agent.release_dlist_handle(local)


class RawNixl:
    """The initiator ("prefill") side of the raw loop: one agent, the source registered once,
    the peer added once. Built on first use through ``bench.resource``; ``close()`` undoes it."""

    def __init__(self, bench: Bench) -> None:
        from kvfsm.transport._nixl import nixl_agent, nixl_agent_config

        self.bench = bench
        self.agent: nixl_agent = nixl_agent(
            f"bench-prefill-{os.getpid()}",
            nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
        )
        src = bench.src
        self._reg = self.agent.register_memory([(bench.src_addr, src.nbytes, 0, "")], bench.mem)
        self.remote: str | None = None
        t0 = time.perf_counter()
        self.remote = self.agent.add_remote_agent(bench.peer.metadata)
        self.add_remote_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.remote is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(self.remote)
            self.remote = None
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None

    def run(self, case: Case) -> Result:
        peer = self.bench.peer
        t0 = time.perf_counter()
        with _prepped(self, case) as (local, remote):
            prep_s = time.perf_counter() - t0

            def go() -> dict[str, float]:
                counters = self._send(case, local, remote)
                counters["prep_dlists_ms"] = prep_s * 1e3
                counters["add_remote_agent_ms"] = self.add_remote_s * 1e3
                return counters

            return measure(
                "raw_nixl",
                case,
                self.bench,
                reset=peer.clear,
                go=go,
                checksum=lambda: peer.checksum(case),
            )

    def _send(
        self,
        case: Case,
        local: nixl_prepped_dlist_handle,
        remote: nixl_prepped_dlist_handle,
        route: Sequence[tuple[nixl_prepped_dlist_handle, int]] | None = None,
    ) -> dict[str, float]:
        """Every chunk of ``case``, ``case.window`` rooms in flight. The timed loop. ``route``
        (several decode peers, ``benchmarks/scaling.py``): each room's remote list and the
        first page of its slice, subtracted from the room's destination pages."""
        targets = route if route is not None else [(remote, 0)] * len(case.rooms)
        agent = self.agent
        make, transfer = agent.make_prepped_xfer, agent.transfer
        check, release = agent.check_xfer_state, agent.release_xfer_handle
        rooms, window = case.rooms, case.window
        left = [len(room) for room in rooms]  # chunks of each room not yet DONE
        in_flight: list[tuple[nixl_xfer_handle, int]] = []
        next_room = active = done_at_post = polls = rounds = 0
        started = time.perf_counter()
        clock = time.perf_counter
        posted_at = [0.0] * len(rooms)
        latency: list[float] = []
        try:
            while True:
                while active < window and next_room < len(rooms):
                    i = next_room
                    next_room += 1
                    posted_at[i] = clock()
                    target, shift = targets[i]
                    for src, dst in rooms[i]:
                        s, d = _request_indices(case, src, dst - shift if shift else dst)
                        handle = make("WRITE", local, s, target, d)
                        if transfer(handle) == "DONE":
                            release(handle)
                            done_at_post += 1
                            left[i] -= 1
                        else:
                            in_flight.append((handle, i))
                    if left[i]:
                        active += 1
                    else:
                        latency.append(clock() - posted_at[i])
                if not in_flight:
                    if next_room >= len(rooms):
                        break
                    continue
                rounds += 1
                still: list[tuple[nixl_xfer_handle, int]] = []
                for handle, i in in_flight:
                    polls += 1
                    if check(handle) == "DONE":
                        release(handle)
                        left[i] -= 1
                        if not left[i]:
                            active -= 1
                            latency.append(clock() - posted_at[i])
                    else:
                        still.append((handle, i))
                in_flight = still
                if in_flight and time.perf_counter() - started > STALL_S:
                    raise BenchError(f"{len(in_flight)} chunks still PROC after {STALL_S:g}s")
        finally:
            for handle, _ in in_flight:  # an error or Ctrl-C: never leave a handle behind
                with contextlib.suppress(Exception):
                    release(handle)
        chunks = case.chunks
        return {
            "done_at_post_pct": 100.0 * done_at_post / chunks,
            "polls_per_chunk": polls / chunks,
            "poll_rounds": float(rounds),
            **_latency(latency),
        }


def run_raw_nixl(case: Case, bench: Bench) -> Result:
    return bench.resource("raw_nixl", lambda: RawNixl(bench)).run(case)


# -- runner: kvfsm end to end -------------------------------------------------------------------


#: The write lease kvfsm's rooms are fenced by (a link generation, in production).
_FENCE = 1


class Kvfsm:
    """kvfsm end to end for one page size: an ``Agent`` with the source registered as one KV
    region of ``case.pages`` pages, a ``NixlTransport`` connected to the shared peer, and a
    ``RoomEngine``. Rooms are driven through the public sender facade from this thread the way
    a scheduler would: create, receive decode's pages, ``init``, one ``send`` per chunk, poll.
    (Decode's page list is posted straight into the room: the control plane is not measured.)

    With ``heads`` (unequal TP) the layout is ``heads.regions`` KV regions of the source, the
    peer's summary as many regions of wider pages in the peer's buffer, and the peer is
    connected with the ``KvPiece`` that ``link_piece`` (what the control plane's ``link_plan``
    uses) computes from the head counts: kvfsm's sliced data path end to end."""

    def __init__(
        self,
        bench: Bench,
        page_bytes: int,
        pages: int,
        *,
        heads: Heads | None = None,
        spin: bool = False,
        alone: bool = False,
        fenced: bool = True,
        ahead: bool = False,
        name: str = "kvfsm",
    ) -> None:
        from kvfsm.rooms import RoomEngine
        from kvfsm.transport import Agent, Layout, LayoutSummary, Leases, NixlTransport, Region
        from kvfsm.transport._layout import MemKind
        from kvfsm.transport._slices import KvPiece, link_piece
        from kvfsm.transport._transport import TransferConfig

        self.bench = bench
        self.name = name
        self.ahead = ahead
        peer = bench.peer
        kind: MemKind = MemKind(bench.mem)
        regions = 1 if heads is None else heads.regions
        dst_page = page_bytes if heads is None else heads.rows * heads.dst_row
        src_region, dst_region = pages * page_bytes, pages * dst_page
        sources = tuple(
            Region(f"kv{b}", bench.src_addr + b * src_region, src_region, page_bytes, kind=kind)
            for b in range(regions)
        )
        self.layout = Layout(kv=sources)
        tag = f"{page_bytes}" if heads is None else f"{page_bytes}-sliced"
        self.agent = Agent(f"bench-{name}-{os.getpid()}-{tag}", self.layout)
        # spin: the pump polls every loop iteration (pacing off), the baseline for what the
        # bounded adaptive polling saves and costs.
        # alone: every chunk its own NIXL request (no merging), the baseline for rule 8.
        config = TransferConfig()
        if bench.merge_max_bytes is not None:
            config = dataclasses.replace(config, merge_max_bytes=bench.merge_max_bytes)
        if spin:
            config = dataclasses.replace(config, poll_max_wait_s=0.0)
        if alone:
            config = dataclasses.replace(config, merge_max_chunks=1)
        # Fenced, as a production prefill runs: every chunk under a write lease (one long
        # lease here; the control plane that renews it is not measured), and every NIXL call
        # that progresses the agent behind the stale-progress gate.
        self.leases = Leases(margin_s=1.0) if fenced else None
        self.transport = NixlTransport(self.agent, config=config, leases=self.leases)
        self.engine = RoomEngine(self.transport).start()

        async def grant() -> int:
            if self.leases is not None:
                self.leases.grant(_FENCE, time.monotonic() + 1e6)
            return threading.get_ident()

        # The loop thread's CPU clock, read from the caller (_loop_cpu).
        self._loop_clock = time.pthread_getcpuclockid(self.engine.call(grant()))
        remote = LayoutSummary(
            kv=tuple((peer.base + b * dst_region, dst_region, dst_page, 0) for b in range(regions)),
            kv_kind=kind,
        )
        piece: KvPiece | None = None
        if heads is not None:
            planned = link_piece(
                total_heads=heads.total,
                head_bytes=heads.head_bytes,
                rows=heads.rows,
                prefill_tp=heads.prefill_tp,
                prefill_rank=heads.prefill_rank,
                decode_tp=heads.decode_tp,
                decode_rank=heads.decode_rank,
            )
            if isinstance(
                planned, str
            ):  # "none": this prefill rank is a dummy for that decode rank
                raise BenchError(f"link_piece planned {planned!r} for {heads}: no KV to move")
            piece = planned  # None with equal TP: whole pages (the raw runner still slices rows)
        self.piece = piece
        self._connect(remote, piece)
        self._rooms = 0

    def _connect(self, remote: Any, piece: Any) -> None:
        """Connect the decode side the rooms send to: the shared peer, as "decode" (a subclass
        may connect several, ``benchmarks/scaling.py``)."""
        self.engine.call(
            self.transport.connect_peer("decode", self.bench.peer.metadata, remote, piece)
        )

    def _destinations(self, case: Case) -> list[tuple[str, bytes]]:
        """Each room's decode peer and page list, packed as it arrives off the wire."""
        return [
            ("decode", np.concatenate([d for _, d in room]).astype(np.int32).tobytes())
            for room in case.rooms
        ]

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        self.agent.close()

    def _loop_cpu(self) -> float:
        """The loop thread's CPU seconds so far, read from this thread: no round trip to the
        loop inside the timed region (one cost the caller to wait for the GIL and a wake-up
        of the loop, twice a repetition, and was timed as kvfsm's)."""
        return time.clock_gettime(self._loop_clock)

    def run(self, case: Case) -> Result:
        # Decode's page list of each room, packed as it arrives off the wire: built before the
        # clock starts (the control plane is not measured here, and raw NIXL builds none).
        destinations = self._destinations(case)
        return measure(
            self.name,
            case,
            self.bench,
            reset=self.bench.peer.clear,
            go=lambda: self._send(case, destinations),
            checksum=lambda: self.bench.peer.checksum(case),
        )

    def _send(self, case: Case, destinations: list[tuple[str, bytes]]) -> dict[str, float]:
        from kvfsm import KVPoll
        from kvfsm.states import TERMINAL, DestinationReceived

        engine = self.engine
        stats0 = self.transport.snapshot()
        cpu0 = self._loop_cpu()
        caller0 = time.thread_time()
        rooms, window = case.rooms, case.window
        live: list[tuple[Any, Room, float]] = []  # (sender, its chunks, handed over at or 0)
        next_room = 0
        clock = time.perf_counter
        latency: list[float] = []
        idle_s = self.bench.caller_idle_s
        ahead = self.ahead
        sending = 0  # with ahead: rooms handed over and not done yet
        while next_room < len(rooms) or live:
            # By default a room counts against the window from its creation. With ahead, up
            # to ``window`` rooms bootstrap while up to ``window`` others are sending.
            free = window - (len(live) - sending if ahead else len(live))
            while free > 0 and next_room < len(rooms):
                free -= 1
                room = rooms[next_room]
                next_room += 1
                self._rooms += 1
                sender = engine.sender(self._rooms)
                peer, dst = destinations[next_room - 1]
                engine.post(sender.key, DestinationReceived(dst, 0, peer=peer, fence=_FENCE))
                live.append((sender, room, 0.0))
            moved = False
            keep = []
            for sender, room, handed in live:
                status = sender.poll()
                sent = handed
                if (
                    not sent
                    and status is KVPoll.WaitingForInput
                    and (not ahead or sending < window)
                ):
                    sent = clock()
                    sender.init(sum(int(src.size) for src, _ in room), -1)
                    for src, _ in room:
                        sender.send(src)
                    sending += 1
                    moved = True
                if status in TERMINAL:
                    if status is not KVPoll.Success:
                        raise BenchError(f"kvfsm room failed: {sender.reason}")
                    latency.append(clock() - sent)
                    sender.clear()
                    sending -= 1
                    moved = True
                    continue
                keep.append((sender, room, sent))
            live = keep
            if idle_s:
                # --caller-step-us N: every iteration ends in an N us wait that releases the
                # GIL, as a scheduler's forward pass does (CUDA synchronisation).
                time.sleep(idle_s)
            elif not moved:
                # The default: a scheduler that spins, yielding with sleep(0) only when an
                # iteration moved nothing. It holds the GIL nearly all the time, so each
                # hand-off to kvfsm's threads waits for CPython's forced switch (5 ms).
                time.sleep(0)
        caller1 = time.thread_time()
        cpu = self._loop_cpu() - cpu0
        stats = self.transport.snapshot()
        chunks = stats["chunks_posted"] - stats0["chunks_posted"]
        return {
            "cpu_s": cpu,
            # This (the caller's) thread: facades and polling every live room per iteration.
            "caller_cpu_ms": (caller1 - caller0) * 1e3,
            "done_at_post_pct": 100.0
            * (stats["done_at_post"] - stats0["done_at_post"])
            / max(chunks, 1),
            "pump_rounds": float(stats["pump_rounds"] - stats0["pump_rounds"]),
            "nixl_requests": float(stats["handles_created"] - stats0["handles_created"]),
            "poster_hand_backs": float(stats["poster_hand_backs"] - stats0["poster_hand_backs"]),
            "pump_sleeps": float(stats["pump_sleeps"] - stats0["pump_sleeps"]),
            **_latency(latency),
        }


# -- runner: the hand-off floor ----------------------------------------------------------------


class ActorFloor:
    """What any engine whose caller's calls only enqueue (design law 6) can reach behind this
    benchmark's caller: kvfsm's event loop (uvloop) on its own thread with no room logic at
    all. The caller is the kvfsm runner's, step for step: it spins (``sleep(0)`` when an
    iteration moved nothing), polls each live room's published value every iteration, and
    with ``trips=2`` makes the same two round trips per room: it posts the room (the loop
    publishes "waiting", as a room in WaitingForInput), sees that, then posts the chunks. The
    loop posts each chunk through raw NIXL (sorted by destination, ``make_prepped_xfer`` +
    ``transfer``), polls every loop iteration until all are DONE, releases them and publishes
    "done". ``trips=1`` posts the room and its chunks at once. No merging, no leases, no state
    machine: ``kvfsm/actor_floor`` is what kvfsm's room logic costs beyond the hand-offs its
    shape needs, and ``actor_floor/raw_nixl`` is the most that shape allows."""

    WAITING, DONE = 1, 2

    def __init__(self, bench: Bench, trips: int) -> None:
        from kvfsm.rooms._runtime import new_event_loop

        self.bench, self.trips = bench, trips
        self.name = "actor_floor" if trips == 2 else "actor_floor_1trip"
        self.raw = bench.resource("raw_nixl", lambda: RawNixl(bench))  # shares its agent
        #: Each room's posted handles, until released (loop thread only).
        self._live: dict[int, list[nixl_xfer_handle]] = {}
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="floor-loop", daemon=True)
        self.thread.start()
        self._loop_clock = time.pthread_getcpuclockid(self._on_loop(threading.get_ident))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()

    def run(self, case: Case) -> Result:
        with _prepped(self.raw, case) as (local, remote):
            try:
                return measure(
                    self.name,
                    case,
                    self.bench,
                    reset=self.bench.peer.clear,
                    go=lambda: self._send(case, local, remote),
                    checksum=lambda: self.bench.peer.checksum(case),
                )
            finally:  # a run that stopped early (an error, a stall): before the lists go
                self._on_loop(self._abandon)

    def _abandon(self) -> None:
        """On the loop: release every handle still posted; their rooms stop polling."""
        live, self._live = self._live, {}
        for handles in live.values():
            for handle in handles:
                with contextlib.suppress(Exception):
                    self.raw.agent.release_xfer_handle(handle)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the loop thread, and its result."""
        done = threading.Event()
        out: list[T] = []

        def run() -> None:
            try:
                out.append(fn())
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        if not done.wait(PEER_TIMEOUT_S) or not out:
            raise BenchError(f"{self.name}: its loop thread did not answer")
        return out[0]

    def _post(
        self,
        slot: list[int | str],
        room: Room,
        case: Case,
        local: nixl_prepped_dlist_handle,
        remote: nixl_prepped_dlist_handle,
    ) -> None:
        """On the loop: post ``room``'s chunks, then poll them each iteration until done."""
        agent = self.raw.agent
        handles: list[nixl_xfer_handle] = []
        key = id(handles)
        self._live[key] = handles

        def release() -> None:
            del self._live[key]
            for handle in handles:
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)

        def check() -> None:
            if key not in self._live:  # abandoned: released by _abandon
                return
            try:
                states = [agent.check_xfer_state(h) for h in handles]
                if any(state == "PROC" for state in states):
                    self.loop.call_soon(check)
                    return
                bad = [state for state in states if state != "DONE"]
                slot[0] = self.DONE if not bad else f"NIXL request ended {bad[0]}"
            except Exception as exc:  # the caller raises it
                slot[0] = f"NIXL: {exc!r}"
            release()

        try:
            for src, dst in room:
                s, d = _request_indices(case, src, dst)
                handles.append(agent.make_prepped_xfer("WRITE", local, s, remote, d))
                agent.transfer(handles[-1])
        except Exception as exc:
            slot[0] = f"NIXL: {exc!r}"
            release()
            return
        check()

    def _send(
        self, case: Case, local: nixl_prepped_dlist_handle, remote: nixl_prepped_dlist_handle
    ) -> dict[str, float]:
        call = self.loop.call_soon_threadsafe
        cpu0 = self._loop_cpu()
        rooms, window = case.rooms, case.window
        live: list[tuple[list[int | str], Room, float]] = []  # (its slot, chunks, handed at)
        next_room = 0
        clock = time.perf_counter
        latency: list[float] = []
        stall = clock() + STALL_S
        while next_room < len(rooms) or live:
            while len(live) < window and next_room < len(rooms):
                room = rooms[next_room]
                next_room += 1
                slot: list[int | str] = [0]
                if self.trips == 2:
                    call(slot.__setitem__, 0, self.WAITING)
                    live.append((slot, room, 0.0))
                else:
                    live.append((slot, room, clock()))
                    call(self._post, slot, room, case, local, remote)
            moved = False
            keep = []
            for slot, room, handed in live:
                value, at = slot[0], handed
                if value == self.WAITING and not at:
                    at = clock()
                    call(self._post, slot, room, case, local, remote)
                    moved = True
                elif value == self.DONE:
                    latency.append(clock() - at)
                    moved = True
                    continue
                elif isinstance(value, str):
                    raise BenchError(f"{self.name}: {value}")
                keep.append((slot, room, at))
            live = keep
            if not moved:
                time.sleep(0)
                if clock() > stall:
                    raise BenchError(f"{self.name}: {len(live)} rooms not done after {STALL_S:g}s")
        # cpu_us_per_chunk is the loop thread's, as kvfsm's row reports its loop's.
        return {"cpu_s": self._loop_cpu() - cpu0, **_latency(latency)}

    def _loop_cpu(self) -> float:
        """The loop thread's CPU seconds so far, read from this thread (as kvfsm's row)."""
        return time.clock_gettime(self._loop_clock)


def run_actor_floor(case: Case, bench: Bench) -> Result:
    return bench.resource("actor_floor", lambda: ActorFloor(bench, trips=2)).run(case)


def run_actor_floor_1trip(case: Case, bench: Bench) -> Result:
    return bench.resource("actor_floor_1trip", lambda: ActorFloor(bench, trips=1)).run(case)


def _kvfsm_runner(name: str, **options: bool) -> Callable[[Case, Bench], Result]:
    """The runner ``name``: kvfsm built with ``options`` (:class:`Kvfsm`'s keywords), one
    engine per page shape for the whole run."""

    def run(case: Case, bench: Bench) -> Result:
        runner = bench.resource(
            f"{name}-{case.page_bytes}-{case.pages}-{case.heads}",
            lambda: Kvfsm(
                bench, case.page_bytes, case.pages, heads=case.heads, name=name, **options
            ),
        )
        return runner.run(case)

    return run


run_kvfsm = _kvfsm_runner("kvfsm")
run_kvfsm_spin = _kvfsm_runner("kvfsm_spin", spin=True)
run_kvfsm_unfenced = _kvfsm_runner("kvfsm_unfenced", fenced=False)
run_kvfsm_ahead = _kvfsm_runner("kvfsm_ahead", ahead=True)
run_kvfsm_alone = _kvfsm_runner("kvfsm_alone", alone=True)


def _latency(seconds: list[float]) -> dict[str, float]:
    """Per-room latency (first post to the room seen done), p50 and p99, microseconds."""
    if not seconds:
        return {}
    us = np.asarray(seconds) * 1e6
    return {
        "room_p50_us": float(np.percentile(us, 50)),
        "room_p99_us": float(np.percentile(us, 99)),
    }


Runner = Callable[[Case, Bench], Result]

# The rows, in report order. Plug-in point: add "kvfsm" here (see the module docstring).
RUNNERS: dict[str, Runner] = {
    "copy": run_copy,
    "raw_nixl": run_raw_nixl,
    "kvfsm": run_kvfsm,
    # Not run by default: kvfsm with pacing off (--runners ...,kvfsm_spin).
    "kvfsm_spin": run_kvfsm_spin,
    # Not run by default: kvfsm posting every chunk alone (--runners ...,kvfsm_alone).
    "kvfsm_alone": run_kvfsm_alone,
    # Not run by default: kvfsm without leases (--runners ...,kvfsm_unfenced).
    "kvfsm_unfenced": run_kvfsm_unfenced,
    # Not run by default: kvfsm with the next rooms bootstrapped while others send.
    "kvfsm_ahead": run_kvfsm_ahead,
    # Not run by default: the hand-off floor (--runners raw_nixl,actor_floor,kvfsm).
    "actor_floor": run_actor_floor,
    "actor_floor_1trip": run_actor_floor_1trip,
}
DEFAULT_RUNNERS: Final = ("copy", "raw_nixl", "kvfsm")

# (numerator, denominator): printed whenever a case has both rows.
RATIOS: tuple[tuple[str, str], ...] = (
    ("kvfsm", "raw_nixl"),
    ("kvfsm", "actor_floor"),
    ("actor_floor", "raw_nixl"),
    ("actor_floor_1trip", "raw_nixl"),
    ("kvfsm_ahead", "raw_nixl"),
    ("kvfsm_ahead", "actor_floor_1trip"),
    ("kvfsm", "kvfsm_spin"),
    ("kvfsm", "kvfsm_alone"),
    ("kvfsm", "kvfsm_unfenced"),
    ("kvfsm_unfenced", "raw_nixl"),
    ("kvfsm_alone", "raw_nixl"),
    ("raw_nixl", "copy"),
    ("kvfsm", "copy"),
)


# -- the run ----------------------------------------------------------------------------------


def _prefaulted(nbytes: int) -> npt.NDArray[np.uint8]:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def _source(nbytes: int) -> npt.NDArray[np.uint8]:
    """Every aligned 8-byte word distinct, so a misplaced or missing page changes the CRC."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    src = np.empty(nbytes, dtype=np.uint8)
    src[: words.nbytes] = words.view(np.uint8)
    src[words.nbytes :] = 0xA5
    return src


def _nixl_version() -> str:
    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "unknown"


def ratios(results: Iterable[Result]) -> list[dict[str, Any]]:
    by_case: dict[str, dict[str, Result]] = {}
    for r in results:
        by_case.setdefault(r.case, {})[r.runner] = r
    out: list[dict[str, Any]] = []
    for case, rows in by_case.items():
        for num, den in RATIOS:
            if num in rows and den in rows:
                a, b = rows[num], rows[den]
                cpu = (
                    a.cpu_us_per_chunk / b.cpu_us_per_chunk
                    if a.cpu_us_per_chunk is not None and b.cpu_us_per_chunk
                    else None
                )
                row: dict[str, Any] = {
                    "case": case,
                    "ratio": f"{num}/{den}",
                    "time": a.seconds / b.seconds,
                    "bandwidth": a.gbps / b.gbps,
                    "cpu_per_chunk": cpu,
                }
                if a.extra.get("process_cpu_s") and b.extra.get("process_cpu_s"):
                    # This process's CPU (every thread) for the same bytes: on a loaded
                    # machine a runner with more threads gets more CPU shares, so wall time
                    # alone flatters it; this does not.
                    row["process_cpu"] = a.extra["process_cpu_s"] / b.extra["process_cpu_s"]
                if den == "raw_nixl" and "process_cpu_s" in a.extra:
                    # Process CPU beyond what the same rooms cost through raw NIXL (whose CPU
                    # is the copies, on this CMA path, plus its minimal loop), per room.
                    extra = a.extra["process_cpu_s"] - b.extra["process_cpu_s"]
                    row["non_copy_cpu_ms_per_room"] = extra / a.rooms * 1e3
                out.append(row)
    return out


def run(args: argparse.Namespace, cases: Sequence[Case], runners: Sequence[str]) -> dict[str, Any]:
    wall0 = time.perf_counter()
    load0 = os.getloadavg()
    src = _source(max(case.src_bytes for case in cases))
    nbytes = max(case.dst_bytes for case in cases)  # the peer's buffer
    mem = args.mem.upper()
    gpu_src: Any = None
    src_addr = src.ctypes.data
    if mem == "VRAM":
        import torch

        gpu_src = torch.from_numpy(src).to("cuda:0")
        torch.cuda.synchronize()
        src_addr = int(gpu_src.data_ptr())
    peer = Peer(nbytes, f"bench-decode-{os.getpid()}", mem)
    results: list[Result] = []
    try:
        bench = Bench(
            peer=peer,
            src=src,
            repeat=args.repeat,
            caller_idle_s=args.caller_step_us * 1e-6,
            merge_max_bytes=args.merge_max_bytes,
            mem=mem,
            src_addr=src_addr,
            gpu_src=gpu_src,
        )
        with bench.stack:
            for case in cases:
                for name in runners:
                    result = RUNNERS[name](case, bench)
                    results.append(result)
                    if not args.json:
                        print(_row(result), flush=True)
    finally:
        peer.close()
    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "nixl": _nixl_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_start": load0[0],
        "loadavg_end": os.getloadavg()[0],
        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
        "mem": mem,
        "repeat": args.repeat,
        "seed": args.seed,
        "merge_max_bytes": args.merge_max_bytes,  # None: TransferConfig's default
        "cases": {
            case.name: {
                "page_bytes": case.page_bytes,
                "pages": int(case.pairs()[0].size),
                "rooms": len(case.rooms),
                "chunks": case.chunks,
                "window": case.window,
                "bytes": case.nbytes,
                "note": case.note,
                **_heads_report(case),
            }
            for case in cases
        },
        "results": [vars(r) for r in results],
        "ratios": ratios(results),
        "wall_s": time.perf_counter() - wall0,
    }


def _heads_report(case: Case) -> dict[str, Any]:
    heads = case.heads
    if heads is None:
        return {}
    return {
        "heads": vars(heads),
        "src_row_bytes": heads.src_row,
        "dst_row_bytes": heads.dst_row,
        "dst_offset": heads.dst_offset,
        "dst_page_bytes": case.dst_page_bytes,
        "descriptors_per_side": heads.descriptors(case.pages),
    }


# -- report -----------------------------------------------------------------------------------

_HEADER = (
    f"{'case':<16} {'runner':<9} {'MiB':>5} {'chunks':>6} {'win':>4} {'best s':>8} "
    f"{'GB/s':>6} {'CPU us/chunk':>12}  notes"
)


def _row(r: Result) -> str:
    cpu = f"{r.cpu_us_per_chunk:,.1f}" if r.cpu_us_per_chunk is not None else "-"
    notes = []
    if "done_at_post_pct" in r.extra:
        note = f"DONE at post {r.extra['done_at_post_pct']:.0f}%"
        if "polls_per_chunk" in r.extra:
            note += f", {r.extra['polls_per_chunk']:.2f} polls/chunk"
        if "pump_rounds" in r.extra:
            note += f", {r.extra['pump_rounds']:.0f} pump rounds"
        notes.append(note)
    if "room_p50_us" in r.extra:
        notes.append(f"room p50/p99 {r.extra['room_p50_us']:,.0f}/{r.extra['room_p99_us']:,.0f} us")
    if "process_cpu_s" in r.extra:
        notes.append(f"process CPU {r.extra['process_cpu_s'] * 1e3:,.1f} ms")
    if "caller_cpu_ms" in r.extra:
        notes.append(f"caller CPU {r.extra['caller_cpu_ms']:,.1f} ms")
    notes.append("verified" if r.verified else "NOT VERIFIED")
    return (
        f"{r.case:<16} {r.runner:<9} {r.bytes / 2**20:>5.0f} {r.chunks:>6} {r.window:>4} "
        f"{r.seconds:>8.4f} {r.gbps:>6.2f} {cpu:>12}  {'; '.join(notes)}"
    )


def print_summary(report: dict[str, Any]) -> None:
    print()
    for ratio in report["ratios"]:
        cpu = ratio["cpu_per_chunk"]
        print(
            f"{ratio['case']:<16} {ratio['ratio']:<16} time {ratio['time']:.2f}x  "
            f"bandwidth {ratio['bandwidth']:.2f}x"
            + (f"  CPU/chunk {cpu:.2f}x" if cpu else "")
            + (f"  process CPU {ratio['process_cpu']:.2f}x" if "process_cpu" in ratio else "")
            + (
                f"  non-copy CPU {ratio['non_copy_cpu_ms_per_room']:.3f} ms/room"
                if "non_copy_cpu_ms_per_room" in ratio
                else ""
            )
        )
    adds = {
        r["extra"]["add_remote_agent_ms"] for r in report["results"] if r["runner"] == "raw_nixl"
    }
    print(
        f"\nbest of {report['repeat']}; nixl {report['nixl']}, UCX_TLS={report['ucx_tls']}, "
        f"{report['cpus']} CPUs, load {report['loadavg_start']:.2f} -> "
        f"{report['loadavg_end']:.2f}; add_remote_agent "
        f"{', '.join(f'{v:.1f} ms' for v in adds) or '-'}; "
        f"wall {report['wall_s']:.1f} s"
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cases", default="all", help="comma-separated case names, or 'all'")
    parser.add_argument(
        "--runners",
        default=",".join(DEFAULT_RUNNERS),
        help=f"comma-separated, of {','.join(RUNNERS)}",
    )
    parser.add_argument(
        "--caller-step-us",
        type=float,
        default=0.0,
        help="kvfsm's caller waits this long (GIL released) every iteration, like a forward "
        "pass; 0: it spins, with sleep(0) when an iteration moved nothing",
    )
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the best is reported")
    parser.add_argument(
        "--merge-max-bytes",
        type=int,
        default=None,
        help="kvfsm's TransferConfig.merge_max_bytes (default: its default, 8 MiB); the "
        "kvfsm and kvfsm_spin runners",
    )
    parser.add_argument("--pages", type=int, default=4096, help="64 KiB pages per 64 KiB case")
    parser.add_argument("--small-pages", type=int, default=16384, help="4 KiB pages (4k case)")
    parser.add_argument(
        "--chunk-pages", type=int, default=0, help="split the first three cases (0: one chunk)"
    )
    parser.add_argument("--room-pages", type=int, default=16, help="pages per room")
    parser.add_argument("--max-chunks", type=int, default=4, help="chunks per room: 1..this")
    parser.add_argument(
        "--windows", type=_ints, default=[1, 16, 256], help="rooms in flight, one case each"
    )
    tp = parser.add_argument_group(
        "unequal TP (tp<P>to<D>_rooms_<W>, tp<P>to<D>_large): head-sliced descriptors"
    )
    tp.add_argument("--kv-heads", type=int, default=8, help="the model's KV heads (MHA)")
    tp.add_argument("--prefill-tp", type=int, default=2)
    tp.add_argument("--prefill-rank", type=int, default=1, help="the prefill rank that sends")
    tp.add_argument("--decode-tp", type=int, default=1, help="prefill TP must be a multiple")
    tp.add_argument("--decode-rank", type=int, default=0, help="the decode rank written into")
    tp.add_argument("--head-bytes", type=int, default=256, help="one head of one token")
    tp.add_argument("--page-tokens", type=int, default=16, help="rows (tokens) per page")
    tp.add_argument("--tp-regions", type=int, default=8, help="KV buffers (layers x K/V)")
    tp.add_argument("--tp-pages", type=int, default=1024, help="pages per KV buffer")
    tp.add_argument(
        "--tp-windows", type=_ints, default=[1, 16, 64], help="rooms in flight, one case each"
    )
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument(
        "--mem", choices=("dram", "vram"), default="dram", help="vram: CUDA device 0 (torch)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    # NIXL's Python logger prints INFO lines to stdout, which would break --json; the peer
    # process inherits this. Set NIXL_LOG_LEVEL yourself to see them.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.repeat < 1 or args.pages < 1 or args.small_pages < 1 or args.room_pages < 1:
        parser.error("--repeat, --pages, --small-pages and --room-pages must be >= 1")
    if args.max_chunks < 1 or not args.windows or min(args.windows) < 1:
        parser.error("--max-chunks and --windows must be >= 1")

    try:
        all_cases = build_cases(args)
    except ValueError as exc:  # a head split the unequal-TP cases cannot make
        parser.error(str(exc))
    names = list(all_cases) if args.cases == "all" else args.cases.split(",")
    runners = args.runners.split(",")
    unknown = [n for n in names if n not in all_cases] + [r for r in runners if r not in RUNNERS]
    if unknown:
        parser.error(f"unknown case or runner: {', '.join(unknown)}")
    cases = [all_cases[n] for n in names]

    if not args.json:
        print(_HEADER, flush=True)
    try:
        report = run(args, cases, runners)
    except KeyboardInterrupt:  # run() has already stopped the peer and released NIXL state
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_summary(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
