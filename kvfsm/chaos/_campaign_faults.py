"""The faults a campaign makes in each episode, and how: which are due when (seeded, or once
that share of the episode's rooms ended), and each one made when it can be: stops and long
freezes of either rank, a decode freeze while prefill has chunks in flight to it and the check
some seconds after it ended, registry restarts, hostile connections, SIGKILLs and link cuts.

The ranks are the campaign's (:mod:`kvfsm.chaos._campaign`); the scores are checked against the
moments recorded here (:mod:`kvfsm.chaos._campaign_scoring`).
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import time
from typing import Any, Final

from kvfsm._child import ChildProcess
from kvfsm.chaos._campaign_scoring import ROLES, CampaignScoring
from kvfsm.chaos._hostile import HOSTILE_KINDS, HostileResult, send_hostile
from kvfsm.chaos._netns import CutMode, TwoHosts
from kvfsm.chaos._netns_helpers import AnyRegistry
from kvfsm.chaos._options import CampaignOptions

__all__ = ["DUE_BY_ENDED", "CampaignFaults"]

#: A fault due at a fraction ``f`` of the span is made once ``f`` times this share of the
#: episode's rooms ended, if that comes before its time. At most this share, then, and the
#: rest (with concurrency 8 and 24 rooms a side, at least 9 rooms) are still to end: the ones
#: live at once could all end between two of the campaign's polls, which at 0.9 once left a
#: fast, idle pair's SIGKILL (and more often its hostile peers) never made.
DUE_BY_ENDED: Final = 0.6

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


class CampaignFaults(CampaignScoring):
    """The faults of a campaign's episodes and the state they keep between two checks."""

    def __init__(self, opts: CampaignOptions) -> None:
        super().__init__(opts)
        self.rng = random.Random(f"kvfsm-chaos/{opts.seed}/campaign")
        self.secret = secrets.token_bytes(32) if opts.use_secret else None
        self.registry: AnyRegistry | None = None
        self.hosts: TwoHosts | None = None
        self.hostile_source: ChildProcess | None = None
        self.cut_until = 0.0  # two hosts: when the link cut now in place is restored
        #: The rank processes (None: not running), which a SIGKILL takes out.
        self.ranks: dict[str, ChildProcess | None] = dict.fromkeys(ROLES)
        self.prefill_in_flight = 0  # chunks in flight at prefill's last answer
        self.ended = 0.0  # the share of the episode's rooms (both roles) ended so far
        self.freeze_wait_until = 0.0  # a long freeze waits this long for chunks in flight
        #: Decode freezes: a separate stream, so that adding them reshuffles no other fault of a
        #: seed; three draws an episode whatever the rate (``FaultPlan``'s rule 2).
        self.decode_rng = random.Random(f"kvfsm-chaos/{opts.seed}/decode-freeze")
        self.decode_freeze_len = 0.0  # this episode's, drawn with its time
        self.decode_wait_until = 0.0  # a decode freeze waits this long for chunks in flight
        self.decode_frozen = False  # decode's stop under way is a decode freeze
        self.frozen_at = 0.0
        #: The end of the latest process or link fault but the decode freezes (monotonic): a
        #: room may wait for a stopped or cut-off peer, so the check after a decode freeze
        #: comes ``after_resume_s`` after this too.
        self.disrupted_until = 0.0

    @property
    def prefill_host(self) -> str:
        """Where prefill's control channel listens (and the registry, on two hosts)."""
        return self.hosts.prefill.address if self.hosts is not None else "127.0.0.1"

    # -- what is due when ----------------------------------------------------------------------

    def span(self) -> float:
        """Process-level faults are due at seeded times within this many seconds of an
        episode's start (see :meth:`actions`)."""
        return max(2.0, self.opts.rooms / self.opts.concurrency * 0.3)

    def actions(self, index: int, span: float) -> list[tuple[float, str, str]]:
        """Episode ``index``'s process, registry, hostile and link faults: ``(due, what,
        arg)``, sorted, ``due`` in seconds from the episode's start. Each is due then, or as
        soon as that fraction of ``span`` (times :data:`DUE_BY_ENDED`) of the episode's rooms
        has ended."""
        opts, rng = self.opts, self.rng
        # Process-level faults at seeded times within the first seconds of the episode, or as
        # soon as that fraction of its rooms (times DUE_BY_ENDED) has ended, if that comes
        # first: a pair that serves its rooms faster than ``span`` still gets every fault
        # mid-episode (one still due after the episode's last room is reported unmade).
        actions: list[tuple[float, str, str]] = []
        if rng.random() < opts.sigstop_rate:
            actions.append((rng.uniform(0, span), "sigstop", rng.choice(ROLES)))
        if rng.random() < opts.registry_restart_rate:
            actions.append((rng.uniform(0, span), "registry", ""))
        actions += [
            (rng.uniform(0, span), "hostile", rng.choice(HOSTILE_KINDS))
            for _ in range(opts.hostile_per_episode)
        ]
        if index > 0 and rng.random() < opts.sigkill_rate:
            actions.append((rng.uniform(0.5 * span, span), "sigkill", rng.choice(ROLES)))
        if self.hosts is not None and rng.random() < opts.link_cut_rate:
            actions.append((rng.uniform(0, span), "cut", rng.choice(("blackhole", "down"))))
        if rng.random() < opts.long_freeze_rate:
            # Past decode's settle bound, with chunks in flight: the fence's case (law 4). Due
            # in the first half (by the time, or by 30% of the rooms ended), and then it waits
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

    # -- making them ---------------------------------------------------------------------------

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
        for role in ROLES:
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
