"""What every kvfsm listener and link stands on: shared-secret authentication (HMAC-SHA256) for
the registry's HTTP routes and the control channel's frames."""

from __future__ import annotations

from kvfsm.link._auth import (
    MAX_SKEW_S,
    MIN_SECRET_BYTES,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AuthError,
    check_request,
    check_secret,
    request_headers,
    sign,
    verify,
)

__all__ = [
    "MAX_SKEW_S",
    "MIN_SECRET_BYTES",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "AuthError",
    "check_request",
    "check_secret",
    "request_headers",
    "sign",
    "verify",
]
