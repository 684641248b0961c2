"""What both ends of the control channel share: its settings (``ChannelConfig``), how decode
finds a prefill rank (``Resolver``), one live link (``Link``), and what a peer can end a
connection with (``PEER_ERRORS``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from kvfsm.control._codec import FrameCodec, SessionCodec
from kvfsm.control._frames import FrameError, Hello
from kvfsm.control._round_trip import RoundTrip
from kvfsm.control._routing import RoutingConfig
from kvfsm.link import PEER_ERRORS as _SOCKET_ERRORS
from kvfsm.link import Liveness

__all__ = ["PEER_ERRORS", "ChannelConfig", "Link", "Resolver", "Sealer"]

#: What a peer can make a handshake or a link fail with: its bytes (``FrameError``), its
#: silence (``TimeoutError``), its hang-up or the socket's errors. Anything else is a bug.
PEER_ERRORS: Final[tuple[type[BaseException], ...]] = (FrameError, *_SOCKET_ERRORS)

#: What seals a link's frames: the shared codec, or the connection's session (with a secret).
Sealer: TypeAlias = FrameCodec | SessionCodec

#: Finds a prefill rank's control address: ``await resolve(peer) -> (host, port)``. ``peer`` is
#: what a receiver room's ``init(peer)`` named, normally the prefill rank. Where peer ids are not
#: ranks (one decode reading from several prefill instances, each with its own rank 0: the SGLang
#: adapter), the resolver returns ``(host, port, rank)`` and the Hello must carry that rank.
Resolver = Callable[[int], Awaitable[tuple[str, int] | tuple[str, int, int]]]


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Control channel settings. The defaults bind to loopback only: a deployment across hosts
    sets ``host`` to the interface its peers reach, and should set ``secret``."""

    host: str = "127.0.0.1"
    port: int = 0  # prefill's listening port; 0 picks a free one (see ControlPlane.port)
    heartbeat_s: float = 1.0
    liveness_factor: float = 2.0
    connect_timeout_s: float = 5.0
    #: Longest wait between two connection attempts to an unreachable rank.
    reconnect_max_s: float = 2.0
    #: Shared secret: every frame is HMAC-signed and checked. None: no authentication.
    secret: bytes | None = None
    #: Per link, for ``pending_ttl_s``: claims and page lists held for rooms that do not exist
    #: yet, early-abort marks, marks of answered rooms (``RoutingConfig``).
    pending_max: int = 4096
    pending_ttl_s: float = 60.0
    #: Prefill, per link: bytes of page lists held for rooms that do not exist yet.
    held_bytes_max: int = 8 << 20
    #: Prefill: how long a sender room may wait for any decode room to claim it
    #: (``RoutingConfig.unclaimed_s``).
    unclaimed_s: float = 60.0
    #: The decode side progresses its NIXL agent this often while writes are expected (the
    #: writer's flushes need it; ``kvfsm.transport.AgentProgress``, which waits 1 ms at least:
    #: the event loop's timer resolution, below which a wait is a spin).
    progress_interval_s: float = 0.001
    #: Decode grants prefill write leases of this length; prefill renews every quarter of it.
    #: A lost link's pages settle ``lease_s + fence_margin_s`` after the last lease decode
    #: granted on it (law 4), however long the prefill process stays frozen.
    lease_s: float = 2.0
    #: What a write checked against its lease just before posting may still take (the rest of
    #: one ``transfer()`` call; docs/reliability.md says what it covers and what it cannot).
    fence_margin_s: float = 1.0
    #: How long shutdown waits for frames already queued (outcomes, settle acks) to go out.
    flush_timeout_s: float = 1.0
    #: Prefill: connections still in their handshake (not authenticated) at most; a new one
    #: over the cap sheds the oldest. Each may buffer at most ``hello_max_bytes`` (its Hello and
    #: the key confirmation): the pre-authentication memory is bounded by their product.
    max_unauthenticated: int = 64
    hello_max_bytes: int = 1 << 20
    #: Prefill: of those, at most this many from one peer host; a new one over it sheds that
    #: host's oldest, so one host's flood never sheds another host's handshake.
    max_unauthenticated_per_host: int = 16
    #: Prefill: control links at most, and from one peer host (an IPv4 address, an IPv6 /64).
    #: A link takes its place once its peer is authenticated, before its NIXL metadata is
    #: loaded; over either bound it is refused with an ``Error`` naming the bound. Every
    #: per-link quota above is multiplied by these: docs/reliability.md gives the memory.
    max_links: int = 128
    max_links_per_host: int = 32
    #: Prefill: bytes queued for one link that its peer has not taken yet. Past it prefill
    #: stops reading that peer until half of them went out (TCP then holds the peer back): a
    #: peer that sends frames whose answers it never reads cannot grow prefill's memory, and
    #: one that stops reading altogether falls silent and is lost.
    outbox_max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not (self.heartbeat_s > 0 and self.liveness_factor >= 1.0):
            raise ValueError("heartbeat_s must be > 0 and liveness_factor >= 1")
        if not self.lease_s > 0 or self.fence_margin_s < 0 or self.flush_timeout_s < 0:
            raise ValueError("lease_s must be > 0, fence_margin_s and flush_timeout_s >= 0")
        if self.max_unauthenticated < 1 or self.hello_max_bytes < 4096:
            raise ValueError("max_unauthenticated must be >= 1 and hello_max_bytes >= 4096")
        bounds = (
            self.max_unauthenticated_per_host,
            self.max_links,
            self.max_links_per_host,
            self.pending_max,
        )
        if min(bounds) < 1:
            raise ValueError(
                "max_unauthenticated_per_host, max_links, max_links_per_host and pending_max "
                "must be >= 1"
            )
        if self.held_bytes_max < 0 or self.outbox_max_bytes < 65536:
            raise ValueError("held_bytes_max must be >= 0 and outbox_max_bytes >= 65536")

    @property
    def silence_s(self) -> float:
        return self.heartbeat_s * self.liveness_factor

    @property
    def settle_after_loss_s(self) -> float:
        """Longest a lost link's pages stay unsettled on decode: the fence's bound."""
        return self.lease_s + self.fence_margin_s

    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            pending_max=self.pending_max,
            pending_ttl_s=self.pending_ttl_s,
            held_bytes_max=self.held_bytes_max,
            max_links=self.max_links,
            max_links_per_host=self.max_links_per_host,
            unclaimed_s=self.unclaimed_s,
            lease_s=self.lease_s,
            fence_margin_s=self.fence_margin_s,
        )


