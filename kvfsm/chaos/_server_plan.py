"""The seeded plan of ``kvfsm chaos servers``: which faults, in which order, and the requests
each fault's episode sends. Pure: a seed and the options give the same plan every time, and
nothing here touches a process, a socket or a clock.

An episode is one fault under its own load: its requests start at seeded offsets (at most
``concurrency`` in flight), the fault lands ``fault_at_s`` after the first one (a fault of
prefill or decode instead lands as soon as that server holds a live room, within
``fault_at_s`` + 5 s). Each
request has a prompt of 4 to 2,000 tokens (log-uniform: most are short, some fill most of the
context), is streamed or not, and may be disconnected by its client or aborted by
``/abort_request`` at a seeded time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "ALL_FAULTS",
    "CALIBRATION",
    "Action",
    "Fault",
    "PlanOptions",
    "PlannedRequest",
    "ServerEpisode",
    "calibration_episode",
    "plan_episodes",
]


class Action(StrEnum):
    """What the campaign does to its target."""

    #: Nothing: the calibration episode, the pipeline's own time for a load with no fault.
    NONE = "no-fault"
    KILL_SCHEDULER = "sigkill-scheduler"
    KILL_SERVER = "sigkill-server"
    STOP = "sigstop"
    DISCONNECT = "client-disconnect"
    ABORT = "abort-request"
    DROP_DECODE_HALF = "drop-decode-half"
    RESTART = "restart"
    LINK_DOWN = "link-down"
    LINK_BLACKHOLE = "link-blackhole"


@dataclass(frozen=True)
class Fault:
    """One fault: ``action`` on ``target`` (``prefill``, ``decode``, ``router``, ``client`` or
    ``link``, the data link between prefill and decode); a SIGSTOP lasts ``pause_s`` before
    its SIGCONT, a link cut ``pause_s`` before the link is restored."""

    action: Action
    target: str
    pause_s: float = 0.0
    #: A SIGSTOP's length by name (``1s``, ``past-lease``, ``long``), for the report.
    label: str = ""

    @property
    def kind(self) -> str:
        """The report's row: ``sigstop prefill past-lease``, ``sigkill-server decode``..."""
        return " ".join(p for p in (self.action.value, self.target, self.label) if p)

    @property
    def restarts(self) -> str | None:
        """The server the campaign must start again after this fault, if any."""
        if self.action in (Action.KILL_SCHEDULER, Action.KILL_SERVER, Action.RESTART):
            return self.target
        return None


@dataclass(frozen=True)
class PlanOptions:
    """What shapes a plan (``kvfsm chaos servers``'s flags)."""

    requests: int = 8
    concurrency: int = 8
    min_prompt: int = 4
    max_prompt: int = 2000
    min_new: int = 4
    max_new: int = 24
    stream_rate: float = 0.5
    vocab: int = 512
    #: The write lease of the servers (``KVFSM_LEASE_S``): a "past-lease" stop lasts longer.
    lease_s: float = 10.0
    long_stop_s: float = 30.0
    #: How long a link cut lasts: past the liveness bound (10 s in these servers), so that
    #: both sides lose the other and the rooms across the link fail, then the link comes back.
    cut_s: float = 15.0
    #: Fault kinds this run cannot inject (with the reason printed), by ``Fault.kind``.
    skip: frozenset[str] = field(default_factory=frozenset)


def _stops(target: str, o: PlanOptions) -> list[Fault]:
    return [
        Fault(Action.STOP, target, 1.0, "1s"),
        Fault(Action.STOP, target, o.lease_s + 1.0, "past-lease"),
        Fault(Action.STOP, target, o.long_stop_s, "long"),
    ]


def all_faults(o: PlanOptions) -> list[Fault]:
    """One fault of each kind, in a fixed order (a plan shuffles them)."""
    return [
        Fault(Action.KILL_SCHEDULER, "prefill"),
        Fault(Action.KILL_SCHEDULER, "decode"),
        Fault(Action.KILL_SERVER, "prefill"),
        Fault(Action.KILL_SERVER, "decode"),
        *_stops("prefill", o),
        *_stops("decode", o),
        Fault(Action.DISCONNECT, "client"),
        Fault(Action.ABORT, "client"),
        Fault(Action.DROP_DECODE_HALF, "router"),
        Fault(Action.RESTART, "prefill"),
        Fault(Action.RESTART, "router"),
        Fault(Action.LINK_DOWN, "link", o.cut_s),
        Fault(Action.LINK_BLACKHOLE, "link", o.cut_s),
    ]


