"""The control channel's wire format: typed frames and the rules of their envelope (the codec and
the stream reader that implement it are ``kvfsm.control._codec``).

Rule 1: a frame on the wire is ``length:u32 big-endian | body``, ``1 <= length <= max_frame_bytes``
        (``MAX_FRAME_BYTES``, 16 MiB, by default). A length above the limit is fatal: it is refused
        as soon as its four bytes are read, before a byte of its body is buffered.
Rule 2: ``body = auth:u8 | mac | payload``. ``auth`` 0: no MAC, ``mac`` is empty. ``auth`` 1:
        ``mac`` is the 32-byte HMAC-SHA256 of ``payload`` under the shared secret
        (``kvfsm.link.sign(secret, payload)``); only ``Hello`` travels so. ``auth`` 2
        (every frame after the Hellos when a secret is set): ``body = 2 | mac | seq:u64 | payload``
        and ``mac`` is the HMAC-SHA256 of ``seq | payload`` under this connection's session key
        for this direction (``SessionCodec``); ``seq`` counts the direction's frames from 1 and
        must arrive in order. No other ``auth`` value exists.
Rule 3: ``payload`` is one msgpack map: the frame's fields by name plus ``"t"``, the frame's class
        name. Decoding it against the tagged union of the frame classes *is* the validation:
        types, ranges and lengths are declared on the fields, and nothing downstream re-checks.
Rule 4: the first frame each way on a new connection is ``Hello``; its ``version`` must equal
        ``PROTOCOL_VERSION`` (``check_hello``). There is no negotiation.
Rule 5: this module is sans-IO. It turns frames into bytes and bytes into frames or
        ``FrameError`` values; sockets, time and the choice of reply belong to the caller.

Frames
------

    frame          direction         meaning
    Hello          both, first       version, role, rank, NIXL agent name and metadata, layout,
                                     incarnation; decode's: its first lease and its fence margin
    Heartbeat      both              a sign of life on an idle connection (any frame is one);
                                     echoes the peer's last heartbeat (the round trip)
    LeaseRequest   prefill -> decode asks for a write lease (sequence number); echoes the last
                                     grant (the round trip)
    LeaseGrant     decode -> prefill grants it: prefill may write into this decode's pages until
                                     its own send time of that request plus ``lease_ms``
    RoomClaim      decode -> prefill this decode room waits for that prefill room (sent as soon as
                                     decode knows its prefill rank, before pages are reserved)
    Reconcile      decode -> prefill after a reconnect: the rooms of the lost link whose pages
                                     still wait for an acknowledgement (packed room, generation)
    RoomMetadata   decode -> prefill where to write: destination pages, aux row, state rows,
                                     and the prompt tokens decode holds already (its prefix)
    RoomOutcome    prefill -> decode the sender room's end: 4 (Success) or 0 (Failed) + reason
    RoomAbort      both              this side failed or aborted the room
    RoomSettled    prefill -> decode every transfer handle touching the room settled (abort ack)
    Error          both              the frame you sent was rejected; names its room if it had one

Every room frame carries ``(room, generation)``, the room's identity (law 5): the generation is the
decode room's (``RoomKey.generation`` of the receiver), and both sides route by the pair. Page
lists and state rows are packed little-endian int32 (``np.asarray(ids, "<i4").tobytes()``): one
million pages are 4 MiB and cost one copy to decode, where a msgpack list of ints costs one Python
int per page. The
codec checks that their length is a multiple of 4; whether each index is inside the peer's pool is
for the transport, which knows the pool.

Validation
----------

Frames are frozen ``msgspec.Struct`` classes, tagged by class name in the field ``"t"``, with
``forbid_unknown_fields``: a field this version does not know is an error, not a silent drop.
Constraints live in the annotations (``Room``, ``Reason``, ...), so msgspec's own error message
names the field: ``Expected `int` >= 0 - at `$.room```. The few rules msgspec cannot express
(packed int32 lengths, the two outcome statuses) are ``__post_init__`` checks, which run both when
a frame is built in Python and when one is decoded. Range constraints run only on decode: a frame
built locally with a bad value is caught by the peer, which fails the room it names.

The payload is a map, not ``array_like``: positional arrays are cheaper (0.72 against 1.13 us per
round trip with msgspec on this kind of machine), but then errors would say ``$[1]`` instead
of ``$.room``, and a rejected frame could not be read for its room (below).

Errors and law 7
----------------

``FrameCodec.decode`` returns a frame or raises ``FrameError(reason, room, fatal)``:

* *fatal* (the connection must be dropped, which the channel treats as peer loss): an oversized
  or empty body, an unknown ``auth`` byte, a missing, unexpected or wrong MAC, and any rejected
  ``Hello`` (a wrong version included). These mean the peer does not speak this protocol with this
  secret, so nothing it sends can be trusted, its room numbers included.
* *not fatal* (skip the frame, reply ``Error``, keep the connection): malformed msgpack, an
  unknown frame type, a missing or unknown field, a wrong type or an out-of-range value.

A non-fatal rejection reads the payload a second time, with a permissive decoder (``_Probe``:
``t``, ``room``, ``generation`` and ``version`` typed ``Any``, every other field skipped). If it
is a map whose ``room`` (and ``generation``) are integers in range, the error names them, so the
caller fails exactly that room and no other (law 7); an invalid ``room`` names nothing. The probe
costs nothing on the happy path, and a payload whose MAC failed is never read at all. Reasons are
clipped (a hostile peer chooses the field names and values msgspec quotes), so every reason fits
an ``Error`` frame. A caller never answers a rejected ``Error`` frame (``FrameError.tag ==
"Error"``) with another ``Error``: two peers would echo each other forever.

Authentication
--------------

With a secret (at least ``MIN_SECRET_BYTES``), every frame is signed and every frame read
must carry a valid MAC; without one, frames go unsigned and a signed frame is *refused*: one side
configured with a secret and the other without is a misconfiguration, reported on the first
``Hello`` rather than papered over. A 1-byte ``auth`` tag and a fixed-offset MAC replace a msgpack
envelope: no second msgpack pass and no copy of the payload just to unwrap it. The MAC proves that
a holder of the secret wrote the payload and that it was not altered. It does not prove freshness:
a recorded frame replayed on another connection would verify. Version 3 closes that: each
``Hello`` carries a fresh 16-byte nonce, and everything after the Hellos is sealed with a
*session key* per direction, derived HKDF-style (RFC 5869, HMAC-SHA256) from the secret and both
nonces (``session_keys``), with a sequence number under the MAC. A frame recorded on one
connection is worthless on any other (other nonces, other key), and a replay, drop or reorder
inside one connection breaks the sequence and drops the connection. A replayed ``Hello`` still
verifies, but its sender cannot produce the session frame that must follow it (key
confirmation), so the channel registers nothing for it (``ControlPlane``'s handshake). No
encryption.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterator
from typing import Annotated, Any, Final, Literal, TypeAlias

import msgspec

from kvfsm.control._fingerprint import Fingerprint
from kvfsm.states import RING_FIELDS

__all__ = [
    "FRAME_TYPES",
    "MAC_BYTES",
    "MAX_FRAME_BYTES",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "REASON_MAX",
    "AnyFrame",
    "Error",
    "Frame",
    "FrameError",
    "Heartbeat",
    "Hello",
    "LeaseGrant",
    "LeaseRequest",
    "Reconcile",
    "RoomAbort",
    "RoomClaim",
    "RoomMetadata",
    "RoomOutcome",
    "RoomSettled",
    "check_hello",
    "clip_reason",
    "iter_refs",
    "pack_refs",
    "session_keys",
    "unpack_refs",
]

#: The version this module speaks. Peers with another version are refused at ``Hello``.
#: 2: leases, claims, reconciliation; 3: session keys, sequence numbers; 4: the handshake
#: fingerprint (Hello.fingerprint); 5: legs (RoomMetadata.part), the attention-TP rank, and
#: decode prefix caching (RoomMetadata.prefix); 6: pipeline stages in the fingerprint
#: (``pp_rank``, ``first_layer``); 7: decode's fence margin in its Hello (``fence_margin_ms``);
#: 8: how state is sharded and which layer each state buffer is (``state_dims``,
#: ``state_conv``, ``state_outer``, ``state_layers``), state rows on KV-only legs, and
#: state-only legs (``part`` 3); 9: the round trip: heartbeats echo the peer's last one and
#: lease requests the last grant (``echo``, ``held_us`` on ``Heartbeat`` and ``LeaseRequest``);
#: 10: the live segments of decode's ring rows (``RoomMetadata.rings``).
PROTOCOL_VERSION: Final = 10
#: Default limit on a frame's body (the bytes after the length prefix): 16 MiB, room for the page
#: list of a four-million-page room.
MAX_FRAME_BYTES: Final = 16 * 2**20

_PREFIX: Final = struct.Struct(">I")
_PREFIX_BYTES: Final = _PREFIX.size
_MAX_LIMIT: Final = 2**32 - 1  # what a u32 length can say
_AUTH_NONE: Final = 0
_AUTH_HMAC_SHA256: Final = 1
_AUTH_SESSION: Final = 2
_MAC_BYTES: Final = 32
#: The MAC's length on the wire (a proxy that reads frames must skip it).
MAC_BYTES: Final = _MAC_BYTES
_UNSIGNED: Final = bytes([_AUTH_NONE])
_SIGNED: Final = bytes([_AUTH_HMAC_SHA256])
_SESSION: Final = bytes([_AUTH_SESSION])
_SEQ: Final = struct.Struct(">Q")
#: A Hello's nonce, when a secret is set.
NONCE_BYTES: Final = 16
_COPY_MAX: Final = 4096  # below this, slicing a payload out of its body copies it
_INT63_MAX: Final = 2**63 - 1
_REASON_MAX: Final = 1024
#: A reason longer than this is clipped by the sender (``clip_reason``), never refused.
REASON_MAX: Final = _REASON_MAX

# Field types. The constraints are checked by the decoder, and its messages name the field.
Room: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=_INT63_MAX)]
Generation: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=_INT63_MAX)]
Count: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=_INT63_MAX)]
Index: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Reason: TypeAlias = Annotated[str, msgspec.Meta(max_length=_REASON_MAX)]
AgentName: TypeAlias = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
PeerRole: TypeAlias = Literal["prefill", "decode"]

_RING_BYTES: Final = 4 * RING_FIELDS
_SUCCESS: Final = 4  # KVPoll.Success
_FAILED: Final = 0  # KVPoll.Failed


def _check_packed(name: str, value: bytes) -> None:
    if len(value) % 4:
        raise ValueError(f"`{name}` is {len(value)} bytes, not a multiple of 4 (packed int32)")


class Frame(
    msgspec.Struct, frozen=True, tag=True, tag_field="t", gc=False, forbid_unknown_fields=True
):
    """Base of every frame. Never sent itself."""


class Hello(Frame, frozen=True):
    """First frame each way on a new connection: who is talking, and what it can be sent."""

    version: int
    role: PeerRole
    rank: Index
    #: The sender's NIXL agent name.
    agent: AgentName
    #: Its NIXL agent metadata (``get_agent_metadata()``); empty from prefill.
    agent_metadata: bytes
    #: Its memory layout, an opaque msgpack blob (``LayoutSummary``); empty from prefill.
    layout: bytes
    #: Changes every time the rank's process starts: a new incarnation is a new peer.
    incarnation: Count
    #: Decode: the write lease its Hello grants (it answers prefill's Hello, so prefill may
    #: write until it sent its own Hello plus this); later leases come in ``LeaseGrant``.
    #: 0 from prefill.
    lease_ms: Annotated[int, msgspec.Meta(ge=0, le=3_600_000)] = 0
    #: With a secret: 16 fresh random bytes, half of the session key's salt. Empty without.
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    #: What the peer must agree on (model layout, parallel shape), checked by both sides
    #: before anything else happens on the link (``_fingerprint.mismatch``).
    fingerprint: Fingerprint = Fingerprint()
    #: Decode: its ``fence_margin_s`` (it settles a lost link's pages at its last grant +
    #: lease + this), which prefill's stale-progress gate must use for this link's writes
    #: (``Leases.grant``). 0 from prefill. (Protocol 7.)
    fence_margin_ms: Annotated[int, msgspec.Meta(ge=0, le=3_600_000)] = 0


class Heartbeat(Frame, frozen=True, omit_defaults=True):
    """A sign of life on an otherwise idle connection, and half of a round-trip measure: it
    echoes the last heartbeat this side received, so its receiver, which sent that one, takes
    the round trip as now - its send time - ``held_us`` (``kvfsm.control._round_trip``).
    The echo fields are left out of the payload until there is something to echo."""

    seq: Count
    #: ``seq`` of the last heartbeat received from the peer; None: none yet.
    echo: Count | None = None
    #: Microseconds between receiving that heartbeat and sending this one.
    held_us: Count = 0


class LeaseRequest(Frame, frozen=True, omit_defaults=True):
    """Prefill → decode: please grant a write lease. ``seq`` grows by one per request. It also
    echoes the last grant prefill received, so decode measures the round trip of its grants
    (``kvfsm.control._round_trip``); the echo fields are left out until there is one."""

    seq: Count
    #: ``seq`` of the last ``LeaseGrant`` received; None: none yet.
    echo: Count | None = None
    #: Microseconds between receiving that grant and sending this request.
    held_us: Count = 0


class LeaseGrant(Frame, frozen=True):
    """Decode → prefill: request ``seq`` is granted for ``lease_ms``. Prefill's lease ends at the
    time *it sent* that request plus ``lease_ms`` (its own clock), so a grant that sat in a
    buffer while prefill was frozen grants nothing; decode knows that no write it granted can
    start later than its own grant time plus ``lease_ms``."""

    seq: Count
    lease_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)]


class RoomClaim(Frame, frozen=True):
    """Decode → prefill: the decode room ``(room, generation)`` waits for prefill's room
    ``room``. Prefill binds the room to this link at once, so a lost decode fails it within
    the liveness bound instead of its Bootstrapping deadline."""

    room: Room
    generation: Generation


class Reconcile(Frame, frozen=True):
    """Decode → prefill, first frame after a reconnect: rooms of the lost link whose pages still
    wait for ``RoomSettled``, packed little-endian ``(room: u64, generation: u64)`` pairs.
    Prefill answers ``RoomSettled`` for each once nothing of it can still write (at once if it
    knows none)."""

    rooms: bytes

    def __post_init__(self) -> None:
        if len(self.rooms) % 16:
            raise ValueError(f"`rooms` is {len(self.rooms)} bytes, not a multiple of 16")


class RoomMetadata(Frame, frozen=True):
    """Decode → prefill: where to write this room's KV (packed int32 page ids), which aux row,
    and which state rows (packed int32, empty when the model keeps no per-request state).
    ``prefix``: prompt tokens decode holds already (SGLang's ``decode_prefix_len``, decode's
    radix cache); ``pages`` are those that follow them, and prefill sends only those."""

    room: Room
    generation: Generation
    pages: bytes
    #: -1 (no aux row) only for a leg that is not ``Part.WHOLE``: another leg carries it.
    aux_index: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
    state: bytes = b""
    #: Which part of the decode request this room carries (``kvfsm.states.Part``): the whole
    #: room, its KV slice (with its shard of sharded state), nothing (a dummy leg: SGLang's
    #: dummy rank), or its shard of the state only.
    part: Annotated[int, msgspec.Meta(ge=0, le=3)] = 0
    #: Prompt tokens decode already holds (SGLang's ``decode_prefix_len``): ``pages`` follow.
    prefix: Count = 0
    #: The live segments of decode's ring rows among ``state`` (DeepSeek V4's tail rings):
    #: packed int32, ``kvfsm.states.RING_FIELDS`` per ring row (its position among the state
    #: rows, two ``(offset, count)`` segments, the ring's slot count). Prefill places its own
    #: live slots at these in a ring of another size; whether they fit is the transport's check.
    rings: bytes = b""

    def __post_init__(self) -> None:
        _check_packed("pages", self.pages)
        _check_packed("state", self.state)
        if len(self.rings) % _RING_BYTES or len(self.rings) // _RING_BYTES > len(self.state) // 4:
            raise ValueError(
                f"`rings` is {len(self.rings)} bytes: not {_RING_BYTES} per ring row, for at "
                f"most the {len(self.state) // 4} state rows"
            )
        if (self.aux_index < 0) != (self.part != 0):
            raise ValueError(
                f"aux_index {self.aux_index} with part {self.part}: only a leg that is not "
                "whole has no aux row"
            )


class RoomOutcome(Frame, frozen=True):
    """Prefill → decode: the sender room ended. ``status`` is 4 (Success: every chunk and the
    aux row landed) or 0 (Failed, ``reason`` says why)."""

    room: Room
    generation: Generation
    status: int
    reason: Reason = ""

    def __post_init__(self) -> None:
        if self.status not in (_SUCCESS, _FAILED):
            raise ValueError(f"`status` must be 4 (Success) or 0 (Failed), not {self.status!r}")


class RoomAbort(Frame, frozen=True):
    """Either direction: this side failed or aborted the room. Prefill answers a decode abort
    with ``RoomSettled`` once no transfer can still write into the room's pages."""

    room: Room
    generation: Generation
    reason: Reason