class Link:
    """One live connection after the Hello exchange (loop side). ``generation`` names it to the
    routing core, and is the fence id of the writes made under its leases."""

    __slots__ = (
        "closed",
        "codec",
        "error",
        "generation",
        "hello",
        "key",
        "liveness",
        "drained",
        "outbox",
        "peer_id",
        "queued",
        "round_trip",
    )

    def __init__(
        self,
        hello: Hello,
        generation: int,
        peer_id: str,
        now: float,
        codec: Sealer,
        *,
        silence_s: float,
    ) -> None:
        self.key: int | str = peer_id
        #: Seals this connection's frames (its session keys and sequence, with a secret).
        self.codec = codec
        self.hello = hello
        self.generation = generation
        self.peer_id = peer_id
        #: When the peer was last heard from, on the loop's clock (any frame counts).
        self.liveness = Liveness(now, silence_s)
        #: The echoes both ways (heartbeats, leases) and the round trip they measure (``last_s``,
        #: ``smoothed_s``: None until the peer echoed one of ours).
        self.round_trip = RoundTrip()
        #: Payloads (``FrameCodec.payload``), sealed by the writer as they go out: with a
        #: session the sequence number is the order on the wire.
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.queued = 0  # the bytes in ``outbox``
        #: Clear while ``queued`` is over the end's bound: its reader waits (backpressure).
        self.drained = asyncio.Event()
        self.drained.set()
        self.closed = False
        #: The peer's last Error frame that named no room (a refusal of the link itself, such as
        #: NIXL refusing our agent): it is the reason the link is lost, if it is.
        self.error = ""
