"""``kvfsm run``: prefill rooms in this process move real KV bytes over NIXL (UCX, DRAM to DRAM)
into a decode rank that runs in its own OS process with its own agent and pages.

One caller thread drives many rooms the way SGLang's scheduler does (:class:`RoomLoop`). Each
room takes decode pages from a free pool (live rooms never share one; pages come back only once
the room is terminal and settled), sends random source pages in 1..4 chunks, and on success is
checked against the decode process's per-page digests. With an abort rate, some rooms are aborted
at a random point; they must fail with the abort reason, or succeed if the abort lost the race,
and never wedge. The decode side is passive (:class:`~kvfsm.workload.peer.PeerProcess`): this
thread hands each sender its destination pages (``DestinationReceived``, standing in for the
control channel) and asks the decode process what landed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.rooms import RoomEngine, SenderRoom
from kvfsm.states import DestinationReceived, KVPoll
from kvfsm.workload.buffers import Shape, fill_random, make_buffers, make_layout, page_digests
from kvfsm.workload.interrupts import sigint_deferred
from kvfsm.workload.loop import LiveRoom, RoomLoop
from kvfsm.workload.options import ABORT_REASON, RunOptions
from kvfsm.workload.report import describe_layout, percentile, reason_class

# NIXL binds its log handler to sys.stdout when first imported, and logs there at once if
# NIXL_LOG_LEVEL is set; stdout is the summary's (--json), so bind it to stderr instead.
with contextlib.redirect_stdout(sys.stderr):
    from kvfsm._child import spawn_quietly
    from kvfsm.transport import Agent, NixlTransport
    from kvfsm.workload.peer import PeerProcess

__all__ = ["DESCRIPTION", "ok", "print_text", "run_job"]

_log = logging.getLogger("kvfsm.cli")

Pages = npt.NDArray[np.int32]
_PEER_ID: Final = "decode"
#: ``kvfsm run --help``'s description.
DESCRIPTION: Final = """\
``kvfsm run`` is the data path alone (the main job is ``kvfsm demo``): prefill rooms in this
process move real KV bytes over NIXL (UCX, DRAM to DRAM) into a decode rank that runs in its own
OS process with its own agent and pages.
One caller thread drives many rooms the way SGLang's scheduler does: every iteration it polls
every live room and never blocks on one. Each room takes decode pages from a free pool (live rooms
never share one; pages come back only once the room is terminal and settled), sends random source
pages in 1..4 chunks, and on success is checked against the decode process's per-page digests.
With --abort-rate, some rooms are aborted at a random point; they must fail with the abort
reason, or succeed if the abort lost the race, and never wedge.
The exit status is 1 if a room failed for any other reason, mismatched, wedged or left its pages
unsettled, and 130 on Ctrl-C.
"""


@dataclass(slots=True, kw_only=True)
class _Room(LiveRoom):
    rid: int
    src: Pages
    dst: Pages
    src_aux: int
    dst_aux: int
    chunks: list[Pages]
    #: Chunks sent before the run aborts this room (-1: before its destination arrives,
    #: len(chunks): right after the last chunk, the seed race); None: never.
    abort_at: int | None
    aborted: bool = False

    @property
    def sender(self) -> SenderRoom:
        assert isinstance(self.room, SenderRoom)
        return self.room


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


class _Scheduler(RoomLoop[int, _Room]):
    """Prefill's loop over sender rooms; a room's plan is drawn when it starts."""

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
        super().__init__()
        self.engine = engine
        self.peer = peer
        self.opts = opts
        self.rng = rng
        self.src_aux = src_aux
        self.window = opts.concurrency
        self.room_timeout_s = opts.room_timeout_s
        self.settle_grace_s = opts.settle_grace_s
        self.idle_sleep_s = opts.idle_sleep_s
        #: Digest of every source page, computed once: verification then only asks decode.
        self.src_digests = np.asarray(
            page_digests(src_kv, np.arange(opts.num_pages, dtype=np.int32)), dtype=np.uint32
        )
        self.free_pages = np.ones(opts.num_pages, dtype=bool)
        self.free_aux = np.ones(opts.aux_rows, dtype=bool)
        self.tally = _Tally()
        self._landed: list[_Room] = []  # Success seen this iteration, verified at its end

    def run(self) -> None:
        self.run_plan(iter(range(self.opts.rooms)))

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

    def start(self, plan: int) -> _Room | None:
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
        sender = self.engine.sender(plan)
        room = _Room(
            room=sender,
            started=self.clock(),
            rid=plan,
            src=src,
            dst=dst,
            src_aux=int(rng.integers(opts.aux_rows)),
            dst_aux=dst_aux,
            chunks=chunks,
            abort_at=abort_at,
        )
        # What decode's control frame would deliver: its pages, its aux row, its agent.
        self.engine.post(sender.key, DestinationReceived(dst.tobytes(), dst_aux, peer=_PEER_ID))
        if abort_at == -1:
            self._abort(room)
        return room

    def starved(self, rest: Sequence[int]) -> None:
        # The summary shows what did not run.
        self.tally.not_started = len(rest)
        self._note_text("pool exhausted by unsettled rooms' pages")

    def _abort(self, room: _Room) -> None:
        room.aborted = True
        self.tally.aborts_requested += 1
        room.sender.abort(ABORT_REASON)

    def advance(self, item: _Room, status: KVPoll) -> bool:
        return self.advance_sender(item, status, item.chunks, item.src_aux, item.abort_at)

    def abort_planned(self, item: _Room) -> None:
        self._abort(item)

    def ended(self, item: _Room, status: KVPoll) -> None:
        if status is KVPoll.Success:
            # Cleared after verification, which needs the pages not yet given back.
            self._landed.append(item)
            return
        reason = item.sender.reason or "failed without a reason"
        self.tally.failed += 1
        self.tally.failed_by_reason[reason_class(reason)] += 1
        if not (item.aborted and ABORT_REASON in reason):
            self.tally.failed_unexpectedly += 1
            self._note(item, f"failed: {reason}")
        item.sender.clear()

    def wedging(self, item: _Room, status: KVPoll) -> None:
        self.tally.wedged += 1
        self._note(item, f"wedged: {status.name} after {item.phase.name}")

    def retire(self, item: _Room, *, settled: bool, now: float) -> None:
        if settled:
            self.free_pages[item.dst] = True
            self.free_aux[item.dst_aux] = True
        else:
            self.tally.unsettled += 1  # its pages stay reserved: never reused
            self._note(item, f"unsettled {now - item.ended:.1f}s after it ended")

    def iterated(self) -> None:
        if self._landed:
            self._verify()

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

    def _note(self, room: _Room, text: str) -> None:
        self._note_text(f"room {room.rid}: {text}")

    def _note_text(self, text: str) -> None:
        if len(self.tally.failures) < 10:
            self.tally.failures.append(text)


# -- process plumbing --------------------------------------------------------------------------


def _start_peer(shape: Shape) -> PeerProcess:
    """The decode process, started deaf to the terminal's Ctrl-C and off our stdout (this
    process stops it, after the engine and the transport; NIXL logs to stdout, which would
    corrupt ``--json``): see :func:`kvfsm._child.spawn_quietly`."""
    name = f"{_PEER_ID}-{os.getpid()}"
    (peer,) = spawn_quietly([lambda: PeerProcess(shape, name=name)])
    return peer


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
    """Run ``kvfsm run``'s job and return its summary as a JSON-able dict.

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
            fill_random(rng, buf)
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
        with sigint_deferred():
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
        "p50_ms": round(percentile(tally.latencies_ms, 50), 3),
        "p99_ms": round(percentile(tally.latencies_ms, 99), 3),
        "concurrency": opts.concurrency,
        "abort_rate": opts.abort_rate,
        "layers": opts.layers,
        "num_pages": opts.num_pages,
        "buffer_page_bytes": opts.buffer_page_bytes,
        "page_bytes": opts.total_page_bytes,
        "aux_row_bytes": opts.aux_row_bytes,
        "layout": describe_layout(opts),
        "peer_pid": peer_pid,
        "seed": seed,
        "handles_created": nixl["handles_created"],
        "handles_released": nixl["handles_released"],
        "in_flight": nixl["in_flight"],
        "nixl": nixl,
        "engine": engine_stats,
        "failures": tally.failures,
    }


def ok(summary: dict[str, Any]) -> bool:
    return bool(
        summary["succeeded"] + summary["failed"] == summary["rooms"]
        and summary["failed_unexpectedly"] == summary["mismatched"] == 0
        and summary["wedged"] == summary["unsettled"] == 0
        and summary["handles_created"] == summary["handles_released"]
        and summary["in_flight"] == 0
    )


def print_text(summary: dict[str, Any]) -> None:
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
