"""What a chaos campaign runs: its options (one frozen, picklable value both the campaign
process and its rank processes read) and the per-episode room plan derived from the seed."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfsm.bootstrap import ChannelConfig
from kvfsm.chaos._plan import ControlRates, TransferRates
from kvfsm.manager import ManagerConfig
from kvfsm.rooms import RoomConfig
from kvfsm.states import KVPoll, Role
from kvfsm.transport import TransferConfig

__all__ = ["CampaignOptions", "RoomPlan", "episode_plan"]


#: Short deadlines (law 3 bounds every room by their sum per role); production is minutes.
#: Plain dicts: the options travel to the rank processes by pickle.
def _deadlines() -> Mapping[Role, Mapping[KVPoll, float]]:
    return {
        Role.SENDER: {
            KVPoll.Bootstrapping: 4.0,
            KVPoll.WaitingForInput: 3.0,
            KVPoll.Transferring: 4.0,
        },
        Role.RECEIVER: {
            KVPoll.Bootstrapping: 4.0,
            KVPoll.WaitingForInput: 3.0,
            KVPoll.Transferring: 6.0,
        },
    }


def _transfer_rates() -> TransferRates:
    return TransferRates(
        post_error=0.01,
        post_raise=0.01,
        post_disconnect=0.003,
        completion_error=0.01,
        never_complete=0.01,
        delay=0.05,
    )


def _control_rates() -> ControlRates:
    return ControlRates(
        drop=0.01,
        duplicate=0.01,
        reorder=0.02,
        delay=0.03,
        truncate=0.002,
        corrupt=0.004,
        cut=0.002,
    )


@dataclass(frozen=True, slots=True)
class CampaignOptions:
    seed: int = 0
    #: Stop starting episodes after this long (seconds); None: run ``episodes`` episodes.
    duration_s: float | None = None
    episodes: int = 3
    rooms: int = 40  # per episode
    concurrency: int = 8
    layers: int = 2
    num_pages: int = 1024
    page_bytes: int = 4096
    aux_rows: int = 64
    aux_row_bytes: int = 256
    max_room_pages: int = 8
    max_chunks: int = 4
    abort_rate: float = 0.25
    transfer: TransferRates = field(default_factory=_transfer_rates)
    control: ControlRates = field(default_factory=_control_rates)
    #: Per episode (after the first, for kills): probability of each process-level fault.
    sigstop_rate: float = 0.5
    sigkill_rate: float = 0.35
    registry_restart_rate: float = 0.5
    #: Hostile connections to the prefill control port per episode.
    hostile_per_episode: int = 3
    #: Sign the registry and every control frame (a corrupted frame is then always detected).
    use_secret: bool = True
    deadlines: Mapping[Role, Mapping[KVPoll, float]] = field(default_factory=_deadlines)
    #: Extra seconds a room gets on top of its deadline sum before it counts as wedged
    #: (scheduler iterations and machine load; time a rank spent stopped is added as well).
    slack_s: float = 8.0
    #: How long a terminal room may take to settle before it is written off as unsettled.
    settle_grace_s: float = 8.0
    #: A scheduler-facing call that takes longer than this counts as blocking.
    slow_call_ms: float = 20.0
    #: Break an invariant on purpose ("canary": scribble on a settled page) to prove the
    #: checker sees it. Empty: break nothing.
    break_invariant: str = ""
    idle_sleep_s: float = 0.001

    def validate(self) -> None:
        if self.rooms < 1 or self.concurrency < 1 or self.episodes < 1:
            raise ValueError("--rooms, --concurrency and --episodes must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be > 0")
        if not 0 <= self.abort_rate <= 1:
            raise ValueError("--abort-rate must be in [0, 1]")
        if self.break_invariant not in ("", "canary"):
            raise ValueError(f"unknown invariant to break: {self.break_invariant!r}")
        if self.max_room_pages * 2 * self.concurrency > self.num_pages:
            raise ValueError("the page pool is too small for the concurrency")

    def bound_s(self, role: Role) -> float:
        """Law 3: the most time a room of ``role`` may take to reach a terminal state."""
        return sum(self.deadlines[role].values())

    def manager_config(self, secret: bytes | None) -> ManagerConfig:
        return ManagerConfig(
            rooms=RoomConfig(
                deadlines=self.deadlines, settle_timeout_s=5.0, shutdown_timeout_s=5.0
            ),
            transfer=TransferConfig(deadline_base_s=1.0, quarantine_s=0.5),
            channel=ChannelConfig(
                heartbeat_s=0.5, liveness_factor=3.0, connect_timeout_s=2.0, pending_ttl_s=10.0
            ),
            secret=secret,
            register_interval_s=0.5,
        )


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """One request. ``abort_side`` "prefill": ``abort_at`` -1 before decode's pages arrive, 0
    before ``init``, k in 1..chunks-1 right after chunk k was sent (a non-last chunk in
    flight), ``chunks`` right after the last chunk. "decode": -1 before ``send_metadata``, k >= 0
    k scheduler iterations after it."""

    room: int
    src: tuple[int, ...]
    src_aux: int
    cuts: tuple[int, ...]
    abort_side: str
    abort_at: int

    @property
    def chunks(self) -> int:
        return len(self.cuts) + 1


def episode_plan(opts: CampaignOptions, episode: int, first_room: int) -> list[RoomPlan]:
    """The rooms of one episode; both ranks compute the same list from the seed."""
    rng = random.Random(f"kvfsm-chaos/{opts.seed}/episode/{episode}")
    plans = []
    for i in range(opts.rooms):
        n = rng.randint(0, opts.max_room_pages)
        start = rng.randrange(opts.num_pages)
        src = [(start + k) % opts.num_pages for k in range(n)]
        rng.shuffle(src)
        chunks = rng.randint(1, max(1, min(opts.max_chunks, n)))
        cuts = tuple(sorted(rng.sample(range(1, n), chunks - 1))) if n > 1 else ()
        side, at = "", 0
        if rng.random() < opts.abort_rate:
            if rng.random() < 0.5:
                side, at = "prefill", rng.randint(-1, len(cuts) + 1)
            else:
                side, at = "decode", rng.randint(-1, 3)
        plans.append(
            RoomPlan(first_room + i, tuple(src), rng.randrange(opts.aux_rows), cuts, side, at)
        )
    return plans
