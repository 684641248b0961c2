"""Deprecated: the bootstrap registry now lives in ``_schemas``, ``_rank_table``,
``_connections``, ``_registry_server`` and ``_registry_client``.

This module only re-exports the names it used to define (the rank table, formerly ``Registry``,
is ``kvfsm.bootstrap._rank_table.RankTable``), for importers not yet moved over (``kvfsm.manager``).
Import from ``kvfsm.bootstrap`` instead; this module goes once nothing imports it.
"""

from __future__ import annotations

from kvfsm.bootstrap._connections import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from kvfsm.bootstrap._rank_table import MAX_ENGINES
from kvfsm.bootstrap._registry_client import (
    BootstrapClient,
    BootstrapError,
    NotFoundError,
    NotReadyError,
    RejectedError,
    UnauthorizedError,
    UnreachableError,
)
from kvfsm.bootstrap._registry_server import (
    DEFAULT_PORT,
    MAX_BODY_BYTES,
    REQUEST_TIMEOUT_S,
    BootstrapServer,
)
from kvfsm.bootstrap._schemas import (
    ENGINE_PATTERN,
    ConnectionStats,
    EngineStatus,
    Health,
    RankInfo,
    Registered,
)

__all__ = [
    "DEFAULT_PORT",
    "ENGINE_PATTERN",
    "IDLE_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "MAX_ENGINES",
    "REQUEST_TIMEOUT_S",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
    "ConnectionStats",
    "EngineStatus",
    "Health",
    "NotFoundError",
    "NotReadyError",
    "RankInfo",
    "Registered",
    "RejectedError",
    "UnauthorizedError",
    "UnreachableError",
]
