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
  since no timer of a stopped process can fire. A room past that is *wedged* (and aborted).
* **never block**: every scheduler-facing call (``poll``, ``init``, ``send``, ``send_metadata``,
  ``abort``, ``clear``, and creating the room) is timed; calls over ``slow_call_ms`` are counted.
* **no late writes** (decode): a settled room's pages are filled with a canary, and checked before
  they are handed out again and at every drain. A changed byte is a write that landed after its
  pages were declared free.
* **settled** (both): a terminal room must settle before its own settle timeout; decode rooms of
  a lost link settle ``peer_lost_grace_s`` after the loss. A decode room whose frames the fault
  proxy dropped or reordered (TCP never does) is reported as such: its acknowledgement may have
  been the frame lost.
* **the bytes** (decode): a Success room's pages and aux row must equal prefill's sources, which
  both ranks compute from the seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.bootstrap._discovery import registry_resolver
from kvfsm.bootstrap._registry import BootstrapClient
from kvfsm.chaos._control_proxy import ProxyThread
from kvfsm.chaos._options import CampaignOptions, RoomPlan, episode_plan
from kvfsm.chaos._plan import FaultPlan
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.manager import DecodeManager, PrefillManager
from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.states import TERMINAL, KVPoll, Role
from kvfsm.transport._peer import Shape, compare_room, make_buffers, make_layout

__all__ = ["ABORT_REASON", "ENGINE", "rank_main"]

_log = logging.getLogger("kvfsm.chaos")
ENGINE: Final = "chaos"
ABORT_REASON: Final = "chaos campaign abort"
_CANARY: Final = 0x5A
_POISON: Final = 0xA5
#: A gap this long between two loop iterations means the process was stopped (or starved).
_FROZEN_GAP_S: Final = 0.25
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


@dataclass(slots=True)
class _Live:
    plan: RoomPlan
    room: SenderRoom | ReceiverRoom
    started: float
    frozen_at_start: float
    phase: int = 0  # 0 bootstrap, 1 sending / metadata sent, 2 finishing, 3 settling
    step: int = 0
    status: int = 0
    reason: str = ""
    ended: float = 0.0
    wedged: bool = False
    mismatched: int = 0
    checked: int = 0
    dst: Pages | None = None
    dst_aux: int = -1


