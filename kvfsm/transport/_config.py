"""The data path's settings and counters: ``TransferConfig`` (deadlines, quarantine, pacing),
``TransportStats`` (the ledger's chunk outcomes plus handles, pump rounds and peers) and
``ChunkObserver`` (told about every finished chunk, for metrics). Shared by the transport's
modules, which each write their own counters (see the field comments)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvfsm.transport._ledger import LedgerStats

__all__ = ["ChunkObserver", "TransferConfig", "TransportStats"]


class ChunkObserver(Protocol):
    def chunk(self, nbytes: int, seconds: float, ok: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Deadlines and pacing of the data path."""

    #: Fixed part of every chunk's deadline (connection set-up, scheduling hiccups).
    deadline_base_s: float = 10.0
    #: The slowest bandwidth a healthy transfer may have; bytes / this is added to the deadline.
    floor_bandwidth_bps: float = 100e6
    #: How long a released, stalled chunk keeps its pages unsettled.
    quarantine_s: float = 2.0
    #: Minimum time between two reconnections of a peer after a remote disconnect.
    reconnect_interval_s: float = 1.0
    #: After a chunk is held (released with bytes perhaps still queued in the agent) or a peer
    #: generation is dropped, how long an otherwise idle pump keeps progressing the agent, and
    #: how often. Queued bytes of a released WRITE move only when the agent is progressed; on
    #: a link cut they can move only once the link is back, long after the quarantine, and
    #: they must land then, not whenever the next transfer happens to progress the agent
    #: (which may be after the owner reused the pages). Past TCP's longest retransmission
    #: interval (120 s) nothing is left to move.
    linger_s: float = 130.0
    linger_interval_s: float = 0.02
    #: Bounded adaptive polling while chunks are in flight (:mod:`kvfsm.transport._pacer`):
    #: the pump polls without sleeping only within ``poll_spin_s`` of a chunk's expected
    #: completion (and never longer than that at a stretch), and otherwise sleeps
    #: ``poll_max_wait_s`` between rounds: the most a completion is found late.
    #: ``poll_max_wait_s = 0`` polls every loop iteration (a spinning pump).
    poll_spin_s: float = 0.0005
    poll_max_wait_s: float = 0.001
    #: Small chunks that rooms post in the same loop callback (a scheduler iteration's worth)
    #: to one peer under one fence go out as one NIXL request (the ledger's rule 8): chunks of
    #: at most ``merge_max_bytes``, up to ``merge_max_chunks`` of them and ``merge_max_bytes``
    #: in all per request. Fewer requests, handles and GIL round trips on the poster; the
    #: first chunk of a request finishes when the request does (1 ms for 8 MiB at 8 GB/s).
    #: 8 MiB, not more: a scheduler iteration's 16 rooms of 1 MiB then go out as two requests,
    #: and the poster hands each back as soon as it is posted, so the first half's rooms end
    #: (and the scheduler starts the next ones) while the second half is copied. One 16 MiB
    #: request left that copy idle while rooms ended and began (benchmarks/README.md).
    #: ``merge_max_chunks = 1`` posts every chunk alone, as soon as its room commands it.
    merge_max_bytes: int = 8 << 20
    merge_max_chunks: int = 64
    #: The poster holds the results of requests it posted while the ones after them are
    #: small, and hands them back to the loop together (:mod:`kvfsm.transport._poster`): before
    #: a request that would take what was posted since the first held result past this many
    #: bytes, each request counting its bytes plus a fixed 32 KiB for its own calls, and once
    #: the queue is empty. 512 KiB: at most 16 small requests, or about 64 us of copy at
    #: 8 GB/s, before a result goes back. ``0`` hands each result back as soon as it is posted.
    hand_back_bytes: int = 512 << 10

    def __post_init__(self) -> None:
        if not (self.deadline_base_s > 0 and self.floor_bandwidth_bps > 0):
            raise ValueError("deadline_base_s and floor_bandwidth_bps must be > 0")
        if self.quarantine_s < 0 or self.reconnect_interval_s < 0 or self.linger_s < 0:
            raise ValueError("quarantine_s, reconnect_interval_s and linger_s must be >= 0")
        if not self.linger_interval_s > 0:
            raise ValueError("linger_interval_s must be > 0")
        if self.poll_spin_s < 0 or self.poll_max_wait_s < 0:
            raise ValueError("poll_spin_s and poll_max_wait_s must be >= 0")
        if self.merge_max_chunks < 1 or self.merge_max_bytes < 0:
            raise ValueError("merge_max_chunks must be >= 1 and merge_max_bytes >= 0")
        if self.hand_back_bytes < 0:
            raise ValueError("hand_back_bytes must be >= 0")

    def deadline_s(self, nbytes: int) -> float:
        return self.deadline_base_s + nbytes / self.floor_bandwidth_bps


@dataclass(slots=True)
class TransportStats(LedgerStats):
    """Counters (the chunk outcomes are the ledger's); each field is written by one thread at
    a time."""

    handles_created: int = 0  # poster thread
    handles_released: int = 0  # loop thread (and close())
    handles_released_at_post: int = 0  # poster thread: done inside transfer()
    flush_handles_created: int = 0  # loop thread: the pump's flushes (ledger rule 2)
    chunks_posted: int = 0
    pump_rounds: int = 0
    #: Pump rounds after which it slept (``poll_max_wait_s``) instead of yielding only.
    pump_sleeps: int = 0
    #: Progresses of the agent by an idle pump after a hold (``TransferConfig.linger_s``).
    linger_progresses: int = 0
    peers_lost: int = 0
    peers_connected: int = 0
    #: Connects of a peer whose current generation already had the same metadata, layout and
    #: piece (its control link came back): that generation is kept (``PeerSet.connect``).
    peers_kept: int = 0
    stale_deliveries: int = 0
    #: Runs of chunks whose merge raised (memory): each chunk was posted alone instead.
    merge_errors: int = 0
    #: Groups of a batch's chunks whose hand-over to the ledger raised (a bug): the chunks the
    #: ledger did not take were failed.
    hand_over_errors: int = 0