#: Every fault kind with the default options (for ``--faults`` choices and the docs).
ALL_FAULTS: tuple[str, ...] = tuple(f.kind for f in all_faults(PlanOptions()))

#: The calibration episode's fault: none.
CALIBRATION = Fault(Action.NONE, "")


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    prompt: tuple[int, ...]
    max_new: int
    stream: bool
    #: Seconds after the episode's start when it is sent.
    start_s: float
    #: The client closes the connection this long after sending (streamed requests only).
    disconnect_s: float | None = None
    #: ``/abort_request`` names it this long after it was sent.
    abort_s: float | None = None


@dataclass(frozen=True)
class ServerEpisode:
    index: int
    fault: Fault
    #: Seconds after the episode's start when the fault lands.
    fault_at_s: float
    requests: tuple[PlannedRequest, ...]


def _prompt(rng: random.Random, o: PlanOptions) -> tuple[int, ...]:
    n = round(math.exp(rng.uniform(math.log(o.min_prompt), math.log(o.max_prompt))))
    n = max(o.min_prompt, min(o.max_prompt, n))
    # Token 0..2 are special (pad, bos, eos): prompts avoid them.
    return tuple(rng.randrange(3, o.vocab) for _ in range(n))


def _requests(
    rng: random.Random, fault: Fault, first: int, o: PlanOptions
) -> tuple[PlannedRequest, ...]:
    out: list[PlannedRequest] = []
    # Starts spread so that at most ``concurrency`` are sent together, a wave every 0.3 s.
    for k in range(o.requests):
        stream = rng.random() < o.stream_rate
        disconnect = abort = None
        if fault.action is Action.DISCONNECT and k % 2 == 0:
            stream = True
            disconnect = rng.uniform(0.05, 1.5)
        if fault.action is Action.ABORT and k % 2 == 0:
            abort = rng.uniform(0.0, 1.0)
        out.append(
            PlannedRequest(
                index=first + k,
                prompt=_prompt(rng, o),
                max_new=rng.randint(o.min_new, o.max_new),
                stream=stream,
                start_s=round((k // max(1, o.concurrency)) * 0.3 + rng.uniform(0, 0.2), 3),
                disconnect_s=disconnect,
                abort_s=abort,
            )
        )
    return tuple(out)


def calibration_episode(seed: int, o: PlanOptions) -> ServerEpisode:
    """The load a campaign first sends with no fault (episode 0, requests from 0): the
    reference server's time and the pipeline's for the same requests give the factor by which
    a fault's bound allows for queueing (:func:`kvfsm.chaos._server_scoring.end_bound_s`).
    Shaped as every episode is, from its own seeded stream, so the plans that follow are the
    same with or without it."""
    rng = random.Random(f"calibration-{seed}")
    return ServerEpisode(0, CALIBRATION, 0.0, _requests(rng, CALIBRATION, 0, o))


def plan_episodes(
    seed: int,
    o: PlanOptions,
    kinds: list[str] | None = None,
    *,
    first_episode: int = 0,
    first_request: int = 0,
) -> list[ServerEpisode]:
    """One episode per fault kind (``kinds``, default all but ``o.skip``), in a seeded order,
    each with its own seeded load; episode and request indices run on from ``first_episode``
    and ``first_request`` (a soak's next pass goes on from the last one's)."""
    rng = random.Random(seed)
    faults = [f for f in all_faults(o) if f.kind not in o.skip]
    if kinds is not None:
        wanted = set(kinds)
        faults = [f for f in faults if f.kind in wanted or f.action.value in wanted]
    rng.shuffle(faults)
    episodes: list[ServerEpisode] = []
    first = first_request
    for i, fault in enumerate(faults, start=first_episode):
        requests = _requests(rng, fault, first, o)
        first += len(requests)
        episodes.append(ServerEpisode(i, fault, round(rng.uniform(0.2, 1.0), 3), requests))
    return episodes
