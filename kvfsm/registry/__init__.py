"""The bootstrap registry: an HTTP service where prefill ranks publish where their control
channel listens and decode ranks look them up (SGLang's bootstrap server, kvfsm's way), with
its client, its schemas, a thread to embed it in a synchronous process, and ``kvfsm bootstrap``
(the parser-adder and runner :mod:`kvfsm.cli` registers it with)."""

from __future__ import annotations

from kvfsm.registry._cli import add_parser as add_bootstrap_parser
from kvfsm.registry._cli import run as run_bootstrap
from kvfsm.registry._client import (
    BootstrapClient,
    BootstrapError,
    NotFoundError,
    NotReadyError,
    RejectedError,
    UnauthorizedError,
    UnreachableError,
)
from kvfsm.registry._schemas import ConnectionStats, Health, RankInfo, Registered
from kvfsm.registry._server import BootstrapServer
from kvfsm.registry._thread import RegistryThread

__all__ = [
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
    "ConnectionStats",
    "Health",
    "NotFoundError",
    "NotReadyError",
    "RankInfo",
    "Registered",
    "RegistryThread",
    "RejectedError",
    "UnauthorizedError",
    "UnreachableError",
    "add_bootstrap_parser",
    "run_bootstrap",
]
