"""``kvfsm demo``: a real prefill-decode pair on this machine, both sides with rooms.

Three kinds of process take part:

* **this process** (the demo) runs the bootstrap registry, embedded in a thread of its own,
  starts the two ranks, hands them the plan, collects what they report, prints a live progress
  line on stderr and the summary on stdout;
* **the prefill process** runs a :class:`~kvfsm.manager.PrefillManager` (its own NIXL agent,
  loop thread and control channel; it registers in the registry) and a scheduler-shaped loop
  over sender rooms: ``sender(room)``, poll until WaitingForInput, ``init(num_pages, aux)``, one
  ``send(chunk)`` per iteration, poll until terminal, ``clear()``, wait until settled;
* **the decode process** runs a :class:`~kvfsm.manager.DecodeManager` (it finds prefill through
  the registry and connects its control channel) and the same kind of loop over receiver rooms:
  ``receiver(room)``, ``init(0)``, poll until WaitingForInput, take destination pages and an aux
  row from its free pools, ``send_metadata(pages, aux)``, poll until terminal, check every
  received byte and the aux row, ``clear()``, and give the pages back only once the room is
  terminal *and* settled.

Every chunk is a real NIXL WRITE (UCX, DRAM to DRAM) from the prefill process into the decode
process's pages, started by the prefill room after decode's page list came over the control
channel.

**The plan.** Both ranks walk the same plan, made from the seed (each rank and this process
generate it from ``(options, seed)``, so nothing per room crosses a pipe): for each request its room
id, its source pages and aux row, how its pages are cut into 1..``max_chunks`` chunks, and
whether (and where) it is aborted: by prefill before decode's pages arrive, before ``init``,
between chunks or right after the last chunk; or by decode a few iterations after it sent its
page list. No per-room message is needed: each rank walks the plan in order, ``concurrency``
rooms in flight (prefill admits twice as many, like a bootstrap queue, so that its room exists
when decode's metadata or abort arrives), and reports each room's outcome (status, reason,
elapsed time, bytes checked, mismatches) back over its pipe when asked.

**Sources are deterministic**: word ``w`` of page ``p`` of K/V buffer ``b`` is a hash of
``(seed, b, p, w)`` (aux rows likewise), so decode checks what landed without asking prefill.
Decode keeps every free page and aux row poisoned and checks the poison when it hands one out
and at the end of the run: a missing write cannot pass a room's byte check, and a write that
lands after its room settled is counted in ``late_writes`` (law 4).

A room is *succeeded* when decode's room ends Success and its bytes check; *failed* when
decode's room ends Failed (counted by reason, numbers blanked); *wedged* when either side's room
is not terminal within ``--room-timeout`` (it is then aborted); *unsettled* when it is terminal
but not settled within the grace. The exit status is 1 if anything wedged, mismatched, stayed
unsettled or failed for a reason other than the demo's own aborts, and 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.cli import (
    ABORT_REASON,
    DTYPES,
    WorkloadOptions,
    _percentile,
    _reason_class,
    _sigint_deferred,
    _size,
    run_command,
    workload_arguments,
)

with contextlib.redirect_stdout(sys.stderr):  # see kvfsm.cli: NIXL binds its log to stdout
    from kvfsm._child import ChildProcess, spawn_quietly
    from kvfsm.bootstrap import BootstrapServer
    from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
    from kvfsm.rooms import ReceiverRoom, SenderRoom
    from kvfsm.states import TERMINAL, KVPoll
    from kvfsm.transport._peer import compare_room, make_buffers, make_layout

__all__ = ["DemoOptions", "Site", "add_parser", "run", "run_demo"]

_log = logging.getLogger("kvfsm.demo")

Pages = npt.NDArray[np.int32]
_ENGINE: Final = "demo"
#: The reason given to requests decode could not start: unsettled rooms hold every free page.
STARVED: Final = "not started: unsettled rooms hold the free pages"

#: What decode's free pages and aux rows hold (see ``_DecodeRank``).
_POISON: Final = 0xA5
#: Word-hash multipliers for the deterministic sources (odd, so distinct inputs spread).
_MUL: Final = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


@dataclass(frozen=True, slots=True)
class DemoOptions(WorkloadOptions):
    """``kvfsm run``'s workload knobs with the demo's defaults, plus its own."""

    num_pages: int = 512
    layers: int = 32
    kv_heads: int = 1
    aux_rows: int = 64
    aux_row_bytes: int = 1024
    room_timeout_s: float = 60.0
    idle_sleep_s: float = 0.0002
    requests: int = 300
    progress: bool = True

    def validate(self) -> None:
        self.validate_workload("--requests", self.requests)


# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One room as both ranks run it. ``abort_side`` is ``"prefill"``, ``"decode"`` or ``""``;
    ``abort_at`` for prefill: -1 before decode's pages arrive, 0 before ``init``, k in
    1..chunks-1 between chunks, ``len(chunks)`` right after the last; for decode: iterations
    after ``send_metadata``."""

    room: int
    src: list[int]
    src_aux: int
    cuts: list[int]
    abort_side: str = ""
    abort_at: int = 0

    def chunks(self) -> list[Pages]:
        return np.split(np.asarray(self.src, np.int32), self.cuts)


