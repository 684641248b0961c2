"""Discovery and control plane: the bootstrap registry (HTTP) where prefill ranks publish their
addresses and decode ranks find them, and the HMAC helpers that authenticate both."""

from __future__ import annotations

from kvfsm.bootstrap._auth import AuthError, sign, verify
from kvfsm.bootstrap._registry import (
    BootstrapClient,
    BootstrapError,
    BootstrapServer,
    Health,
    NotFoundError,
    NotReadyError,
    RankInfo,
    Registered,
    RejectedError,
    UnauthorizedError,
    UnreachableError,
)

__all__ = [
    "AuthError",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
    "Health",
    "NotFoundError",
    "NotReadyError",
    "RankInfo",
    "Registered",
    "RejectedError",
    "UnauthorizedError",
    "UnreachableError",
    "sign",
    "verify",
]
