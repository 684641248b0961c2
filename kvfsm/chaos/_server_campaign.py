"""``kvfsm chaos servers``: the seeded plan (:mod:`._server_plan`) run against real SGLang
servers (:mod:`._server_rig`), one episode per fault, and scored (:mod:`._server_scoring`).
Prefill and decode run in two network namespaces joined by a data link
(:class:`~kvfsm.chaos._server_hosts.ServerHosts`), which the link-cut faults cut; where
namespaces cannot be made (not root, no ``ip``), or with ``one_host``, every server shares this
host's loopback and the link cuts are left out, each with the reason printed.

An episode: the reference server answers the episode's requests first (greedy: the tokens a
completed request must equal); then the requests go to the router at their planned times and
the fault lands while they are in flight; when every request has ended (or its client gave up:
hung), a killed or restarted server is started again behind the same port, the router is
waited for until it serves, and both kvfsm servers are read until they hold no live room, no
page and no NIXL handle (or the drain bound passes); their ``/failures`` name the rooms that
ended by a deadline and those the unclaimed bound failed.

The first episode has no fault: the calibration (:class:`Calibration`). How much longer the
pipeline takes than the reference server for the same load is the factor every later bound
allows for queueing behind its own episode's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvfsm.chaos._netns import CutMode, NetnsError
from kvfsm.chaos._server_client import payload, send_request
from kvfsm.chaos._server_hosts import ServerHosts
from kvfsm.chaos._server_plan import (
    Action,
    PlanOptions,
    ServerEpisode,
    calibration_episode,
    plan_episodes,
)
from kvfsm.chaos._server_rig import Rig, group_usage, scheduler_pids
from kvfsm.chaos._server_scoring import (
    SGLANG_SLACK_S,
    EpisodeRecord,
    RequestOutcome,
    Score,
    end_bound_s,
    score,
)
from kvfsm.chaos._server_soak import Sample, Sampler
from kvfsm.chaos._servers import KVFSM_ENV, LIVENESS_S, SHIM, Server

__all__ = [
    "LINK_CUT_SKIP",
    "Calibration",
    "CampaignResult",
    "ServerCampaignOptions",
    "run_server_campaign",
]

#: Why the link-cut faults are not injected when the servers share this host's loopback.
LINK_CUT_SKIP = (
    "not injected: every SGLang server of this run shares one network namespace, on loopback, "
    "which no cut separates"
)
LINK_FAULTS = ("link-down link", "link-blackhole link")
#: How long the calibration episode's client waits before it calls a request hung (beside the
#: bounds every episode has): a load of 64 with prompts up to 2,000 tokens takes about a minute
#: through the pipeline on two cores.
CALIBRATION_WAIT_S = 300.0


@dataclass
class ServerCampaignOptions:
    seed: int
    plan: PlanOptions = field(default_factory=PlanOptions)
    kinds: list[str] | None = None
    #: Run the plan again (new seeds) until this many minutes passed (a soak).
    minutes: float | None = None
    #: The prefill's unclaimed bound in these servers (``KVFSM_UNCLAIMED_S``).
    unclaimed_s: float = 8.0
    #: How many router-to-decode requests the dropped-decode-half fault resets.
    drops: int = 2
    log_dir: Path | None = None
    shim: Path = SHIM
    sample_every_s: float = 60.0
    #: kvfsm prefill and decode servers (1 or 2 each); faults land on the first of each.
    prefills: int = 1
    decodes: int = 1
    #: Run every server on this host's loopback (no link cuts) even where two network
    #: namespaces could be made.
    one_host: bool = False


@dataclass
class CampaignResult:
    seed: int
    records: list[EpisodeRecord]
    outcomes: list[RequestOutcome]
    score: Score
    samples: list[Sample]
    skipped: dict[str, str]
    elapsed_s: float
    log_dir: Path
    liveness_s: float
    lease_s: float
    unclaimed_s: float
    #: The soak's length asked for (None: one pass of the plan).
    minutes: float | None = None
    #: The reference server's tokens for each request.
    reference: dict[int, list[int]] = field(default_factory=dict)
    #: Where prefill and decode ran (the namespaces and their addresses), or "one host".
    topology: str = "one host"
    #: The no-fault calibration: the reference server's seconds and the pipeline's for the
    #: same load (the first episode), and the queueing factor every bound took from them.
    calibration: Calibration | None = None


@dataclass(frozen=True)
class Calibration:
    """How much slower the disaggregated pipeline (router, prefill, decode, on this host's
    cores) serves a load than the reference server alone, measured with no fault. A fault's
    bound allows its episode's reference time times this factor for queueing
    (:func:`~kvfsm.chaos._server_scoring.end_bound_s`): a request that waits behind its own
    load is not late, one that waits longer is."""

    reference_s: float
    pipeline_s: float
    requests: int

    @property
    def factor(self) -> float:
        return max(1.0, self.pipeline_s / max(self.reference_s, 1e-3))


def _lease_s() -> float:
    return float(KVFSM_ENV["KVFSM_LEASE_S"])


def _episodes(
    o: ServerCampaignOptions, cycle: int, episodes: int, requests: int
) -> list[ServerEpisode]:
    """Pass ``cycle`` of the plan (a soak's passes each have their own seed), its episodes and
    requests numbered on from those before: scores and reference outputs go by number."""
    return plan_episodes(
        o.seed + cycle, o.plan, o.kinds, first_episode=episodes, first_request=requests
    )


async def _reference(url: str, episode: ServerEpisode) -> dict[int, list[int]]:
    """The reference server's greedy output for each request, a few at a time."""
    gate = asyncio.Semaphore(4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def one(i: int) -> tuple[int, list[int]]:
            req = episode.requests[i]
            body = {**payload(req, f"kvfsm-chaos-ref-{os.getpid()}-{req.index}"), "stream": False}
            async with gate, s.post(url + "/generate", json=body) as resp:
                answer: Any = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RuntimeError(f"the reference server answered {resp.status}: {answer}")
                return req.index, list(answer["output_ids"])

        pairs = await asyncio.gather(*(one(i) for i in range(len(episode.requests))))
    return dict(pairs)


class _Injector:
    """Lands one episode's fault on the rig; ``at`` is when it landed (monotonic)."""

    def __init__(self, rig: Rig, drops: int) -> None:
        self.rig, self.drops = rig, drops
        self.at: float | None = None
        #: Why the fault could not land, if it could not.
        self.missed = ""

    def _schedulers(self, name: str) -> list[int]:
        pids = scheduler_pids(self.rig.by_name(name))
        if not pids:
            self.missed = f"no scheduler process in {name}'s process group"
        return pids

    async def _rooms_in_flight(self, name: str, within_s: float) -> None:
        """Until ``name`` has a live room (its status server says), for at most ``within_s``:
        a fault of a kvfsm server lands while it holds rooms, not between them."""
        server = self.rig.by_name(name)
        give_up = time.monotonic() + within_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while time.monotonic() < give_up:
                try:
                    async with s.get(server.status_url + "/stats") as resp:
                        if (await resp.json())["rooms"]["live"] > 0:
                            return
                except (aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError):
                    pass
                await asyncio.sleep(0.02)

    @staticmethod
    async def _supervise(server: Server, within_s: float = 30.0) -> None:
        """What a supervisor does for a server that crashed: once its process has exited
        (SGLang's launcher ends itself when one of its schedulers dies), or after
        ``within_s`` if it has not (its liveness probe failing), what is left of its process
        group is killed and it is started again at once, behind the same address and port,
        while the episode's requests are still ending. The episode waits for it to be ready
        after them."""
        give_up = time.monotonic() + within_s
        while server.proc is not None and server.proc.poll() is None:
            if time.monotonic() > give_up:
                break
            await asyncio.sleep(0.1)
        await asyncio.to_thread(server.kill)
        # From this (the main) thread: a server dies with the thread that started it (its
        # parent-death signal), and the loop's worker threads end with the loop.
        server.start()

    async def land(self, episode: ServerEpisode, start: float) -> None:
        fault, rig = episode.fault, self.rig
        if fault.action is Action.DROP_DECODE_HALF:
            # Armed before the first request goes out: the router sends a request's two halves
            # as soon as it has it.
            self.at = time.monotonic()
            rig.arm_drops(self.drops)
            return
        if fault.target in ("prefill", "decode", "link"):
            # From the load's start: a prefill room lives only while its pages move, a few
            # hundred milliseconds here, and ``fault_at_s`` would often miss them all. A link
            # is cut while prefill has rooms whose pages cross it.
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            watched = "prefill" if fault.target == "link" else fault.target
            await self._rooms_in_flight(watched, episode.fault_at_s + 5.0)
        else:
            await asyncio.sleep(max(0.0, start + episode.fault_at_s - time.monotonic()))
        self.at = time.monotonic()
        if fault.action is Action.KILL_SCHEDULER:
            for pid in self._schedulers(fault.target):
                os.kill(pid, signal.SIGKILL)
            await self._supervise(rig.by_name(fault.target))
        elif fault.action is Action.KILL_SERVER:
            await asyncio.to_thread(rig.by_name(fault.target).kill)
            await self._supervise(rig.by_name(fault.target))
        elif fault.action is Action.STOP:
            pids = self._schedulers(fault.target)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(fault.pause_s)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        elif fault.action in (Action.LINK_DOWN, Action.LINK_BLACKHOLE):
            hosts = rig.hosts
            if hosts is None:
                self.missed = LINK_CUT_SKIP
                return
            mode: CutMode = "down" if fault.action is Action.LINK_DOWN else "blackhole"
            await asyncio.to_thread(hosts.cut, mode)
            try:
                await asyncio.sleep(fault.pause_s)
            finally:
                await asyncio.to_thread(hosts.restore)
        elif fault.action is Action.RESTART:
            # Behind the same address and port, while requests are in flight: SIGTERM (a
            # deployment's restart), then started again at once.
            server = rig.by_name(fault.target)
            await asyncio.to_thread(server.stop)
            # Started from this (the main) thread: a server dies with the thread that started
            # it (its parent-death signal), and the loop's worker threads end with the loop.
            server.start()
        # DISCONNECT and ABORT are the plan's own requests; they land at their times.


async def _episode_load(
    rig: Rig, episode: ServerEpisode, *, epoch: float, hang_s: float, injector: _Injector, tag: str
) -> list[RequestOutcome]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        start = time.monotonic() + 0.1
        abort_urls = [s.url for s in rig.kvfsm_servers]
        fault = asyncio.ensure_future(injector.land(episode, start))
        sends = [
            send_request(
                s,
                rig.router.url,
                abort_urls,
                r,
                episode.index,
                epoch=epoch,
                start=start,
                hang_s=hang_s,
                tag=tag,
            )
            for r in episode.requests
        ]
        outcomes = await asyncio.gather(*sends)
        await fault
    return list(outcomes)


def _drain(rig: Rig, record: EpisodeRecord, bound_s: float) -> None:
    give_up = time.monotonic() + bound_s
    while True:
        readings = [rig.read_drain(s) for s in rig.kvfsm_servers]
        if all(r.clean for r in readings) or time.monotonic() > give_up:
            record.drain = readings
            return
        time.sleep(0.5)


def _run_episode(
    rig: Rig,
    episode: ServerEpisode,
    o: ServerCampaignOptions,
    epoch: float,
    say: Callable[[str], None],
    *,
    factor: float | None,
) -> tuple[EpisodeRecord, list[RequestOutcome], dict[int, list[int]]]:
    """One episode. ``factor`` is the calibration's queueing factor; None for the calibration
    episode itself, whose queueing allowance is the pipeline's time it measures."""
    fault = episode.fault
    served = time.monotonic()
    reference = asyncio.run(_reference(rig.reference.url, episode))
    load_s = round(time.monotonic() - served, 1)
    # The calibration has no allowance to go by yet: its client waits as long as any episode's.
    queue_s = load_s * factor if factor is not None else CALIBRATION_WAIT_S
    bound = end_bound_s(fault, LIVENESS_S, _lease_s(), o.unclaimed_s, queue_s)
    began, began_wall = time.monotonic(), time.time()
    injector = _Injector(rig, o.drops)
    tag = f"{o.seed}-{int(began)}"
    outcomes = asyncio.run(
        _episode_load(rig, episode, epoch=epoch, hang_s=bound + 30.0, injector=injector, tag=tag)
    )
    rig.disarm_drops()
    loaded = time.monotonic()
    record = EpisodeRecord(episode, None if injector.at is None else injector.at - epoch)
    record.skipped = injector.missed
    record.load_s = load_s
    record.queue_s = round(queue_s if factor is not None else loaded - began, 1)
    restart = fault.restarts
    if restart is not None:
        # Started again by the injector, as a supervisor would, the moment it went down.
        rig.by_name(restart).wait_ready()
    # A server that ended itself under the fault (kvfsm's fenced-out exit, status 75, which
    # leaves the restart to the supervisor by design) is started again here, as a supervisor
    # would, and named in the report.
    for server, why in rig.exited():
        say(f"episode {episode.index}: {server.name} exited ({why}); starting it again")
        record.supervisor_restarts.append(f"{server.name}: {why}")
        rig.restart_server(server)
    restarted = time.monotonic()
    rig.wait_serving()
    serving = time.monotonic()
    _drain(rig, record, LIVENESS_S + _lease_s() + o.unclaimed_s + SGLANG_SLACK_S)
    drained = time.monotonic()
    record.phases_s = {
        "reference": round(began - served, 1),
        "load": round(loaded - began, 1),
        "restart": round(restarted - loaded, 1),
        "serving": round(serving - restarted, 1),
        "drain": round(drained - serving, 1),
    }
    for server in rig.kvfsm_servers:
        for row in rig.failures_since(server, began_wall):
            reason = str(row.get("reason", ""))
            if str(row.get("reason_kind", "")).startswith("deadline"):
                record.deadline_rooms.append(row)
            if "no decode room claimed" in reason:
                record.unclaimed_rooms.append(row)
    ended = sum(1 for x in outcomes if x.status != "hung")
    say(
        f"episode {episode.index} {fault.kind}: {ended}/{len(outcomes)} ended, "
        f"{sum(x.status == 'completed' for x in outcomes)} completed, "
        f"drained {all(d.clean for d in record.drain)} ({time.monotonic() - began:.0f}s: "
        + ", ".join(f"{k} {v:g}s" for k, v in record.phases_s.items())
        + ")"
    )
    return record, outcomes, reference


def run_server_campaign(
    o: ServerCampaignOptions, say: Callable[[str], None] = print
) -> CampaignResult:
    with contextlib.ExitStack() as stack:
        hosts, skipped = _hosts(o, stack)
        o.plan = PlanOptions(**{**o.plan.__dict__, "skip": frozenset(skipped) | o.plan.skip})
        for kind, why in skipped.items():
            say(f"fault {kind!r} {why}")
        if hosts is not None:
            say(f"two hosts: {hosts.describe()}")
        return _run(o, hosts, skipped, say)


def _up(server: Server) -> bool:
    """Serving in its current incarnation: a sample of a server still starting (or dead) would
    read its growth from a process that has not loaded its model yet."""
    return (
        server.proc is not None
        and server.proc.poll() is None
        and len(server.startup_s) >= server.starts
    )


def _hosts(
    o: ServerCampaignOptions, stack: contextlib.ExitStack
) -> tuple[ServerHosts | None, dict[str, str]]:
    """The two server hosts (entered on ``stack``), or None and why each link cut is left
    out."""
    if o.one_host:
        return None, {kind: LINK_CUT_SKIP + " (one host asked for)" for kind in LINK_FAULTS}
    try:
        hosts = ServerHosts()
        stack.enter_context(hosts)
    except NetnsError as exc:
        why = f"{LINK_CUT_SKIP}: two network namespaces cannot be made here ({exc})"
        return None, dict.fromkeys(LINK_FAULTS, why)
    return hosts, {}


def _run(
    o: ServerCampaignOptions,
    hosts: ServerHosts | None,
    skipped: dict[str, str],
    say: Callable[[str], None],
) -> CampaignResult:
    log_dir = o.log_dir or Path(tempfile.mkdtemp(prefix="kvfsm-chaos-servers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"KVFSM_UNCLAIMED_S": str(o.unclaimed_s)}
    rig = Rig(log_dir, env, o.shim, hosts, o.prefills, o.decodes)
    epoch = time.monotonic()
    records: list[EpisodeRecord] = []
    outcomes: list[RequestOutcome] = []
    reference: dict[int, list[int]] = {}
    calibration: Calibration | None = None
    sampler = Sampler(
        lambda: [(s.name, s.starts, *group_usage(s)) for s in rig.kvfsm_servers if _up(s)],
        lambda: len(outcomes),
        epoch,
        o.sample_every_s,
    )
    say(f"seed {o.seed}; servers' logs in {log_dir}")
    try:
        rig.start()
        say(f"servers up in {time.monotonic() - epoch:.0f}s")
        sampler.start()
        record, got, reference = _run_episode(
            rig, calibration_episode(o.seed, o.plan), o, epoch, say, factor=None
        )
        records.append(record)
        outcomes += got
        calibration = Calibration(record.load_s, record.queue_s, len(got))
        say(
            f"calibration: {calibration.requests} requests with no fault, reference "
            f"{calibration.reference_s:g}s, pipeline {calibration.pipeline_s:g}s: each fault's "
            f"bound allows its reference time x {calibration.factor:.1f} for queueing"
        )
        cycle = 0
        while True:
            for episode in _episodes(o, cycle, len(records), len(outcomes)):
                record, got, ref = _run_episode(
                    rig, episode, o, epoch, say, factor=calibration.factor
                )
                records.append(record)
                outcomes += got
                reference.update(ref)
                if o.minutes is not None and time.monotonic() - epoch > o.minutes * 60:
                    break
            cycle += 1
            if o.minutes is None or time.monotonic() - epoch > o.minutes * 60:
                break
    finally:
        sampler.stop()
        rig.stop()
    result = score(
        records,
        outcomes,
        reference,
        liveness_s=LIVENESS_S,
        lease_s=_lease_s(),
        unclaimed_s=o.unclaimed_s,
    )
    return CampaignResult(
        o.seed,
        records,
        outcomes,
        result,
        sampler.samples,
        skipped,
        time.monotonic() - epoch,
        log_dir,
        LIVENESS_S,
        _lease_s(),
        o.unclaimed_s,
        o.minutes,
        reference,
        "one host" if hosts is None else hosts.describe(),
        calibration,
    )
