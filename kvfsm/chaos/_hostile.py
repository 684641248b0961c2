"""Hostile clients for a prefill rank's control port: garbage, oversized lengths, wrong protocol
versions, bad or missing MACs, frames cut short. Each one opens its own connection, sends its
bytes, and reports how the rank answered (law 7: a clear refusal, and no room of anyone else's
touched; the campaign checks the second part against every room's reason).
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Final

from kvfsm.control import PROTOCOL_VERSION, FrameCodec, FrameReader, Hello

__all__ = ["HOSTILE_KINDS", "HostileResult", "send_hostile"]

HOSTILE_KINDS: Final = (
    "garbage",
    "oversized",
    "wrong_version",
    "bad_auth",
    "unsigned",
    "signed_without_secret",
    "short",
)


@dataclass(frozen=True, slots=True)
class HostileResult:
    kind: str
    #: ``"closed"`` (the rank dropped the connection), ``"error"`` (it answered an Error
    #: frame), ``"answered"`` (it sent something else, e.g. its own Hello first) or
    #: ``"open"`` (nothing within the timeout).
    outcome: str
    detail: str = ""


def _hello(version: int) -> Hello:
    return Hello(version, "decode", 0, "hostile", b"", b"", secrets.randbits(62))


def payload(kind: str, secret: bytes | None) -> bytes:
    """The bytes a hostile client of ``kind`` sends (``secret``: the rank's, if it has one)."""
    if kind == "garbage":
        return struct.pack(">I", 40) + os.urandom(40)
    if kind == "oversized":
        return struct.pack(">I", 0xFFFF_FFF0) + os.urandom(64)
    if kind == "wrong_version":
        # An insider's codec (the right secret, if any) with a protocol this rank does not speak.
        return FrameCodec(secret).encode(_hello(PROTOCOL_VERSION + 99))
    if kind == "bad_auth":
        return FrameCodec(secrets.token_bytes(32)).encode(_hello(PROTOCOL_VERSION))
    if kind == "unsigned":
        return FrameCodec(None).encode(_hello(PROTOCOL_VERSION))
    if kind == "signed_without_secret":
        return FrameCodec(secrets.token_bytes(32)).encode(_hello(PROTOCOL_VERSION))
    if kind == "short":
        return struct.pack(">I", 500) + b"\x00" * 20  # then the connection closes
    raise ValueError(f"unknown hostile kind {kind!r}")


def send_hostile(
    host: str, port: int, kind: str, *, secret: bytes | None = None, timeout: float = 5.0
) -> HostileResult:
    """Connect to ``host:port``, send a ``kind`` payload, and report what the rank did.

    Blocking. The rank speaks first (its Hello) on every connection; that frame is read and
    skipped, so ``outcome`` is about what came after the hostile bytes."""
    reader = FrameReader(FrameCodec(secret))
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(payload(kind, secret))
            if kind == "short":
                sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    break
                if not data:
                    return HostileResult(kind, "closed")
                for item in reader.feed(data):
                    if isinstance(item, Hello):
                        continue
                    name = type(item).__name__
                    detail = getattr(item, "reason", name)
                    return HostileResult(kind, "error" if name == "Error" else "answered", detail)
            return HostileResult(kind, "open")
    except (ConnectionError, OSError) as exc:
        return HostileResult(kind, "closed", type(exc).__name__)