def make_plan(opts: DemoOptions, seed: int, first_room: int = 0) -> Iterator[Request]:
    """The requests, in order, lazily (a long run does not hold its plan in memory). A later
    batch of the same ranks (``first_room`` > 0, see ``("run", first_room)``) gets room ids
    from ``first_room`` on and plans of its own; the sources stay those of ``seed``."""
    rng = np.random.default_rng(seed if first_room == 0 else (seed, first_room))
    for room in range(first_room, first_room + opts.requests):
        n = int(rng.integers(0, opts.max_room_pages + 1))  # 0: an aux-only room
        src = ((int(rng.integers(opts.num_pages)) + np.arange(n)) % opts.num_pages).astype(np.int32)
        if rng.random() < 0.5:
            rng.shuffle(src)
        # The last chunk is not empty (it is the one that brings the count to n) unless n == 0.
        extra = int(rng.integers(opts.max_chunks)) if n > 0 else 0
        cuts = sorted(int(c) for c in rng.integers(0, max(n, 1), size=extra))
        side, at = "", 0
        if opts.abort_rate > 0 and rng.random() < opts.abort_rate:
            if rng.random() < 0.5:
                side, at = "prefill", int(rng.integers(-1, len(cuts) + 2))
            else:
                side, at = "decode", int(rng.integers(0, 4))
        yield Request(room, src.tolist(), int(rng.integers(opts.aux_rows)), cuts, side, at)


def _pattern(
    seed: int, buffer: int, pages: npt.NDArray[np.integer[Any]], words: int
) -> npt.NDArray[np.uint32]:
    """The deterministic contents of ``pages`` of one buffer, as uint32 words."""
    with np.errstate(over="ignore"):
        p = pages.astype(np.uint32)[:, None] * np.uint32(_MUL[0])
        w = np.arange(words, dtype=np.uint32)[None, :] * np.uint32(_MUL[2])
        base = np.uint32((seed * _MUL[3] + buffer * _MUL[1] + 0x5BD1E995) & 0xFFFFFFFF)
        x = p ^ w ^ base
        return x ^ (x >> np.uint32(15))


def _aux_buffer_id(opts: DemoOptions) -> int:
    return 2 * opts.layers  # after the K and V buffers


