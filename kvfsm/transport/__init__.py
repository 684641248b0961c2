"""Everything that touches NIXL: layouts and registration, agents and peers, the chunk data path
with its completion pump, deadlines and quarantine, the write leases that fence it, and the
progress loop of an agent that is only written into (decode)."""

from __future__ import annotations

from kvfsm.transport._agent import Agent, AgentConfig, AgentFencedOutError, Peer
from kvfsm.transport._fence import Leases
from kvfsm.transport._layout import Layout, LayoutError, LayoutSummary, MemKind, Region
from kvfsm.transport._progress import AgentProgress, ProgressWatch
from kvfsm.transport._slices import NO_KV, HeadShard, KvPiece, legs, link_piece, targets
from kvfsm.transport._transport import NixlTransport, TransferConfig, TransportStats

__all__ = [
    "NO_KV",
    "Agent",
    "AgentConfig",
    "AgentFencedOutError",
    "AgentProgress",
    "HeadShard",
    "KvPiece",
    "Layout",
    "LayoutError",
    "LayoutSummary",
    "Leases",
    "MemKind",
    "NixlTransport",
    "Peer",
    "ProgressWatch",
    "Region",
    "TransferConfig",
    "TransportStats",
    "legs",
    "link_piece",
    "targets",
]
