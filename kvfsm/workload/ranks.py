"""The demo's two ranks, each in its own OS process: a manager and a scheduler-shaped loop.

* **prefill** runs a :class:`~kvfsm.manager.PrefillManager` (its own NIXL agent, loop thread and
  control channel; it registers in the registry) and a loop over sender rooms: ``sender(room)``,
  poll until WaitingForInput, ``init(num_pages, aux)``, one ``send(chunk)`` per iteration, poll
  until terminal, ``clear()``, wait until settled;
* **decode** runs a :class:`~kvfsm.manager.DecodeManager` (it finds prefill through the registry
  and connects its control channel) and the same loop over receiver rooms, stepped as
  :mod:`kvfsm.workload.receiver_steps` says: take destination pages and an aux row from its free
  pools, ``receiver(room)``, ``init(0)``, poll until WaitingForInput, ``send_metadata(pages,
  aux)``, poll until terminal, check every received byte and the aux row, ``clear()``, and give
  the pages back only once the room is terminal *and* settled.

Each rank walks the plan (:func:`~kvfsm.workload.plan.make_plan`) in order, ``concurrency`` rooms
in flight (prefill admits twice as many, like a bootstrap queue, so that its room exists when
decode's metadata or abort arrives), and reports each room's :class:`Outcome` back over its pipe
when asked (``("results",)``). Decode keeps every free page and aux row poisoned and checks the
poison when it hands one out and when asked (``("late",)``): a missing write cannot pass a room's
byte check, and a write that lands after its room settled is counted as a late write (law 4).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.rooms import ReceiverRoom
from kvfsm.states import KVPoll
from kvfsm.workload.buffers import DecodeChecks, make_buffers, make_layout
from kvfsm.workload.loop import ServedLoop
from kvfsm.workload.options import ABORT_REASON, DemoOptions
from kvfsm.workload.plan import Request, fill_sources, make_plan
from kvfsm.workload.receiver_steps import ReceiverSteps, ReceivingRoom

__all__ = ["STARVED", "Outcome", "rank_main"]

Pages = npt.NDArray[np.int32]
_ENGINE: Final = "demo"
#: The reason given to requests decode could not start: unsettled rooms hold every free page.
STARVED: Final = "not started: unsettled rooms hold the free pages"
#: What decode's free pages and aux rows hold (see ``_DecodeRank``).
_POISON: Final = 0xA5


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


@dataclass(slots=True, kw_only=True)
class _Live(ReceivingRoom):
    req: Request
    chunks: list[Pages] = field(default_factory=list)
    ended_at: float = 0.0


class _Rank(ServedLoop[Request, _Live]):
    """The pipe and the loop both ranks share; the role-specific parts are the hooks."""

    manager: PrefillManager | DecodeManager

    def __init__(self, conn: Connection, opts: DemoOptions, seed: int) -> None:
        super().__init__(conn)
        self.opts = opts
        self.seed = seed
        self.room_timeout_s = opts.room_timeout_s
        self.settle_grace_s = opts.settle_grace_s
        self.idle_sleep_s = opts.idle_sleep_s
        self.reports: list[Outcome] = []
        self.acked = False

    def serve(self) -> None:
        """Answer requests until ``run``, run the plan (still answering), then until ``quit``."""
        while not self.stopping():
            if not self.conn.poll(0.05):
                if os.getppid() != self.parent:
                    return
                continue
            request: Any = self.conn.recv()
            if request[0] == "run":  # answered once the first rooms exist
                first_room = int(request[1]) if len(request) > 1 else 0
                self.run(make_plan(self.opts, self.seed, first_room))
            else:
                self.answer(request)

    def answer(self, request: Any) -> None:
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
        self.acked = False
        self.run_plan(plan)
        if not self.acked:  # an empty plan
            self.conn.send(True)

    # -- the loop's hooks shared by both roles -------------------------------------------------

    def admitted(self) -> None:
        if not self.acked:
            self.conn.send(True)
            self.acked = True

    def starved(self, rest: Sequence[Request]) -> None:
        # Report the rest as not started rather than spin.
        for req in rest:
            self.reports.append(Outcome(req.room, int(KVPoll.Failed), STARVED, 0.0))

    def ended(self, item: _Live, status: KVPoll) -> None:
        item.ended_at = time.time()
        self._terminal(item, status)

    def wedging(self, item: _Live, status: KVPoll) -> None:
        item.ended_at = time.time()
        self._wedged(item)

    def retire(self, item: _Live, *, settled: bool, now: float) -> None:
        self._retired(item, settled=settled)
        self.reports.append(
            Outcome(
                item.req.room,
                item.status,
                item.reason,
                (item.ended - item.started) * 1e3,
                item.wedged,
                not settled,
                item.checked,
                item.mismatched,
                item.ended_at,
            )
        )

    # -- what each role does when a room ends, wedges and retires ------------------------------

    def _terminal(self, item: _Live, status: KVPoll) -> None:
        self.call("clear", item.room.clear)

    def _wedged(self, item: _Live) -> None:
        pass

    def _retired(self, item: _Live, *, settled: bool) -> None:
        pass


class _PrefillRank(_Rank):
    manager: PrefillManager

    def __init__(
        self, conn: Connection, opts: DemoOptions, seed: int, manager: PrefillManager
    ) -> None:
        super().__init__(conn, opts, seed)
        self.manager = manager
        self.window = 2 * opts.concurrency  # a bootstrap queue ahead of decode's window

    def start(self, plan: Request) -> _Live:
        sender = self.manager.sender(plan.room)
        item = _Live(room=sender, started=self.clock(), req=plan, chunks=plan.chunks())
        if plan.abort_side == "prefill" and plan.abort_at == -1:
            sender.abort(ABORT_REASON)
        return item

    def advance(self, item: _Live, status: KVPoll) -> bool:
        req = item.req
        abort_at = req.abort_at if req.abort_side == "prefill" else None
        return self.advance_sender(item, status, item.chunks, req.src_aux, abort_at)

    def abort_planned(self, item: _Live) -> None:
        item.room.abort(ABORT_REASON)


class _DecodeRank(_Rank, ReceiverSteps[Request, _Live]):
    """Decode's rooms follow the shared receiver steps; the hooks are this rank's pools of
    poisoned pages, its byte checks and the plan's aborts."""

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
        # What prefill's sources hold, computed once: checking a room is a gather and a compare.
        want_kv, want_aux = make_buffers(opts.shape())
        fill_sources(opts, seed, want_kv, want_aux)
        self.checks = DecodeChecks(kv, aux, want_kv, want_aux, marker=_POISON)
        self.window = opts.concurrency
        self.free_pages = np.ones(opts.num_pages, dtype=bool)
        self.free_aux = np.ones(opts.aux_rows, dtype=bool)
        self.rng = np.random.default_rng(seed + 1)
        # Every free page and aux row holds the poison, checked when it is handed out and on
        # request ("late"): a byte changed while free landed after its room settled (law 4).
        # A page never written cannot pass a room's byte check either.
        self.checks.watch(np.arange(opts.num_pages), np.arange(opts.aux_rows))

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

    def answer(self, request: Any) -> None:
        if request[0] == "late":  # every free page and aux row checked now
            checks = self.checks
            checks.check_all()
            self.conn.send({"late_writes": checks.late_writes, "notes": list(checks.late_notes)})
        else:
            super().answer(request)

    # -- the loop's hooks: the receiver steps ------------------------------------------------

    def start(self, plan: Request) -> _Live | None:
        return self.start_receiver(plan)

    def advance(self, item: _Live, status: KVPoll) -> bool:
        return self.advance_receiver(item, status)

    def _terminal(self, item: _Live, status: KVPoll) -> None:
        self.receiver_ended(item, status)

    def _wedged(self, item: _Live) -> None:
        self.receiver_wedged(item)

    def _retired(self, item: _Live, *, settled: bool) -> None:
        self.receiver_retired(item, settled=settled)

    # -- the receiver steps' hooks -------------------------------------------------------------

    def pages_for(self, plan: Request) -> tuple[Pages, int] | None:
        dst = self._pick(self.free_pages, len(plan.src))
        aux = self._pick(self.free_aux, 1)
        if dst is None or aux is None:
            return None  # wait until a live room settles and gives its pages back
        self.checks.check(dst, aux, hand_out=True)
        self.free_pages[dst] = False
        self.free_aux[aux] = False
        return dst, int(aux[0])

    def new_receiver(self, plan: Request) -> ReceiverRoom:
        return self.manager.receiver(plan.room)

    def receiving_item(self, plan: Request, receiver: ReceiverRoom, dst: Pages, aux: int) -> _Live:
        return _Live(room=receiver, started=self.clock(), req=plan, dst=dst, dst_aux=aux)

    def abort_due(self, item: _Live) -> bool:
        # 0: right after the page list went out; k: k iterations later.
        return item.req.abort_side == "decode" and item.req.abort_at == item.step

    def abort_planned(self, item: _Live) -> None:
        self.call("abort", item.room.abort, ABORT_REASON)

    def check_bytes(self, item: _Live) -> None:
        self.checks.landed(item, item.req)

    def release_pages(self, item: _Live) -> None:
        """The room settled: poison its pages and aux row, watch them and give them back."""
        self.checks.settled(item, item.req)
        assert item.dst is not None
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


def rank_main(  # noqa: PLR0917 (ChildProcess passes its arguments positionally)
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
