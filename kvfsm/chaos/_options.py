"""What a chaos campaign runs: its options (one frozen, picklable value both the campaign
process and its rank processes read) and the per-episode room plan derived from the seed."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

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


#: Chunk deadlines of 1 s + bytes / 100 MB/s, quarantine 0.5 s.
_TRANSFER: Final = TransferConfig(deadline_base_s=1.0, quarantine_s=0.5)
#: Heartbeats every 0.5 s; a link silent for 1.5 s is lost.
_HEARTBEAT_S: Final = 0.5
_LIVENESS: Final = 3.0


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
    #: A stopped rank stays stopped for up to this long (from 0.3 s).
    sigstop_max_s: float = 2.5
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
    #: Decode settles the rooms of a lost control link this long after the loss
    #: (``ChannelConfig.peer_lost_grace_s``); :meth:`validate` checks it outlasts everything
    #: that can still write into their pages (see :meth:`writes_end_s`). None: that bound
    #: plus 2 s, rounded up to whole seconds (8 s on one host, 11 s on two).
    peer_lost_grace_s: float | None = None
    #: Prefill and decode in two network namespaces joined by a veth (``--two-hosts``): NIXL on
    #: UCX TCP over it, and the link cut as one more fault.
    two_hosts: bool = False
    #: Two hosts: per episode, probability of cutting the link, and for how long at most.
    link_cut_rate: float = 0.6
    link_cut_max_s: float = 3.0
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
        if 4 * self.concurrency > self.aux_rows:
            raise ValueError("too few aux rows for the concurrency")
        if not self.grace_s() > self.writes_end_s():
            raise ValueError(
                f"peer_lost_grace_s ({self.grace_s():g}) must exceed the time a lost "
                f"prefill may still write ({self.writes_end_s():g} s)"
            )

    def grace_s(self) -> float:
        """``ChannelConfig.peer_lost_grace_s`` of the ranks."""
        if self.peer_lost_grace_s is not None:
            return self.peer_lost_grace_s
        return float(math.ceil(self.writes_end_s() + 2.0))

    def channel(self, host: str = "127.0.0.1") -> ChannelConfig:
        return ChannelConfig(
            host=host,
            heartbeat_s=_HEARTBEAT_S,
            liveness_factor=_LIVENESS,
            connect_timeout_s=2.0,
            pending_ttl_s=10.0,
            # The campaign's settle bound after a lost link is grace_s(): the lease plus the
            # margin (ChannelConfig.settle_after_loss_s).
            fence_margin_s=max(0.0, self.grace_s() - ChannelConfig().lease_s),
        )

    def channel_silence_s(self) -> float:
        # Not self.channel(): that needs grace_s(), which needs this.
        return _HEARTBEAT_S * _LIVENESS

    def writes_end_s(self) -> float:
        """After decode loses its link, how long prefill may still be writing into the rooms'
        pages: it notices within its silence window, later by as long as it can be stopped;
        a WRITE it cannot release ends at its chunk deadline plus the quarantine. On two hosts
        bytes that were on the wire when the link was cut arrive after the restore, and TCP's
        retransmission backoff (doubling) may wait about as long again as the cut lasted, so
        a cut counts twice. ``ChannelConfig.peer_lost_grace_s`` must be longer (law 4)."""
        transfer = _TRANSFER
        largest = self.max_room_pages * self.layers * self.page_bytes + self.aux_row_bytes
        held = max(self.sigstop_max_s, 2 * self.link_cut_max_s if self.two_hosts else 0.0)
        return (
            self.channel_silence_s() + held + transfer.deadline_s(largest) + transfer.quarantine_s
        )

    def room_settle_timeout_s(self) -> float:
        """``RoomConfig.settle_timeout_s``: a decode room that failed just before its link was
        lost (its prefill stopped or cut off) must still be waiting when the grace ends."""
        return self.channel_silence_s() + self.grace_s() + self.sigstop_max_s + 2.0

    def settle_wait_s(self) -> float:
        """How long a rank watches a terminal room for its settle before reporting it
        unsettled: past the room's own settle timeout, after which nothing can settle it."""
        return self.room_settle_timeout_s() + 1.0

    def bound_s(self, role: Role) -> float:
        """Law 3: the most time a room of ``role`` may take to reach a terminal state."""
        return sum(self.deadlines[role].values())

    def manager_config(self, secret: bytes | None, host: str = "127.0.0.1") -> ManagerConfig:
        """A rank's config; ``host``: where prefill's control channel listens (and what its
        registration publishes)."""
        return ManagerConfig(
            rooms=RoomConfig(
                deadlines=self.deadlines,
                settle_timeout_s=self.room_settle_timeout_s(),
                shutdown_timeout_s=5.0,
            ),
            transfer=_TRANSFER,
            channel=self.channel(host),
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