class _Rank:
    def __init__(self, conn: Connection, role: str, opts: CampaignOptions, url: str) -> None:
        self.conn, self.role, self.opts, self.url = conn, role, opts, url
        self.parent = os.getppid()
        self.kv, self.aux = make_buffers(shape_of(opts))
        self.layout = make_layout(self.kv, self.aux)
        self.outcomes: list[dict[str, Any]] = []
        self.live: list[_Live] = []
        self.pending: list[RoomPlan] = []
        self.frozen = 0.0
        self.slow: Counter[str] = Counter()
        self.max_call_ms: dict[str, float] = {}
        self.calls = 0
        self.late_writes = 0
        self.late_notes: list[str] = []
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
        config = opts.manager_config(secret, host)
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
            self.free_pages = np.ones(opts.num_pages, bool)
            self.free_aux = np.ones(opts.aux_rows, bool)
            self.canary_pages = np.zeros(opts.num_pages, bool)
            self.canary_aux = np.zeros(opts.aux_rows, bool)
            self.owner = np.full(opts.num_pages, -1, np.int64)
            self.rng = np.random.default_rng(opts.seed + seed_salt)

    # -- the pipe ------------------------------------------------------------------------------

    def serve(self) -> None:
        last = time.perf_counter()
        while not self.quit:
            now = time.perf_counter()
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
            self.conn.send(
                {
                    "done": not (self.live or self.pending),
                    "outcomes": outcomes,
                    "counters": self._counters(),
                }
            )
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
        t0 = time.perf_counter()
        result = call(*args)
        ms = (time.perf_counter() - t0) * 1e3
        self.calls += 1
        if ms > self.max_call_ms.get(name, 0.0):
            self.max_call_ms[name] = ms
        if ms > self.opts.slow_call_ms:
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
        self.live = [item for item in self.live if item.phase < 4]
        if blocked and not self.live:
            # Unsettled rooms hold every free page: report the rest rather than spin.
            for plan in self.pending:
                self.outcomes.append(_outcome(plan.room, int(KVPoll.Failed), "starved"))
            self.pending = []
        return progressed

    def _step(self, item: _Live, now: float) -> bool:
        room = item.room
        if item.phase == 3:
            grace_over = now - item.ended > self.settle_wait + self.frozen_since(item)
            if room.settled or grace_over:
                self._finish(item, settled=room.settled)
                item.phase = 4
                return True
            return False
        status = self._timed("poll", room.poll)
        if status in TERMINAL:
            item.status, item.reason, item.ended = int(status), room.reason, now
            if status is KVPoll.Success:
                self._landed(item)
            self._timed("clear", room.clear)
            item.phase = 3
            return True
        allowed = self.bound + self.opts.slack_s + self.frozen_since(item)
        if now - item.started > allowed:
            self._timed("abort", room.abort, "wedged")
            item.status, item.reason, item.ended = int(KVPoll.Failed), "wedged", now
            item.wedged = True
            item.phase = 3
            return True
        if self.role == "prefill":
            return self._advance_sender(item, status)
        return self._advance_receiver(item, status)

    def frozen_since(self, item: _Live) -> float:
        return self.frozen - item.frozen_at_start

    def _start(self, plan: RoomPlan, now: float) -> _Live | None:
        if self.role == "prefill":
            assert isinstance(self.manager, PrefillManager)
            sender = self._timed("create", self.manager.sender, plan.room)
            item = _Live(plan, sender, now, self.frozen)
            if plan.abort_side == "prefill" and plan.abort_at == -1:
                self._timed("abort", sender.abort, ABORT_REASON)
            return item
        dst = self._pick(self.free_pages, len(plan.src))
        aux = self._pick(self.free_aux, 1)
        if dst is None or aux is None:
            return None
        self._check_canary(dst, int(aux[0]), clear=True)
        self.free_pages[dst] = False
        self.free_aux[aux] = False
        assert isinstance(self.manager, DecodeManager)
        receiver = self._timed("create", self.manager.receiver, plan.room)
        self._timed("init", receiver.init, 0)
        return _Live(plan, receiver, now, self.frozen, dst=dst, dst_aux=int(aux[0]))

    def _advance_sender(self, item: _Live, status: KVPoll) -> bool:
        sender, plan = item.room, item.plan
        assert isinstance(sender, SenderRoom)
        mine = plan.abort_side == "prefill"
        if item.phase == 0 and status is KVPoll.WaitingForInput:
            if mine and plan.abort_at == 0:
                self._timed("abort", sender.abort, ABORT_REASON)
            else:
                self._timed("init", sender.init, len(plan.src), plan.src_aux)
                item.phase = 1
            return True
        if item.phase == 1:
            bounds = (0, *plan.cuts, len(plan.src))
            chunk = np.asarray(plan.src[bounds[item.step] : bounds[item.step + 1]], np.int32)
            self._timed("send", sender.send, chunk)
            item.step += 1
            if item.step == plan.chunks:
                item.phase = 2
            if mine and plan.abort_at == item.step:
                # Right after a chunk was handed over: it is in flight (the seed race when it
                # is not the last one).
                self._timed("abort", sender.abort, ABORT_REASON)
                item.phase = 2
            return True
        return False

    def _advance_receiver(self, item: _Live, status: KVPoll) -> bool:
        receiver, plan = item.room, item.plan
        assert isinstance(receiver, ReceiverRoom)
        assert item.dst is not None
        mine = plan.abort_side == "decode"
        if item.phase == 0 and status is KVPoll.WaitingForInput:
            if mine and plan.abort_at == -1:
                self._timed("abort", receiver.abort, ABORT_REASON)
                return True
            for buf in self.kv:  # a page that is never written cannot pass the check
                buf[item.dst] = _POISON
            self.aux[item.dst_aux] = _POISON
            self._timed("send_metadata", receiver.send_metadata, item.dst, item.dst_aux)
            item.phase = 1
            if mine and plan.abort_at == 0:
                self._timed("abort", receiver.abort, ABORT_REASON)
            return True
        if item.phase == 1:
            item.step += 1
            if mine and plan.abort_at == item.step:
                self._timed("abort", receiver.abort, ABORT_REASON)
        return False

    def _pick(self, free: npt.NDArray[np.bool_], n: int) -> Pages | None:
        candidates = np.flatnonzero(free)
        if candidates.size < n:
            return None
        start = int(self.rng.integers(candidates.size)) if candidates.size else 0
        picked = np.roll(candidates, -start)[:n].astype(np.int32)
        self.rng.shuffle(picked)
        return picked

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
        self.free_pages[item.dst] = True
        self.free_aux[item.dst_aux] = True
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
                elapsed_s=item.ended - item.started - self.frozen_since(item),
                wedged=item.wedged,
                settled=settled,
                mismatched=item.mismatched,
                checked=item.checked,
                aborted=bool(item.plan.abort_side),
                disordered=disordered,
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
            out["written_off_pages"] = int(
                self.opts.num_pages - np.count_nonzero(self.free_pages)
            ) - sum(len(i.plan.src) for i in self.live)
            out["written_off_aux"] = int(self.opts.aux_rows - np.count_nonzero(self.free_aux)) - (
                len(self.live)
            )
        return out

    def _counters(self) -> dict[str, Any]:
        """What was counted since the last call: calls (total and slow, by name), late writes
        and their notes, injected transfer faults, the frame proxy's counters."""
        now: Counter[str] = Counter({"calls": self.calls, "late_writes": self.late_writes})
        now.update({f"slow.{name}": n for name, n in self.slow.items()})
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