def fill_sources(
    opts: DemoOptions, seed: int, kv: list[npt.NDArray[np.uint8]], aux: npt.NDArray[np.uint8]
) -> None:
    for b, buf in enumerate(kv):
        rows = np.arange(buf.shape[0])
        buf.view(np.uint32)[:] = _pattern(seed, b, rows, buf.shape[1] // 4)
    aux.view(np.uint32)[:] = _pattern(
        seed, _aux_buffer_id(opts), np.arange(aux.shape[0]), aux.shape[1] // 4
    )


# -- the ranks (each runs in its own process) -----------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What a rank reports about one room."""

    room: int
    status: int
    reason: str
    elapsed_ms: float
    wedged: bool = False
    unsettled: bool = False
    #: Decode only: bytes compared and bytes that differ (pages and aux row).
    checked: int = 0
    mismatched: int = 0
    #: When the room was seen terminal (``time.time()``: comparable across the processes).
    ended_at: float = 0.0


@dataclass(slots=True)
class _Live:
    req: Request
    room: SenderRoom | ReceiverRoom
    started: float
    chunks: list[Pages] = field(default_factory=list)
    dst: Pages | None = None
    dst_aux: int = -1
    phase: int = 0  # 0 bootstrap, 1 sending / metadata sent, 2 finishing, 3 settling
    step: int = 0  # prefill: chunks sent; decode: iterations since send_metadata
    status: int = 0
    reason: str = ""
    ended: float = 0.0
    ended_at: float = 0.0
    wedged: bool = False
    checked: int = 0
    mismatched: int = 0


class _Rank:
    """The scheduler loop both ranks share; the role-specific parts are the ``_*`` hooks."""

    window: int
    manager: PrefillManager | DecodeManager

    def __init__(self, conn: Connection, opts: DemoOptions, seed: int) -> None:
        self.conn = conn
        self.opts = opts
        self.seed = seed
        self.parent = os.getppid()
        self.reports: list[Outcome] = []
        self.quit = False

    def serve(self) -> None:
        """Answer requests until ``run``, run the plan (still answering), then until ``quit``."""
        while not self.quit:
            if not self.conn.poll(0.05):
                if os.getppid() != self.parent:
                    return
                continue
            request: Any = self.conn.recv()
            if request[0] == "run":  # answered once the first rooms exist
                first_room = int(request[1]) if len(request) > 1 else 0
                self.run(make_plan(self.opts, self.seed, first_room))
            else:
                self._answer(request)

    def _answer(self, request: Any) -> None:
        op = request[0]
        if op == "quit":
            self.quit = True
        elif op == "stopping":  # the other rank going away is expected from now on
            if logging.getLogger().getEffectiveLevel() > logging.INFO:
                logging.getLogger("kvfsm.control").setLevel(logging.ERROR)
            self.conn.send(True)
        elif op == "stats":
            self.conn.send(self.manager.stats())
        elif op == "nixl":
            self.conn.send(_nixl_counters(self.manager))
        elif op == "results":
            reports, self.reports = self.reports, []
            self.conn.send([asdict(r) for r in reports])
        else:
            self.conn.send(None)

    def run(self, plan: Iterator[Request]) -> None:
        opts = self.opts
        live: list[_Live] = []
        pending: Request | None = next(plan, None)
        acked = False
        while (pending is not None or live) and not self.quit:
            progressed = False
            while pending is not None and len(live) < self.window:
                started = self._start(pending)
                if started is None and not live:
                    # Every free page is free for good: rooms written off as unsettled hold
                    # the rest. Report the rest as not started rather than spin.
                    for req in (pending, *plan):
                        self.reports.append(Outcome(req.room, int(KVPoll.Failed), STARVED, 0.0))
                    pending = None
                    break
                if started is None:
                    break
                live.append(started)
                pending = next(plan, None)
                progressed = True
            if not acked:
                self.conn.send(True)
                acked = True
            now = time.perf_counter()
            for item in live:
                progressed |= self._step(item, now)
            live = [item for item in live if item.phase < 4]
            if self.conn.poll(0):
                self._answer(self.conn.recv())
            elif not progressed:
                if os.getppid() != self.parent:
                    self.quit = True
                time.sleep(opts.idle_sleep_s)
        if not acked:  # an empty plan
            self.conn.send(True)

    def _step(self, item: _Live, now: float) -> bool:
        room = item.room
        if item.phase == 3:
            unsettled = now - item.ended > self.opts.settle_grace_s
            if room.settled or unsettled:
                self._release(item)
                self.reports.append(
                    Outcome(
                        item.req.room,
                        item.status,
                        item.reason,
                        (item.ended - item.started) * 1e3,
                        item.wedged,
                        unsettled and not room.settled,
                        item.checked,
                        item.mismatched,
                        item.ended_at,
                    )
                )
                item.phase = 4
                return True
            return False
        status = room.poll()
        if status in TERMINAL:
            item.status, item.reason, item.ended = int(status), room.reason, now
            item.ended_at = time.time()
            if status is KVPoll.Success:
                self._landed(item)
            room.clear()
            item.phase = 3
            return True
        if now - item.started > self.opts.room_timeout_s:
            room.abort("wedged")
            item.status, item.reason, item.ended = int(KVPoll.Failed), "wedged", now
            item.ended_at = time.time()
            item.wedged = True
            room.clear()
            item.phase = 3
            return True
        return self._advance(item, status)

    def _start(self, req: Request) -> _Live | None:
        raise NotImplementedError

    def _advance(self, item: _Live, status: KVPoll) -> bool:
        raise NotImplementedError

    def _landed(self, item: _Live) -> None:
        pass

    def _release(self, item: _Live) -> None:
        pass


class _PrefillRank(_Rank):
    manager: PrefillManager

    def __init__(
        self, conn: Connection, opts: DemoOptions, seed: int, manager: PrefillManager
    ) -> None:
        super().__init__(conn, opts, seed)
        self.manager = manager
        self.window = 2 * opts.concurrency  # a bootstrap queue ahead of decode's window

    def _start(self, req: Request) -> _Live:
        sender = self.manager.sender(req.room)
        item = _Live(req, sender, time.perf_counter(), chunks=req.chunks())
        if req.abort_side == "prefill" and req.abort_at == -1:
            sender.abort(ABORT_REASON)
        return item

    def _advance(self, item: _Live, status: KVPoll) -> bool:
        sender, req = item.room, item.req
        assert isinstance(sender, SenderRoom)
        mine = req.abort_side == "prefill"
        if item.phase == 0 and status is KVPoll.WaitingForInput:
            if mine and req.abort_at == 0:
                sender.abort(ABORT_REASON)
            else:
                sender.init(len(req.src), req.src_aux)
                item.phase = 1
            return True
        if item.phase == 1:
            if mine and req.abort_at == item.step and item.step > 0:
                sender.abort(ABORT_REASON)  # between two chunks
                return True
            sender.send(item.chunks[item.step])
            item.step += 1
            if item.step == len(item.chunks):
                item.phase = 2
                if mine and req.abort_at >= item.step:  # while the last chunk is in flight
                    sender.abort(ABORT_REASON)
            return True
        return False


class _DecodeRank(_Rank):
    manager: DecodeManager

    def __init__(
        self,
        conn: Connection,
        opts: DemoOptions,
        seed: int,
        *,
        manager: DecodeManager,
        kv: list[npt.NDArray[np.uint8]],
        aux: npt.NDArray[np.uint8],
    ) -> None:
        super().__init__(conn, opts, seed)
        self.manager = manager
        self.kv, self.aux = kv, aux
        # What prefill's sources hold, computed once: checking a room is a gather and a compare.
        self.want_kv, self.want_aux = make_buffers(opts.shape())
        fill_sources(opts, seed, self.want_kv, self.want_aux)
        self.window = opts.concurrency
        self.free_pages = np.ones(opts.num_pages, dtype=bool)
        self.free_aux = np.ones(opts.aux_rows, dtype=bool)
        self.rng = np.random.default_rng(seed + 1)
        # Every free page and aux row holds the poison, checked when it is handed out and on
        # request ("late"): a byte changed while free landed after its room settled (law 4).
        # A page never written cannot pass a room's byte check either.
        for buf in self.kv:
            buf[:] = _POISON
        self.aux[:] = _POISON
        self.late_writes = 0
        self.late_notes: list[str] = []
        self.last_owner = np.full(opts.num_pages, -1, np.int64)

    def _pick(self, free: npt.NDArray[np.bool_], n: int) -> Pages | None:
        """``n`` free indices from a random offset, shuffled half the time (fragmentation)."""
        candidates = np.flatnonzero(free)
        if candidates.size < n:
            return None
        start = int(self.rng.integers(candidates.size)) if candidates.size else 0
        picked = np.roll(candidates, -start)[:n].astype(np.int32)
        if self.rng.random() < 0.5:
            self.rng.shuffle(picked)
        return picked

    def _answer(self, request: Any) -> None:
        if request[0] == "late":  # every free page and aux row checked now
            self._check_poison(np.flatnonzero(self.free_pages), np.flatnonzero(self.free_aux))
            self.conn.send({"late_writes": self.late_writes, "notes": list(self.late_notes)})
        else:
            super()._answer(request)

    def _check_poison(
        self, pages: npt.NDArray[np.integer[Any]], aux: npt.NDArray[np.integer[Any]]
    ) -> None:
        """Count free pages and aux rows that no longer hold the poison (and restore it, so one
        late write is counted once)."""
        changed = np.zeros(pages.size, bool)
        for buf in self.kv:
            changed |= np.any(buf[pages] != _POISON, axis=1)
        for page in pages[changed].tolist():
            self._late(f"page {page} changed after room {int(self.last_owner[page])} settled")
            for buf in self.kv:
                buf[page] = _POISON
        for row in aux[np.any(self.aux[aux] != _POISON, axis=1)].tolist():
            self._late(f"aux row {row} changed after its room settled")
            self.aux[row] = _POISON

    def _late(self, note: str) -> None:
        self.late_writes += 1
        if len(self.late_notes) < 10:
            self.late_notes.append(note)

    def _start(self, req: Request) -> _Live | None:
        dst = self._pick(self.free_pages, len(req.src))
        aux = self._pick(self.free_aux, 1)
        if dst is None or aux is None:
            return None  # wait until a live room settles and gives its pages back
        self._check_poison(dst, aux)
        self.free_pages[dst] = False
        self.free_aux[aux] = False
        receiver = self.manager.receiver(req.room)
        receiver.init(0)
        return _Live(req, receiver, time.perf_counter(), dst=dst, dst_aux=int(aux[0]))

    def _advance(self, item: _Live, status: KVPoll) -> bool:
        receiver, req = item.room, item.req
        assert isinstance(receiver, ReceiverRoom)
        assert item.dst is not None
        if item.phase == 0 and status is KVPoll.WaitingForInput:
            receiver.send_metadata(item.dst, item.dst_aux)
            item.phase = 1
        elif item.phase == 1:
            if req.abort_side == "decode" and req.abort_at == item.step:
                receiver.abort(ABORT_REASON)
            item.step += 1
            return False
        else:
            return False
        if req.abort_side == "decode" and req.abort_at == 0:
            receiver.abort(ABORT_REASON)  # right after the page list went out
        item.step = 1
        return True

    def _landed(self, item: _Live) -> None:
        """Check every byte of the room's pages and its aux row against the sources."""
        assert item.dst is not None
        checked, mismatched = compare_room(
            self.kv,
            self.want_kv,
            self.aux,
            self.want_aux,
            dst=item.dst,
            src=item.req.src,
            dst_aux=item.dst_aux,
            src_aux=item.req.src_aux,
        )
        item.checked += checked
        item.mismatched += mismatched

    def _release(self, item: _Live) -> None:
        if not item.room.settled:
            return  # written off: its pages stay reserved for good
        assert item.dst is not None
        for buf in self.kv:
            buf[item.dst] = _POISON
        self.aux[item.dst_aux] = _POISON
        self.last_owner[item.dst] = item.req.room
        self.free_pages[item.dst] = True
        self.free_aux[item.dst_aux] = True


def _nixl_counters(manager: PrefillManager | DecodeManager) -> dict[str, int]:
    """The agent's (and on prefill the transport's) handle and list counts: after a drain,
    every transfer handle is released and only the local lists and live peers' lists remain."""
    agent = manager.agent
    out = {
        "dlists_prepped": agent.dlists_prepped,
        "dlists_released": agent.dlists_released,
        "peers_added": agent.peers_added,
        "peers_removed": agent.peers_removed,
    }
    if isinstance(manager, PrefillManager):
        out.update(manager.transport.snapshot())
    return out


def _rank_main(  # noqa: PLR0917 (ChildProcess passes its arguments positionally)
    conn: Connection,
    role: str,
    opts: DemoOptions,
    seed: int,
    url: str,
    log_level: int,
    configure: Callable[[str], ManagerConfig] | None = None,
) -> None:
    """A rank's process: build its buffers and manager, greet, serve the parent.
    ``configure(role)`` (picklable: a module-level function or a partial of one) gives the
    manager's config; default ``ManagerConfig()``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo process stops us, after the run
    logging.basicConfig(
        level=log_level, stream=sys.stderr, format=f"%(levelname)s {role} %(name)s: %(message)s"
    )
    kv, aux = make_buffers(opts.shape())
    layout = make_layout(kv, aux)
    config = configure(role) if configure is not None else ManagerConfig()
    if config.fingerprint is None:
        config = dataclasses.replace(config, fingerprint=opts.fingerprint())
    rank: _Rank
    manager: PrefillManager | DecodeManager
    if role == "prefill":
        fill_sources(opts, seed, kv, aux)
        manager = PrefillManager(layout, url, engine_id=_ENGINE, config=config)
        rank = _PrefillRank(conn, opts, seed, manager)
    else:
        manager = DecodeManager(layout, url, engine_id=_ENGINE, config=config)
        rank = _DecodeRank(conn, opts, seed, manager=manager, kv=kv, aux=aux)
    try:
        conn.send(os.getpid())
        rank.serve()
    except (EOFError, OSError, BrokenPipeError):
        pass
    finally:
        manager.close()


# -- the demo process ---------------------------------------------------------------------


class _Registry:
    """The bootstrap registry, embedded: a ``BootstrapServer`` on a loop in its own thread."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.loop = asyncio.new_event_loop()
        self.server = BootstrapServer(host, 0, expected_ranks=1)
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="kvfsm-registry", daemon=True
        )
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()


