"""How a campaign scores its episodes and reports: the checks every room's outcome must pass,
liveness after a peer was lost (law 3), the rooms served after a decode freeze, what the ranks
counted and still hold after a drain, and the report with its verdict (:func:`ok`).

What each rank checks itself is :mod:`kvfsm.chaos._rank`; the faults that the scores are
checked against are :mod:`kvfsm.chaos._campaign_faults`.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict
from typing import Any, Final

from kvfsm.chaos._options import CampaignOptions, RoomPlan
from kvfsm.chaos._rank import CAMPAIGN_ABORT
from kvfsm.states import KVPoll, Role
from kvfsm.workload.report import reason_class

__all__ = ["ROLES", "CampaignScoring", "Tally", "ok"]

ROLES: Final = ("prefill", "decode")
#: Decode reasons of a room that was bound to a control link when that link was lost.
_LINK_LOST: Final = re.compile(r"^peer lost: (connection to |prefill-.* silent)")


class Tally:
    """Everything the report counts."""

    def __init__(self) -> None:
        self.rooms = self.succeeded = self.failed = self.killed = self.wedged = 0
        self.mismatched_bytes = self.late_writes = self.starved = 0
        self.unsettled: Counter[str] = Counter()
        #: Without a secret: decode rooms left unsettled after the fault proxy dropped or
        #: reordered one of their frames (maybe the acknowledgement itself): not a violation.
        self.unsettled_disordered = 0
        self.restarts: Counter[str] = Counter()
        self.failed_by_reason: dict[str, Counter[str]] = {r: Counter() for r in ROLES}
        self.faults: Counter[str] = Counter()
        self.slow_calls: Counter[str] = Counter()
        self.max_call_ms: dict[str, float] = {}
        self.calls = 0
        self.leaks: Counter[str] = Counter()
        self.violations: list[str] = []
        self.hostile: Counter[str] = Counter()
        self.bad_frame_rooms = 0
        self.max_elapsed_s: dict[str, float] = {r: 0.0 for r in ROLES}
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


class CampaignScoring:
    """The scoring half of a campaign: the tally, and what of an episode's faults the scores
    are checked against (the peers lost, the decode freezes); the faults and the ranks are its
    subclasses' (:mod:`kvfsm.chaos._campaign_faults`, :mod:`kvfsm.chaos._campaign`)."""

    def __init__(self, opts: CampaignOptions) -> None:
        self.opts = opts
        self.tally = Tally()
        #: This episode's decode freezes: when each began and ended (monotonic).
        self.freezes: list[tuple[float, float]] = []
        #: Peers lost this episode, for the liveness check: (monotonic time, role lost).
        self.losses: list[tuple[float, str]] = []

    # -- scoring an episode --------------------------------------------------------------------

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
            for role in ROLES:
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

    # -- the report ----------------------------------------------------------------------------

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
