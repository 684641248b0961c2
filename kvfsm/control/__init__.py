"""The control channel between prefill and decode ranks: the handshake that checks both sides
agree on the KV layout, typed frames with heartbeats and leases, per-room routing, the PP status
consensus between pipeline stages, and the glue that publishes a prefill rank in the registry."""

from __future__ import annotations

from kvfsm.control._channel import ChannelConfig, Resolver
from kvfsm.control._codec import FrameCodec, FrameReader
from kvfsm.control._decode import DecodeControl
from kvfsm.control._discovery import Registration, registry_resolver
from kvfsm.control._fingerprint import Fingerprint
from kvfsm.control._frames import MAC_BYTES, PROTOCOL_VERSION, FrameError, Hello
from kvfsm.control._pipeline import PipelineStage
from kvfsm.control._plane import ControlPlane
from kvfsm.control._prefill import PrefillControl

__all__ = [
    "MAC_BYTES",
    "PROTOCOL_VERSION",
    "ChannelConfig",
    "ControlPlane",
    "DecodeControl",
    "Fingerprint",
    "FrameCodec",
    "FrameError",
    "FrameReader",
    "Hello",
    "PipelineStage",
    "PrefillControl",
    "Registration",
    "Resolver",
    "registry_resolver",
]