class RoomSettled(Frame, frozen=True):
    """Prefill → decode: every transfer handle touching this room has settled, so its pages may
    be reused (the abort acknowledgement, law 4)."""

    room: Room
    generation: Generation


class Error(Frame, frozen=True):
    """Reply to a rejected frame: ``reason`` is the rejection, ``room`` (and ``generation``) name
    the room the rejected frame named, when it could be read that far."""

    room: Room | None
    reason: Reason
    generation: Generation | None = None


AnyFrame: TypeAlias = (
    Hello
    | Heartbeat
    | LeaseRequest
    | LeaseGrant
    | RoomClaim
    | Reconcile
    | RoomMetadata
    | RoomOutcome
    | RoomAbort
    | RoomSettled
    | Error
)
#: Every frame class, in the order of the table in the module docstring.
FRAME_TYPES: Final[tuple[type[Frame], ...]] = (
    Hello,
    Heartbeat,
    LeaseRequest,
    LeaseGrant,
    RoomClaim,
    Reconcile,
    RoomMetadata,
    RoomOutcome,
    RoomAbort,
    RoomSettled,
    Error,
)
_TAGS: Final = frozenset(cls.__name__ for cls in FRAME_TYPES)


class FrameError(Exception):
    """A frame that could not be accepted. ``str(error) == error.reason``.

    ``room``/``generation``: the room the bad frame named, when its payload could be read that
    far (fail that room and no other); ``None`` otherwise. ``fatal``: the connection can no longer
    be trusted and must be dropped. ``tag``: the frame type the payload claimed, if any.
    """

    def __init__(
        self,
        reason: str,
        room: int | None = None,
        fatal: bool = False,
        *,
        generation: int | None = None,
        tag: str | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.room = room
        self.fatal = fatal
        self.generation = generation
        self.tag = tag

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.reason, self.room, self.fatal),
            {"generation": self.generation, "tag": self.tag},
        )

    def __repr__(self) -> str:
        return (
            f"FrameError({self.reason!r}, room={self.room!r}, fatal={self.fatal!r}, "
            f"generation={self.generation!r}, tag={self.tag!r})"
        )