class _Progress:
    """A ``\\r`` progress line on stderr, at most ten times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.last, self.shown = total, enabled, 0.0, False

    def show(self, done: int, ok: int, failed: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < 0.1):
            return
        self.last, self.shown = now, True
        width = 30
        filled = width * done // self.total if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r  [{bar}] {done}/{self.total}  ok {ok}  failed {failed} ")
        sys.stderr.flush()

    def end(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _collect(
    child: ChildProcess, into: dict[int, Outcome], what: str, timeout: float = 60.0
) -> bool:
    """Add what ``child`` reported since the last call; True if a request was not started."""
    if not child.process.is_alive():
        raise RuntimeError(f"the {what} process exited (status {child.process.exitcode})")
    starved = False
    for raw in child.ask("results", timeout=timeout):
        outcome = into[raw["room"]] = Outcome(**raw)
        starved |= outcome.reason == STARVED
    return starved


class Site:
    """Where the demo's processes run. This one: the registry in this process on loopback, both
    ranks on this machine with default configs. ``kvfsm demo --two-hosts`` uses another
    (:mod:`kvfsm.chaos._two_hosts`): each rank in its own network namespace."""

    def start_registry(self) -> tuple[str, Callable[[], None]]:
        """Start the registry; its URL and how to stop it."""
        registry = _Registry()
        return registry.url, registry.close

    def rank(self, role: str) -> tuple[Sequence[str], Callable[[str], ManagerConfig] | None]:
        """How to start ``role``'s process: a command prefix and a picklable config factory."""
        return (), None

    def started(self) -> None:
        """Both ranks are up; the run starts now."""

    def report(self) -> dict[str, Any]:
        """Added to the summary after the run (before the ranks stop)."""
        return {}


