"""A campaign rank as the campaign process sees it: the requests it answers over its pipe, the
calls on rooms it times, and what it counts and reports.

The campaign process drives a rank (:mod:`kvfsm.chaos._rank`, which adds the rooms) over a
pipe: ``("episode", index, first_room)`` starts that episode's rooms (from
:func:`~kvfsm.chaos._options.episode_plan`, the same list on both ranks), ``("poll",)`` returns
the outcomes since the last poll and whether the episode is over, ``("exposed", wait)`` what a
stop of decode would catch (prefill: its chunks in flight, answered as soon as there are some,
or after ``wait`` seconds; decode: its rooms whose page list is out and that are not terminal,
at once; the campaign freezes decode while there are both), ``("waiting", before)`` the rooms
created before ``before`` that are still not terminal (the campaign asks it some seconds after a
decode freeze ended), ``("drain", timeout)`` waits until the engine has no room left and
returns what is still held, ``("close",)`` closes the manager and returns the NIXL accounting,
``("quit",)`` ends it. Every answer to poll, drain and close carries ``counters``: what was
counted since the previous answer (calls, slow calls, late writes, injected faults), so the
campaign adds them up without counting anything twice and loses at most one poll's worth when
the rank is killed.

Every call on a room goes through :meth:`RankService.call`, timed on its own time
(:mod:`kvfsm.workload.call_timer`): a call over ``slow_call_ms`` is counted as slow.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Final, TypeVar

from kvfsm.chaos._control_proxy import ProxyThread
from kvfsm.chaos._options import CampaignOptions, RoomPlan, episode_plan
from kvfsm.chaos._transport_faults import TransportFaults
from kvfsm.manager import DecodeManager, PrefillManager
from kvfsm.registry import BootstrapClient
from kvfsm.workload.buffers import DecodeChecks
from kvfsm.workload.call_timer import CallTimer
from kvfsm.workload.loop import LiveRoom, Phase, ServedLoop

__all__ = ["RankService"]

T = TypeVar("T")
LiveT = TypeVar("LiveT", bound=LiveRoom)
#: Transport counters each prefill answer carries (as deltas).
_XFER_COUNTERS: Final = ("chunks_fenced", "chunks_stalled", "chunks_quarantined", "chunks_posted")


class RankService(ServedLoop[RoomPlan, LiveT]):
    """The pipe, the call timing and the accounting of a campaign rank of either role. The
    rank's rooms (its manager, its pools, its outcomes) are the subclass's; what of them the
    answers need is declared here, and :meth:`_waiting` and :meth:`_written_off` are its
    hooks."""

    def __init__(self, conn: Connection, role: str, opts: CampaignOptions) -> None:
        super().__init__(conn)
        self.role, self.opts = role, opts
        #: Outcomes of retired rooms, until the next poll takes them.
        self.outcomes: list[dict[str, Any]] = []
        self.slow: Counter[str] = Counter()
        self.max_call_ms: dict[str, float] = {}
        self.timer = CallTimer()
        self.calls = 0
        #: SIGCONTs received (``continued_by_sigcont``), and the calls they fell inside.
        self.continued = 0
        self.calls_stopped = 0
        self.events: Counter[str] = Counter()  # what this rank did on plan (reuse, oversized)
        self.reported: Counter[str] = Counter()  # cumulative counters as last reported
        #: Prefill: a pending ``exposed`` request's deadline (0: none pending).
        self.exposed_until = 0.0
        self.manager: PrefillManager | DecodeManager
        self.checks: DecodeChecks | None = None  # decode's bytes and canaries
        #: Decode's pages held back after its own stops, counted by its rooms.
        self.holds: Counter[str] = Counter()
        self.faults: TransportFaults | None = None
        self.proxy: ProxyThread | None = None
        self.client: BootstrapClient | None = None

    # -- the pipe ------------------------------------------------------------------------------

    def serve(self) -> None:
        """Iterate until told to quit or orphaned; the plan comes episode by episode, and one
        may come while the last one's rooms still settle (the campaign gave up waiting)."""
        while not self.stopping():
            self.between(self.iterate())

    def between(self, progressed: bool) -> None:
        if self.exposed_until:
            self._answer_exposed()
        super().between(progressed)

    def _answer_exposed(self) -> None:
        """Answer a pending ``exposed`` once prefill has chunks in flight, or its wait is
        over (the campaign waits for the answer: no other request comes meanwhile)."""
        assert isinstance(self.manager, PrefillManager)
        in_flight = self.manager.transport.in_flight
        if in_flight or time.monotonic() >= self.exposed_until:
            self.exposed_until = 0.0
            self.conn.send(in_flight)

    def nap_s(self) -> float:
        return self.idle_sleep_s if self.busy else 0.01

    def answer(self, request: Any) -> None:
        op = request[0]
        if op == "episode":
            self.feed(episode_plan(self.opts, request[1], request[2]))
            self.conn.send(True)
        elif op == "poll":
            outcomes, self.outcomes = self.outcomes, []
            answer: dict[str, Any] = {
                "done": not self.busy,
                "outcomes": outcomes,
                "counters": self._counters(),
            }
            if isinstance(self.manager, PrefillManager):
                # The campaign freezes prefill past decode's settle bound while chunks are
                # accepted and not final (queued for the poster, or posted).
                answer["in_flight"] = self.manager.transport.in_flight
            self.conn.send(answer)
        elif op == "exposed":
            if isinstance(self.manager, PrefillManager):
                # Over the default transports a chunk to a running decode is in flight for
                # moments that the campaign's own asking rarely sees: the answer waits for
                # one, checked after every iteration (_answer_exposed).
                self.exposed_until = time.monotonic() + float(request[1])
                self._answer_exposed()
            else:
                # Phase.SENDING: the page list went out, the room is not terminal yet.
                self.conn.send(sum(item.phase is Phase.SENDING for item in self.live))
        elif op == "waiting":
            self.conn.send(self._waiting(float(request[1])))
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

    def call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """Every call on a room, the loop's (poll, abort, clear) and the hooks', is timed."""
        return self._timed_within(name, self.opts.slow_call_ms, fn, *args)

    def _timed_within(self, name: str, limit_ms: float, fn: Callable[..., T], *args: Any) -> T:
        # Judged on the call's own time: wall time less what this thread spent waiting for a
        # CPU that other processes held (a blocked call still counts in full; call_timer).
        continued = self.continued
        result, timed = self.timer.time(fn, *args)
        ms = timed.own_ms
        self.calls += 1
        if self.continued != continued:
            # The campaign stopped this process (SIGSTOP) inside the call: its wall time is
            # the stop's, which no thread of this process could shorten, and is no block. (A
            # stopped thread is not on a run queue, so the timer cannot subtract it.)
            self.calls_stopped += 1
            return result
        if ms > self.max_call_ms.get(name, 0.0):
            self.max_call_ms[name] = ms
        if ms > limit_ms:
            self.slow[name] += 1
        return result

    def continued_by_sigcont(self, _signum: int, _frame: object) -> None:
        """SIGCONT's handler (``rank_main``): the campaign resumed this process."""
        self.continued += 1

    # -- the rooms' part of the answers --------------------------------------------------------

    def _waiting(self, before: float) -> list[dict[str, Any]]:
        """Rooms created before ``before`` (monotonic) that are still not terminal."""
        raise NotImplementedError

    def _written_off(self) -> dict[str, int]:
        """Decode: what rooms that never settled hold for good (pages, aux rows, oversized
        page lists)."""
        raise NotImplementedError

    # -- drain and close -----------------------------------------------------------------------

    def _drain(self, timeout: float) -> dict[str, Any]:
        engine = self.manager.engine
        assert engine is not None
        deadline = time.monotonic() + timeout
        while engine.stats()["live"] and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.checks is not None:
            self.checks.check_all()
        out: dict[str, Any] = {
            "live_rooms": len(engine.rooms()),
            "engine": engine.stats(),
            "control": dict(self.manager.control.stats) if self.manager.control else {},
            "max_call_ms": {k: round(v, 3) for k, v in self.max_call_ms.items()},
            "frozen_s": round(self.stopped_s, 3),
            "calls_stopped": self.calls_stopped,
            "counters": self._counters(),
        }
        if isinstance(self.manager, PrefillManager):
            out["transport"] = self.manager.transport.snapshot()
        if self.faults is not None:
            out["transfer_faults"] = self.faults.snapshot()
        if self.role == "decode":
            out.update(self._written_off())
        return out

    def _counters(self) -> dict[str, Any]:
        """What was counted since the last call: calls (total and slow, by name), late writes
        and their notes, injected transfer faults, the frame proxy's counters."""
        checks = self.checks
        late = checks.late_writes if checks is not None else 0
        now: Counter[str] = Counter({"calls": self.calls, "late_writes": late})
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
        if self.checks is not None:
            now.update({f"hold.{name}": n for name, n in self.holds.items()})
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
        notes: list[str] = []
        if checks is not None:
            notes, checks.late_notes = checks.late_notes, []
        return {"delta": {k: v for k, v in delta.items() if v}, "late_notes": notes}

    def _close(self) -> dict[str, Any]:
        final = self._drain(self.settle_grace_s)
        manager = self.manager
        if self.client is not None and manager.engine is not None:
            with contextlib.suppress(Exception):
                manager.engine.call(self.client.close(), timeout=10)
        manager.close()
        counters = self._counters()  # anything counted during the close itself
        self.timer.close()
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
