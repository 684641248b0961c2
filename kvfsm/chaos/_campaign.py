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
connections come from a helper process in the decode namespace, across the veth
(:mod:`kvfsm.chaos._netns_helpers`).

This module runs the ranks and the episodes; which faults an episode gets and how each is made
is :mod:`kvfsm.chaos._campaign_faults`, the checks on its outcomes and the report
:mod:`kvfsm.chaos._campaign_scoring`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

from kvfsm._child import ChildProcess, environ, spawn_quietly
from kvfsm.chaos._campaign_faults import DUE_BY_ENDED, CampaignFaults
from kvfsm.chaos._campaign_scoring import ROLES, ok
from kvfsm.chaos._netns import TwoHosts
from kvfsm.chaos._netns_helpers import NetnsRegistry, helper_main
from kvfsm.chaos._options import CampaignOptions, episode_plan
from kvfsm.chaos._rank import rank_main
from kvfsm.registry import RegistryThread
from kvfsm.states import Role

__all__ = ["ok", "run_campaign"]

_log = logging.getLogger("kvfsm.chaos")


class _Campaign(CampaignFaults):
    """The campaign process: its ranks, one episode after another, and the whole run."""

    def __init__(self, opts: CampaignOptions) -> None:
        super().__init__(opts)
        self.first_room = 0
        self.incarnations = 0
        self.level = logging.getLogger("kvfsm").getEffectiveLevel()

    # -- ranks ---------------------------------------------------------------------------------

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
        missing = [role for role in ROLES if self.ranks[role] is None]
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
        outcomes: dict[str, dict[tuple[int, int], dict[str, Any]]] = {r: {} for r in ROLES}
        done = dict.fromkeys(ROLES, False)
        killed: set[str] = set()
        stopped: dict[str, float] = {}
        t0 = time.monotonic()
        # Every room within its bound, plus what the freezes planned add (no room moves then).
        freezes = [what for _, what, _ in actions if what in ("long_freeze", "decode_freeze")]
        limit = (opts.rooms / opts.concurrency + 2) * (
            max(opts.bound_s(r) for r in Role) + opts.slack_s
        ) + len(freezes) * (opts.longest_stop_s() + opts.after_resume_s)
        retried: set[tuple[float, str, str]] = set()  # due by time only
        while not all(done[r] or r in killed for r in ROLES) or any(
            what == "after_resume" for _, what, _ in actions
        ):
            now = time.monotonic() - t0
            ended = self.ended = sum(len(outcomes[r]) for r in ROLES) / (2 * opts.rooms)
            while actions and (
                actions[0][0] <= now
                or (actions[0] not in retried and DUE_BY_ENDED * actions[0][0] / span <= ended)
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
            for role in ROLES:
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
        # A fault still planned when the episode's rooms have all ended is not made: the report
        # says so (``unmade_<what>`` among the faults) rather than leave it out in silence.
        for _, what, _ in actions:
            tally.faults[f"unmade_{what}"] += 1
        self.decode_frozen = False
        if self.hosts is not None:
            self.hosts.restore()
        self._score(index, plans, outcomes, killed)
        self._liveness(index, outcomes)
        self._after_freezes(plans, outcomes)
        wait = opts.settle_wait_s()
        for role in ROLES:
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
            for role in ROLES:
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
                    helper_main,
                    address,
                    secret,
                    True,
                    what="registry",
                    prefix=hosts.command(hosts.prefill),
                ),
                lambda: ChildProcess(
                    helper_main,
                    address,
                    secret,
                    False,
                    what="hostile source",
                    prefix=hosts.command(hosts.decode),
                ),
            ]
        )
        self.registry = NetnsRegistry(registry)
        self.hostile_source = source


def run_campaign(opts: CampaignOptions) -> dict[str, Any]:
    opts.validate()
    return _Campaign(opts).run()