class _Probe(msgspec.Struct):
    """What a rejected payload is read for: lenient types, unknown fields ignored."""

    t: Any = None
    room: Any = None
    generation: Any = None
    version: Any = None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TRUNCATED: Final = " [truncated]"


def clip_reason(text: str) -> str:
    """``text`` cut at the source to fit a frame's reason field, with a marker: a long reason is
    shortened, never turned into a frame the peer must refuse."""
    if len(text) <= _REASON_MAX:
        return text
    return text[: _REASON_MAX - len(_TRUNCATED)] + _TRUNCATED


def session_keys(secret: bytes, decode_nonce: bytes, prefill_nonce: bytes) -> tuple[bytes, bytes]:
    """``(decode -> prefill key, prefill -> decode key)`` of one connection: HKDF (RFC 5869) with
    HMAC-SHA256, the secret as input keying material and both nonces as salt. One key per
    direction, so a frame reflected back to its sender does not verify either."""
    prk = hmac.new(decode_nonce + prefill_nonce, secret, hashlib.sha256).digest()
    label = f"kvfsm control v{PROTOCOL_VERSION} ".encode()

    def expand(direction: bytes) -> bytes:
        return hmac.new(prk, label + direction + b"\x01", hashlib.sha256).digest()

    return expand(b"decode->prefill"), expand(b"prefill->decode")


