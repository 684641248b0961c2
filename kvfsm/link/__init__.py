"""What every kvfsm listener and link stands on: shared-secret authentication (HMAC-SHA256) for
the registry's HTTP routes and the control channel's frames, and the one implementation of the
raw stream, accept loop, handshake reads, heartbeats and liveness that every listener uses."""

from __future__ import annotations

from kvfsm.link._auth import AuthError, check_request, check_secret, request_headers, sign
from kvfsm.link._link import (
    PEER_ERRORS,
    AcceptErrors,
    Liveness,
    RawConnection,
    accept_forever,
    describe,
    next_frame,
    peer_host,
    send_or_beat,
    shake_hands,
    tune,
)

__all__ = [
    "PEER_ERRORS",
    "AcceptErrors",
    "AuthError",
    "Liveness",
    "RawConnection",
    "accept_forever",
    "check_request",
    "check_secret",
    "describe",
    "next_frame",
    "peer_host",
    "request_headers",
    "send_or_beat",
    "shake_hands",
    "sign",
    "tune",
]
