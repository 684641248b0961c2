"""``run_campaign``: real prefill and decode processes through randomized fault episodes.

The campaign process runs the bootstrap registry (in a thread, restartable on its port) and two
rank processes (:mod:`kvfsm.chaos._rank`): prefill, whose NIXL agent is wrapped by the transfer
fault proxy, and decode, whose control connections go through the frame fault proxy. Each
episode runs ``rooms`` rooms on both ranks (aborts from either side at planned points) while this
process, at seeded times, stops a rank (SIGSTOP, SIGCONT later), freezes prefill for longer
than decode's settle bound while it has chunks in flight, freezes decode as long while prefill
has chunks in flight to it (and checks, some seconds after it wakes, that no room still waits
because of it), restarts the registry, sends hostile
connections to prefill's control port, and maybe SIGKILLs a rank near the end (it is restarted
before the next episode; its rooms count as ``killed``). The room plan itself reuses some room
ids right after decode aborts them and makes some ``send_metadata`` calls oversized. After each
episode every rank still alive drains and reports what it still holds. At the end both ranks
close and report their NIXL accounting. Everything random comes from the seed, which the report
prints for replay.

Besides what each rank checks (:mod:`kvfsm.chaos._rank`), the campaign checks liveness (law 3):
it records when it killed, stopped (past the silence limit) or cut off a rank, and every room of
the other rank that was bound to it then (past Bootstrapping: decode claimed it) must fail
within the silence limit plus ``liveness_slack_s``, not at its deadline. ``after_resume_s``
after a decode freeze ended (later if another process fault came meanwhile), no room of either
rank created before it ended may still be non-terminal; and rooms created on both sides after
it must still be served (the report counts how many succeeded).

Both ranks run UCX's default transports, or TCP only (``transport="tcp"``: ``UCX_TLS=tcp`` in
their environment), where a stopped decode leaves prefill's WRITEs queued in sockets.

With ``two_hosts`` the ranks run in two network namespaces joined by a veth
(:class:`~kvfsm.chaos._netns.TwoHosts`), NIXL on UCX TCP over it, and the link between them is
cut (a blackhole or the link down) and restored at seeded times, as one more fault. The registry
then runs in the prefill namespace (a child process, restartable on its port) and hostile
connections come from a helper process in the decode namespace, across the veth.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import signal
import time
from collections import Counter
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any, Final, Protocol

from kvfsm._child import ChildProcess, environ, spawn_quietly
from kvfsm.chaos._hostile import HOSTILE_KINDS, HostileResult, send_hostile
from kvfsm.chaos._netns import CutMode, TwoHosts
from kvfsm.chaos._options import CampaignOptions, RoomPlan, episode_plan
from kvfsm.chaos._rank import CAMPAIGN_ABORT, rank_main
from kvfsm.registry import RegistryThread
from kvfsm.states import KVPoll, Role
from kvfsm.workload.report import reason_class

__all__ = ["ok", "run_campaign"]

_log = logging.getLogger("kvfsm.chaos")
_ROLES: Final = ("prefill", "decode")
#: Decode reasons of a room that was bound to a control link when that link was lost.
_LINK_LOST: Final = re.compile(r"^peer lost: (connection to |prefill-.* silent)")

#: A long freeze waiting for chunks in flight is made anyway once this share of the episode's
#: rooms ended: the rest must still be moving when it comes.
_FREEZE_BY_ENDED: Final = 0.6
#: ... and once it waited this long for them.
_FREEZE_WAIT_S: Final = 3.0
#: A decode freeze asks prefill for chunks in flight, and prefill answers once it has some or
#: after this long (the campaign's loop waits meanwhile).
_IN_FLIGHT_WAIT_S: Final = 0.2
#: Violations listed for rooms still waiting after a decode freeze (all are counted).
_WAITING_LISTED: Final = 8


class _AnyRegistry(Protocol):
    @property
    def url(self) -> str: ...

    def restart(self, down_s: float) -> None: ...

    def close(self) -> None: ...


def _helper_main(conn: Connection, host: str, secret: bytes | None, serve_registry: bool) -> None:
    """A helper process inside a namespace (two hosts): the registry on ``host``
    (``("restart", down_s)``), or a source of hostile connections (``("hostile", kind, host,
    port)``). Quits when told or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the campaign process stops us
    parent = os.getppid()
    registry = (
        RegistryThread(host, secret=secret, ttl_s=5.0, quiet=True) if serve_registry else None
    )
    try:
        conn.send(registry.url if registry is not None else "")
        while os.getppid() == parent:
            if not conn.poll(0.2):
                continue
            request = conn.recv()
            if request[0] == "quit":
                break
            if request[0] == "restart" and registry is not None:
                registry.restart(float(request[1]))
                conn.send(None)
            elif request[0] == "hostile":
                _, kind, to_host, port = request
                conn.send(send_hostile(to_host, int(port), kind, secret=secret, timeout=3.0))
            else:
                conn.send(None)
    except (EOFError, OSError):
        pass
    finally:
        if registry is not None:
            registry.close()


class _NetnsRegistry:
    """The registry in a helper process in the prefill namespace (two hosts)."""

    def __init__(self, child: ChildProcess) -> None:
        self.child = child
        self.url = str(child.greeting)

    def restart(self, down_s: float) -> None:
        self.child.ask("restart", down_s, timeout=30)

    def close(self) -> None:
        self.child.close()


