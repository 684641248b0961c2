"""A campaign rank: one OS process with a prefill or decode manager and a scheduler-shaped loop.

The campaign process drives it over a pipe: ``("episode", index, first_room)`` starts that
episode's rooms (from :func:`~kvfsm.chaos._options.episode_plan`, the same list on both ranks),
``("poll",)`` returns the outcomes since the last poll and whether the episode is over,
``("drain", timeout)`` waits until the engine has no room left and returns what is still held,
``("close",)`` closes the manager and returns the NIXL accounting, ``("quit",)`` ends it. Every
answer to poll, drain and close carries ``counters``: what was counted since the previous
answer (calls, slow calls, late writes, injected faults), so the campaign adds them up without
counting anything twice and loses at most one poll's worth when the rank is killed.

What a rank checks itself, because only it can:

* **bounded time**: every room must be terminal within its role's deadline sum plus slack; the
  time this process spent stopped (SIGSTOP, seen as a gap between two loop iterations) is added,
  since no timer of a stopped process can fire. Only this process's own stops count: a room
  whose *peer* is stopped must not wait for it (law 3). A room past that is *wedged* (and
  aborted).
* **never block**: every scheduler-facing call (``poll``, ``init``, ``send``, ``send_metadata``,
  ``abort``, ``clear``, and creating the room) is timed; calls over ``slow_call_ms`` are counted.
  An oversized ``send_metadata`` is timed on its own: the facade packs (copies) the caller's
  page list before refusing it, so its bound is ``slow_call_ms`` plus 1 ms per MB.
* **no late writes** (decode): a settled room's pages are filled with a canary, and checked before
  they are handed out again and at every drain. A changed byte is a write that landed after its
  pages were declared free. Pages are handed out oldest-freed first, so a canary stays in place
  as long as the pool allows (through a freeze of prefill past decode's settle bound).
* **settled** (both): a terminal room must settle before its own settle timeout; decode rooms of
  a lost link settle the lease plus the fence margin after the last lease granted on it. A
  decode room whose frames the fault proxy dropped or reordered (TCP never does) is reported as
  such: its acknowledgement may have been the frame lost.
* **the bytes** (decode): a Success room's pages and aux row must equal prefill's sources, which
  both ranks compute from the seed.
* **id reuse** (both): a room planned for reuse has two generations on each side, reported
  separately (``gen`` 0 and 1); both must end and settle. Decode creates its next receiver
  right after aborting the first (before it settled); prefill its next sender once the first
  is terminal.
* **oversized calls** (decode): an ``send_metadata`` over ``max_pages`` must leave the room Failed
  when the call returns, with a reason naming ``max_pages``; one over the frame limit must fail
  the room within a second. The outcome says whether it did (``oversized_problem``).

Outcomes carry ``started_at``, ``bound_at`` (when the room was first seen past Bootstrapping:
decode claimed it on the link) and ``ended_at``, on ``time.monotonic()``, which every process of
one kernel shares: the campaign checks them against the moments it killed, stopped or cut off
the peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.bootstrap import BootstrapClient, registry_resolver
from kvfsm.chaos._control_proxy import ProxyThread
from kvfsm.chaos._options import OVERSIZED_PAGES, CampaignOptions, RoomPlan, episode_plan
from kvfsm.chaos._plan import FaultPlan
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.manager import DecodeManager, PrefillManager
from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.states import TERMINAL, KVPoll, Role
from kvfsm.workload.buffers import Shape, compare_room, make_buffers, make_layout
from kvfsm.workload.loop import Phase

__all__ = ["CAMPAIGN_ABORT", "ENGINE", "rank_main"]

_log = logging.getLogger("kvfsm.chaos")
ENGINE: Final = "chaos"
#: The reason the campaign's planned aborts give (``kvfsm run``'s and the demo's is
#: :data:`kvfsm.workload.options.ABORT_REASON`).
CAMPAIGN_ABORT: Final = "chaos campaign abort"
_CANARY: Final = 0x5A
_POISON: Final = 0xA5
#: A gap this long between two loop iterations means the process was stopped (or starved).
_FROZEN_GAP_S: Final = 0.25
#: Transport counters each prefill answer carries (as deltas).
_XFER_COUNTERS: Final = ("chunks_fenced", "chunks_stalled", "chunks_quarantined", "chunks_posted")
Pages = npt.NDArray[np.int32]


def shape_of(opts: CampaignOptions) -> Shape:
    return Shape(
        layers=opts.layers,
        num_pages=opts.num_pages,
        page_bytes=opts.page_bytes,
        aux_rows=opts.aux_rows,
        aux_row_bytes=opts.aux_row_bytes,
    )


def source_rows(seed: int, buffer: int, rows: npt.NDArray[np.int64], width: int) -> Any:
    """Prefill's bytes for ``rows`` of one buffer: a pure function of (seed, buffer, row)."""
    with np.errstate(over="ignore"):
        base = np.uint32((seed * 2654435761 + buffer * 40503) & 0xFFFFFFFF)
        row = rows.astype(np.uint32)[:, None] * np.uint32(2246822519)
        word = np.arange(width // 4, dtype=np.uint32)[None, :] * np.uint32(3266489917)
        return (row ^ word ^ base).view(np.uint8)


class _Pool:
    """Free indices of one pool (pages, or aux rows), handed out oldest-freed first.

    A real allocator hands out only what is free; this one also hands out what was freed
    longest ago, so a settled room's canary stays in place for as long as the pool allows (a
    late write is caught even when it lands seconds after the settle, as it would after a freeze
    past decode's settle bound). Indices of rooms that never settle are never given back."""

    __slots__ = ("free", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: deque[int] = deque(range(size))

    def take(self, n: int, rng: np.random.Generator) -> Pages | None:
        if len(self.free) < n:
            return None
        picked = np.fromiter((self.free.popleft() for _ in range(n)), np.int32, n)
        rng.shuffle(picked)  # page lists are not sorted in the wild
        return picked

    def give(self, indices: Pages) -> None:
        self.free.extend(int(i) for i in indices)


@dataclass(slots=True)
class _Live:
    plan: RoomPlan
    room: SenderRoom | ReceiverRoom
    started: float
    frozen_at_start: float
    #: 0: the room's first generation; 1: the next room of the same id (``plan.reuse``).
    gen: int = 0
    phase: Phase = Phase.BOOTSTRAP
    step: int = 0
    status: int = 0
    reason: str = ""
    bound_at: float = 0.0  # first seen past Bootstrapping
    ended: float = 0.0
    frozen_s: float = 0.0  # how long this process was stopped while the room was live
    wedged: bool = False
    mismatched: int = 0
    checked: int = 0
    dst: Pages | None = None
    dst_aux: int = -1
    #: An oversized send_metadata: when it was called, and what was wrong with its outcome.
    oversized_at: float = 0.0
    oversized_problem: str = ""
    oversized_slot: int = -1

    @property
    def abort_side(self) -> str:
        # The next generation of a reused id runs without a planned abort.
        return self.plan.abort_side if self.gen == 0 else ""


class _Rank:
    def __init__(self, conn: Connection, role: str, opts: CampaignOptions, url: str) -> None:
        self.conn, self.role, self.opts, self.url = conn, role, opts, url
        self.parent = os.getppid()
        self.kv, self.aux = make_buffers(shape_of(opts))
        self.layout = make_layout(self.kv, self.aux)
        self.outcomes: list[dict[str, Any]] = []
        self.live: list[_Live] = []
        self.spawned: list[_Live] = []  # next generations started during an iteration
        self.pending: list[RoomPlan] = []
        self.frozen = 0.0
        self.slow: Counter[str] = Counter()
        self.max_call_ms: dict[str, float] = {}
        self.calls = 0
        self.late_writes = 0
        self.late_notes: list[str] = []
        self.events: Counter[str] = Counter()  # what this rank did on plan (reuse, oversized)
        self.reported: Counter[str] = Counter()  # cumulative counters as last reported
        self.settle_wait = opts.settle_wait_s()
        self.broken = False
        self.quit = False
        self.bound = opts.bound_s(Role.SENDER if role == "prefill" else Role.RECEIVER)
        self.window = opts.concurrency * (2 if role == "prefill" else 1)
        self.manager: PrefillManager | DecodeManager
        self.faults: TransportFaults | None = None
        self.proxy: ProxyThread | None = None
        self.client: BootstrapClient | None = None

    # -- setup ---------------------------------------------------------------------------------

    def build(self, secret: bytes | None, seed_salt: int, host: str) -> None:
        opts = self.opts
        config = opts.manager_config(secret, host, self.role)
        # Each incarnation of a rank gets its own fault streams (a restarted rank must not
        # replay its predecessor's faults); the salt is the campaign's, so still reproducible.
        plan = FaultPlan(opts.seed * 1000 + seed_salt, opts.transfer, opts.control)
        if self.role == "prefill":
            for b, buf in enumerate(self.kv):
                buf[:] = source_rows(opts.seed, b, np.arange(opts.num_pages), opts.page_bytes)
            self.aux[:] = source_rows(opts.seed, -1, np.arange(opts.aux_rows), opts.aux_row_bytes)
            self.faults = TransportFaults(plan)
            config = dataclasses.replace(
                config, agent=faulty_agent_config(self.faults, config.agent)
            )
            self.manager = PrefillManager(self.layout, self.url, engine_id=ENGINE, config=config)
        else:
            self.proxy = ProxyThread(plan).start()
            self.client = BootstrapClient(self.url, secret=secret)
            resolver = self.proxy.resolver(registry_resolver(self.client, ENGINE))
            self.manager = DecodeManager(
                self.layout, self.url, engine_id=ENGINE, resolver=resolver, config=config
            )
            self.want_kv = [
                source_rows(opts.seed, b, np.arange(opts.num_pages), opts.page_bytes)
                for b in range(len(self.kv))
            ]
            self.want_aux = source_rows(opts.seed, -1, np.arange(opts.aux_rows), opts.aux_row_bytes)
            self.pages = _Pool(opts.num_pages)
            self.aux_pool = _Pool(opts.aux_rows)
            self.canary_pages = np.zeros(opts.num_pages, bool)
            self.canary_aux = np.zeros(opts.aux_rows, bool)
            self.owner = np.full(opts.num_pages, -1, np.int64)
            self.rng = np.random.default_rng(opts.seed + seed_salt)
            # Oversized page lists over the frame limit pass the facade, so the engine holds
            # them as destinations until the room settles: indices past the pool, in slots
            # that never overlap while one is held (a room that never settles keeps its slot).
            self.oversized_held: set[int] = set()

    # -- the pipe ------------------------------------------------------------------------------

    def serve(self) -> None:
        last = time.monotonic()
        while not self.quit:
            now = time.monotonic()
            if now - last > _FROZEN_GAP_S:
                self.frozen += now - last
            last = now
            progressed = self._iterate(now)
            if self.conn.poll(0):
                self._answer(self.conn.recv())
            elif not progressed:
                if os.getppid() != self.parent:
                    return
                time.sleep(self.opts.idle_sleep_s if self.live or self.pending else 0.01)

    def _answer(self, request: Any) -> None:
        op = request[0]
        if op == "episode":
            self.pending = episode_plan(self.opts, request[1], request[2])
            self.conn.send(True)
        elif op == "poll":
            outcomes, self.outcomes = self.outcomes, []
            answer: dict[str, Any] = {
                "done": not (self.live or self.pending),
                "outcomes": outcomes,
                "counters": self._counters(),
            }
            if isinstance(self.manager, PrefillManager):
                # The campaign freezes prefill past decode's settle bound while chunks are
                # accepted and not final (queued for the poster, or posted).
                answer["in_flight"] = self.manager.transport.in_flight
            self.conn.send(answer)
        elif op == "port":
            self.conn.send(self.manager.port if isinstance(self.manager, PrefillManager) else 0)
        elif op == "drain":
            self.conn.send(self._drain(float(request[1])))
        elif op == "close":
            self.conn.send(self._close())
        elif op == "quit":
            self.quit = True
        else:
            self.conn.send(None)

    # -- timing the scheduler-facing calls -----------------------------------------------------

    def _timed(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        return self._timed_within(name, self.opts.slow_call_ms, call, *args)

    def _timed_within(
        self, name: str, limit_ms: float, call: Callable[..., Any], *args: Any
    ) -> Any:
        t0 = time.perf_counter()
        result = call(*args)
        ms = (time.perf_counter() - t0) * 1e3
        self.calls += 1
        if ms > self.max_call_ms.get(name, 0.0):
            self.max_call_ms[name] = ms
        if ms > limit_ms:
            self.slow[name] += 1
        return result

    # -- the scheduler loop --------------------------------------------------------------------

    def _iterate(self, now: float) -> bool:
        progressed = False
        blocked = False  # a room could not start: no free pages
        while self.pending and len(self.live) < self.window:
            item = self._start(self.pending[0], now)
            if item is None:
                blocked = True
                break
            self.pending.pop(0)
            self.live.append(item)
            progressed = True
        for item in self.live:
            progressed |= self._step(item, now)
        self.live = [item for item in self.live if item.phase is not Phase.DONE]
        if self.spawned:
            self.live += self.spawned
            self.spawned = []
        if blocked and not self.live:
            # Unsettled rooms hold every free page: report the rest rather than spin.
            for plan in self.pending:
                self.outcomes.append(_outcome(plan.room, int(KVPoll.Failed), "starved"))
            self.pending = []
        return progressed

    def _step(self, item: _Live, now: float) -> bool:
        room = item.room
        if item.phase is Phase.SETTLING:
            waited_out = now - item.ended > self.settle_wait + self.frozen_since(item)
            if room.settled or waited_out:
                self._finish(item, settled=room.settled)
                item.phase = Phase.DONE
                return True
            return False
        status = self._timed("poll", room.poll)
        if not item.bound_at and status is not KVPoll.Bootstrapping:
            item.bound_at = now
        if status in TERMINAL:
            item.status, item.reason, item.ended = int(status), room.reason, now
            item.frozen_s = self.frozen_since(item)
            if status is KVPoll.Success:
                self._landed(item)
            self._check_oversized(item)
            self._timed("clear", room.clear)
            item.phase = Phase.SETTLING
            if self.role == "prefill" and item.plan.reuse and item.gen == 0:
                # Decode reuses the id after aborting it: serve its next receiver, whatever the
                # first sender became (it may have finished before decode's abort came, or
                # served the next receiver itself when the first one's claim was withdrawn
                # before it existed; then this one waits out its Bootstrapping deadline).
                self._next_generation(item, now)
            return True
        allowed = self.bound + self.opts.slack_s + self.frozen_since(item)
        if now - item.started > allowed:
            self._timed("abort", room.abort, "wedged")
            item.status, item.reason, item.ended = int(KVPoll.Failed), "wedged", now
            item.frozen_s = self.frozen_since(item)
            item.wedged = True
            item.phase = Phase.SETTLING
            return True
        if self.role == "prefill":
            return self._advance_sender(item, status)
        return self._advance_receiver(item, status, now)

    def frozen_since(self, item: _Live) -> float:
        return self.frozen - item.frozen_at_start

    def _start(self, plan: RoomPlan, now: float, gen: int = 0) -> _Live | None:
        if self.role == "prefill":
            assert isinstance(self.manager, PrefillManager)
            sender = self._timed("create", self.manager.sender, plan.room)
            item = _Live(plan, sender, now, self.frozen, gen=gen)
            if item.abort_side == "prefill" and plan.abort_at == -1:
                self._timed("abort", sender.abort, CAMPAIGN_ABORT)
            return item
        # An oversized room names pages past the pool (see _oversized_pages), none of it.
        dst = self.pages.take(0 if plan.oversized else len(plan.src), self.rng)
        if dst is None:
            return None
        aux = self.aux_pool.take(1, self.rng)
        if aux is None:
            self.pages.give(dst)
            return None
        self._check_canary(dst, int(aux[0]), clear=True)
        assert isinstance(self.manager, DecodeManager)
        receiver = self._timed("create", self.manager.receiver, plan.room)
        self._timed("init", receiver.init, 0)
        return _Live(plan, receiver, now, self.frozen, gen=gen, dst=dst, dst_aux=int(aux[0]))

    def _next_generation(self, item: _Live, now: float) -> None:
        """The id's next room on this side (``plan.reuse``): right away, while the first one
        may still be settling."""
        nxt = self._start(item.plan, now, gen=1)
        if nxt is None:  # decode: no free pages; the reuse is skipped, and counted
            self.events["reuse_skipped"] += 1
            return
        self.events[f"reuse_{self.role}"] += 1
        self.spawned.append(nxt)

    def _advance_sender(self, item: _Live, status: KVPoll) -> bool:
        sender, plan = item.room, item.plan
        assert isinstance(sender, SenderRoom)
        mine = item.abort_side == "prefill"
        if item.phase is Phase.BOOTSTRAP and status is KVPoll.WaitingForInput:
            if mine and plan.abort_at == 0:
                self._timed("abort", sender.abort, CAMPAIGN_ABORT)
            else:
                self._timed("init", sender.init, len(plan.src), plan.src_aux)
                item.phase = Phase.SENDING
            return True
        if item.phase is Phase.SENDING:
            bounds = (0, *plan.cuts, len(plan.src))
            chunk = np.asarray(plan.src[bounds[item.step] : bounds[item.step + 1]], np.int32)
            self._timed("send", sender.send, chunk)
            item.step += 1
            if item.step == plan.chunks:
                item.phase = Phase.FINISHING
            if mine and plan.abort_at == item.step:
                # Right after a chunk was handed over: it is in flight (the seed race when it
                # is not the last one).
                self._timed("abort", sender.abort, CAMPAIGN_ABORT)
                item.phase = Phase.FINISHING
            return True
        return False

    def _advance_receiver(self, item: _Live, status: KVPoll, now: float) -> bool:
        receiver, plan = item.room, item.plan
        assert isinstance(receiver, ReceiverRoom)
        assert item.dst is not None
        mine = item.abort_side == "decode"
        if item.phase is Phase.BOOTSTRAP and status is KVPoll.WaitingForInput:
            if mine and plan.abort_at == -1:
                self._timed("abort", receiver.abort, CAMPAIGN_ABORT)
                return True
            if plan.oversized and item.gen == 0:
                self._send_oversized(item, receiver, now)
                item.phase = Phase.SENDING
                return True
            for buf in self.kv:  # a page that is never written cannot pass the check
                buf[item.dst] = _POISON
            self.aux[item.dst_aux] = _POISON
            self._timed("send_metadata", receiver.send_metadata, item.dst, item.dst_aux)
            item.phase = Phase.SENDING
            if mine and plan.abort_at == 0:
                self._abort_receiver(item, receiver, now)
            return True
        if item.phase is Phase.SENDING:
            item.step += 1
            if mine and plan.abort_at == item.step:
                self._abort_receiver(item, receiver, now)
        return False

    def _abort_receiver(self, item: _Live, receiver: ReceiverRoom, now: float) -> None:
        self._timed("abort", receiver.abort, CAMPAIGN_ABORT)
        if item.plan.reuse and item.gen == 0:
            # At once, before the aborted generation settled: the next receiver of the id,
            # on fresh pages (the aborted room's stay held until it settles).
            self._next_generation(item, now)

    # -- decode: oversized page lists ----------------------------------------------------------

    def _send_oversized(self, item: _Live, receiver: ReceiverRoom, now: float) -> None:
        kind = item.plan.oversized
        count = OVERSIZED_PAGES[kind]
        slot = 0
        if kind == "frame":
            while slot in self.oversized_held:
                slot += 1
            self.oversized_held.add(slot)
            item.oversized_slot = slot
        start = self.opts.num_pages + slot * count
        pages = np.arange(start, start + count, dtype=np.int32)
        self.events[f"oversized_{kind}"] += 1
        item.oversized_at = now
        # The facade packs the caller's list (a copy of 4 bytes per page) before it can look at
        # its length: that copy is the call's cost, not a wait on anything.
        limit = self.opts.slow_call_ms + pages.nbytes / 1e6
        self._timed_within(
            "send_metadata_oversized", limit, receiver.send_metadata, pages, item.dst_aux
        )
        if kind == "max_pages":
            status = receiver.poll()
            if status is not KVPoll.Failed or "max_pages" not in receiver.reason:
                item.oversized_problem = (
                    f"{count} pages: {status.name} after the call ({receiver.reason!r})"
                )

    def _check_oversized(self, item: _Live) -> None:
        """An oversized room must have failed, a frame-sized one within a second (frozen
        time aside): nothing it asked for could be sent."""
        if not item.plan.oversized or item.gen or item.oversized_problem:
            return
        if item.status != KVPoll.Failed:
            item.oversized_problem = f"ended {KVPoll(item.status).name}"
        elif not item.oversized_at:
            return  # failed before its call (a lost link): nothing to check
        elif item.ended - item.oversized_at - self.frozen_since(item) > 1.0:
            item.oversized_problem = (
                f"failed {item.ended - item.oversized_at:.2f}s after the call: {item.reason!r}"
            )

    # -- decode: bytes, canaries ---------------------------------------------------------------

    def _landed(self, item: _Live) -> None:
        if self.role != "decode":
            return
        assert item.dst is not None
        checked, mismatched = compare_room(
            self.kv,
            self.want_kv,
            self.aux,
            self.want_aux,
            dst=item.dst,
            src=item.plan.src,
            dst_aux=item.dst_aux,
            src_aux=item.plan.src_aux,
        )
        item.checked += checked
        item.mismatched += mismatched

    def _release(self, item: _Live) -> None:
        """The room is settled: its pages go back to the pool, holding a canary."""
        assert item.dst is not None
        for buf in self.kv:
            buf[item.dst] = _CANARY
        self.aux[item.dst_aux] = _CANARY
        self.canary_pages[item.dst] = True
        self.canary_aux[item.dst_aux] = True
        self.owner[item.dst] = item.plan.room
        self.pages.give(item.dst)
        self.aux_pool.give(np.asarray([item.dst_aux], np.int32))
        self.oversized_held.discard(item.oversized_slot)
        if self.opts.break_invariant == "canary" and not self.broken and item.dst.size:
            # A deliberate late write, to prove the check below is not vacuous.
            self.kv[0][item.dst[0], 0] ^= 0xFF
            self.broken = True

    def _check_canary(self, pages: Pages, aux: int | None, *, clear: bool) -> None:
        """Count canaried pages (and the aux row) that changed; unmark what was checked
        (``clear``: they are being handed out) or only what was found changed."""
        marked = pages[self.canary_pages[pages]]
        if marked.size:
            bad = np.zeros(marked.size, bool)
            for buf in self.kv:
                bad |= np.any(buf[marked] != _CANARY, axis=1)
            for page in marked[bad].tolist():
                self._late(f"page {page} changed after room {int(self.owner[page])} settled")
            self.canary_pages[marked if clear else marked[bad]] = False
        if aux is not None and self.canary_aux[aux]:
            changed = bool(np.any(self.aux[aux] != _CANARY))
            if changed:
                self._late(f"aux row {aux} changed after its room settled")
            if clear or changed:
                self.canary_aux[aux] = False

    def _late(self, note: str) -> None:
        self.late_writes += 1
        if len(self.late_notes) < 10:
            self.late_notes.append(note)

    def _check_all_canaries(self) -> None:
        self._check_canary(np.flatnonzero(self.canary_pages).astype(np.int32), None, clear=False)
        for aux in np.flatnonzero(self.canary_aux).tolist():
            self._check_canary(np.empty(0, np.int32), int(aux), clear=False)

    def _finish(self, item: _Live, *, settled: bool) -> None:
        disordered = False
        if self.role == "decode":
            if settled:
                self._release(item)
            if self.proxy is not None:
                # Either way: a dropped abort or page list towards prefill leaves prefill with
                # nothing to acknowledge (until its held metadata expires), a dropped
                # acknowledgement towards decode is simply gone.
                room = item.plan.room
                disordered = self.proxy.disordered("to_decode", room) or self.proxy.disordered(
                    "to_prefill", room
                )
        self.outcomes.append(
            _outcome(
                item.plan.room,
                item.status,
                item.reason,
                gen=item.gen,
                elapsed_s=item.ended - item.started - item.frozen_s,
                started_at=item.started,
                bound_at=item.bound_at,
                ended_at=item.ended,
                frozen_s=item.frozen_s,
                wedged=item.wedged,
                settled=settled,
                mismatched=item.mismatched,
                checked=item.checked,
                aborted=bool(item.abort_side),
                disordered=disordered,
                reuse=item.plan.reuse,
                oversized=item.plan.oversized if item.gen == 0 else "",
                oversized_problem=item.oversized_problem,
            )
        )

    # -- drain and close -----------------------------------------------------------------------

    def _drain(self, timeout: float) -> dict[str, Any]:
        engine = self.manager.engine
        assert engine is not None
        deadline = time.monotonic() + timeout
        while engine.stats()["live"] and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.role == "decode":
            self._check_all_canaries()
        out: dict[str, Any] = {
            "live_rooms": len(engine.rooms()),
            "engine": engine.stats(),
            "control": dict(self.manager.control.stats) if self.manager.control else {},
            "max_call_ms": {k: round(v, 3) for k, v in self.max_call_ms.items()},
            "frozen_s": round(self.frozen, 3),
            "counters": self._counters(),
        }
        if isinstance(self.manager, PrefillManager):
            out["transport"] = self.manager.transport.snapshot()
        if self.faults is not None:
            out["transfer_faults"] = self.faults.snapshot()
        if self.role == "decode":
            # Not free and not held by a room still watched: a room that never settled.
            held = sum(i.dst.size for i in self.live if i.dst is not None)
            out["written_off_pages"] = self.pages.size - len(self.pages.free) - held
            out["written_off_aux"] = self.aux_pool.size - len(self.aux_pool.free) - len(self.live)
            # Oversized page lists of rooms that never settled: 4 M destinations each, held by
            # the engine for its life (34 MB of owner table per slot).
            live_slots = {i.oversized_slot for i in self.live}
            out["written_off_oversized"] = len(self.oversized_held - live_slots)
        return out

    def _counters(self) -> dict[str, Any]:
        """What was counted since the last call: calls (total and slow, by name), late writes
        and their notes, injected transfer faults, the frame proxy's counters."""
        now: Counter[str] = Counter({"calls": self.calls, "late_writes": self.late_writes})
        now.update({f"slow.{name}": n for name, n in self.slow.items()})
        now.update({f"fault.{name}": n for name, n in self.events.items()})
        if isinstance(self.manager, PrefillManager):
            # What the fence and the deadlines did to chunks (law 4's evidence, not faults).
            snapshot = self.manager.transport.snapshot()
            now.update({f"xfer.{name}": snapshot[name] for name in _XFER_COUNTERS})
        if self.faults is not None:
            now.update(
                {
                    f"fault.transfer_{name[len('injected_') :]}": n
                    for name, n in self.faults.snapshot().items()
                    if name.startswith("injected_")
                }
            )
        if self.proxy is not None:
            now.update(
                {
                    f"fault.frame_{name.replace(':', '_')}": n
                    for name, n in self.proxy.stats().items()
                    if ":" in name and not name.endswith(":frames")
                }
            )
        delta = {name: n - self.reported[name] for name, n in now.items()}
        self.reported = now
        notes, self.late_notes = self.late_notes, []
        return {"delta": {k: v for k, v in delta.items() if v}, "late_notes": notes}

    def _close(self) -> dict[str, Any]:
        final = self._drain(self.settle_wait)
        manager = self.manager
        if self.client is not None and manager.engine is not None:
            with contextlib.suppress(Exception):
                manager.engine.call(self.client.close(), timeout=10)
        manager.close()
        counters = self._counters()  # anything counted during the close itself
        if self.proxy is not None:
            self.proxy.close()
        agent = manager.agent
        final["agent"] = {
            "dlists_prepped": agent.dlists_prepped,
            "dlists_released": agent.dlists_released,
            "peers_added": agent.peers_added,
            "peers_removed": agent.peers_removed,
        }
        if isinstance(manager, PrefillManager):
            final["transport"] = manager.transport.snapshot()
        if self.faults is not None:
            final["transfer_faults"] = self.faults.snapshot()
        final["counters"] = counters
        return final


def _outcome(room: int, status: int, reason: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "room": room,
        "status": status,
        "reason": reason,
        "elapsed_s": 0.0,
        "wedged": False,
        "settled": True,
        "mismatched": 0,
        "checked": 0,
        "aborted": False,
    }
    base.update(fields)
    return base


def rank_main(  # noqa: PLR0917 - ChildProcess passes its arguments positionally
    conn: Connection,
    role: str,
    opts: CampaignOptions,
    url: str,
    secret: bytes | None,
    salt: int,
    log_level: int,
    host: str = "127.0.0.1",
) -> None:
    """A rank's process: build, greet with the pid, serve the campaign process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the campaign process stops us
    logging.basicConfig(
        level=log_level, stream=sys.stderr, format=f"%(levelname)s {role} %(name)s: %(message)s"
    )
    rank = _Rank(conn, role, opts, url)
    rank.build(secret, salt, host)
    try:
        conn.send(os.getpid())
        rank.serve()
    except (EOFError, OSError):
        pass
    finally:
        if not rank.quit:
            with contextlib.suppress(Exception):
                rank.manager.close()
