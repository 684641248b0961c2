"""The demo across two network namespaces, and cutting the link between them mid-transfer.

``kvfsm demo --two-hosts`` (:func:`run_demo_two_hosts`): :class:`~kvfsm.chaos._netns.TwoHosts`
makes a prefill host and a decode host joined by a veth pair; the registry runs in the prefill
namespace on prefill's veth address, the prefill rank's control channel listens there and
registers that address, and the decode rank, in the other namespace, reaches both over the
veth. Both ranks run NIXL with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<their veth>``: shared
memory between the namespaces of one kernel would work and never touch the wire, so it is
excluded, and the veth's byte counters, read before and after the run, show the KV crossing it.

:func:`run_link_cut`: the same ranks, rooms transferring, and the link cut while chunks are in
flight (a silent blackhole both ways, or the link down). Every room still ends (Success, or
Failed with a reason) within its deadline bound on both sides and settles (decode's rooms of the
lost link the lease plus the fence margin after the last lease granted on it, the margin covering
WRITEs that TCP still holds across the cut), prefill's handles drain and are released, and
after the link is restored a second batch of rooms succeeds byte for byte on the same processes
(decode reconnects, prefill reloads the peer as a new generation).

``kvfsm chaos --two-hosts`` (:mod:`kvfsm.chaos._campaign`) runs the whole fault campaign across
the same kind of namespaces, with link cuts as one more fault.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvfsm._child import ChildProcess, spawn_quietly
from kvfsm.chaos._netns import CutMode, TwoHosts
from kvfsm.control import ChannelConfig
from kvfsm.demo import run_demo
from kvfsm.manager import ManagerConfig
from kvfsm.registry import RegistryThread
from kvfsm.rooms import RoomConfig
from kvfsm.states import KVPoll, Role
from kvfsm.transport import TransferConfig
from kvfsm.workload.options import DemoOptions
from kvfsm.workload.pair import Site, collect, running_ranks
from kvfsm.workload.plan import make_plan
from kvfsm.workload.ranks import STARVED, Outcome
from kvfsm.workload.report import reason_class

__all__ = ["CutReport", "Tuning", "TwoHostSite", "run_demo_two_hosts", "run_link_cut"]

_log = logging.getLogger("kvfsm.chaos")


# -- configuration that crosses into the rank processes (plain, picklable values) -------------


@dataclass(frozen=True, slots=True)
class Tuning:
    """Room deadlines and data-path timing for the ranks; ``None`` keeps the production value.
    Deadlines are per role (``"sender"``/``"receiver"``) and state name."""

    deadlines: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    transfer_deadline_base_s: float | None = None
    quarantine_s: float | None = None
    heartbeat_s: float | None = None
    #: ``ChannelConfig.fence_margin_s``: decode settles a lost link's pages the lease plus this
    #: after the last lease it granted there. None keeps the production value.
    fence_margin_s: float | None = None

    def channel(self, host: str) -> ChannelConfig:
        base = ChannelConfig(host=host)
        return dataclasses.replace(
            base,
            heartbeat_s=self.heartbeat_s if self.heartbeat_s is not None else base.heartbeat_s,
            fence_margin_s=(
                self.fence_margin_s if self.fence_margin_s is not None else base.fence_margin_s
            ),
        )

    def transfer(self) -> TransferConfig:
        base = TransferConfig()
        return TransferConfig(
            deadline_base_s=self.transfer_deadline_base_s or base.deadline_base_s,
            quarantine_s=self.quarantine_s if self.quarantine_s is not None else base.quarantine_s,
        )

    def needed_margin_s(self, largest_chunk_bytes: int, cut_s: float) -> float:
        """What decode's fence margin must cover when the link is cut for ``cut_s``. The lease
        stops prefill from *posting* once it ends, but bytes of a WRITE posted just before
        stay in TCP's hands across the cut, and decode cannot refuse them (removing an agent
        or deregistering memory does not stop a WRITE on TCP). They arrive after the restore,
        and TCP's retransmission backoff (doubling) may wait about as long again as the cut
        lasted: a cut counts twice, on top of the chunk deadline and quarantine of a WRITE
        still in progress when the cut began."""
        transfer = self.transfer()
        return 2 * cut_s + transfer.deadline_s(largest_chunk_bytes) + transfer.quarantine_s

    def bound_s(self, role: Role) -> float:
        """Longest a room of ``role`` can live: the sum of its states' deadlines."""
        from kvfsm.states import DEFAULT_DEADLINES  # noqa: PLC0415 - keeps the header short

        mine = self.deadlines.get(role.value, {})
        return sum(mine.get(state.name, s) for state, s in DEFAULT_DEADLINES[role].items())