def run_demo(opts: DemoOptions, site: Site | None = None) -> dict[str, Any]:
    """Run the demo and return its summary as a JSON-able dict (see the module docstring).
    Stops both ranks (prefill first) and the registry whatever happens, Ctrl-C included."""
    opts.validate()
    site = site if site is not None else Site()
    seed = (
        opts.seed if opts.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    )
    stop_registry: Callable[[], None] | None = None
    children: list[ChildProcess] = []
    progress = _Progress(opts.requests, opts.progress)
    pre: dict[int, Outcome] = {}
    dec: dict[int, Outcome] = {}
    t_setup = time.perf_counter()
    try:
        level = logging.getLogger("kvfsm").getEffectiveLevel()
        url, stop_registry = site.start_registry()

        def factory(role: str) -> Callable[[], ChildProcess]:
            prefix, configure = site.rank(role)
            return lambda: ChildProcess(
                _rank_main, role, opts, seed, url, level, configure, what=role, prefix=prefix
            )

        children = spawn_quietly([factory("prefill"), factory("decode")])
        prefill, decode = children
        site.started()
        setup_s = time.perf_counter() - t_setup
        t0 = time.perf_counter()
        # Prefill first, and it answers once its first rooms exist: from then on its rooms are
        # there before decode's page lists or aborts for them arrive (its window is larger).
        prefill.ask("run")
        decode.ask("run")
        ok = 0
        starved = False  # decode gave up on the rest: prefill's rooms for it never finish
        while len(dec) < opts.requests or (len(pre) < opts.requests and not starved):
            time.sleep(0.05)
            _collect(prefill, pre, "prefill")
            starved |= _collect(decode, dec, "decode")
            ok = sum(o.status == KVPoll.Success and not o.mismatched for o in dec.values())
            progress.show(len(dec), ok, len(dec) - ok)
        seconds = time.perf_counter() - t0
        progress.show(len(dec), ok, len(dec) - ok, force=True)
        pids = {"prefill": prefill.pid, "decode": decode.pid}
        stats = {"prefill": prefill.ask("stats"), "decode": decode.ask("stats")}
        late = decode.ask("late")
        extra = site.report()
    finally:
        progress.end()
        with _sigint_deferred():
            for child in children:
                with contextlib.suppress(Exception):
                    child.ask("stopping", timeout=5)
            for child in sorted(children, key=lambda c: c.what != "prefill"):
                try:
                    child.close()
                except Exception:
                    _log.exception("stopping the %s process failed", child.what)
            if stop_registry is not None:
                try:
                    stop_registry()
                except Exception:
                    _log.exception("stopping the registry failed")
    summary = _summarize(opts, seed, pre=pre, dec=dec, seconds=seconds, setup_s=setup_s, pids=pids)
    summary["engines"] = stats
    summary["late_writes"] = late["late_writes"]
    summary["failures"] += late["notes"][: max(0, 10 - len(summary["failures"]))]
    summary.update(extra)
    return summary


