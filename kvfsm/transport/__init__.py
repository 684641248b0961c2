"""Everything that touches NIXL: layouts and registration, agents and peers, the chunk data path
with its completion pump, deadlines and quarantine, the write leases that fence it, and the
progress loop of an agent that is only written into (decode).

Exported: what a rank builds its layout from and configures (``Layout``, ``Region``,
``MemKind``, ``AgentConfig``, ``TransferConfig``), what the manager and the control channel
wire together (the agent, the data path, the leases, decode's progress loop, layout summaries),
and the head and state slices of unequal TP that the handshake and the SGLang backend share.
"""

from __future__ import annotations

from kvfsm.transport._agent import Agent, AgentConfig
from kvfsm.transport._fence import Leases
from kvfsm.transport._geometry import RegionSpec, state_groups
from kvfsm.transport._layout import Layout, LayoutError, LayoutSummary, MemKind, Region
from kvfsm.transport._progress import AgentProgress, ProgressWatch
from kvfsm.transport._slices import (
    NO_KV,
    HeadShard,
    KvPiece,
    legs,
    link_piece,
    prefill_legs,
    state_legs,
    targets,
)
from kvfsm.transport._state_slices import Block, StatePiece
from kvfsm.transport._transport import NixlTransport, TransferConfig

__all__ = [
    "NO_KV",
    "Agent",
    "AgentConfig",
    "AgentProgress",
    "Block",
    "HeadShard",
    "KvPiece",
    "Layout",
    "LayoutError",
    "LayoutSummary",
    "Leases",
    "MemKind",
    "NixlTransport",
    "ProgressWatch",
    "Region",
    "RegionSpec",
    "StatePiece",
    "TransferConfig",
    "legs",
    "link_piece",
    "prefill_legs",
    "state_groups",
    "state_legs",
    "targets",
]
