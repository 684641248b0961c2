"""``run_campaign``: real prefill and decode processes through randomized fault episodes.

The campaign process runs the bootstrap registry (in a thread, restartable on its port) and two
rank processes (:mod:`kvfsm.chaos._rank`): prefill, whose NIXL agent is wrapped by the transfer
fault proxy, and decode, whose control connections go through the frame fault proxy. Each
episode runs ``rooms`` rooms on both ranks (aborts from either side at planned points) while this
process, at seeded times, stops a rank (SIGSTOP, SIGCONT later), restarts the registry, sends
hostile connections to prefill's control port, and maybe SIGKILLs a rank near the end (it is
restarted before the next episode; its rooms count as ``killed``). After each episode every rank
still alive drains and reports what it still holds. At the end both ranks close and report their
NIXL accounting. Everything random comes from the seed, which the report prints for replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import secrets
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import Any, Final

from kvfsm._child import ChildProcess, spawn_quietly
from kvfsm.bootstrap import BootstrapServer
from kvfsm.chaos._hostile import HOSTILE_KINDS, send_hostile
from kvfsm.chaos._options import CampaignOptions
from kvfsm.chaos._rank import ABORT_REASON, rank_main
from kvfsm.states import KVPoll, Role

__all__ = ["ok", "run_campaign"]

_log = logging.getLogger("kvfsm.chaos")
_ROLES: Final = ("prefill", "decode")


class _Registry:
    """The bootstrap registry on its own loop thread; :meth:`restart` keeps the port."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = 0
        self.server: BootstrapServer | None = None
        self.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def start(self) -> None:
        server = BootstrapServer(
            "127.0.0.1", self.port, expected_ranks=1, ttl_s=5.0, secret=self.secret
        )
        self._call(server.start())
        self.server, self.port = server, server.port

    def stop(self) -> None:
        if self.server is not None:
            self._call(self.server.stop())
            self.server = None

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        for _ in range(50):  # the port may linger for a moment
            try:
                self.start()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the registry could not be restarted on its port")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class _Tally:
    """Everything the report counts."""

    def __init__(self) -> None:
        self.rooms = self.succeeded = self.failed = self.killed = self.wedged = 0
        self.mismatched_bytes = self.late_writes = 0
        self.unsettled: Counter[str] = Counter()
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

    def violation(self, text: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(text)


class _Campaign:
    def __init__(self, opts: CampaignOptions) -> None:
        self.opts = opts
        self.rng = random.Random(f"kvfsm-chaos/{opts.seed}/campaign")
        self.secret = secrets.token_bytes(32) if opts.use_secret else None
        self.tally = _Tally()
        self.registry: _Registry | None = None
        self.ranks: dict[str, ChildProcess | None] = dict.fromkeys(_ROLES)
        self.incarnations = 0
        self.level = logging.getLogger("kvfsm").getEffectiveLevel()
        self.first_room = 0

    # -- ranks ---------------------------------------------------------------------------------

    def _start(self, roles: list[str]) -> None:
        assert self.registry is not None
        url, opts, secret, level = self.registry.url, self.opts, self.secret, self.level

        def factory(role: str, salt: int) -> Any:
            return lambda: ChildProcess(
                rank_main, role, opts, url, secret, salt, level, what=f"chaos {role}"
            )

        factories = []
        for role in roles:
            self.incarnations += 1
            factories.append(factory(role, self.incarnations))
        for role, child in zip(roles, spawn_quietly(factories), strict=True):
            self.ranks[role] = child

    def _close_rank(self, role: str) -> None:
        child = self.ranks[role]
        self.ranks[role] = None
        if child is None:
            return
        try:
            final = child.ask("close", timeout=60)
            self._account(role, final, closing=True)
        except Exception as exc:
            self.tally.violation(f"{role} did not close cleanly: {exc!r}")
        finally:
            with contextlib.suppress(Exception):
                child._conn.send(("quit",))
            child.close()

    # -- one episode ---------------------------------------------------------------------------

    def episode(self, index: int) -> None:
        opts, tally, rng = self.opts, self.tally, self.rng
        missing = [role for role in _ROLES if self.ranks[role] is None]
        if missing:
            self._start(missing)
        ranks: dict[str, ChildProcess] = {}
        for role, child in self.ranks.items():
            assert child is not None
            ranks[role] = child
        port = ranks["prefill"].ask("port")
        # Process-level faults at seeded times within the first seconds of the episode.
        span = max(2.0, opts.rooms / opts.concurrency * 0.3)
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
        actions.sort()
        for child in (ranks["prefill"], ranks["decode"]):  # prefill first: a bootstrap queue
            child.ask("episode", index, self.first_room)
        rooms = range(self.first_room, self.first_room + opts.rooms)
        self.first_room += opts.rooms
        outcomes: dict[str, dict[int, dict[str, Any]]] = {r: {} for r in _ROLES}
        done = dict.fromkeys(_ROLES, False)
        killed: set[str] = set()
        stopped: dict[str, float] = {}
        t0 = time.monotonic()
        limit = (opts.rooms / opts.concurrency + 2) * (
            max(opts.bound_s(r) for r in Role) + opts.slack_s
        )
        while not all(done[r] or r in killed for r in _ROLES):
            now = time.monotonic() - t0
            while actions and actions[0][0] <= now:
                _, what, arg = actions.pop(0)
                self._act(what, arg, port, ranks, stopped, killed)
            for role, until in list(stopped.items()):
                if time.monotonic() >= until:
                    os.kill(ranks[role].pid, signal.SIGCONT)
                    del stopped[role]
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
                    outcomes[role][outcome["room"]] = outcome
                done[role] = answer["done"]
            if now > limit:
                tally.violation(f"episode {index}: not over after {limit:.0f}s")
                break
            time.sleep(0.05)
        for role in stopped:
            os.kill(ranks[role].pid, signal.SIGCONT)
        self._score(index, rooms, outcomes, killed)
        for role in _ROLES:
            child = self.ranks[role]
            if role in killed or child is None:
                continue
            report = child.ask("drain", opts.settle_grace_s, timeout=opts.settle_grace_s + 30)
            self._account(role, report, closing=False)
            pool_left = opts.num_pages - report.get("written_off_pages", 0)
            if role == "decode" and pool_left < opts.num_pages // 2:
                self._close_rank("decode")  # a fresh decode rank gets a fresh pool

    def _act(  # noqa: PLR0917 - one scheduled action and the episode's state
        self,
        what: str,
        arg: str,
        port: int,
        ranks: dict[str, ChildProcess],
        stopped: dict[str, float],
        killed: set[str],
    ) -> None:
        tally = self.tally
        if what == "sigstop" and arg not in killed and arg not in stopped:
            os.kill(ranks[arg].pid, signal.SIGSTOP)
            stopped[arg] = time.monotonic() + self.rng.uniform(0.3, 2.5)
            tally.faults[f"sigstop_{arg}"] += 1
        elif what == "registry":
            assert self.registry is not None
            self.registry.restart(self.rng.uniform(0.2, 1.5))
            tally.faults["registry_restart"] += 1
        elif what == "hostile" and "prefill" not in killed:
            result = send_hostile("127.0.0.1", port, arg, secret=self.secret, timeout=3.0)
            tally.faults[f"hostile_{arg}"] += 1
            tally.hostile[result.outcome] += 1
            if result.outcome != "closed":
                tally.violation(f"hostile {arg}: not refused ({result.outcome} {result.detail})")
        elif what == "sigkill" and arg not in killed:
            stopped.pop(arg, None)
            ranks[arg].kill()
            killed.add(arg)
            self.ranks[arg] = None
            tally.faults[f"sigkill_{arg}"] += 1

    def _score(
        self,
        index: int,
        rooms: range,
        outcomes: dict[str, dict[int, dict[str, Any]]],
        killed: set[str],
    ) -> None:
        tally = self.tally
        for room in rooms:
            tally.rooms += 1
            pre, dec = outcomes["prefill"].get(room), outcomes["decode"].get(room)
            if dec is None:
                if "decode" in killed or "prefill" in killed:
                    tally.killed += 1
                else:
                    tally.violation(f"episode {index}: room {room}: no decode outcome")
                continue
            for role, out in (("prefill", pre), ("decode", dec)):
                if out is None:
                    continue
                tally.max_elapsed_s[role] = max(tally.max_elapsed_s[role], out["elapsed_s"])
                if out["wedged"]:
                    tally.wedged += 1
                    tally.violation(f"room {room}: {role} wedged")
                if not out["settled"]:
                    tally.unsettled[role] += 1
                    if role == "prefill":  # a sender always drains its handles (law 4)
                        tally.violation(f"room {room}: prefill room never settled")
                if "bad frame" in out["reason"]:
                    tally.bad_frame_rooms += 1
                if out["status"] != KVPoll.Success:
                    tally.failed_by_reason[role][_reason_class(out["reason"])] += 1
            if dec["status"] == KVPoll.Success:
                if dec["mismatched"]:
                    tally.mismatched_bytes += dec["mismatched"]
                    tally.violation(f"room {room}: {dec['mismatched']} bytes differ")
                else:
                    tally.succeeded += 1
            else:
                tally.failed += 1

    def _account(self, role: str, report: dict[str, Any], *, closing: bool) -> None:
        """Fold a rank's drain (or close) report into the tally."""
        tally = self.tally
        tally.leaks["rooms"] += report["live_rooms"]
        if report["live_rooms"]:
            tally.violation(f"{role}: {report['live_rooms']} rooms left after drain")
        for name, n in report["slow_calls"].items():
            tally.slow_calls[f"{role}.{name}"] += n
        for name, ms in report["max_call_ms"].items():
            key = f"{role}.{name}"
            tally.max_call_ms[key] = max(tally.max_call_ms.get(key, 0.0), ms)
        tally.calls += report["calls"]
        tally.late_writes += report["late_writes"]
        for note in report["late_notes"]:
            tally.violation(f"late write: {note}")
        transport = report.get("transport")
        if transport is not None:
            handles = transport["handles_created"] - transport["handles_released"]
            tally.leaks["nixl_handles"] += handles
            tally.leaks["chunks_in_flight"] += transport["in_flight"]
            if handles or transport["in_flight"]:
                tally.violation(f"{role}: {handles} NIXL handles, {transport['in_flight']} chunks")
        if closing:
            agent = report["agent"]
            dlists = agent["dlists_prepped"] - agent["dlists_released"]
            peers = agent["peers_added"] - agent["peers_removed"]
            tally.leaks["descriptor_lists"] += dlists
            tally.leaks["remote_agents"] += peers
            if dlists or peers:
                tally.violation(f"{role}: {dlists} descriptor lists, {peers} remote agents left")
            for name, value in report.get("transfer_faults", {}).items():
                if name.startswith("injected_"):
                    tally.faults[f"transfer_{name[9:]}"] += value
            for name, value in report.get("proxy", {}).items():
                if ":" in name and not name.endswith(":frames"):
                    tally.faults[f"frame_{name.replace(':', '_')}"] += value
            tally.leaks["fault_proxy_handles"] += report.get("transfer_faults", {}).get(
                "outstanding", 0
            )

    # -- the whole run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        opts = self.opts
        t0 = time.monotonic()
        episodes = 0
        try:
            self.registry = _Registry(self.secret)
            while True:
                if opts.duration_s is None and episodes >= opts.episodes:
                    break
                if opts.duration_s is not None and time.monotonic() - t0 >= opts.duration_s:
                    break
                self.episode(episodes)
                episodes += 1
        finally:
            for role in _ROLES:
                self._close_rank(role)
            if self.registry is not None:
                self.registry.close()
        return self.report(episodes, time.monotonic() - t0)

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
            "hostile": dict(t.hostile),
            "options": _options_json(self.opts),
            "violations": t.violations,
        }
        summary["ok"] = ok(summary)
        return summary


def _reason_class(reason: str) -> str:
    """A reason with numbers and peer ids blanked, for counting; the campaign's own aborts
    are one class."""
    if ABORT_REASON in reason:
        return f"aborted ({'peer' if '(peer)' in reason else 'local'}): campaign abort"
    return re.sub(r"\d+(\.\d+)?", "#", reason)[:160]


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