def rank_config(role: str, host: str, tuning: Tuning) -> ManagerConfig:
    """A rank's config on a two-host run: the control channel on ``host`` (the veth address,
    which the registration publishes), plus ``tuning``. Module-level, so a partial of it
    pickles into the rank process."""
    del role  # both roles get the same settings; decode's channel host is unused
    channel = tuning.channel(host)
    transfer = tuning.transfer()
    deadlines = {
        Role(role_name): {KVPoll[state]: s for state, s in states.items()}
        for role_name, states in tuning.deadlines.items()
    }
    return ManagerConfig(rooms=RoomConfig(deadlines=deadlines), transfer=transfer, channel=channel)


def _registry_main(conn: Connection, host: str) -> None:
    """The registry's process (in the prefill namespace): serve on ``host`` until told to quit
    or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us
    parent = os.getppid()
    registry = RegistryThread(host)
    try:
        conn.send(registry.url)
        while os.getppid() == parent:
            if conn.poll(0.2):
                if conn.recv()[0] == "quit":
                    break
                conn.send(None)
    except (EOFError, OSError):
        pass
    finally:
        registry.close()


# -- the site: where the demo's processes run --------------------------------------------------


class TwoHostSite(Site):
    """The registry and prefill in ``hosts.prefill``'s namespace, decode in ``hosts.decode``'s,
    NIXL on UCX TCP over the veth. Reports the veth counters of the run."""

    def __init__(self, hosts: TwoHosts, tuning: Tuning | None = None) -> None:
        self.hosts = hosts
        self.tuning = tuning if tuning is not None else Tuning()
        self._before: dict[str, tuple[int, int]] = {}
        self._registry: ChildProcess | None = None

    def prefix(self, role: str) -> list[str]:
        host = self.hosts.prefill if role in ("prefill", "registry") else self.hosts.decode
        return self.hosts.command(host, env=self.hosts.ucx_env(host))

    def start_registry(self) -> tuple[str, Callable[[], None]]:
        host = self.hosts.prefill
        (child,) = spawn_quietly(
            [
                lambda: ChildProcess(
                    _registry_main, host.address, what="registry", prefix=self.prefix("registry")
                )
            ]
        )
        self._registry = child
        return str(child.greeting), child.close

    def rank(self, role: str) -> tuple[Sequence[str], Callable[[str], ManagerConfig] | None]:
        configure = functools.partial(
            rank_config, host=self.hosts.prefill.address, tuning=self.tuning
        )
        return self.prefix(role), configure

    def started(self) -> None:
        self._before = {h.role: self.hosts.counters(h) for h in self.hosts.hosts}

    def wire(self) -> dict[str, int]:
        """Bytes each veth end received and sent since :meth:`started`."""
        out: dict[str, int] = {}
        for h in self.hosts.hosts:
            rx, tx = self.hosts.counters(h)
            out[f"{h.role}_rx_bytes"] = rx - self._before[h.role][0]
            out[f"{h.role}_tx_bytes"] = tx - self._before[h.role][1]
        return out

    def report(self) -> dict[str, Any]:
        p, d = self.hosts.hosts
        return {
            "two_hosts": {
                "prefill": {"netns": p.netns, "device": p.device, "address": p.address},
                "decode": {"netns": d.netns, "device": d.device, "address": d.address},
                "ucx": {"prefill": self.hosts.ucx_env(p), "decode": self.hosts.ucx_env(d)},
                "wire": self.wire(),
            }
        }


def crossed_wire(summary: Mapping[str, Any]) -> bool:
    """The KV really went over the veth: prefill's end sent, and decode's end received, at
    least every byte decode checked in (TCP adds headers; control frames add a little)."""
    wire = summary["two_hosts"]["wire"]
    moved = int(summary["bytes"])
    return bool(
        moved > 0 and wire["prefill_tx_bytes"] >= moved and wire["decode_rx_bytes"] >= moved
    )


def run_demo_two_hosts(opts: DemoOptions) -> dict[str, Any]:
    """``kvfsm demo --two-hosts``: the demo with each rank in its own namespace."""
    with TwoHosts() as hosts:
        summary = run_demo(opts, TwoHostSite(hosts))
    summary["two_hosts"]["crossed_wire"] = crossed_wire(summary)
    return summary


# -- cutting the link mid-transfer ------------------------------------------------------------


@dataclass(slots=True)
class CutReport:
    """What :func:`run_link_cut` saw; ``problems`` lists every broken invariant (empty: pass)."""

    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    before: dict[str, dict[int, Outcome]] = field(default_factory=dict)
    after: dict[str, dict[int, Outcome]] = field(default_factory=dict)
    nixl: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


#: How long the cut scenario holds the link cut.
CUT_S = 4.0

#: Deadlines for the cut scenario: production shapes, shrunk so that a room orphaned by the
#: cut (a prefill room whose decode room failed before its page list went out waits out its
#: Bootstrapping deadline) ends within seconds. Decode settles the rooms of the lost link 2 s
#: (the lease) + 13 s (the margin) after its last grant there: the margin exceeds the 12 s a
#: WRITE posted under the lease may still take to land across a ``CUT_S`` cut (twice the cut,
#: a 3 s chunk deadline, 1 s quarantine: :meth:`Tuning.needed_margin_s`).
CUT_TUNING = Tuning(
    deadlines={
        "sender": {"Bootstrapping": 8.0, "WaitingForInput": 8.0, "Transferring": 8.0},
        "receiver": {"Bootstrapping": 8.0, "WaitingForInput": 8.0, "Transferring": 10.0},
    },
    transfer_deadline_base_s=3.0,
    quarantine_s=1.0,
    fence_margin_s=13.0,
)


def cut_options(tuning: Tuning = CUT_TUNING, **overrides: Any) -> DemoOptions:
    """The workload of the cut scenario: smallish rooms, wedge check at the deadline bound,
    and a settle wait past decode's settle bound for the rooms of the lost link (a decode room may
    have ended up to the silence window before its link was declared lost)."""
    bound = max(tuning.bound_s(Role.SENDER), tuning.bound_s(Role.RECEIVER))
    channel = tuning.channel("127.0.0.1")
    base: dict[str, Any] = {
        "requests": 80,
        "concurrency": 8,
        "num_pages": 1024,
        "layers": 8,
        "max_room_pages": 16,
        "room_timeout_s": bound + 2.0,  # past the bound, a room counts as wedged
        "settle_grace_s": channel.silence_s + channel.settle_after_loss_s + 3.0,
        "idle_sleep_s": 0.0005,
        "progress": False,
        "seed": 7,
    }
    base.update(overrides)
    return DemoOptions(**base)


def largest_chunk_bytes(opts: DemoOptions) -> int:
    return opts.max_room_pages * opts.total_page_bytes + opts.aux_row_bytes


def _batch(
    prefill: ChildProcess,
    decode: ChildProcess,
    opts: DemoOptions,
    first_room: int,
    *,
    during: Callable[[dict[int, Outcome], dict[int, Outcome]], None] | None = None,
) -> tuple[dict[int, Outcome], dict[int, Outcome]]:
    """Run one batch of ``opts.requests`` rooms from ``first_room`` to the end on both sides;
    ``during(pre, dec)`` is called between collections."""
    pre: dict[int, Outcome] = {}
    dec: dict[int, Outcome] = {}
    prefill.ask("run", first_room)
    decode.ask("run", first_room)
    starved = False
    while len(dec) < opts.requests or (len(pre) < opts.requests and not starved):
        time.sleep(0.02)
        collect(prefill, pre, "prefill")
        starved |= collect(decode, dec, "decode")
        if during is not None:
            during(pre, dec)
    return pre, dec


def _drained(prefill: ChildProcess, timeout_s: float) -> dict[str, Any]:
    """Prefill's NIXL counters once nothing is in flight (stalled chunks finish quarantine)."""
    deadline = time.monotonic() + timeout_s
    counters: dict[str, Any] = prefill.ask("nixl")
    while counters["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
        counters = prefill.ask("nixl")
    return counters


def run_link_cut(
    opts: DemoOptions | None = None,
    *,
    mode: CutMode = "blackhole",
    cut_after: int = 12,
    cut_s: float = CUT_S,
    tuning: Tuning = CUT_TUNING,
) -> CutReport:
    """Run a batch of rooms across two namespaces; once ``cut_after`` decode rooms have ended
    and prefill has chunks in flight, cut the link for ``cut_s`` seconds; let the batch finish;
    check the invariants; then run a second batch on the restored link, which must all succeed.
    """
    opts = opts if opts is not None else cut_options(tuning)
    opts.validate()
    needed = tuning.needed_margin_s(largest_chunk_bytes(opts), cut_s)
    margin = tuning.channel("127.0.0.1").fence_margin_s
    if not margin > needed:
        raise ValueError(
            f"fence_margin_s {margin:g} s must exceed the {needed:.1f} s a WRITE posted under "
            f"the lease may take to land across a {cut_s:g} s cut"
        )
    seed = opts.seed if opts.seed is not None else 1
    report = CutReport()
    problems = report.problems
    with TwoHosts() as hosts:
        site = TwoHostSite(hosts, tuning)
        with running_ranks(site, opts, seed) as (prefill, decode):
            cut_at: list[float] = []
            restored_at: list[float] = []
            in_flight_at_cut: list[int] = []

            def during(pre: dict[int, Outcome], dec: dict[int, Outcome]) -> None:
                now = time.time()
                if not cut_at and len(dec) >= cut_after:
                    in_flight = int(prefill.ask("nixl")["in_flight"])
                    if in_flight:  # chunks are on the wire right now: cut under them
                        hosts.cut(mode)
                        cut_at.append(time.time())
                        in_flight_at_cut.append(in_flight)
                elif cut_at and not restored_at and now - cut_at[0] >= cut_s:
                    hosts.restore()
                    restored_at.append(time.time())

            t0 = time.time()
            pre, dec = _batch(prefill, decode, opts, 0, during=during)
            if hosts.is_cut:
                hosts.restore()
                restored_at.append(time.time())
            drained = _drained(prefill, timeout_s=tuning.bound_s(Role.SENDER))
            wire_before = site.wire()
            t1 = time.time()
            pre2, dec2 = _batch(prefill, decode, opts, opts.requests)
            t2 = time.time()
            wire_after = site.wire()
            final = _drained(prefill, timeout_s=tuning.bound_s(Role.SENDER))
            decode_nixl = decode.ask("nixl")
            late = decode.ask("late")
            engines = {"prefill": prefill.ask("stats"), "decode": decode.ask("stats")}
    report.before = {"prefill": pre, "decode": dec}
    report.after = {"prefill": pre2, "decode": dec2}
    report.nixl = {"prefill_after_cut": drained, "prefill_final": final, "decode": decode_nixl}
    if not cut_at:
        problems.append(f"the link was never cut: no chunk in flight after {cut_after} rooms")
        return report
    t_cut = cut_at[0]
    # Law 4: nothing landed in a page or aux row after its room settled (the poison of every
    # free one checked when it was handed out again, and now).
    if late["late_writes"]:
        problems.append(f"{late['late_writes']} late writes: " + "; ".join(late["notes"]))
    report.figures["late_writes"] = late["late_writes"]
    _check_cut_batch(report, opts, seed, tuning, t_cut)
    _check_after(report, opts, seed, dec2, pre2)
    # NIXL: after the drain every transfer handle is released; the lists left are the local
    # ones (kv, aux, the flush's scratch) and those of the peer generation now connected (kv,
    # aux, the flush's target).
    for name, counters in (("after the cut", drained), ("at the end", final)):
        if counters["in_flight"]:
            problems.append(f"prefill has {counters['in_flight']} chunks in flight {name}")
        if counters["handles_created"] != counters["handles_released"]:
            problems.append(
                f"prefill handles {name}: {counters['handles_created']} made, "
                f"{counters['handles_released']} released"
            )
    live_lists = final["dlists_prepped"] - final["dlists_released"]
    live_peers = final["peers_added"] - final["peers_removed"]
    if live_peers != 1 or live_lists != 3 + 3 * live_peers:
        problems.append(
            f"prefill holds {live_lists} descriptor lists and {live_peers} peers at the end "
            "(want 3 local + 3 for the one connected peer)"
        )
    if decode_nixl["dlists_prepped"] - decode_nixl["dlists_released"] != 3:  # its local ones
        problems.append(f"decode descriptor lists: {decode_nixl}")
    moved2 = sum(
        len(r.src) * opts.total_page_bytes + opts.aux_row_bytes
        for r in make_plan(opts, seed, opts.requests)
    )
    crossed = wire_after["prefill_tx_bytes"] - wire_before["prefill_tx_bytes"]
    if crossed < moved2:
        problems.append(f"after restore, {moved2} bytes moved but the veth sent only {crossed}")
    report.figures.update(
        {
            "mode": mode,
            "cut_s": round((restored_at[0] if restored_at else t_cut) - t_cut, 3),
            "chunks_in_flight_at_cut": in_flight_at_cut[0],
            "first_batch_s": round(t1 - t0, 3),
            "second_batch_s": round(t2 - t1, 3),
            "second_batch_gbps": round(moved2 / (t2 - t1) / 1e9, 4) if t2 > t1 else 0.0,
            "wire_second_batch_prefill_tx": crossed,
            "transport": {k: final[k] for k in ("chunks_stalled", "chunks_failed", "peers_lost")},
            "control": {
                side: engines[side].get("control", {}).get("links_lost", 0)
                for side in ("prefill", "decode")
            },
        }
    )
    return report


def _check_cut_batch(
    report: CutReport, opts: DemoOptions, seed: int, tuning: Tuning, t_cut: float
) -> None:
    """The batch the cut hit: every room on both sides terminal, with a reason if Failed,
    within its deadline bound; prefill settled; bytes of successes correct."""
    problems, figures = report.problems, report.figures
    pre, dec = report.before["prefill"], report.before["decode"]
    reasons: dict[str, Counter[str]] = {"prefill": Counter(), "decode": Counter()}
    cut_to_failed: dict[str, list[float]] = {"prefill": [], "decode": []}
    for req in make_plan(opts, seed, 0):
        for side, outcomes, role in (
            ("prefill", pre, Role.SENDER),
            ("decode", dec, Role.RECEIVER),
        ):
            o = outcomes.get(req.room)
            if o is None:
                if side == "prefill" and dec.get(req.room, Outcome(0, 0, "", 0)).reason == STARVED:
                    continue  # decode never started it: no prefill room was made either
                problems.append(f"room {req.room}: no {side} outcome (lost)")
                continue
            if o.wedged or o.elapsed_ms / 1e3 > tuning.bound_s(role):
                problems.append(f"room {req.room}: {side} room past its deadline bound: {o}")
            if o.status not in (KVPoll.Success, KVPoll.Failed):
                problems.append(f"room {req.room}: {side} room not terminal: {o}")
            if o.status == KVPoll.Failed:
                if not o.reason:
                    problems.append(f"room {req.room}: {side} room Failed without a reason")
                reasons[side][reason_class(o.reason)] += 1
                started = o.ended_at - o.elapsed_ms / 1e3
                if started < t_cut < o.ended_at:  # live when the link went
                    cut_to_failed[side].append(o.ended_at - t_cut)
            if o.unsettled:
                # Prefill drains its handles; decode hears the settle, or settles the rooms of
                # the lost link the lease plus the margin after its last grant (law 4).
                problems.append(f"room {req.room}: {side} room never settled: {o}")
        d = dec.get(req.room)
        if d is not None and d.mismatched:
            problems.append(f"room {req.room}: {d.mismatched} of {d.checked} bytes differ")
    failed = {side: sum(c.values()) for side, c in reasons.items()}
    if not failed["prefill"] or not failed["decode"]:
        problems.append(f"the cut failed no room on some side: {failed}")
    figures["cut_batch"] = {
        side: {
            "succeeded": sum(o.status == KVPoll.Success for o in outcomes.values()),
            "failed": failed[side],
            "failed_by_reason": dict(reasons[side].most_common()),
            "live_at_cut_failed": len(cut_to_failed[side]),
            "cut_to_failed_s_max": round(max(cut_to_failed[side], default=0.0), 3),
            "cut_to_failed_s_p50": round(float(np.median(cut_to_failed[side])), 3)
            if cut_to_failed[side]
            else 0.0,
        }
        for side, outcomes in (("prefill", pre), ("decode", dec))
    }
    figures["settle_after_loss_s"] = tuning.channel("127.0.0.1").settle_after_loss_s
    figures["deadline_bound_s"] = {
        "prefill": tuning.bound_s(Role.SENDER),
        "decode": tuning.bound_s(Role.RECEIVER),
    }


def _check_after(
    report: CutReport,
    opts: DemoOptions,
    seed: int,
    dec: dict[int, Outcome],
    pre: dict[int, Outcome],
) -> None:
    """The batch after the restore: every room succeeds on both sides, bytes checked."""
    bad = 0
    for req in make_plan(opts, seed, opts.requests):
        d, p = dec.get(req.room), pre.get(req.room)
        if d is None or p is None or d.status != KVPoll.Success or p.status != KVPoll.Success:
            bad += 1
            if bad <= 5:
                report.problems.append(f"after restore, room {req.room}: prefill {p}, decode {d}")
        elif d.mismatched or d.unsettled or p.unsettled:
            report.problems.append(f"after restore, room {req.room}: {d}")
    report.figures["after_restore"] = {"requests": opts.requests, "not_succeeded": bad}
