"""A campaign rank: one OS process with a prefill or decode manager and the workload's room loop.

The loop is :class:`~kvfsm.workload.loop.RoomLoop`, the one ``kvfsm run`` and ``kvfsm demo``
run: the same admission, wedge timeout, settle grace and life of a room. A prefill room takes
the loop's sender steps (``advance_sender``); a decode room takes the receiver steps of
:mod:`kvfsm.workload.receiver_steps`, as the demo's decode rank's do, and the campaign's faults
come in through their hooks. The rank adds the loop's two chaos hooks: every call on a room goes
through ``call`` (timed), and the loop counts the time this process spent stopped
(``stop_gap_s``). What the campaign process asks of a rank over its pipe, and what the rank
counts and reports, is :mod:`kvfsm.chaos._rank_service`.

What a rank checks itself, because only it can:

* **bounded time**: every room must be terminal within its role's deadline sum plus slack; the
  time this process spent stopped (SIGSTOP, seen by the loop as a gap of over
  ``_FROZEN_GAP_S`` between two iterations) is added to that bound and to the settle timeout,
  since no timer of a stopped process can fire. Only this process's own stops count: a room
  whose *peer* is stopped must not wait for it (law 3). A room past that is *wedged* (and
  aborted).
* **never block**: every scheduler-facing call (``poll``, ``init``, ``send``, ``send_metadata``,
  ``abort``, ``clear``, and creating the room) is timed; calls over ``slow_call_ms`` are counted.
  A call's time is its wall time less the time this thread waited on a run queue while other
  processes held every CPU (:mod:`kvfsm.workload.call_timer`): the machine's load is not a
  block, a lock or a round trip is. A call that the campaign's SIGSTOP of this process fell
  inside (a SIGCONT came during it) is counted apart (``calls_stopped``), not as slow: its
  wall time is the stop's.
  An oversized ``send_metadata`` is timed on its own: the facade packs (copies) the caller's
  page list before refusing it, so its bound is ``slow_call_ms`` plus 1 ms per MB.
* **no late writes** (decode): a settled room's pages are filled with a canary, and checked before
  they are handed out again and at every drain (:class:`~kvfsm.workload.buffers.DecodeChecks`,
  the demo's decode rank's check too). A changed byte is a write that landed after its pages
  were declared free. Pages are handed out oldest-freed first, so a canary stays in place
  as long as the pool allows (through a freeze of prefill past decode's settle bound). The
  pages of a room that lived through a stop of decode itself are not handed out at all for
  ``after_resume_s`` after they were freed, and are checked again then: a WRITE that prefill
  posted before the stop may still be in sockets and UCX's buffers when decode wakes and
  frees the room, and land moments later; in a page already handed out again it would land
  in a live room (caught there only if that room succeeds).
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
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.chaos._control_proxy import ProxyThread
from kvfsm.chaos._options import OVERSIZED_PAGES, CampaignOptions, RoomPlan
from kvfsm.chaos._plan import FaultPlan
from kvfsm.chaos._rank_service import RankService
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.control import registry_resolver
from kvfsm.manager import DecodeManager, PrefillManager
from kvfsm.registry import BootstrapClient
from kvfsm.rooms import ReceiverRoom
from kvfsm.states import TERMINAL, KVPoll, Role
from kvfsm.workload.buffers import DecodeChecks, make_buffers, make_layout, shape_of
from kvfsm.workload.loop import Phase
from kvfsm.workload.receiver_steps import ReceiverSteps, ReceivingRoom, Step

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
Pages = npt.NDArray[np.int32]


def source_rows(seed: int, buffer: int, rows: npt.NDArray[np.int64], width: int) -> Any:
    """Prefill's bytes for ``rows`` of one buffer: a pure function of (seed, buffer, row)."""
    with np.errstate(over="ignore"):
        base = np.uint32((seed * 2654435761 + buffer * 40503) & 0xFFFFFFFF)
        row = rows.astype(np.uint32)[:, None] * np.uint32(2246822519)
        word = np.arange(width // 4, dtype=np.uint32)[None, :] * np.uint32(3266489917)
        return (row ^ word ^ base).view(np.uint8)


def max_pages_refusal_problem(receiver: ReceiverRoom, count: int) -> str | None:
    """What is wrong with ``receiver`` right after a ``send_metadata`` of ``count`` pages, more
    than ``max_pages``: the facade must refuse it in the caller's thread, so the room reads
    Failed when the call returns. Its reason is the refusal's, unless the room had failed by
    itself meanwhile (a lost link published on the loop thread between the caller's last poll
    and the call, or just after it): the published reason wins over the caller's local one,
    and nothing was sent either way. None if nothing is wrong."""
    status = receiver.poll()
    if status is not KVPoll.Failed:
        return f"{count} pages: {status.name} after the call ({receiver.reason!r})"
    return None


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

    def __len__(self) -> int:
        return len(self.free)

    def take(self, n: int, rng: np.random.Generator) -> Pages | None:
        if len(self.free) < n:
            return None
        picked = np.fromiter((self.free.popleft() for _ in range(n)), np.int32, n)
        rng.shuffle(picked)  # page lists are not sorted in the wild
        return picked

    def give(self, indices: Pages) -> None:
        self.free.extend(int(i) for i in indices)


@dataclass(slots=True, frozen=True)
class _Held:
    """A freed room's pages and aux row, kept watched (out of the pools) until ``until``."""

    until: float
    room: int
    pages: Pages
    aux: int


@dataclass(slots=True, kw_only=True)
class _Live(ReceivingRoom):
    plan: RoomPlan
    #: 0: the room's first generation; 1: the next room of the same id (``plan.reuse``).
    gen: int = 0
    #: Prefill: the plan's source pages, cut into its chunks.
    chunks: list[Pages] = field(default_factory=list)
    #: An oversized send_metadata: when it was called, and what was wrong with its outcome.
    oversized_at: float = 0.0
    oversized_problem: str = ""
    oversized_slot: int = -1

    @property
    def abort_side(self) -> str:
        # The next generation of a reused id runs without a planned abort.
        return self.plan.abort_side if self.gen == 0 else ""


class _Rank(RankService[_Live], ReceiverSteps[RoomPlan, _Live]):
    """A campaign rank of either role: the served room loop and its hooks. Prefill's part of a
    room is the loop's ``advance_sender``; decode's is the receiver steps, whose hooks here add
    the campaign's faults: an abort before the page list goes out, oversized page lists, the
    next room of a reused id, and pages held back after a stop of this process."""

    #: Only this process's own stops stretch its bounds (see the module's docstring).
    stop_gap_s = _FROZEN_GAP_S

    def __init__(self, conn: Connection, role: str, opts: CampaignOptions, url: str) -> None:
        super().__init__(conn, role, opts)
        self.url = url
        self.kv, self.aux = make_buffers(shape_of(opts, page_bytes=opts.page_bytes))
        self.layout = make_layout(self.kv, self.aux)
        self.broken = False
        # The loop's bounds: a room must be terminal within its role's deadline sum plus slack,
        # and settle within the settle wait (both plus this process's stops).
        side = Role.SENDER if role == "prefill" else Role.RECEIVER
        self.room_timeout_s = opts.bound_s(side) + opts.slack_s
        self.settle_grace_s = opts.settle_wait_s()
        self.idle_sleep_s = opts.idle_sleep_s
        self.window = opts.concurrency * (2 if role == "prefill" else 1)

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
            self.decode_pages(seed_salt)

    def decode_pages(self, seed_salt: int) -> None:
        """Decode's page and aux pools and their checks (no NIXL: a test can drive them)."""
        opts = self.opts
        want_kv = [
            source_rows(opts.seed, b, np.arange(opts.num_pages), opts.page_bytes)
            for b in range(len(self.kv))
        ]
        want_aux = source_rows(opts.seed, -1, np.arange(opts.aux_rows), opts.aux_row_bytes)
        self.checks = DecodeChecks(self.kv, self.aux, want_kv, want_aux, marker=_CANARY)
        self.pages = _Pool(opts.num_pages)
        self.aux_pool = _Pool(opts.aux_rows)
        self.rng = np.random.default_rng(opts.seed + seed_salt)
        # Oversized page lists over the frame limit pass the facade, so the engine holds
        # them as destinations until the room settles: indices past the pool, in slots
        # that never overlap while one is held (a room that never settles keeps its slot).
        self.oversized_held: set[int] = set()
        #: Freed pages of rooms that lived through a stop of this process, oldest first:
        #: watched, out of the pools, until ``after_resume_s`` after they were freed.
        self.held: deque[_Held] = deque()

    # -- the loop's hooks ----------------------------------------------------------------------

    def clock(self) -> float:
        # Outcomes carry the loop's times, which the campaign compares with the moments it
        # killed, stopped or cut off the peer: every process of one kernel shares monotonic.
        return time.monotonic()

    def starved(self, rest: Sequence[RoomPlan]) -> None:
        # Unsettled rooms hold every free page: report the rest rather than spin.
        for plan in rest:
            self.outcomes.append(_outcome(plan.room, int(KVPoll.Failed), "starved"))

    def start(self, plan: RoomPlan) -> _Live | None:
        return self._start(plan)

    def advance(self, item: _Live, status: KVPoll) -> bool:
        plan = item.plan
        if self.role == "prefill":
            abort_at = plan.abort_at if item.abort_side == "prefill" else None
            return self.advance_sender(item, status, item.chunks, plan.src_aux, abort_at)
        if (
            item.receiver_step is Step.BOOTSTRAPPING
            and status is KVPoll.WaitingForInput
            and item.abort_side == "decode"
            and plan.abort_at == -1
        ):
            # The plan's abort before the page list goes out, in place of sending it: the room
            # stays in its step until it reads Failed.
            self.call("abort", item.room.abort, CAMPAIGN_ABORT)
            return True
        return self.advance_receiver(item, status)

    def abort_planned(self, item: _Live) -> None:
        self.call("abort", item.room.abort, CAMPAIGN_ABORT)
        if self.role == "decode" and item.plan.reuse and item.gen == 0:
            # At once, before the aborted generation settled: the next receiver of the id,
            # on fresh pages (the aborted room's stay held until it settles).
            self._next_generation(item)

    def ended(self, item: _Live, status: KVPoll) -> None:
        self._check_oversized(item)
        if self.role == "decode":
            self.receiver_ended(item, status)  # the byte check of a Success, then the clear
            return
        self.call("clear", item.room.clear)
        if item.plan.reuse and item.gen == 0:
            # Decode reuses the id after aborting it: serve its next receiver, whatever the
            # first sender became (it may have finished before decode's abort came, or
            # served the next receiver itself when the first one's claim was withdrawn
            # before it existed; then this one waits out its Bootstrapping deadline).
            self._next_generation(item)

    def wedging(self, item: _Live, status: KVPoll) -> None:
        if self.role == "decode":
            self.receiver_wedged(item)

    def retire(self, item: _Live, *, settled: bool, now: float) -> None:
        if self.role == "decode":
            self.receiver_retired(item, settled=settled)  # its pages back, once settled
        self._finish(item, settled=settled)

    def _start(self, plan: RoomPlan, gen: int = 0) -> _Live | None:
        if self.role == "prefill":
            assert isinstance(self.manager, PrefillManager)
            sender = self.call("create", self.manager.sender, plan.room)
            chunks = np.split(np.asarray(plan.src, np.int32), plan.cuts)
            item = _Live(room=sender, started=self.now, plan=plan, gen=gen, chunks=chunks)
            if item.abort_side == "prefill" and plan.abort_at == -1:
                self.call("abort", sender.abort, CAMPAIGN_ABORT)
            return item
        received = self.start_receiver(plan)
        if received is not None:
            received.gen = gen
        return received

    def _next_generation(self, item: _Live) -> None:
        """The id's next room on this side (``plan.reuse``): right away, while the first one
        may still be settling."""
        nxt = self._start(item.plan, gen=1)
        if nxt is None:  # decode: no free pages; the reuse is skipped, and counted
            self.events["reuse_skipped"] += 1
            return
        self.events[f"reuse_{self.role}"] += 1
        self.spawn(nxt)

    # -- decode: the receiver steps' hooks -----------------------------------------------------

    def pages_for(self, plan: RoomPlan) -> tuple[Pages, int] | None:
        # An oversized room names pages past the pool (see _send_oversized), none of it.
        taken = self.take_pages(0 if plan.oversized else len(plan.src))
        if taken is None:
            return None
        dst, aux = taken
        assert self.checks is not None
        self.checks.check(dst, aux, hand_out=True)
        return dst, int(aux[0])

    def take_pages(self, n: int) -> tuple[Pages, Pages] | None:
        """``n`` free pages and one aux row for a new decode room; None: not now."""
        if self.held and not self.live and (len(self.pages) < n or not len(self.aux_pool)):
            # Nothing live frees anything: the loop would call the rest of the plan starved.
            # Held pages are free, only watched for a while: check them now and give them back.
            self._release_held(math.inf)
            self.holds["released_early"] += 1
        dst = self.pages.take(n, self.rng)
        if dst is None:
            return None
        aux = self.aux_pool.take(1, self.rng)
        if aux is None:
            self.pages.give(dst)
            return None
        return dst, aux

    def new_receiver(self, plan: RoomPlan) -> ReceiverRoom:
        assert isinstance(self.manager, DecodeManager)
        return self.manager.receiver(plan.room)

    def receiving_item(self, plan: RoomPlan, receiver: ReceiverRoom, dst: Pages, aux: int) -> _Live:
        return _Live(room=receiver, started=self.now, plan=plan, dst=dst, dst_aux=aux)

    def abort_due(self, item: _Live) -> bool:
        return item.abort_side == "decode" and item.plan.abort_at == item.step

    def send_pages(self, item: _Live) -> None:
        if item.plan.oversized and item.gen == 0:
            self._send_oversized(item)
            return
        assert item.dst is not None
        for buf in self.kv:  # a page that is never written cannot pass the check
            buf[item.dst] = _POISON
        self.aux[item.dst_aux] = _POISON
        super().send_pages(item)

    def check_bytes(self, item: _Live) -> None:
        assert self.checks is not None
        self.checks.landed(item, item.plan)

    # -- decode: oversized page lists ----------------------------------------------------------

    def _send_oversized(self, item: _Live) -> None:
        receiver = item.room
        assert isinstance(receiver, ReceiverRoom)
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
        item.oversized_at = self.now
        # The facade packs the caller's list (a copy of 4 bytes per page) before it can look at
        # its length: that copy is the call's cost, not a wait on anything.
        limit = self.opts.slow_call_ms + pages.nbytes / 1e6
        self._timed_within(
            "send_metadata_oversized", limit, receiver.send_metadata, pages, item.dst_aux
        )
        if kind == "max_pages":
            problem = max_pages_refusal_problem(receiver, count)
            if problem is not None:
                item.oversized_problem = problem
            elif "max_pages" not in receiver.reason:
                item.oversized_at = 0.0  # it failed by itself meanwhile: no timing to check

    def _check_oversized(self, item: _Live) -> None:
        """An oversized room must have failed, a frame-sized one within a second (frozen
        time aside): nothing it asked for could be sent."""
        if not item.plan.oversized or item.gen or item.oversized_problem:
            return
        if item.status != KVPoll.Failed:
            item.oversized_problem = f"ended {KVPoll(item.status).name}"
        elif not item.oversized_at:
            return  # failed before its call (a lost link): nothing to check
        elif item.ended - item.oversized_at - item.stopped_s > 1.0:
            item.oversized_problem = (
                f"failed {item.ended - item.oversized_at:.2f}s after the call: {item.reason!r}"
            )

    # -- decode: bytes, canaries ---------------------------------------------------------------

    def release_pages(self, item: _Live) -> None:
        """The room is settled: its pages go back to the pool, holding a canary; those of a
        room that lived through a stop of this process only after ``after_resume_s``."""
        assert self.checks is not None
        self.checks.settled(item, item.plan)
        assert item.dst is not None
        if self.stopped_since(item) > 0:
            self.held.append(
                _Held(self.now + self.opts.after_resume_s, item.plan.room, item.dst, item.dst_aux)
            )
            self.holds["rooms"] += 1
            self.holds["pages"] += int(item.dst.size)
        else:
            self.pages.give(item.dst)
            self.aux_pool.give(np.asarray([item.dst_aux], np.int32))
        self.oversized_held.discard(item.oversized_slot)
        if self.opts.break_invariant == "canary" and not self.broken and item.dst.size:
            # A deliberate late write, to prove the check is not vacuous.
            self.kv[0][item.dst[0], 0] ^= 0xFF
            self.broken = True

    def _release_held(self, now: float) -> None:
        """Check the held pages due by ``now`` for late writes, then give them to the pools
        (still watched until handed out, where they are checked once more)."""
        checks = self.checks
        assert checks is not None
        while self.held and self.held[0].until <= now:
            held = self.held.popleft()
            before = checks.late_writes
            checks.check(held.pages, [held.aux], hand_out=False)
            self.holds["late_writes"] += checks.late_writes - before
            self.pages.give(held.pages)
            self.aux_pool.give(np.asarray([held.aux], np.int32))

    def iterated(self) -> None:
        if self.role == "decode" and self.held:
            self._release_held(self.now)

    def _waiting(self, before: float) -> list[dict[str, Any]]:
        """Rooms created before ``before`` (monotonic) that are still not terminal, polled now
        (the loop may not have stepped a room that just ended)."""
        out = []
        for item in self.live:
            if item.phase >= Phase.SETTLING or item.started >= before:
                continue
            status = self.call("poll", item.room.poll)
            if status in TERMINAL:
                continue
            out.append(
                {
                    "room": item.plan.room,
                    "gen": item.gen,
                    "state": status.name,
                    "phase": item.phase.name,
                    "age_s": round(time.monotonic() - item.started, 3),
                    "frozen_s": round(self.stopped_since(item), 3),
                }
            )
        return out

    def _finish(self, item: _Live, *, settled: bool) -> None:
        disordered = False
        if self.role == "decode" and self.proxy is not None:
            # Settled or not: a dropped abort or page list towards prefill leaves prefill with
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
                elapsed_s=item.ended - item.started - item.stopped_s,
                started_at=item.started,
                bound_at=item.bound_at,
                ended_at=item.ended,
                frozen_s=item.stopped_s,
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

    def _written_off(self) -> dict[str, int]:
        # Not free, not held by a room still watched, not held back after a stop of this
        # process (free, only watched a while longer): a room that never settled.
        held = sum(i.dst.size for i in self.live if i.dst is not None)
        held += sum(h.pages.size for h in self.held)
        live_slots = {i.oversized_slot for i in self.live}
        return {
            "written_off_pages": self.pages.size - len(self.pages) - held,
            "written_off_aux": (
                self.aux_pool.size - len(self.aux_pool) - len(self.live) - len(self.held)
            ),
            # Oversized page lists of rooms that never settled: 4 M destinations each, held by
            # the engine for its life (34 MB of owner table per slot).
            "written_off_oversized": len(self.oversized_held - live_slots),
        }


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
    # Counted so that a call the campaign's SIGSTOP fell inside is not judged a block
    # (RankService._timed_within); restartable, so that no system call fails for it.
    signal.signal(signal.SIGCONT, rank.continued_by_sigcont)
    signal.siginterrupt(signal.SIGCONT, False)
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
