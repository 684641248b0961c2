"""The control channel's envelope, sans-IO: ``FrameCodec`` turns frames into wire bytes and bodies
into frames or ``FrameError`` values, ``SessionCodec`` seals a connection's frames under its
session keys once the Hellos are exchanged, and ``FrameReader`` cuts a byte stream into frames.

The rules they keep (the length prefix, the ``auth`` byte and MAC, the session sequence, which
errors are fatal) are stated with the frames themselves, in :mod:`kvfsm.control._frames`; this
module is their implementation, and like the frames it reads no socket and no clock.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal, TypeAlias

import msgspec

from kvfsm.control._frames import (
    _AUTH_HMAC_SHA256,
    _AUTH_NONE,
    _AUTH_SESSION,
    _COPY_MAX,
    _MAC_BYTES,
    _MAX_LIMIT,
    _PREFIX,
    _PREFIX_BYTES,
    _SEQ,
    _SESSION,
    _SIGNED,
    _TAGS,
    _UNSIGNED,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AnyFrame,
    Frame,
    FrameError,
    _clip,
    _int63,
    _Probe,
    _version_mismatch,
    session_keys,
)
from kvfsm.link import check_secret

__all__ = ["FrameCodec", "FrameReader", "SessionCodec"]

# CPython 3.11 compiles ``NAME.method(...)`` on an imported NAME as an attribute load and a
# call, building a bound method each time; every frame sealed or read calls these, so they are
# bound once here.
_pack_prefix = _PREFIX.pack
_unpack_prefix = _PREFIX.unpack_from
_pack_seq = _SEQ.pack
_unpack_seq = _SEQ.unpack_from


class FrameCodec:
    """Encode frames to wire bytes and decode frame bodies, with an optional shared secret.

    One codec may serve many connections: it holds no per-connection state. ``secret``: sign
    every frame and require a valid MAC on every frame read (``ValueError`` if shorter than
    ``MIN_SECRET_BYTES``). ``max_frame_bytes``: the largest body accepted or produced.
    """

    __slots__ = ("_decoder", "_encoder", "_mac", "_overhead", "_probe", "max_frame_bytes", "secret")

    def __init__(self, secret: bytes | None = None, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not 1 + _MAC_BYTES <= max_frame_bytes <= _MAX_LIMIT:
            raise ValueError(
                f"max_frame_bytes must be in [{1 + _MAC_BYTES}, {_MAX_LIMIT}], "
                f"not {max_frame_bytes}"
            )
        self.secret = None if secret is None else check_secret(secret)
        # HMAC-SHA256 keyed once; each frame copies the keyed state (cheaper than re-keying).
        # The MAC equals ``sign(secret, payload)``.
        self._mac = None if secret is None else hmac.new(secret, digestmod=hashlib.sha256)
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyFrame)
        self._probe = msgspec.msgpack.Decoder(_Probe)
        # Body bytes before the payload: the auth byte and the MAC.
        self._overhead = 1 if secret is None else 1 + _MAC_BYTES

    def encode(self, frame: Frame) -> bytes:
        """The wire bytes of ``frame``, length prefix included.

        Raises ``FrameError`` (not fatal, naming the frame's room if it has one) if the body would
        exceed ``max_frame_bytes``: the peer would drop the connection for it.
        """
        return self.seal(self.payload(frame))

    def payload(self, frame: Frame) -> bytes:
        """The msgpack payload of ``frame``, checked against the frame limit (``FrameError``
        naming the frame's room if it would exceed it); ``seal`` makes it wire bytes."""
        payload = self._encoder.encode(frame)
        size = self._overhead + _SEQ.size + len(payload)
        if size > self.max_frame_bytes:
            raise FrameError(
                f"{type(frame).__name__} of {size} bytes exceeds the frame limit of "
                f"{self.max_frame_bytes} bytes",
                getattr(frame, "room", None),
                False,
                generation=getattr(frame, "generation", None),
                tag=type(frame).__name__,
            )
        return payload

    def seal(self, payload: bytes) -> bytes:
        """Wire bytes of a payload from :meth:`payload`: length prefix, auth byte, MAC."""
        size = self._overhead + len(payload)
        if self._mac is None:
            return b"".join((_pack_prefix(size), _UNSIGNED, payload))
        mac = self._mac.copy()
        mac.update(payload)
        return b"".join((_pack_prefix(size), _SIGNED, mac.digest(), payload))

    def session(
        self, role: Literal["prefill", "decode"], own_nonce: bytes, peer_nonce: bytes
    ) -> SessionCodec:
        """The codec of one connection after its Hellos (a secret is required)."""
        if self.secret is None:
            raise ValueError("a session needs a secret")
        decode_nonce, prefill_nonce = (
            (own_nonce, peer_nonce) if role == "decode" else (peer_nonce, own_nonce)
        )
        to_prefill, to_decode = session_keys(self.secret, decode_nonce, prefill_nonce)
        send, receive = (to_prefill, to_decode) if role == "decode" else (to_decode, to_prefill)
        return SessionCodec(self, send, receive)

    def decode(self, body: bytes | bytearray | memoryview) -> Frame:
        """The frame in ``body`` (the bytes after the length prefix).

        Raises ``FrameError`` for anything else; see the module docstring for which errors are
        fatal and when the error names a room. Never raises another exception type.
        """
        size = len(body)
        if size > self.max_frame_bytes:
            raise FrameError(
                f"frame of {size} bytes exceeds the limit of {self.max_frame_bytes} bytes",
                None,
                True,
            )
        if size == 0:
            raise FrameError("empty frame body (no auth byte)", None, True)
        # Never keep a view of a buffer the caller may change.
        data = bytes(body) if isinstance(body, bytearray) else body
        auth = data[0]
        payload: bytes | memoryview
        if self._mac is None:
            if auth != _AUTH_NONE:
                raise FrameError(
                    "the peer signs its frames but no secret is configured here"
                    if auth == _AUTH_HMAC_SHA256
                    else f"unknown auth byte {auth}",
                    None,
                    True,
                )
            # Small payloads: a copy is cheaper than a view. Large ones: a view, no copy.
            payload = data[1:] if size <= _COPY_MAX else memoryview(data)[1:]
        else:
            if auth != _AUTH_HMAC_SHA256:
                raise FrameError(
                    "unsigned frame: a secret is configured here and every frame must carry a MAC"
                    if auth == _AUTH_NONE
                    else "a session frame before the session was set up (expected Hello)"
                    if auth == _AUTH_SESSION
                    else f"unknown auth byte {auth}",
                    None,
                    True,
                )
            if size < 1 + _MAC_BYTES:
                raise FrameError(f"frame of {size} bytes is too short for its MAC", None, True)
            view = memoryview(data)
            payload = view[1 + _MAC_BYTES :]
            mac = self._mac.copy()
            mac.update(payload)
            if not hmac.compare_digest(mac.digest(), view[1 : 1 + _MAC_BYTES]):
                raise FrameError("bad MAC: frame altered or signed with another secret", None, True)
        return self.parse(payload)

    def parse(self, payload: bytes | memoryview) -> Frame:
        """The frame in an authenticated payload (``FrameError`` if it is not one)."""
        try:
            frame: Frame = self._decoder.decode(payload)
        except (msgspec.MsgspecError, RecursionError) as exc:
            raise self._rejected(payload, exc) from None
        return frame

    def _rejected(self, payload: bytes | memoryview, exc: BaseException) -> FrameError:
        """Turn a decode failure into a ``FrameError``, naming the room if the payload can."""
        try:
            probe = self._probe.decode(payload)
        except (msgspec.MsgspecError, RecursionError):
            probe = _Probe()
        tag = _clip(probe.t, 64) if type(probe.t) is str else None
        room, generation = _int63(probe.room), _int63(probe.generation)
        # msgspec quotes offending values and field names, which a hostile peer chooses.
        detail = _clip(str(exc), 256)
        if isinstance(exc, RecursionError):
            reason = "malformed frame: nested too deeply"
        elif not isinstance(exc, msgspec.ValidationError):
            reason = f"malformed frame: {detail}"
        elif tag is not None and tag not in _TAGS:
            reason = f"unknown frame type {tag!r}"
        elif tag is not None:
            reason = f"invalid {tag} frame: {detail}"
        else:
            reason = f"invalid frame: {detail}"
        fatal = False
        if tag == "Hello":
            fatal = True
            if type(probe.version) is int and probe.version != PROTOCOL_VERSION:
                reason = _version_mismatch(probe.version)
        return FrameError(reason, room, fatal, generation=generation, tag=tag)


class SessionCodec:
    """One connection's codec after the Hellos, when a secret is set: every frame is sealed
    under this direction's session key with the next sequence number, and every frame read must
    carry the peer's next one (Rule 2). Stateful: one per connection, one writer, one reader."""

    __slots__ = ("_base", "_receive", "_send", "max_frame_bytes", "received", "sent")

    def __init__(self, base: FrameCodec, send_key: bytes, receive_key: bytes) -> None:
        self._base = base
        self._send = hmac.new(send_key, digestmod=hashlib.sha256)
        self._receive = hmac.new(receive_key, digestmod=hashlib.sha256)
        self.max_frame_bytes = base.max_frame_bytes
        self.sent = 0  # sequence number of the last frame sealed
        self.received = 0  # ... and of the last frame accepted

    def payload(self, frame: Frame) -> bytes:
        return self._base.payload(frame)

    def encode(self, frame: Frame) -> bytes:
        return self.seal(self.payload(frame))

    def seal(self, payload: bytes) -> bytes:
        self.sent += 1
        seq = _pack_seq(self.sent)
        mac = self._send.copy()
        mac.update(seq)
        mac.update(payload)
        size = 1 + _MAC_BYTES + _SEQ.size + len(payload)
        return b"".join((_pack_prefix(size), _SESSION, mac.digest(), seq, payload))

    def decode(self, body: bytes | bytearray | memoryview) -> Frame:
        size = len(body)
        if size > self.max_frame_bytes:
            raise FrameError(f"frame of {size} bytes exceeds the limit", None, True)
        if size < 1 + _MAC_BYTES + _SEQ.size or body[0] != _AUTH_SESSION:
            raise FrameError(
                "not a session frame: every frame after the Hellos must be sealed with the "
                "session key",
                None,
                True,
            )
        view = memoryview(bytes(body) if isinstance(body, bytearray) else body)
        seq_at = 1 + _MAC_BYTES
        signed = view[seq_at:]
        mac = self._receive.copy()
        mac.update(signed)
        if not hmac.compare_digest(mac.digest(), view[1:seq_at]):
            raise FrameError(
                "bad MAC: frame altered, or recorded on another connection", None, True
            )
        (seq,) = _unpack_seq(view, seq_at)
        if seq != self.received + 1:
            raise FrameError(
                f"frame {seq} out of sequence (expected {self.received + 1}): replayed, "
                "dropped or reordered",
                None,
                True,
            )
        self.received = seq
        return self._base.parse(view[seq_at + _SEQ.size :])


Decoder: TypeAlias = FrameCodec | SessionCodec


class FrameReader:
    """Incremental reader for one connection's byte stream (sans-IO).

    ``feed(data)`` takes whatever the socket returned and gives back, in order, every frame that
    became complete, or a ``FrameError`` in its place. Frames may be split across reads and one
    read may hold several. After a fatal error the reader is dead: that list ends with the error,
    the buffer is dropped, and every later ``feed`` returns ``[error]`` again.
    """

    __slots__ = ("_failed", "_need", "_pending", "codec", "limit")

    def __init__(self, codec: Decoder | None = None, limit: int | None = None) -> None:
        self.codec: Decoder = FrameCodec() if codec is None else codec
        #: The largest body accepted, checked on the length prefix before a byte of the body is
        #: kept. Lower than the codec's limit while the peer is not authenticated (its Hello).
        self.limit = self.codec.max_frame_bytes if limit is None else limit
        #: The start of a frame that is not complete yet.
        self._pending = bytearray()
        self._need = _PREFIX_BYTES  # nothing can complete before this many bytes are pending
        self._failed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for a frame that is not complete yet."""
        return len(self._pending)

    @property
    def failed(self) -> FrameError | None:
        """The fatal error that killed this reader, if one did."""
        return self._failed

    def feed(
        self, data: bytes | bytearray | memoryview, max_items: int | None = None
    ) -> list[Frame | FrameError]:
        """Add ``data`` to the stream; return the frames (or errors) it completed. With
        ``max_items``, stop after that many and keep the rest for the next call (``feed(b"")``
        goes on with it): the handshake changes the codec after the peer's Hello."""
        if self._failed is not None:
            return [self._failed]
        if not data:
            if not self._pending:
                return []
            data, self._pending, self._need = bytes(self._pending), bytearray(), _PREFIX_BYTES
        # A read that starts on a frame boundary is parsed in place (no copy). A partial frame
        # waits in a bytearray (amortised O(1) per read, compact even if it trickles in a byte at
        # a time) and is copied out once, when it is complete.
        if self._pending:
            self._pending += data
            if len(self._pending) < self._need:
                return []
            buf = bytes(self._pending)
            self._pending = bytearray()
        else:
            buf = data if type(data) is bytes else bytes(data)
        view = memoryview(buf)
        end, pos = len(buf), 0
        limit, decode = self.limit, self.codec.decode
        out: list[Frame | FrameError] = []
        need = _PREFIX_BYTES
        while end - pos >= _PREFIX_BYTES:
            if max_items is not None and len(out) >= max_items:
                break
            (size,) = _unpack_prefix(buf, pos)
            if size > limit:
                return self._die(
                    out,
                    FrameError(
                        f"frame length {size} exceeds the limit of {limit} bytes",
                        None,
                        True,
                    ),
                )
            if end - pos - _PREFIX_BYTES < size:
                need = _PREFIX_BYTES + size
                break
            start = pos + _PREFIX_BYTES
            pos = start + size
            try:
                out.append(decode(view[start:pos]))
            except FrameError as exc:
                if exc.fatal:
                    return self._die(out, exc)
                out.append(exc)
        if pos < end:
            self._pending = bytearray(view[pos:])
        self._need = need
        return out

    def _die(self, out: list[Frame | FrameError], error: FrameError) -> list[Frame | FrameError]:
        self._failed = error
        self._pending = bytearray()
        out.append(error)
        return out
