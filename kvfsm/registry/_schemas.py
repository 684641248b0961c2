"""The bootstrap registry's wire schemas: the JSON bodies of its routes, which ``msgspec``
decodes against these types on both sides (``_server``, ``_client``).

What a rank publishes
---------------------

One ``RankInfo`` per rank of an *engine* (a deployment id): its topology coordinates, the address of
its control channel, its NIXL agent name, an opaque ``layout`` blob (msgpack of the rank's layout
summary; the registry stores and returns it, never reads it) and an ``incarnation`` that changes
whenever the rank restarts. Everything is validated on the way in: engine ids match
``ENGINE_PATTERN`` (they appear in URL paths), ``0 <= tp_rank < tp_size``, ranks and ports are in
range, strings carry no control characters, unknown fields are refused.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

import msgspec

__all__ = [
    "ENGINE_PATTERN",
    "ENGINE_RE",
    "MAX_QUERY_ROOMS",
    "MAX_RANKS",
    "ConnectionStats",
    "DpRankQuery",
    "DpRankRegistration",
    "EngineStatus",
    "ErrorBody",
    "Health",
    "Outcome",
    "RankInfo",
    "RankList",
    "Registered",
]

#: Engine ids: they are URL path segments, so a conservative alphabet.
ENGINE_PATTERN: Final = r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z"
ENGINE_RE: Final = re.compile(ENGINE_PATTERN)
#: Ranks per engine: a rank is ``0 <= rank < MAX_RANKS``.
MAX_RANKS: Final = 1 << 20
_MAX_LAYOUT_BYTES: Final = 512 * 1024

_Engine = Annotated[str, msgspec.Meta(pattern=ENGINE_PATTERN)]
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
# Host names, IPv4 and IPv6 literals (with brackets or zone ids); no spaces or control characters.
_Host = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9._:%\[\]-]{1,253}\Z")]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Agent = Annotated[str, msgspec.Meta(pattern=r"\A[^\x00-\x1f\x7f]{1,256}\Z")]
_Layout = Annotated[bytes, msgspec.Meta(max_length=_MAX_LAYOUT_BYTES)]
_Incarnation = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class RankInfo(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """What one rank publishes. ``layout`` is opaque here; it travels base64 in JSON."""

    engine: _Engine
    #: Global rank within the engine: ``0 <= rank < expected_ranks`` of the registry.
    rank: _Rank
    tp_rank: _Rank
    tp_size: _Size
    dp_rank: _Rank
    pp_rank: _Rank
    #: The rank's control-channel address.
    host: _Host
    port: _Port
    #: The rank's NIXL agent name.
    agent: _Agent
    #: msgpack of the rank's layout summary.
    layout: _Layout
    #: Changes whenever the rank restarts (a start time in ns, a random 63-bit number...).
    incarnation: _Incarnation
    #: Data-parallel width of the engine, so a decode rank can pick the DP rank serving a room.
    dp_size: _Size = 1
    #: Pipeline-parallel depth of the engine: decode reads each request from every stage.
    pp_size: _Size = 1
    #: How the engine picks the DP rank of a room: True, ``room % dp_size`` (decode computes
    #: it); False, a balancer picks it and the serving rank registers it
    #: (``POST /register_dp_rank``), so decode asks (``POST /query_dp_ranks``).
    dp_by_room: bool = True
    #: The HTTP port of the engine's serving frontend on ``host`` (0: none published): where a
    #: decode asks prefill to recompute a request it retracted (SGLang's re-bootstrap).
    http_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: Pipeline stage 0 only (``pp_size > 1``): where the other stages of its pipeline report
    #: their rooms' statuses (``_stages``); 0 otherwise.
    stage_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(
                f"tp_rank {self.tp_rank} out of range: 0 <= tp_rank < tp_size ({self.tp_size})"
            )
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"dp_rank {self.dp_rank} out of range: 0 <= dp_rank < dp_size ({self.dp_size})"
            )
        if self.pp_rank >= self.pp_size:
            raise ValueError(
                f"pp_rank {self.pp_rank} out of range: 0 <= pp_rank < pp_size ({self.pp_size})"
            )

    @property
    def coords(self) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)``: unique among the live ranks of an engine."""
        return (self.tp_rank, self.dp_rank, self.pp_rank)


Outcome = Literal["registered", "refreshed", "replaced"]


class Registered(msgspec.Struct, frozen=True):
    """The answer to a registration. Re-register well within ``ttl_s`` (every ``ttl_s / 3``)."""

    outcome: Outcome
    ttl_s: float


class RankList(msgspec.Struct, frozen=True):
    engine: str
    ranks: list[RankInfo]


class EngineStatus(msgspec.Struct, frozen=True):
    registered: int
    expected: int
    ready: bool


class ConnectionStats(msgspec.Struct, frozen=True):
    """The listener's connections now and its counters since it started."""

    #: Connections held now (their descriptors: one being closed counts until it is), and the
    #: most held open for use (``max_connections``).
    open: int
    limit: int
    #: Of the open ones, those running a request.
    busy: int
    accepted: int
    #: Closed to make room: beyond ``limit`` (the one idle the longest, else the one busy the
    #: longest), or when accept() ran out of descriptors (idle ones only).
    shed: int
    #: Closed after ``idle_timeout_s`` with no request in progress.
    idle_closed: int
    #: Requests cut off after ``request_timeout_s``.
    request_timeouts: int
    #: Failed accept() calls (EMFILE, ENFILE...); each was followed by shedding or a back-off.
    accept_errors: int


class Health(msgspec.Struct, frozen=True):
    """``ready``: at least one engine is known and every known engine has all its ranks.

    ``connections``: the server's ``ConnectionStats`` (``None`` from the table alone).
    """

    ready: bool
    detail: str
    engines: dict[str, EngineStatus]
    connections: ConnectionStats | None = None


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    error: str
    registered: int | None = None
    expected: int | None = None


#: Rooms are SGLang's ``bootstrap_room`` (random in 0..2**63-1), as on the control channel.
_Room = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: Rooms one query may ask about (SGLang asks for the requests pending on one decode rank).
MAX_QUERY_ROOMS: Final = 1 << 16


class DpRankRegistration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /register_dp_rank``: ``bootstrap_room`` is served by ``dp_rank`` (SGLang's body)."""

    bootstrap_room: _Room
    dp_rank: _Rank


class DpRankQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /query_dp_ranks``: the rooms whose DP rank decode wants (SGLang's body); the
    answer is ``{"<room>": dp_rank}`` for those registered."""

    bootstrap_rooms: Annotated[list[_Room], msgspec.Meta(max_length=MAX_QUERY_ROOMS)]
