"""Discovery and control plane: the bootstrap registry (HTTP) where prefill ranks publish their
addresses and decode ranks find them, the control channel between them (typed frames, heartbeats),
and the HMAC helpers that authenticate both."""

from __future__ import annotations

from kvfsm.bootstrap._auth import AuthError, sign, verify
from kvfsm.bootstrap._control import ChannelConfig, ControlPlane, Resolver
from kvfsm.bootstrap._discovery import Registration, registry_resolver
from kvfsm.bootstrap._fingerprint import Fingerprint
from kvfsm.bootstrap._frames import PROTOCOL_VERSION, FrameCodec, FrameError, FrameReader
from kvfsm.bootstrap._pipeline import PipelineStage
from kvfsm.bootstrap._registry_client import (
    BootstrapClient,
    BootstrapError,
    NotFoundError,
    NotReadyError,
    RejectedError,
    UnauthorizedError,
    UnreachableError,
)
from kvfsm.bootstrap._registry_server import BootstrapServer
from kvfsm.bootstrap._registry_thread import RegistryThread
from kvfsm.bootstrap._schemas import ConnectionStats, Health, RankInfo, Registered

__all__ = [
    "PROTOCOL_VERSION",
    "AuthError",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
    "ChannelConfig",
    "ConnectionStats",
    "ControlPlane",
    "Fingerprint",
    "FrameCodec",
    "FrameError",
    "FrameReader",
    "Health",
    "NotFoundError",
    "NotReadyError",
    "PipelineStage",
    "RankInfo",
    "Registered",
    "Registration",
    "RegistryThread",
    "RejectedError",
    "Resolver",
    "UnauthorizedError",
    "UnreachableError",
    "registry_resolver",
    "sign",
    "verify",
]
