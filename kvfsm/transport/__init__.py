"""NIXL transports: agent setup, registration, prepped descriptor lists, the completion pump."""

from __future__ import annotations

from kvfsm.transport._nixl_pair import NixlPairSink

__all__ = ["NixlPairSink"]
