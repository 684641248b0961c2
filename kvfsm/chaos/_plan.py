"""``FaultPlan``: which fault to inject where, decided from a seed, reproducibly.

Rule 1: every fault site (``"xfer"``: each NIXL transfer handle; ``"to_prefill"`` and
        ``"to_decode"``: each control frame in that direction; anything a campaign names) draws
        from its own ``random.Random`` stream, seeded from ``(seed, site)``. Decisions at one
        site never shift because another site was asked more or less often, or from another
        thread: the n-th decision at a site is a function of the seed alone.
Rule 2: every decision consumes exactly two draws (the kind, then a parameter in [0, 1)), whatever
        it decides, so the streams stay aligned when rates change from zero to non-zero.
Rule 3: decisions are recorded (counts per site and kind, and the first ``keep`` decisions in
        full), so a report can say what was injected and a failure can name the decision that
        preceded it. Replaying a failure is running the same seed with the same rates.
"""

from __future__ import annotations

import enum
import hashlib
import random
import threading
from collections import Counter
from dataclasses import dataclass, fields
from typing import Final, TypeVar

__all__ = [
    "ControlRates",
    "Decision",
    "FaultPlan",
    "FrameFault",
    "TransferFault",
    "TransferRates",
]

#: Decisions kept in full for the report; the counts cover all of them.
_KEEP: Final = 256


class TransferFault(enum.Enum):
    """What happens to one NIXL transfer handle."""

    NONE = "none"
    #: ``transfer()`` returns ``"ERR"``; nothing is posted.
    POST_ERROR = "post_error"
    #: ``transfer()`` raises; nothing is posted.
    POST_RAISE = "post_raise"
    #: ``transfer()`` raises a remote-disconnect error (the peer-loss path); nothing is posted.
    POST_DISCONNECT = "post_disconnect"
    #: The transfer runs; once it is over, ``check_xfer_state`` reports ``"ERR"``.
    COMPLETION_ERROR = "completion_error"
    #: The transfer runs, but ``check_xfer_state`` says ``"PROC"`` forever.
    NEVER_COMPLETE = "never_complete"
    #: ``check_xfer_state`` says ``"PROC"`` until a delay has passed since the post.
    DELAY = "delay"


class FrameFault(enum.Enum):
    """What happens to one control frame (or its connection) in the proxy."""

    NONE = "none"
    DROP = "drop"
    DUPLICATE = "duplicate"
    #: Held back and forwarded after the next frame (or after a short hold, if none comes).
    REORDER = "reorder"
    #: Forwarded after a delay; the frames behind it wait too (a stream keeps its order).
    DELAY = "delay"
    #: Part of the frame is forwarded, then the connection is cut (a peer dying mid-write).
    TRUNCATE = "truncate"
    #: One byte of the frame's body is flipped.
    CORRUPT = "corrupt"
    #: The connection is cut before the frame.
    CUT = "cut"


@dataclass(frozen=True, slots=True)
class TransferRates:
    """Probability of each transfer fault per handle (their sum must be <= 1)."""

    post_error: float = 0.0
    post_raise: float = 0.0
    post_disconnect: float = 0.0
    completion_error: float = 0.0
    never_complete: float = 0.0
    delay: float = 0.0
    #: A delayed completion is reported after up to this long.
    delay_max_s: float = 0.2

    def __post_init__(self) -> None:
        _check_rates(self, "delay_max_s")


