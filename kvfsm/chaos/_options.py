"""What a chaos campaign runs: its options (one frozen, picklable value both the campaign
process and its rank processes read) and the per-episode room plan derived from the seed."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from kvfsm.chaos._plan import ControlRates, TransferRates
from kvfsm.control import ChannelConfig
from kvfsm.manager import ManagerConfig
from kvfsm.rooms import RoomConfig
from kvfsm.states import KVPoll, Role
from kvfsm.transport import TransferConfig

__all__ = ["OVERSIZED_PAGES", "TRANSPORTS", "CampaignOptions", "RoomPlan", "episode_plan"]


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
    # With a secret (the default), every frame after the Hellos carries a sequence number under
    # its MAC (protocol v3): a dropped, duplicated or reordered frame breaks the sequence and
    # costs the whole link, like a cut, a truncation or a corrupted byte. At about 60 frames a
    # second, these rates lose a link every few seconds; the delays cost nothing but time.
    return ControlRates(
        drop=0.0005,
        duplicate=0.0005,
        reorder=0.001,
        delay=0.03,
        truncate=0.0003,
        corrupt=0.0005,
        cut=0.0003,
    )


#: What the write fence cannot see on one host (docs/reliability.md, "Write fencing"): the
#: window between the poster's lease check and ``transfer()``'s entry (p99 1.5 us, at most
#: 100 us measured; a GIL hand-off there costs up to the 5 ms switch interval) and the copy
#: inside ``transfer()`` (CMA: 62 us per MiB; the campaign's largest chunk is 64 KiB). 1 s,
#: ``ChannelConfig``'s default, covers both by more than two orders of magnitude. It does not
#: and cannot cover a freeze *inside* those windows, which is why they must stay short.
_UNFENCED_S: Final = 1.0

#: The most pages one decode room may name in the campaign: raised above what one 16 MiB
#: control frame holds (about 4.19 M packed int32), so that an oversized page list can fail
#: either at the facade (more than this) or at the control plane (more than a frame holds).
_DECODE_MAX_PAGES: Final = 4_400_000
#: Page counts of the two oversized calls: one over ``_DECODE_MAX_PAGES``, one under it but
#: over the frame limit.
OVERSIZED_PAGES: Final = {"max_pages": _DECODE_MAX_PAGES + 1, "frame": 4_250_000}

#: UCX transports the ranks may run (``--transport``): ``"default"`` leaves the choice to UCX
#: (on one host: TCP active messages, shared memory, CMA); ``"tcp"`` sets ``UCX_TLS=tcp`` in
#: both rank processes, where a WRITE is bytes in sockets that the target's own UCX worker
#: applies, so a stopped decode leaves them queued.
TRANSPORTS: Final = ("default", "tcp")

#: A decode freeze lasts this many times decode's settle bound, unless ``decode_freeze_s``
#: says otherwise: past the bound (and so past the silence limit), so that on waking decode
#: finds its link lost and may settle that link's pages at once.
_DECODE_FREEZE_FACTOR: Final = (1.5, 4.0)


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
    #: Per episode: probability of freezing the prefill rank (SIGSTOP) for longer than decode's
    #: settle bound, ``long_freeze_factor`` times :meth:`settle_after_loss_s`, timed while it
    #: has chunks in flight. Fencing must keep every late write out (law 4).
    long_freeze_rate: float = 0.3
    long_freeze_factor: tuple[float, float] = (1.5, 4.0)
    #: Per episode: probability of freezing the *decode* rank (SIGSTOP) for a seeded time in
    #: :meth:`decode_freeze_range_s`, made while prefill reports chunks in flight. Over TCP
    #: the WRITEs of those chunks sit in sockets and UCX's buffers, and land only once decode
    #: runs again: none may land in pages decode declared free on waking (law 4), and no room
    #: may still wait because of the freeze ``after_resume_s`` after it (law 3).
    decode_freeze_rate: float = 0.2
    #: How long a decode freeze lasts (from, to); None: ``_DECODE_FREEZE_FACTOR`` times
    #: :meth:`settle_after_loss_s` (4.5 to 12 s on one host, 16.5 to 44 s on two).
    decode_freeze_s: tuple[float, float] | None = None
    #: ... and, as well as chunks in flight, at least this many decode rooms with their page
    #: list out (capped at ``concurrency``): each is a room prefill may be writing to when
    #: decode stops, the more the more bytes queued for decode to find on waking.
    decode_freeze_exposed: int = 4
    #: After a decode freeze ends: when every room that existed before it must be terminal,
    #: and how long decode keeps the pages of rooms that lived through one of its own stops
    #: watched (canaried, not handed out) after freeing them.
    after_resume_s: float = 5.0
    #: UCX transports of both ranks (``TRANSPORTS``); two hosts always run ``"tcp"``.
    transport: str = "default"
    #: Per room: probability that decode aborts the room after its page list went out and at
    #: once creates the id's next receiver (prefill then creates the id's next sender).
    reuse_rate: float = 0.05
    #: Per room: probability that decode calls ``send_metadata`` with more pages than it may
    #: (``OVERSIZED_PAGES``: over ``RoomConfig.max_pages``, or over the frame limit).
    oversized_rate: float = 0.02
    #: Hostile connections to the prefill control port per episode.
    hostile_per_episode: int = 3
    #: Sign the registry and every control frame (a corrupted frame is then always detected).
    use_secret: bool = True
    deadlines: Mapping[Role, Mapping[KVPoll, float]] = field(default_factory=_deadlines)
    #: Extra seconds a room gets on top of its deadline sum before it counts as wedged
    #: (scheduler iterations and machine load; time a rank spent stopped is added as well).
    slack_s: float = 8.0
    #: A rank whose peer is lost (killed, stopped, cut off) must fail the peer's rooms within
    #: the silence limit plus this much (law 3: a known-dead peer is not waited for).
    liveness_slack_s: float = 2.0
    #: Decode grants prefill write leases of this long (``ChannelConfig.lease_s``).
    lease_s: float = 2.0
    #: ``ChannelConfig.fence_margin_s``: decode settles a lost link's pages ``lease_s`` plus
    #: this after the last lease it granted there. None: :meth:`needed_margin_s`, rounded up
    #: to whole seconds; :meth:`validate` refuses less.
    fence_margin_s: float | None = None
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
        for name in (
            "abort_rate",
            "reuse_rate",
            "oversized_rate",
            "long_freeze_rate",
            "decode_freeze_rate",
        ):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
        if self.break_invariant not in ("", "canary"):
            raise ValueError(f"unknown invariant to break: {self.break_invariant!r}")
        if self.max_room_pages * 2 * self.concurrency > self.num_pages:
            raise ValueError("the page pool is too small for the concurrency")
        if 4 * self.concurrency > self.aux_rows:
            raise ValueError("too few aux rows for the concurrency")
        low, high = self.long_freeze_factor
        if not 1.0 < low <= high:
            raise ValueError("long freezes must outlast decode's settle bound: 1 < low <= high")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        low, high = self.decode_freeze_range_s()
        floor = max(self.channel_silence_s(), self.settle_after_loss_s())
        if not floor < low <= high:
            raise ValueError(
                f"decode freezes ({low:g} to {high:g} s) must outlast the silence limit and "
                f"decode's settle bound ({floor:g} s): {floor:g} < low <= high"
            )
        if self.decode_freeze_exposed < 1:
            raise ValueError("decode_freeze_exposed must be >= 1")
        if not self.after_resume_s > 0:
            raise ValueError("after_resume_s must be > 0")
        if not self.margin_s() >= self.needed_margin_s():
            raise ValueError(
                f"fence_margin_s ({self.margin_s():g}) must cover what the fence cannot see "
                f"({self.needed_margin_s():g} s)"
            )

    def needed_margin_s(self) -> float:
        """What decode's margin past the lease must cover. One host: the unfenced windows
        (``_UNFENCED_S``); how long prefill is stopped does not matter any more, since a writer
        posts only under a valid lease, checked right before each ``transfer()``. Two hosts:
        also bytes of WRITEs posted before the lease ended that TCP still holds when the link
        is cut. Decode cannot refuse them (deregistering or removing an agent does not stop a
        WRITE on TCP), they arrive after the restore, and TCP's retransmission backoff
        (doubling) may wait about as long again as the cut lasted, so a cut counts twice, on
        top of the chunk deadline and quarantine of a WRITE still in progress when it began."""
        if not self.two_hosts:
            return _UNFENCED_S
        largest = self.max_room_pages * self.layers * self.page_bytes + self.aux_row_bytes
        return (
            _UNFENCED_S
            + 2 * self.link_cut_max_s
            + _TRANSFER.deadline_s(largest)
            + _TRANSFER.quarantine_s
        )

    def margin_s(self) -> float:
        """``ChannelConfig.fence_margin_s`` of the ranks."""
        if self.fence_margin_s is not None:
            return self.fence_margin_s
        return float(math.ceil(self.needed_margin_s()))

    def settle_after_loss_s(self) -> float:
        """Decode settles a lost link's pages this long after the last lease it granted on it
        (``ChannelConfig.settle_after_loss_s``): 3 s on one host, 11 s on two."""
        return self.lease_s + self.margin_s()

    def channel(self, host: str = "127.0.0.1") -> ChannelConfig:
        return ChannelConfig(
            host=host,
            heartbeat_s=_HEARTBEAT_S,
            liveness_factor=_LIVENESS,
            connect_timeout_s=2.0,
            pending_ttl_s=self.pending_ttl_s(),
            lease_s=self.lease_s,
            fence_margin_s=self.margin_s(),
        )

    def pending_ttl_s(self) -> float:
        """``ChannelConfig.pending_ttl_s``: how long prefill keeps held claims and the
        tombstones of senders no decode claimed. 10 s, or with decode freezes 10 s past the
        longest: prefill runs ahead in the plan while decode is frozen and fails those rooms
        at their Bootstrapping deadline, and decode, on waking, must find their tombstones and
        fail its rooms of the same ids at once. Without them each such room waits out its own
        deadline, eight at a time, while prefill fails the next ids at theirs: the pair would
        not serve a room together again within the episode. (Production keeps them 60 s.)"""
        if self.decode_freeze_rate <= 0:
            return 10.0
        return max(10.0, self.decode_freeze_range_s()[1] + 10.0)

    def channel_silence_s(self) -> float:
        return _HEARTBEAT_S * _LIVENESS

    def long_freeze_s(self) -> tuple[float, float]:
        """How long a freeze past decode's settle bound lasts (from, to)."""
        low, high = self.long_freeze_factor
        bound = self.settle_after_loss_s()
        return low * bound, high * bound

    def decode_freeze_range_s(self) -> tuple[float, float]:
        """How long a decode freeze lasts (from, to)."""
        if self.decode_freeze_s is not None:
            return self.decode_freeze_s
        low, high = _DECODE_FREEZE_FACTOR
        bound = self.settle_after_loss_s()
        return low * bound, high * bound

    def longest_stop_s(self) -> float:
        """The longest a rank may be stopped in one go."""
        longest = self.long_freeze_s()[1] if self.long_freeze_rate > 0 else 0.0
        decode = self.decode_freeze_range_s()[1] if self.decode_freeze_rate > 0 else 0.0
        return max(self.sigstop_max_s, longest, decode)

    def ucx_transport(self) -> str:
        """The UCX transports the ranks run (``TRANSPORTS``): two hosts force ``"tcp"`` (on
        the veth), whatever ``transport`` says."""
        return "tcp" if self.two_hosts else self.transport

    def rank_env(self) -> dict[str, str]:
        """Environment both rank processes of one host get on top of the campaign's own:
        ``UCX_TLS=tcp`` for ``"tcp"``, nothing for ``"default"`` (an inherited ``UCX_*``
        setting then stands; the report shows it). Two hosts set it with each namespace's
        device instead (``TwoHosts.ucx_env``)."""
        return {"UCX_TLS": "tcp"} if self.transport == "tcp" else {}

    def room_settle_timeout_s(self) -> float:
        """``RoomConfig.settle_timeout_s``, after which a terminal room gives up settling. A
        decode room waits for its acknowledgement, which comes once prefill's room drained its
        chunks (deadline plus quarantine), later by as long as prefill is stopped without its
        link being declared lost (the silence limit), or, when the link is lost, with the
        lease-derived settle. A prefill room's own timer runs on through a freeze of its
        process: one that ended just before a long freeze finds its settle timeout expired on
        waking while its released chunks still sit out their quarantine, so the longest stop
        counts as well."""
        largest = self.max_room_pages * self.layers * self.page_bytes + self.aux_row_bytes
        drain = _TRANSFER.deadline_s(largest) + _TRANSFER.quarantine_s
        stopped = max(self.longest_stop_s(), self.channel_silence_s())
        return stopped + drain + self.settle_after_loss_s() + 2.0

    def settle_wait_s(self) -> float:
        """How long a rank watches a terminal room for its settle before reporting it
        unsettled: past the room's own settle timeout, after which nothing can settle it."""
        return self.room_settle_timeout_s() + 1.0

    def bound_s(self, role: Role) -> float:
        """Law 3: the most time a room of ``role`` may take to reach a terminal state."""
        return sum(self.deadlines[role].values())

    def manager_config(
        self, secret: bytes | None, host: str = "127.0.0.1", role: str = "prefill"
    ) -> ManagerConfig:
        """A rank's config; ``host``: where prefill's control channel listens (and what its
        registration publishes). Decode may name more pages per room than a frame holds (see
        ``_DECODE_MAX_PAGES``)."""
        return ManagerConfig(
            rooms=RoomConfig(
                deadlines=self.deadlines,
                settle_timeout_s=self.room_settle_timeout_s(),
                shutdown_timeout_s=5.0,
                max_pages=_DECODE_MAX_PAGES if role == "decode" else RoomConfig().max_pages,
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
    k scheduler iterations after it.

    ``reuse``: decode's abort (at ``abort_at`` >= 0, after the page list went out) is followed at
    once by a new receiver of the same id, on fresh pages; prefill, once its first sender of the
    id is terminal, creates the id's next sender. ``oversized``: decode's ``send_metadata`` names
    ``OVERSIZED_PAGES[oversized]`` pages instead of the planned ones (``"max_pages"``: refused
    by the facade; ``"frame"``: a page list no control frame can carry)."""

    room: int
    src: tuple[int, ...]
    src_aux: int
    cuts: tuple[int, ...]
    abort_side: str
    abort_at: int
    reuse: bool = False
    oversized: str = ""

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
        # Always drawn, whatever the rates, so that changing one rate does not reshuffle the
        # rest of the plan (FaultPlan's rule 2).
        special, param = rng.random(), rng.random()
        reuse, oversized = False, ""
        if special < opts.reuse_rate:
            reuse, side, at = True, "decode", int(param * 4)  # 0..3 iterations after
        elif special < opts.reuse_rate + opts.oversized_rate:
            side, at, oversized = "", 0, "max_pages" if param < 0.5 else "frame"
        plans.append(
            RoomPlan(
                first_room + i,
                tuple(src),
                rng.randrange(opts.aux_rows),
                cuts,
                side,
                at,
                reuse=reuse,
                oversized=oversized,
            )
        )
    return plans
