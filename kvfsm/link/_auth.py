"""Shared-secret message authentication (HMAC-SHA256) for the bootstrap registry and the control
channel.

Model
-----

Every party of one deployment holds the same secret (``--secret-file`` on the command line; at
least ``MIN_SECRET_BYTES`` bytes; ``secrets.token_hex(32)`` makes a good one). A message is
authenticated by a MAC over its *parts* joined with ``b"\\n"``; only the **last** part may contain a
newline (``sign`` refuses otherwise, ``verify`` answers False), which keeps the joined form
unambiguous: ``("a\\nb", "c")`` and ``("a", "b\\nc")`` can never produce the same input.
``verify`` compares with ``hmac.compare_digest``, so the time it takes does not leak how many
leading bytes of a forged MAC were right.

For HTTP (the bootstrap registry) the parts are ``method, path, timestamp, body``:

    X-Kvfsm-Signature: hex(HMAC-SHA256(secret, METHOD \\n /raw/path?query \\n TIMESTAMP \\n body))
    X-Kvfsm-Timestamp: unix seconds, a decimal integer

``path`` is the request target exactly as sent (percent-encoding and query string included).
``check_request`` refuses a timestamp more than ``MAX_SKEW_S`` (60 s) away from the verifier's
clock, which bounds replays of a captured request to that window. It does not stop a replay
*inside* the window; the registry tolerates that because its state is soft: a replayed
registration or deletion is undone by the rank's next heartbeat. A channel that needs more (the
control channel carries per-room frames) must add its own nonce or sequence number as a part.

No encryption: the secret proves who wrote a message, it does not hide it. Use TLS or a private
network when the content is confidential.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Mapping
from typing import Final

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

#: The header that carries the hex MAC of a signed HTTP request.
SIGNATURE_HEADER: Final = "X-Kvfsm-Signature"
#: The header that carries the signer's clock, unix seconds as a decimal integer.
TIMESTAMP_HEADER: Final = "X-Kvfsm-Timestamp"
#: How far (seconds, either direction) a request's timestamp may be from the verifier's clock.
MAX_SKEW_S: Final = 60.0
#: Shorter secrets are refused: they can be guessed offline from one captured MAC.
MIN_SECRET_BYTES: Final = 16

_DIGEST_BYTES: Final = hashlib.sha256().digest_size
_HEX_MAC: Final = re.compile(f"[0-9a-fA-F]{{{2 * _DIGEST_BYTES}}}")
_TIMESTAMP: Final = re.compile(r"[0-9]{1,12}")


class AuthError(Exception):
    """A request that is not authentic: unsigned, wrongly signed, or stale. ``str()`` says which."""


def check_secret(secret: bytes) -> bytes:
    """Return ``secret`` if it can key a MAC; raise ``TypeError``/``ValueError`` if not."""
    if not isinstance(secret, bytes):
        raise TypeError(f"the secret must be bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required"
        )
    return secret


def _joined(parts: tuple[bytes, ...]) -> bytes | None:
    if any(b"\n" in part for part in parts[:-1]):
        return None
    return b"\n".join(parts)


def sign(secret: bytes, *parts: bytes) -> bytes:
    """The raw 32-byte HMAC-SHA256 of ``parts`` joined with ``b"\\n"`` under ``secret``.

    Raises ``ValueError`` if a part other than the last contains a newline, or if the secret is
    too short (``check_secret``).
    """
    data = _joined(parts)
    if data is None:
        raise ValueError("only the last part of a signed message may contain a newline")
    return hmac.digest(check_secret(secret), data, "sha256")


def verify(secret: bytes, mac: bytes, *parts: bytes) -> bool:
    """Whether ``mac`` (raw bytes, as ``sign`` returns) authenticates ``parts`` under ``secret``.

    Constant-time in the content of ``mac``. Parts that ``sign`` would refuse verify as False.
    """
    data = _joined(parts)
    if data is None:
        return False
    expected = hmac.digest(check_secret(secret), data, "sha256")
    return hmac.compare_digest(expected, mac)


def request_headers(
    secret: bytes, method: str, path: str, body: bytes, *, now: float | None = None
) -> dict[str, str]:
    """The two headers that sign an HTTP request (``path``: the raw target, query included)."""
    timestamp = str(int(time.time() if now is None else now))
    mac = sign(secret, method.upper().encode(), path.encode(), timestamp.encode(), body)
    return {SIGNATURE_HEADER: mac.hex(), TIMESTAMP_HEADER: timestamp}


def check_request(
    secret: bytes,
    method: str,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float | None = None,
    max_skew_s: float = MAX_SKEW_S,
) -> None:
    """Raise ``AuthError`` unless ``headers`` carry a fresh, valid signature of the request.

    ``headers`` is looked up with the exact names ``SIGNATURE_HEADER``/``TIMESTAMP_HEADER``; pass a
    case-insensitive mapping (aiohttp's ``request.headers`` is one).
    """
    signature = headers.get(SIGNATURE_HEADER)
    timestamp = headers.get(TIMESTAMP_HEADER)
    if signature is None or timestamp is None:
        raise AuthError(
            f"this registry requires signed writes: missing {SIGNATURE_HEADER} or "
            f"{TIMESTAMP_HEADER} header"
        )
    if not _TIMESTAMP.fullmatch(timestamp):
        raise AuthError(f"malformed {TIMESTAMP_HEADER}: expected unix seconds")
    skew = int(timestamp) - (time.time() if now is None else now)
    if abs(skew) > max_skew_s:
        raise AuthError(
            f"stale {TIMESTAMP_HEADER}: {skew:+.0f} s from the registry's clock "
            f"(limit {max_skew_s:.0f} s)"
        )
    if not _HEX_MAC.fullmatch(signature):
        raise AuthError(f"malformed {SIGNATURE_HEADER}: expected {2 * _DIGEST_BYTES} hex digits")
    parts = (method.upper().encode(), path.encode(), timestamp.encode(), body)
    if not verify(secret, bytes.fromhex(signature), *parts):
        raise AuthError("bad signature")