def _summarize(
    opts: DemoOptions,
    seed: int,
    *,
    pre: dict[int, Outcome],
    dec: dict[int, Outcome],
    seconds: float,
    setup_s: float,
    pids: dict[str, int],
) -> dict[str, Any]:
    succeeded = failed = unexpected = mismatched_rooms = mismatched = wedged = unsettled = 0
    split = aborts_too_late = checked = moved = 0
    by_reason: Counter[str] = Counter()
    latencies: list[float] = []
    failures: list[str] = []

    def note(text: str) -> None:
        if len(failures) < 10:
            failures.append(text)

    planned = 0
    for req in make_plan(opts, seed):
        planned += bool(req.abort_side)
        d = dec[req.room]
        p = pre.get(req.room) or Outcome(req.room, int(KVPoll.Failed), STARVED, 0.0)
        wedged += p.wedged or d.wedged
        unsettled += p.unsettled or d.unsettled
        checked += d.checked
        mismatched += d.mismatched
        if p.unsettled or d.unsettled:
            note(f"room {req.room}: unsettled (prefill {p.reason!r}, decode {d.reason!r})")
        if p.wedged or d.wedged:
            note(f"room {req.room}: wedged (prefill {p.reason!r}, decode {d.reason!r})")
        if d.status == KVPoll.Success:
            split += p.status != KVPoll.Success
            if d.mismatched:
                mismatched_rooms += 1
                note(f"room {req.room}: {d.mismatched} of {d.checked} bytes differ")
            else:
                succeeded += 1
                aborts_too_late += bool(req.abort_side)
                moved += len(req.src) * opts.total_page_bytes + opts.aux_row_bytes
                latencies.append(d.elapsed_ms)
        else:
            failed += 1
            by_reason[_reason_class(d.reason)] += 1
            if not (req.abort_side and ABORT_REASON in d.reason):
                unexpected += 1
                note(f"room {req.room}: failed: {d.reason}")
    gbps = round(moved / seconds / 1e9, 4) if seconds > 0 else 0.0
    return {
        "requests": opts.requests,
        "succeeded": succeeded,
        "failed": failed,
        "failed_by_reason": dict(by_reason.most_common()),
        "failed_unexpectedly": unexpected,
        "aborts_planned": planned,
        "aborts_too_late": aborts_too_late,
        "wedged": wedged,
        "unsettled": unsettled,
        "mismatched": mismatched_rooms,
        "mismatched_bytes": mismatched,
        "checked_bytes": checked,
        "split_outcomes": split,
        "bytes": moved,
        "seconds": round(seconds, 4),
        "setup_seconds": round(setup_s, 4),
        "gbps": gbps,
        "requests_per_s": round(opts.requests / seconds, 1) if seconds > 0 else 0.0,
        "p50_ms": round(_percentile(latencies, 50), 3),
        "p99_ms": round(_percentile(latencies, 99), 3),
        "concurrency": opts.concurrency,
        "abort_rate": opts.abort_rate,
        "layout": describe_layout(opts),
        "pids": pids,
        "seed": seed,
        "failures": failures,
    }