class _Tally:
    """Everything the report counts."""

    def __init__(self) -> None:
        self.rooms = self.succeeded = self.failed = self.killed = self.wedged = 0
        self.mismatched_bytes = self.late_writes = self.starved = 0
        self.unsettled: Counter[str] = Counter()
        #: Without a secret: decode rooms left unsettled after the fault proxy dropped or
        #: reordered one of their frames (maybe the acknowledgement itself): not a violation.
        self.unsettled_disordered = 0
        self.restarts: Counter[str] = Counter()
        self.failed_by_reason: dict[str, Counter[str]] = {r: Counter() for r in _ROLES}
        self.faults: Counter[str] = Counter()
        self.slow_calls: Counter[str] = Counter()
        self.max_call_ms: dict[str, float] = {}
        self.calls = 0
        self.leaks: Counter[str] = Counter()
        self.violations: list[str] = []
        self.hostile: Counter[str] = Counter()
        self.bad_frame_rooms = 0
        self.max_elapsed_s: dict[str, float] = {r: 0.0 for r in _ROLES}
        #: Prefill's transport: chunks fenced, stalled, quarantined, posted.
        self.transport: Counter[str] = Counter()
        #: Freezes of prefill past decode's settle bound: how many, how long, how many had
        #: chunks in flight when they began.
        self.long_freezes: list[float] = []
        self.long_freezes_in_flight = 0
        #: Freezes of decode past its settle bound: how long, how many began with chunks in
        #: flight at prefill (asked right before the stop), those chunks and decode's rooms
        #: with their page list out then, in all.
        self.decode_freezes: list[float] = []
        self.decode_freezes_in_flight = 0
        self.decode_freeze_chunks = 0
        self.decode_freeze_exposed = 0
        #: ``after_resume_s`` after each: checks made, rooms still not terminal then; rooms
        #: created on both sides after it, and how many of them succeeded.
        self.resume_checks = 0
        self.waiting_after_resume = 0
        self.later_rooms = 0
        self.later_rooms_succeeded = 0
        #: Prefill rooms left to their Bootstrapping deadline after a decode freeze although
        #: decode's room had ended, and the longest such wait past decode's end.
        self.untold = 0
        self.untold_max_s = 0.0
        #: Decode's pages held back (watched, out of the pool) after its own stops.
        self.holds: Counter[str] = Counter()
        #: Prefill incarnations whose agent the stale-progress gate fenced out (a freeze left
        #: a WRITE queued past its lease): restarted before the next episode; what they
        #: abandoned on purpose (handles, remote agents, lists) is not counted as leaked.
        self.fenced_out = 0
        #: Rooms whose peer was lost (killed, stopped or cut off past the silence limit) while
        #: they were bound to it: how many, and the longest from the loss to their failure.
        self.liveness_checked = 0
        self.liveness_max_s = 0.0
        #: Reused room ids: by what the next generation on decode became.
        self.reuse: Counter[str] = Counter()
        #: Oversized send_metadata calls, by kind and by the reason the room failed with.
        self.oversized: Counter[str] = Counter()

    def violation(self, text: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(text)


class _Campaign:
    def __init__(self, opts: CampaignOptions) -> None:
        self.opts = opts
        self.rng = random.Random(f"kvfsm-chaos/{opts.seed}/campaign")
        self.secret = secrets.token_bytes(32) if opts.use_secret else None
        self.tally = _Tally()
        self.registry: _AnyRegistry | None = None
        self.hosts: TwoHosts | None = None
        self.hostile_source: ChildProcess | None = None
        self.cut_until = 0.0  # two hosts: when the link cut now in place is restored
        self.ranks: dict[str, ChildProcess | None] = dict.fromkeys(_ROLES)
        self.incarnations = 0
        self.level = logging.getLogger("kvfsm").getEffectiveLevel()
        self.first_room = 0
        self.prefill_in_flight = 0  # chunks in flight at prefill's last answer
        self.ended = 0.0  # the share of the episode's rooms (both roles) ended so far
        self.freeze_wait_until = 0.0  # a long freeze waits this long for chunks in flight
        #: Decode freezes: a separate stream, so that adding them reshuffles no other fault of a
        #: seed; three draws an episode whatever the rate (``FaultPlan``'s rule 2).
        self.decode_rng = random.Random(f"kvfsm-chaos/{opts.seed}/decode-freeze")
        self.decode_freeze_len = 0.0  # this episode's, drawn with its time
        self.decode_wait_until = 0.0  # a decode freeze waits this long for chunks in flight
        self.decode_frozen = False  # decode's stop under way is a decode freeze
        #: This episode's decode freezes: when each began and ended (monotonic).
        self.freezes: list[tuple[float, float]] = []
        self.frozen_at = 0.0
        #: The end of the latest process or link fault but the decode freezes (monotonic): a
        #: room may wait for a stopped or cut-off peer, so the check after a decode freeze
        #: comes ``after_resume_s`` after this too.
        self.disrupted_until = 0.0
        #: Peers lost this episode, for the liveness check: (monotonic time, role lost).
        self.losses: list[tuple[float, str]] = []

    # -- ranks ---------------------------------------------------------------------------------

    @property
    def prefill_host(self) -> str:
        """Where prefill's control channel listens (and the registry, on two hosts)."""
        return self.hosts.prefill.address if self.hosts is not None else "127.0.0.1"

    def _prefix(self, role: str) -> list[str]:
        """How a process of ``role`` is started: in its namespace, with UCX on the veth."""
        hosts = self.hosts
        if hosts is None:
            return []
        host = hosts.prefill if role == "prefill" else hosts.decode
        return hosts.command(host, env=hosts.ucx_env(host))

    def _start(self, roles: list[str]) -> None:
        assert self.registry is not None
        url, opts, secret, level = self.registry.url, self.opts, self.secret, self.level
        host = self.prefill_host

        def factory(role: str, salt: int) -> Any:
            prefix = self._prefix(role)
            return lambda: ChildProcess(
                rank_main,
                role,
                opts,
                url,
                secret,
                salt,
                level,
                host,
                what=f"chaos {role}",
                prefix=prefix,
            )

        factories = []
        for role in roles:
            self.incarnations += 1
            factories.append(factory(role, self.incarnations))
        # One host: the UCX transports through the environment, which the ranks inherit (two
        # hosts set them in each rank's command prefix, with its namespace's device).
        with environ(opts.rank_env() if self.hosts is None else {}):
            children = spawn_quietly(factories)
        for role, child in zip(roles, children, strict=True):
            self.ranks[role] = child

    def _close_rank(self, role: str) -> None:
        child = self.ranks[role]
        self.ranks[role] = None
        if child is None:
            return
        try:
            # The close drains first, for as long as a room may take to settle.
            final = child.ask("close", timeout=self.opts.settle_wait_s() + 60)
            self._account(role, final, closing=True)
        except Exception as exc:
            self.tally.violation(f"{role} did not close cleanly: {exc!r}")
        finally:
            with contextlib.suppress(Exception):
                child._conn.send(("quit",))
            child.close()

    # -- one episode ---------------------------------------------------------------------------

    def episode(self, index: int) -> None:
        opts, tally = self.opts, self.tally
        missing = [role for role in _ROLES if self.ranks[role] is None]
        if missing:
            self._start(missing)
        ranks: dict[str, ChildProcess] = {}
        for role, child in self.ranks.items():
            assert child is not None
            ranks[role] = child
        port = ranks["prefill"].ask("port")
        span = self.span()
        actions = self.actions(index, span)
        self.losses = []
        self.freeze_wait_until = 0.0
        self.decode_wait_until = 0.0
        self.freezes = []
        for child in (ranks["prefill"], ranks["decode"]):  # prefill first: a bootstrap queue
            child.ask("episode", index, self.first_room)
        plans = episode_plan(opts, index, self.first_room)
        self.first_room += opts.rooms
        outcomes: dict[str, dict[tuple[int, int], dict[str, Any]]] = {r: {} for r in _ROLES}
        done = dict.fromkeys(_ROLES, False)
        killed: set[str] = set()
        stopped: dict[str, float] = {}
        t0 = time.monotonic()
        # Every room within its bound, plus what the freezes planned add (no room moves then).
        freezes = [what for _, what, _ in actions if what in ("long_freeze", "decode_freeze")]
        limit = (opts.rooms / opts.concurrency + 2) * (
            max(opts.bound_s(r) for r in Role) + opts.slack_s
        ) + len(freezes) * (opts.longest_stop_s() + opts.after_resume_s)
        retried: set[tuple[float, str, str]] = set()  # due by time only
        while not all(done[r] or r in killed for r in _ROLES) or any(
            what == "after_resume" for _, what, _ in actions
        ):
            now = time.monotonic() - t0
            ended = self.ended = sum(len(outcomes[r]) for r in _ROLES) / (2 * opts.rooms)
            while actions and (
                actions[0][0] <= now
                or (actions[0] not in retried and 0.9 * actions[0][0] / span <= ended)
            ):
                _, what, arg = actions.pop(0)
                later = self._act(what, arg, port, ranks, stopped, killed)
                if later is not None:  # not now: when the rank runs and the link is up
                    retry = (later - t0 + 0.1, what, arg)
                    retried.add(retry)
                    actions.append(retry)
                    actions.sort()
            for role, until in list(stopped.items()):
                if time.monotonic() >= until:
                    os.kill(ranks[role].pid, signal.SIGCONT)
                    del stopped[role]
                    if role == "decode" and self.decode_frozen:
                        # Due by time only (never by the rooms ended): it is a wait.
                        self.decode_frozen = False
                        resumed = time.monotonic()
                        self.freezes.append((self.frozen_at, resumed))
                        check = (resumed - t0 + opts.after_resume_s, "after_resume", repr(resumed))
                        retried.add(check)
                        actions.append(check)
                        actions.sort()
            if self.hosts is not None and self.hosts.is_cut and time.monotonic() >= self.cut_until:
                self.hosts.restore()
            for role in _ROLES:
                if role in killed or role in stopped or done[role]:
                    continue
                child = ranks[role]
                if not child.process.is_alive():
                    tally.violation(f"episode {index}: the {role} process died by itself")
                    killed.add(role)
                    self.ranks[role] = None
                    continue
                answer = child.ask("poll", timeout=60)
                for outcome in answer["outcomes"]:
                    outcomes[role][(outcome["room"], outcome.get("gen", 0))] = outcome
                if role == "prefill":
                    self.prefill_in_flight = int(answer.get("in_flight", 0))
                done[role] = answer["done"]
                self._fold(role, answer["counters"])
            if now > limit:
                tally.violation(f"episode {index}: not over after {limit:.0f}s")
                break
            time.sleep(0.05)
        for role in stopped:
            os.kill(ranks[role].pid, signal.SIGCONT)
        self.decode_frozen = False
        if self.hosts is not None:
            self.hosts.restore()
        self._score(index, plans, outcomes, killed)
        self._liveness(index, outcomes)
        self._after_freezes(plans, outcomes)
        wait = opts.settle_wait_s()
        for role in _ROLES:
            child = self.ranks[role]
            if role in killed or child is None:
                continue
            report = child.ask("drain", wait, timeout=wait + 30)
            self._account(role, report, closing=False)
            if report.get("transport", {}).get("fenced_out"):
                # What an operator's supervisor does: a fenced-out prefill is restarted.
                tally.fenced_out += 1
                self._close_rank(role)
                continue
            if role != "decode":
                continue
            # Rooms that never settled keep their pages and aux rows for good (law 4): a fresh
            # decode rank gets fresh pools before they run out.
            pages_left = opts.num_pages - report["written_off_pages"]
            aux_left = opts.aux_rows - report["written_off_aux"]
            oversized = report.get("written_off_oversized", 0)
            if pages_left < opts.num_pages // 2 or aux_left < opts.aux_rows // 2 or oversized > 1:
                tally.restarts["decode_pools"] += 1
                self._close_rank("decode")

    def span(self) -> float:
        """Process-level faults are due at seeded times within this many seconds of an
        episode's start (see :meth:`actions`)."""
        return max(2.0, self.opts.rooms / self.opts.concurrency * 0.3)

    def actions(self, index: int, span: float) -> list[tuple[float, str, str]]:
        """Episode ``index``'s process, registry, hostile and link faults: ``(due, what,
        arg)``, sorted, ``due`` in seconds from the episode's start. Each is due then, or as
        soon as that fraction of ``span`` (times 0.9) of the episode's rooms has ended."""
        opts, rng = self.opts, self.rng
        # Process-level faults at seeded times within the first seconds of the episode, or as
        # soon as that fraction of its rooms (times 0.9) has ended, if that comes first: a pair
        # that serves its rooms faster than ``span`` still gets every fault mid-episode (a
        # fault due after the episode's last room would not be made at all).
        actions: list[tuple[float, str, str]] = []
        if rng.random() < opts.sigstop_rate:
            actions.append((rng.uniform(0, span), "sigstop", rng.choice(_ROLES)))
        if rng.random() < opts.registry_restart_rate:
            actions.append((rng.uniform(0, span), "registry", ""))
        actions += [
            (rng.uniform(0, span), "hostile", rng.choice(HOSTILE_KINDS))
            for _ in range(opts.hostile_per_episode)
        ]
        if index > 0 and rng.random() < opts.sigkill_rate:
            actions.append((rng.uniform(0.5 * span, span), "sigkill", rng.choice(_ROLES)))
        if self.hosts is not None and rng.random() < opts.link_cut_rate:
            actions.append((rng.uniform(0, span), "cut", rng.choice(("blackhole", "down"))))
        if rng.random() < opts.long_freeze_rate:
            # Past decode's settle bound, with chunks in flight: the fence's case (law 4). Due
            # in the first half (by the time, or by 45% of the rooms ended), and then it waits
            # a little for chunks in flight (``_act``): it must come while rooms still move.
            actions.append((rng.uniform(0, 0.5 * span), "long_freeze", "prefill"))
        chance, at, length = (self.decode_rng.random() for _ in range(3))
        low, high = opts.decode_freeze_range_s()
        self.decode_freeze_len = low + length * (high - low)
        if chance < opts.decode_freeze_rate:
            # Due in the first half like a long freeze, for the same reason: it waits for
            # chunks in flight, and rooms must be left to serve after it.
            actions.append((at * 0.5 * span, "decode_freeze", "decode"))
        actions.sort()
        return actions

    def _act(  # noqa: PLR0917 - one scheduled action and the episode's state
        self,
        what: str,
        arg: str,
        port: int,
        ranks: dict[str, ChildProcess],
        stopped: dict[str, float],
        killed: set[str],
    ) -> float | None:
        """Do one scheduled fault; return a monotonic time to try again at instead, when it
        cannot be done now."""
        tally, opts = self.tally, self.opts
        if what == "sigstop" and arg not in killed and arg not in stopped:
            os.kill(ranks[arg].pid, signal.SIGSTOP)
            length = self.rng.uniform(0.3, opts.sigstop_max_s)
            self._stopped(arg, length, stopped)
            self._disrupted(length)
            tally.faults[f"sigstop_{arg}"] += 1
        elif what == "long_freeze" and arg not in killed:
            if arg in stopped:  # an ordinary stop is under way: after it
                return stopped[arg]
            now = time.monotonic()
            if not self.freeze_wait_until:
                self.freeze_wait_until = now + 3.0
            # Wait (a little) for chunks in flight, as sampled by the last poll: at most 3 s,
            # and not past 60% of the episode's rooms ended. A pair that moves rooms fast has
            # chunks in flight for moments that 50 ms polls rarely see, and a freeze still
            # pending when the episode's last room ends is never made (it once was not).
            waiting = now < self.freeze_wait_until and self.ended < _FREEZE_BY_ENDED
            if self.prefill_in_flight == 0 and waiting:
                return now + 0.02
            os.kill(ranks[arg].pid, signal.SIGSTOP)
            length = self.rng.uniform(*opts.long_freeze_s())
            self._stopped(arg, length, stopped)
            self._disrupted(length)
            tally.faults[f"long_freeze_{arg}"] += 1
            tally.long_freezes.append(length)
            tally.long_freezes_in_flight += self.prefill_in_flight > 0
        elif what == "decode_freeze" and arg not in killed:
            return self._decode_freeze(ranks, stopped, killed)
        elif what == "after_resume":
            return self._after_resume(float(arg), ranks, killed)
        elif what == "registry":
            assert self.registry is not None
            self.registry.restart(self.rng.uniform(0.2, 1.5))
            self._disrupted(0.0)  # restart() returns once it is back
            tally.faults["registry_restart"] += 1
        elif what == "hostile" and "prefill" not in killed:
            # A stopped prefill cannot answer, and a cut link carries nothing: what is being
            # checked is how a running prefill refuses them, so they wait.
            if "prefill" in stopped or (self.hosts is not None and self.hosts.is_cut):
                return max(stopped.get("prefill", 0.0), self.cut_until)
            result = self._hostile(arg, port)
            tally.faults[f"hostile_{arg}"] += 1
            tally.hostile[result.outcome] += 1
            # Refused: the connection dropped, or an Error frame saying why (without a secret
            # an unsigned Hello is well formed, and a NIXL handshake prefill cannot load is
            # answered that way before it closes).
            if result.outcome not in ("closed", "error"):
                tally.violation(f"hostile {arg}: not refused ({result.outcome} {result.detail})")
        elif what == "sigkill" and arg not in killed:
            stopped.pop(arg, None)
            ranks[arg].kill()
            self.losses.append((time.monotonic(), arg))
            self._disrupted(0.0)
            killed.add(arg)
            self.ranks[arg] = None
            tally.faults[f"sigkill_{arg}"] += 1
        elif what == "cut" and self.hosts is not None and not self.hosts.is_cut:
            mode: CutMode = "down" if arg == "down" else "blackhole"
            self.hosts.cut(mode)
            now = time.monotonic()
            length = self.rng.uniform(0.5, opts.link_cut_max_s)
            self.cut_until = now + length
            self._disrupted(length)
            if length > opts.channel_silence_s() + 0.5:  # each side loses the other
                self.losses += [(now, "prefill"), (now, "decode")]
            tally.faults[f"link_cut_{mode}"] += 1
        return None

    def _decode_freeze(
        self, ranks: dict[str, ChildProcess], stopped: dict[str, float], killed: set[str]
    ) -> float | None:
        """Freeze decode past its settle bound, right after prefill said it has chunks in
        flight and then decode that it has at least ``decode_freeze_exposed`` rooms with their
        page list out (asked now, not at their last poll: over TCP, and for the default
        transports' rendezvous, those WRITEs and the rooms' next ones cannot finish while
        decode is stopped, since decode's own UCX worker is what applies them). Like a long
        freeze it waits for such a moment a little, and not past 60% of the episode's rooms
        ended; a stopped rank (either) is waited for."""
        if "decode" in stopped or "prefill" in stopped:
            return max(stopped.values())
        opts = self.opts
        now = time.monotonic()
        if not self.decode_wait_until:
            self.decode_wait_until = now + _FREEZE_WAIT_S
        waiting = now < self.decode_wait_until and self.ended < _FREEZE_BY_ENDED
        in_flight = 0
        if "prefill" not in killed:
            # Prefill answers the moment it has chunks in flight (or after the wait), then
            # decode at once: the stop follows within a millisecond or so.
            wait = _IN_FLIGHT_WAIT_S if waiting else 0.0
            in_flight = int(ranks["prefill"].ask("exposed", wait, timeout=wait + 30))
        exposed = int(ranks["decode"].ask("exposed", 0.0))
        enough = min(opts.decode_freeze_exposed, opts.concurrency)
        if (in_flight == 0 or exposed < enough) and waiting and "prefill" not in killed:
            return now + 0.02
        os.kill(ranks["decode"].pid, signal.SIGSTOP)
        self.frozen_at = time.monotonic()
        length = self.decode_freeze_len
        self._stopped("decode", length, stopped)
        self.decode_frozen = True  # the check after it is scheduled when it ends
        tally = self.tally
        tally.faults["decode_freeze"] += 1
        tally.decode_freezes.append(length)
        tally.decode_freezes_in_flight += in_flight > 0
        tally.decode_freeze_chunks += in_flight
        tally.decode_freeze_exposed += exposed
        return None

    def _after_resume(
        self, resumed: float, ranks: dict[str, ChildProcess], killed: set[str]
    ) -> float | None:
        """``after_resume_s`` after a decode freeze ended: no room of either rank created
        before it ended may still be non-terminal. The last lease of the lost link is long
        over, decode's rooms of it fail on waking, prefill's failed on the loss; an unclaimed
        prefill room ends at its Bootstrapping deadline at the latest, and one claimed after
        the freeze is served like any other. Another process or link fault since the freeze
        ended (a room may then wait for its peer) moves the check as long after that one."""
        due = max(resumed, self.disrupted_until) + self.opts.after_resume_s
        if time.monotonic() < due:
            return due
        tally = self.tally
        tally.resume_checks += 1
        for role in _ROLES:
            if role in killed:
                continue
            waiting: list[dict[str, Any]] = ranks[role].ask("waiting", resumed)
            tally.waiting_after_resume += len(waiting)
            late = time.monotonic() - resumed
            for room in waiting[:_WAITING_LISTED]:
                tally.violation(
                    f"{role} room {room['room']} still {room['state']} {late:.1f}s after decode "
                    f"woke from a freeze ({room})"
                )
        return None

    def _disrupted(self, length: float) -> None:
        """A process or link fault (not a decode freeze) was just made, over ``length`` s
        from now (see ``disrupted_until``)."""
        self.disrupted_until = max(self.disrupted_until, time.monotonic() + length)

    def _after_freezes(
        self, plans: list[RoomPlan], outcomes: dict[str, dict[tuple[int, int], dict[str, Any]]]
    ) -> None:
        """Rooms created on both sides after this episode's last decode freeze ended: they
        must still be served (counted; the report says how many succeeded). And prefill rooms
        that lived through a freeze and ended at their Bootstrapping deadline longer than the
        liveness bound after decode's room of that id, bound to a link that was then lost, had
        already ended: decode knew, prefill was not told (counted, with the longest such
        wait, and a violation)."""
        tally = self.tally
        # One reconnect (its backoff included) and the abort's way over it: the liveness bound.
        told_within = self.opts.channel_silence_s() + self.opts.liveness_slack_s
        for plan in plans:
            gen = 1 if (plan.room, 1) in outcomes["decode"] else 0
            dec = outcomes["decode"].get((plan.room, gen))
            pre = outcomes["prefill"].get((plan.room, gen))
            if dec is None or pre is None:
                continue
            started = min(dec.get("started_at", 0.0), pre.get("started_at", 0.0))
            if self.freezes and started > self.freezes[-1][1]:
                tally.later_rooms += 1
                if dec["status"] == KVPoll.Success and not dec["mismatched"]:
                    tally.later_rooms_succeeded += 1
            pre_end, dec_end = pre.get("ended_at", 0.0), dec.get("ended_at", 0.0)
            if not pre["reason"].startswith("deadline expired: Bootstrapping"):
                continue
            if not _LINK_LOST.search(str(dec.get("reason", ""))):
                # Decode's room never reached a link (its prefill rank unreachable, killed or
                # restarting): a sender no decode claimed waits out its deadline by design.
                continue
            for frozen_at, resumed in self.freezes:
                lived = pre.get("started_at", 0.0) < resumed < pre_end
                if lived and dec_end >= frozen_at and pre_end - dec_end > told_within:
                    tally.untold += 1
                    tally.untold_max_s = max(tally.untold_max_s, pre_end - dec_end)
                    # Decode tells what a lost link failed within one reconnect (law 3).
                    tally.violation(
                        f"room {plan.room}: prefill waited out Bootstrapping "
                        f"{pre_end - dec_end:.2f}s after decode's room ended"
                    )
                    break

    def _stopped(self, role: str, length: float, stopped: dict[str, float]) -> None:
        """``role`` was just stopped for ``length`` seconds. Long enough past the silence
        limit, its peer must declare it lost (a shorter stop may not be noticed)."""
        now = time.monotonic()
        stopped[role] = now + length
        if length > self.opts.channel_silence_s() + 0.5:
            self.losses.append((now, role))

    def _hostile(self, kind: str, port: int) -> HostileResult:
        if self.hostile_source is None:
            return send_hostile("127.0.0.1", port, kind, secret=self.secret, timeout=3.0)
        result: HostileResult = self.hostile_source.ask(
            "hostile", kind, self.prefill_host, port, timeout=30
        )
        return result

    def _score(
        self,
        index: int,
        plans: list[RoomPlan],
        outcomes: dict[str, dict[tuple[int, int], dict[str, Any]]],
        killed: set[str],
    ) -> None:
        tally = self.tally
        lost = "decode" in killed or "prefill" in killed
        for plan in plans:
            room = plan.room
            tally.rooms += 1
            dec = outcomes["decode"].get((room, 0))
            if dec is None:
                if lost:
                    tally.killed += 1
                else:
                    tally.violation(f"episode {index}: room {room}: no decode outcome")
                continue
            for role in _ROLES:
                for gen in (0, 1):
                    out = outcomes[role].get((room, gen))
                    if out is not None:
                        self._check_outcome(room, role, out, plan)
            nxt = outcomes["decode"].get((room, 1))
            if plan.reuse and nxt is not None:
                # Both generations ended and settled (checked above, like every room); the
                # next one may succeed, with its own bytes right.
                tally.reuse["rooms"] += 1
                status = KVPoll(nxt["status"])
                tally.reuse["next_" + status.name.lower()] += 1
                if status is not KVPoll.Success:
                    tally.reuse[f"next failed: {_reason_class(nxt['reason'])}"] += 1
            final = nxt if nxt is not None else dec
            if final["status"] == KVPoll.Success:
                if final["mismatched"]:
                    tally.mismatched_bytes += final["mismatched"]
                    tally.violation(f"room {room}: {final['mismatched']} bytes differ")
                else:
                    tally.succeeded += 1
            else:
                tally.failed += 1
            if nxt is not None and dec["status"] == KVPoll.Success and dec["mismatched"]:
                tally.mismatched_bytes += dec["mismatched"]
                tally.violation(f"room {room} gen 0: {dec['mismatched']} bytes differ")

    def _check_outcome(self, room: int, role: str, out: dict[str, Any], plan: RoomPlan) -> None:
        """The checks every room of either side, of any generation, must pass."""
        tally = self.tally
        name = f"room {room}" + (f" gen {out['gen']}" if out.get("gen") else "")
        tally.max_elapsed_s[role] = max(tally.max_elapsed_s[role], out["elapsed_s"])
        if out["wedged"]:
            tally.wedged += 1
            tally.violation(f"{name}: {role} wedged")
        if not out["settled"]:
            if out.get("disordered") and not self.opts.use_secret:
                # Unsigned frames carry no sequence number: a frame dropped or reordered (TCP
                # never does that) goes unnoticed, and its acknowledgement may be what was
                # lost, so its pages stay reserved. Law 4's safe side, not a violation. With a
                # secret the break in the sequence costs the link, and the lost link's rooms
                # settle by the lease like any other: no excuse then.
                tally.unsettled_disordered += 1
            else:
                # Prefill always drains its handles; decode hears the settle, or its link was
                # lost and it settles the lease plus the fence margin after its last grant.
                tally.unsettled[role] += 1
                tally.violation(f"{name}: {role} room never settled ({out})")
        reason = out["reason"]
        if reason == "starved":
            tally.starved += 1
        if "bad frame" in reason:
            tally.bad_frame_rooms += 1
        if "already held" in reason:
            # The campaign hands out only pages and aux rows of settled rooms, so one owner
            # per destination must never refuse it.
            tally.violation(f"{name}: {role} refused a destination known to be free: {reason}")
        if out["status"] != KVPoll.Success:
            tally.failed_by_reason[role][_reason_class(reason)] += 1
        kind = out.get("oversized", "")
        if kind and role == "decode":
            tally.oversized[kind] += 1
            tally.oversized[f"{kind}: {_reason_class(reason)}"] += 1
            if out.get("oversized_problem"):
                tally.violation(f"{name}: oversized ({kind}) {out['oversized_problem']}")
        elif not plan.oversized and ("max_pages" in reason or "frame limit" in reason):
            tally.violation(f"{name}: {role} failed by someone else's oversized call: {reason}")

    def _liveness(
        self, index: int, outcomes: dict[str, dict[tuple[int, int], dict[str, Any]]]
    ) -> None:
        """Law 3: a room bound to a peer that is lost (killed, stopped or cut off past the
        silence limit) fails within the silence limit, not at its deadline. Decode claims its
        room on the link as soon as it is bound, so this holds for prefill's rooms too."""
        tally, opts = self.tally, self.opts
        bound = opts.channel_silence_s() + opts.liveness_slack_s
        for lost_at, lost in self.losses:
            side = "decode" if lost == "prefill" else "prefill"
            for (room, _), out in outcomes[side].items():
                bound_at, ended_at = out.get("bound_at", 0.0), out.get("ended_at", 0.0)
                if not bound_at or not bound_at < lost_at < ended_at:
                    continue
                took = ended_at - lost_at - out.get("frozen_s", 0.0)
                tally.liveness_checked += 1
                tally.liveness_max_s = max(tally.liveness_max_s, took)
                if took > bound:
                    tally.violation(
                        f"episode {index}: {side} room {room} ended {took:.2f}s after its "
                        f"{lost} peer was lost (bound {bound:g}s): {out['reason']!r}"
                    )

    def _fold(self, role: str, counters: dict[str, Any]) -> None:
        """Add what a rank counted since its previous answer."""
        tally = self.tally
        for name, n in counters["delta"].items():
            if name == "calls":
                tally.calls += n
            elif name == "late_writes":
                tally.late_writes += n
            elif name.startswith("slow."):
                tally.slow_calls[f"{role}.{name[5:]}"] += n
            elif name.startswith("fault."):
                tally.faults[name[6:]] += n
            elif name.startswith("xfer."):
                tally.transport[name[5:]] += n
            elif name.startswith("hold."):
                tally.holds[name[5:]] += n
        for note in counters["late_notes"]:
            tally.violation(f"late write: {note}")

    def _account(self, role: str, report: dict[str, Any], *, closing: bool) -> None:
        """Fold a rank's drain (or close) report into the tally."""
        tally = self.tally
        self._fold(role, report["counters"])
        tally.leaks["rooms"] += report["live_rooms"]
        if report["live_rooms"]:
            tally.violation(f"{role}: {report['live_rooms']} rooms left after drain")
        for name, ms in report["max_call_ms"].items():
            key = f"{role}.{name}"
            tally.max_call_ms[key] = max(tally.max_call_ms.get(key, 0.0), ms)
        transport = report.get("transport")
        # A fenced-out agent's handles, lists and remote agents are abandoned on purpose
        # (nothing of it may be called again); its chunks must still all have ended.
        fenced = transport is not None and bool(transport.get("fenced_out"))
        if transport is not None:
            handles = 0 if fenced else transport["handles_created"] - transport["handles_released"]
            tally.leaks["nixl_handles"] += handles
            tally.leaks["chunks_in_flight"] += transport["in_flight"]
            if handles or transport["in_flight"]:
                tally.violation(f"{role}: {handles} NIXL handles, {transport['in_flight']} chunks")
        if closing and not fenced:
            agent = report["agent"]
            dlists = agent["dlists_prepped"] - agent["dlists_released"]
            peers = agent["peers_added"] - agent["peers_removed"]
            tally.leaks["descriptor_lists"] += dlists
            tally.leaks["remote_agents"] += peers
            if dlists or peers:
                tally.violation(f"{role}: {dlists} descriptor lists, {peers} remote agents left")
            tally.leaks["fault_proxy_handles"] += report.get("transfer_faults", {}).get(
                "outstanding", 0
            )

    # -- the whole run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        opts = self.opts
        t0 = time.monotonic()
        episodes = 0
        try:
            if opts.two_hosts:
                self._enter_two_hosts()
            else:
                self.registry = RegistryThread(secret=self.secret, ttl_s=5.0, quiet=True)
            while True:
                if opts.duration_s is None and episodes >= opts.episodes:
                    break
                if opts.duration_s is not None and time.monotonic() - t0 >= opts.duration_s:
                    break
                self.episode(episodes)
                episodes += 1
        finally:
            if self.hosts is not None:
                self.hosts.restore()
            for role in _ROLES:
                self._close_rank(role)
            if self.registry is not None:
                self.registry.close()
            if self.hostile_source is not None:
                self.hostile_source.close()
            if self.hosts is not None:
                self.hosts.close()
        return self.report(episodes, time.monotonic() - t0)

    def _enter_two_hosts(self) -> None:
        """The namespaces, the registry in prefill's and the hostile source in decode's."""
        hosts = self.hosts = TwoHosts().__enter__()  # closed in run()'s finally
        secret, address = self.secret, hosts.prefill.address
        registry, source = spawn_quietly(
            [
                lambda: ChildProcess(
                    _helper_main,
                    address,
                    secret,
                    True,
                    what="registry",
                    prefix=hosts.command(hosts.prefill),
                ),
                lambda: ChildProcess(
                    _helper_main,
                    address,
                    secret,
                    False,
                    what="hostile source",
                    prefix=hosts.command(hosts.decode),
                ),
            ]
        )
        self.registry = _NetnsRegistry(registry)
        self.hostile_source = source

    def _ucx(self) -> dict[str, Any]:
        """Which UCX transports the ranks ran: the option, and the ``UCX_TLS`` they had (set
        by the campaign, or inherited; None: UCX chose)."""
        opts = self.opts
        tls = "tcp" if opts.two_hosts else opts.rank_env().get("UCX_TLS", os.environ.get("UCX_TLS"))
        return {"transport": opts.ucx_transport(), "UCX_TLS": tls}

    def report(self, episodes: int, seconds: float) -> dict[str, Any]:
        t = self.tally
        for name, n in t.slow_calls.items():
            t.violation(f"{n} {name} calls over {self.opts.slow_call_ms:g} ms")
        if t.bad_frame_rooms:
            t.violation(f"{t.bad_frame_rooms} rooms failed by someone else's bad frame")
        summary: dict[str, Any] = {
            "seed": self.opts.seed,
            "episodes": episodes,
            "seconds": round(seconds, 1),
            "rooms": t.rooms,
            "succeeded": t.succeeded,
            "failed": t.failed,
            "killed": t.killed,
            "failed_by_reason": {r: dict(c.most_common()) for r, c in t.failed_by_reason.items()},
            "wedged": t.wedged,
            "unsettled": dict(t.unsettled),
            "unsettled_disordered": t.unsettled_disordered,
            "starved": t.starved,
            "decode_restarts": dict(t.restarts),
            "late_writes": t.late_writes,
            "mismatched_bytes": t.mismatched_bytes,
            "slow_calls": sum(t.slow_calls.values()),
            "calls": t.calls,
            "max_call_ms": dict(sorted(t.max_call_ms.items())),
            "max_room_s": {r: round(v, 3) for r, v in t.max_elapsed_s.items()},
            "bound_s": {
                "prefill": self.opts.bound_s(Role.SENDER),
                "decode": self.opts.bound_s(Role.RECEIVER),
            },
            "settle_after_loss_s": self.opts.settle_after_loss_s(),
            "leaks": {
                k: t.leaks.get(k, 0)
                for k in (
                    "rooms",
                    "nixl_handles",
                    "chunks_in_flight",
                    "descriptor_lists",
                    "remote_agents",
                    "fault_proxy_handles",
                )
            },
            "faults": dict(sorted(t.faults.items())),
            "transport": dict(sorted(t.transport.items())),
            "long_freezes": {
                "count": len(t.long_freezes),
                "with_chunks_in_flight": t.long_freezes_in_flight,
                "min_s": round(min(t.long_freezes, default=0.0), 2),
                "max_s": round(max(t.long_freezes, default=0.0), 2),
                "settle_after_loss_s": self.opts.settle_after_loss_s(),
                "fenced_out": t.fenced_out,
            },
            "decode_freezes": {
                "count": len(t.decode_freezes),
                "with_chunks_in_flight": t.decode_freezes_in_flight,
                "chunks_in_flight": t.decode_freeze_chunks,
                "rooms_exposed": t.decode_freeze_exposed,
                "min_s": round(min(t.decode_freezes, default=0.0), 2),
                "max_s": round(max(t.decode_freezes, default=0.0), 2),
                "checks_after_resume": t.resume_checks,
                "waiting_after_resume": t.waiting_after_resume,
                "later_rooms": t.later_rooms,
                "later_rooms_succeeded": t.later_rooms_succeeded,
                "prefill_untold": t.untold,
                "prefill_untold_max_s": round(t.untold_max_s, 3),
                "rooms_held": t.holds["rooms"],
                "pages_held": t.holds["pages"],
                "held_released_early": t.holds["released_early"],
                # Late writes (of ``late_writes``) found when held pages were checked.
                "late_writes_in_held": t.holds["late_writes"],
            },
            "ucx": self._ucx(),
            "liveness": {
                "rooms_checked": t.liveness_checked,
                "max_s": round(t.liveness_max_s, 3),
                "bound_s": self.opts.channel_silence_s() + self.opts.liveness_slack_s,
            },
            "reuse": dict(t.reuse),
            "oversized": dict(sorted(t.oversized.items())),
            "hostile": dict(t.hostile),
            "options": _options_json(self.opts),
            "violations": t.violations,
        }
        summary["ok"] = ok(summary)
        return summary


def _reason_class(reason: str) -> str:
    """A reason with numbers and peer ids blanked, for counting; the campaign's own aborts
    are one class."""
    return reason_class(reason, own_abort=CAMPAIGN_ABORT, own_name="campaign abort", width=160)


def _options_json(opts: CampaignOptions) -> dict[str, Any]:
    out = asdict(opts)
    out["deadlines"] = {
        role.value: {state.name: s for state, s in states.items()}
        for role, states in opts.deadlines.items()
    }
    return out


def ok(summary: dict[str, Any]) -> bool:
    """No violation of any kind."""
    return not summary["violations"] and summary["wedged"] == 0 and summary["late_writes"] == 0


def run_campaign(opts: CampaignOptions) -> dict[str, Any]:
    opts.validate()
    return _Campaign(opts).run()