@dataclass(frozen=True, slots=True)
class ControlRates:
    """Probability of each frame fault per frame (their sum must be <= 1)."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    truncate: float = 0.0
    corrupt: float = 0.0
    cut: float = 0.0
    delay_max_s: float = 0.3
    #: How long a frame held for reordering waits for a next frame before it goes anyway.
    hold_max_s: float = 0.05

    def __post_init__(self) -> None:
        _check_rates(self, "delay_max_s", "hold_max_s")


def _check_rates(rates: TransferRates | ControlRates, *times: str) -> None:
    total = 0.0
    for f in fields(rates):
        value = getattr(rates, f.name)
        if f.name in times:
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
            continue
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"rate {f.name} must be in [0, 1], got {value}")
        total += value
    if total > 1.0 + 1e-9:
        raise ValueError(f"fault rates add up to {total:g} > 1")


K = TypeVar("K", TransferFault, FrameFault)


@dataclass(frozen=True, slots=True)
class Decision:
    """The ``index``-th decision at ``site``: a fault kind and a parameter in [0, 1) (a delay's
    fraction of its maximum, the byte to corrupt, ...)."""

    site: str
    index: int
    kind: str
    param: float


class _Stream:
    __slots__ = ("count", "lock", "rng")

    def __init__(self, seed: int, site: str) -> None:
        # random.Random(str) would do, but a digest makes the derivation explicit and stable.
        digest = hashlib.sha256(f"kvfsm-chaos/{seed}/{site}".encode()).digest()
        self.rng = random.Random(int.from_bytes(digest[:8], "big"))
        self.lock = threading.Lock()
        self.count = 0


class FaultPlan:
    """Seeded fault decisions, one independent stream per site. Thread-safe."""

    def __init__(
        self,
        seed: int,
        transfer: TransferRates | None = None,
        control: ControlRates | None = None,
    ) -> None:
        self.seed = seed
        self.transfer_rates = transfer if transfer is not None else TransferRates()
        self.control_rates = control if control is not None else ControlRates()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.decisions: list[Decision] = []

    def _stream(self, site: str) -> _Stream:
        with self._lock:
            stream = self._streams.get(site)
            if stream is None:
                stream = self._streams[site] = _Stream(self.seed, site)
            return stream

    def draw(self, site: str) -> tuple[int, float, float]:
        """The next raw draw at ``site``: ``(index, choice, param)``, both in [0, 1)."""
        stream = self._stream(site)
        with stream.lock:
            index = stream.count
            stream.count += 1
            return index, stream.rng.random(), stream.rng.random()

    def _decide(self, site: str, table: list[tuple[K, float]], none: K) -> tuple[K, float]:
        index, choice, param = self.draw(site)
        kind = none
        edge = 0.0
        for candidate, rate in table:
            edge += rate
            if choice < edge:
                kind = candidate
                break
        with self._lock:
            self.counts[(site, kind.value)] += 1
            if kind is not none and len(self.decisions) < _KEEP:
                self.decisions.append(Decision(site, index, kind.value, param))
        return kind, param

    def transfer_fault(self, site: str = "xfer") -> tuple[TransferFault, float]:
        r = self.transfer_rates
        return self._decide(
            site,
            [
                (TransferFault.POST_ERROR, r.post_error),
                (TransferFault.POST_RAISE, r.post_raise),
                (TransferFault.POST_DISCONNECT, r.post_disconnect),
                (TransferFault.COMPLETION_ERROR, r.completion_error),
                (TransferFault.NEVER_COMPLETE, r.never_complete),
                (TransferFault.DELAY, r.delay),
            ],
            TransferFault.NONE,
        )

    def frame_fault(self, site: str) -> tuple[FrameFault, float]:
        r = self.control_rates
        return self._decide(
            site,
            [
                (FrameFault.DROP, r.drop),
                (FrameFault.DUPLICATE, r.duplicate),
                (FrameFault.REORDER, r.reorder),
                (FrameFault.DELAY, r.delay),
                (FrameFault.TRUNCATE, r.truncate),
                (FrameFault.CORRUPT, r.corrupt),
                (FrameFault.CUT, r.cut),
            ],
            FrameFault.NONE,
        )

    def injected(self) -> dict[str, int]:
        """Faults injected so far, by ``"site:kind"`` (``none`` decisions left out)."""
        with self._lock:
            return {
                f"{site}:{kind}": n
                for (site, kind), n in sorted(self.counts.items())
                if kind != "none"
            }
