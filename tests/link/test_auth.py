"""Shared-secret authentication (``kvfsm.link._auth``): the MAC of parts, and signed HTTP
requests with their freshness window. Pure functions, given ``now``."""

from __future__ import annotations

import hashlib
import hmac

import pytest

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

SECRET = b"s" * 32
NOW = 1_800_000_000.0


def test_sign_is_hmac_sha256_of_the_parts_joined_by_newlines() -> None:
    assert sign(SECRET, b"a", b"b", b"c\nd") == hmac.digest(SECRET, b"a\nb\nc\nd", hashlib.sha256)
    assert verify(SECRET, sign(SECRET, b"x", b"y"), b"x", b"y")


def test_only_the_last_part_may_hold_a_newline() -> None:
    # Otherwise ("a\nb", "c") and ("a", "b\nc") would sign the same bytes.
    with pytest.raises(ValueError, match="only the last part"):
        sign(SECRET, b"a\nb", b"c")
    assert not verify(SECRET, sign(SECRET, b"a", b"b\nc"), b"a\nb", b"c")


@pytest.mark.parametrize(
    ("mac_parts", "checked_parts", "key"),
    [
        ((b"a", b"b"), (b"a", b"c"), SECRET),  # another message
        ((b"a", b"b"), (b"a", b"b"), b"t" * 32),  # another secret
        ((b"ab",), (b"a", b"b"), SECRET),  # the same bytes, split differently
    ],
    ids=["other-message", "other-secret", "other-split"],
)
def test_a_mac_verifies_nothing_else(
    mac_parts: tuple[bytes, ...], checked_parts: tuple[bytes, ...], key: bytes
) -> None:
    assert not verify(key, sign(SECRET, *mac_parts), *checked_parts)


def test_a_truncated_mac_verifies_nothing() -> None:
    mac = sign(SECRET, b"a", b"b")
    assert not verify(SECRET, mac[:-1], b"a", b"b")
    assert not verify(SECRET, b"", b"a", b"b")


def test_a_short_or_non_bytes_secret_is_refused() -> None:
    assert check_secret(b"k" * MIN_SECRET_BYTES) == b"k" * MIN_SECRET_BYTES
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES}"):
        check_secret(b"k" * (MIN_SECRET_BYTES - 1))
    with pytest.raises(TypeError, match="must be bytes"):
        check_secret("k" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least"):
        sign(b"short", b"x")


def _signed(body: bytes = b"{}", path: str = "/ranks/e?x=1") -> dict[str, str]:
    return request_headers(SECRET, "post", path, body, now=NOW)


def test_a_signed_request_passes_within_the_skew() -> None:
    headers = _signed()
    assert headers[TIMESTAMP_HEADER] == str(int(NOW))
    check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", headers, now=NOW)
    check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", headers, now=NOW + MAX_SKEW_S)
    check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", headers, now=NOW - MAX_SKEW_S)


@pytest.mark.parametrize(
    ("method", "path", "body", "match"),
    [
        ("POST", "/ranks/e?x=2", b"{}", "bad signature"),  # the query is signed
        ("DELETE", "/ranks/e?x=1", b"{}", "bad signature"),  # so is the method
        ("POST", "/ranks/e?x=1", b'{"a":1}', "bad signature"),  # and the body
    ],
)
def test_any_change_to_a_signed_request_is_refused(
    method: str, path: str, body: bytes, match: str
) -> None:
    with pytest.raises(AuthError, match=match):
        check_request(SECRET, method, path, body, _signed(), now=NOW)


def test_stale_missing_and_malformed_signatures_are_refused_by_name() -> None:
    good = _signed()
    with pytest.raises(AuthError, match="stale"):
        check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", good, now=NOW + MAX_SKEW_S + 1)
    with pytest.raises(AuthError, match="missing"):
        check_request(SECRET, "POST", "/", b"", {}, now=NOW)
    bad_time = {**good, TIMESTAMP_HEADER: "12.5"}
    with pytest.raises(AuthError, match="malformed X-Kvfsm-Timestamp"):
        check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", bad_time, now=NOW)
    bad_mac = {**good, SIGNATURE_HEADER: "zz" * 32}
    with pytest.raises(AuthError, match="malformed X-Kvfsm-Signature"):
        check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", bad_mac, now=NOW)
    moved_time = {**good, TIMESTAMP_HEADER: str(int(NOW) + 1)}  # the timestamp is signed
    with pytest.raises(AuthError, match="bad signature"):
        check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", moved_time, now=NOW)
    other_key = request_headers(b"o" * 32, "POST", "/ranks/e?x=1", b"{}", now=NOW)
    with pytest.raises(AuthError, match="bad signature"):
        check_request(SECRET, "POST", "/ranks/e?x=1", b"{}", other_key, now=NOW)