def pack_refs(refs: list[tuple[int, int]]) -> bytes:
    """``(room, generation)`` pairs as ``Reconcile.rooms``."""
    return b"".join(struct.pack("<QQ", room, gen) for room, gen in refs)


def unpack_refs(packed: bytes) -> list[tuple[int, int]]:
    return list(iter_refs(packed))


def iter_refs(packed: bytes) -> Iterator[tuple[int, int]]:
    """The ``(room, generation)`` pairs of a packed list, one at a time: a 16 MiB ``Reconcile``
    names a million, which as one list of tuples would cost some 120 MiB at once."""
    for room, gen in struct.iter_unpack("<QQ", packed):
        if room <= _INT63_MAX and gen <= _INT63_MAX:
            yield room, gen


def _int63(value: Any) -> int | None:
    if type(value) is int and 0 <= value <= _INT63_MAX:
        return value
    return None


def check_hello(hello: Hello) -> None:
    """Raise a fatal ``FrameError`` unless the peer's ``Hello`` speaks ``PROTOCOL_VERSION``."""
    if hello.version != PROTOCOL_VERSION:
        raise FrameError(_version_mismatch(hello.version), None, True, tag="Hello")


def _version_mismatch(theirs: object) -> str:
    return (
        f"protocol version mismatch: the peer speaks version {theirs!r}, "
        f"this side speaks version {PROTOCOL_VERSION}"
    )