def describe_layout(opts: DemoOptions) -> str:
    pool = opts.num_pages * opts.total_page_bytes
    return (
        f"{opts.layers} layers x K,V; a page is {opts.page_tokens} tokens x {opts.kv_heads} KV "
        f"heads x {opts.head_dim} dims {opts.dtype} = {_size(opts.buffer_page_bytes)} per "
        f"buffer, {_size(opts.total_page_bytes)} in all; {opts.num_pages} pages "
        f"({_size(pool)} of KV per side); aux {opts.aux_rows} x {_size(opts.aux_row_bytes)}"
    )


def ok(summary: dict[str, Any]) -> bool:
    return bool(
        summary["succeeded"] + summary["failed"] == summary["requests"]
        and summary["failed_unexpectedly"] == summary["mismatched"] == 0
        and summary["mismatched_bytes"] == 0
        and summary["wedged"] == summary["unsettled"] == 0
        and summary.get("late_writes", 0) == 0
        # --two-hosts: the KV must have crossed the veth, not a shared-memory shortcut.
        and summary.get("two_hosts", {}).get("crossed_wire", True)
    )


def print_text(s: dict[str, Any]) -> None:
    aborts = f", abort rate {s['abort_rate']:g}" if s["abort_rate"] else ""
    print(
        f"kvfsm demo: {s['requests']} requests, {s['concurrency']} in flight{aborts}; "
        f"prefill pid {s['pids']['prefill']} -> decode pid {s['pids']['decode']} over NIXL "
        f"(UCX, DRAM->DRAM), control channel, bootstrap registry; seed {s['seed']}"
    )
    print(f"  layout: {s['layout']}")
    rows = [
        ("requests", s["requests"]),
        ("succeeded", s["succeeded"]),
        ("failed", s["failed"]),
        *((f"  {reason}", n) for reason, n in s["failed_by_reason"].items()),
        ("wedged", s["wedged"]),
        ("unsettled", s["unsettled"]),
        ("mismatched rooms", s["mismatched"]),
        ("mismatched bytes", f"{s['mismatched_bytes']} of {s['checked_bytes']} checked"),
        ("late writes", s.get("late_writes", 0)),
        ("moved", f"{s['bytes'] / 1e9:.3f} GB in {s['seconds']:.2f} s"),
        ("GB/s", f"{s['gbps']:.2f}"),
        ("p50 ms / room", f"{s['p50_ms']:.2f}"),
        ("p99 ms / room", f"{s['p99_ms']:.2f}"),
        ("setup s", f"{s['setup_seconds']:.2f}"),
    ]
    two = s.get("two_hosts")
    if two is not None:
        p, d, wire = two["prefill"], two["decode"], two["wire"]
        rows += [
            ("prefill host", f"netns {p['netns']}, {p['device']} {p['address']}"),
            ("decode host", f"netns {d['netns']}, {d['device']} {d['address']}"),
            ("UCX", " ".join(f"{k}={v}" for k, v in two["ucx"]["prefill"].items())),
            (
                "veth sent",
                f"{wire['prefill_tx_bytes']} B by prefill, {wire['decode_tx_bytes']} B by decode",
            ),
            ("crossed veth", "yes" if two["crossed_wire"] else "NO (shared memory?)"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for line in s["failures"]:
        print(f"  {line}")


# -- command line ------------------------------------------------------------------------


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``kvfsm``'s subparsers and return its parser."""
    d = DemoOptions()
    p = subparsers.add_parser(
        "demo",
        help="a prefill process and a decode process, both with rooms, moving real KV over "
        "NIXL (DRAM), found through the bootstrap registry, every byte checked",
        description=(__doc__ or "").split("\n\n")[0],
    )
    a = p.add_argument
    a("--requests", type=int, default=d.requests, help="requests to run (%(default)s)")
    a("--concurrency", type=int, default=d.concurrency, help="rooms in flight (%(default)s)")
    a("--pages", type=int, default=d.num_pages, help="KV pages per side (%(default)s)")
    a("--layers", type=int, default=d.layers, help="layers, each K and V (%(default)s)")
    a("--page-tokens", type=int, default=d.page_tokens, help="tokens per page (%(default)s)")
    a("--kv-heads", type=int, default=d.kv_heads, help="KV heads (%(default)s)")
    a("--head-dim", type=int, default=d.head_dim, help="head dim (%(default)s)")
    a("--dtype", choices=tuple(DTYPES), default=d.dtype, help="KV dtype (%(default)s)")
    a("--aux-rows", type=int, default=d.aux_rows, help="aux rows (%(default)s)")
    a("--aux-row-bytes", type=int, default=d.aux_row_bytes, help="bytes per aux row")
    a("--max-room-pages", type=int, default=d.max_room_pages, help="pages per room, at most")
    a("--max-chunks", type=int, default=d.max_chunks, help="chunks per room, at most")
    a(
        "--abort-rate",
        type=float,
        default=d.abort_rate,
        help="probability that a request is aborted, by either side (%(default)s)",
    )
    a(
        "--room-timeout",
        type=float,
        default=d.room_timeout_s,
        help="seconds after which a non-terminal room counts as wedged (%(default)s)",
    )
    a(
        "--idle-sleep",
        type=float,
        default=d.idle_sleep_s,
        help="seconds a rank's scheduler naps when an iteration did nothing (%(default)s)",
    )
    a("--seed", type=int, default=None, help="random seed (default: random)")
    a(
        "--two-hosts",
        action="store_true",
        help="run prefill and decode in two network namespaces joined by a veth pair, NIXL on "
        "UCX TCP over it (needs root and iproute2)",
    )
    a("--no-progress", action="store_true", help="no progress line on stderr")
    a("--json", action="store_true", help="print the summary as one JSON object")
    a("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``kvfsm demo`` from ``add_parser``'s arguments; the exit status."""
    opts = DemoOptions(
        requests=args.requests, progress=not args.no_progress, **workload_arguments(args)
    )
    try:
        opts.validate()
    except ValueError:
        pass  # run_command reports it and exits 2
    else:
        if not args.json:
            print(f"kvfsm demo: layout: {describe_layout(opts)}", file=sys.stderr)
    go: Callable[[], dict[str, Any]] = lambda: run_demo(opts)  # noqa: E731
    if args.two_hosts:
        from kvfsm.chaos._two_hosts import run_demo_two_hosts  # noqa: PLC0415 - only then

        go = lambda: run_demo_two_hosts(opts)  # noqa: E731
    return run_command("demo", opts.validate, go, print_text, ok, as_json=args.json)
