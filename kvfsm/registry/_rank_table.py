"""The rank table of the bootstrap registry: its rules, without IO and without a clock.

Every method takes ``now`` (monotonic seconds), so the rules can be tested without sockets or
sleeps; ``BootstrapServer`` (``_server``) adds HTTP and the clock. A refusal is a
``RefusedError`` carrying the HTTP status the server answers with.

Expiry
------

An entry lives ``ttl_s`` (default 30 s) after its last registration, on the monotonic clock.
Expired entries are dropped lazily by every read (a lookup never returns a dead rank) and by the
server's sweep task every ``ttl_s / 2`` (at most 5 s), which also logs them. Ranks should
re-register every ``ttl_s / 3`` or so; ``register`` returns the ttl so they need not be configured
twice.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Final

from kvfsm.registry._schemas import MAX_RANKS, EngineStatus, Health, Outcome, RankInfo

__all__ = ["MAX_ENGINES", "RankTable", "RefusedError"]

_log = logging.getLogger("kvfsm.registry")

#: Engines held at once; registrations of further engines get 429.
MAX_ENGINES: Final = 1024


class RefusedError(Exception):
    """The registry refuses a request; ``status`` is the HTTP status that says why."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        registered: int | None = None,
        expected: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.registered = registered
        self.expected = expected


@dataclass(slots=True)
class _Entry:
    info: RankInfo
    expires_at: float


class RankTable:
    """The rank table. No IO and no clock: every method takes ``now`` (monotonic seconds)."""

    def __init__(
        self, *, expected_ranks: int, ttl_s: float, max_engines: int = MAX_ENGINES
    ) -> None:
        if not 1 <= expected_ranks <= MAX_RANKS:
            raise ValueError(f"expected_ranks must be in 1..{MAX_RANKS}, got {expected_ranks}")
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        self.expected_ranks = expected_ranks
        self.ttl_s = ttl_s
        self.max_engines = max_engines
        self._engines: dict[str, dict[int, _Entry]] = {}

    def register(self, info: RankInfo, now: float) -> Outcome:
        """Add, refresh or replace ``info``'s entry; raise ``RefusedError`` if it cannot be held."""
        if info.rank >= self.expected_ranks:
            raise RefusedError(
                400,
                f"rank {info.rank} out of range: this registry expects ranks "
                f"0..{self.expected_ranks - 1} per engine",
            )
        entries = self._live(info.engine, now)
        if entries is None and len(self._engines) >= self.max_engines:
            raise RefusedError(429, f"registry full: {self.max_engines} engines registered")
        entries = entries or {}
        old = entries.get(info.rank)
        if old is not None and old.info.incarnation == info.incarnation and old.info != info:
            raise RefusedError(
                409,
                f"rank {info.rank} of engine {info.engine!r} is registered with incarnation "
                f"{info.incarnation} and different fields; a restarted rank must use a new "
                "incarnation",
            )
        for rank, entry in entries.items():
            if rank == info.rank:
                continue
            if entry.info.tp_size != info.tp_size:
                raise RefusedError(
                    409,
                    f"tp_size {info.tp_size} of rank {info.rank} disagrees with live rank {rank} "
                    f"of engine {info.engine!r} (tp_size {entry.info.tp_size})",
                )
            if entry.info.coords == info.coords:
                raise RefusedError(
                    409,
                    f"rank {info.rank} claims (tp_rank, dp_rank, pp_rank) = {info.coords}, "
                    f"already held by live rank {rank} of engine {info.engine!r}",
                )
        entries[info.rank] = _Entry(info, now + self.ttl_s)
        self._engines[info.engine] = entries
        if old is None:
            return "registered"
        return "refreshed" if old.info == info else "replaced"

    def deregister(
        self, engine: str, rank: int, now: float, *, incarnation: int | None = None
    ) -> RankInfo:
        """Remove a rank, return its info. ``RefusedError``: 404 unknown, 409 other incarnation."""
        entries = self._live(engine, now)
        entry = None if entries is None else entries.get(rank)
        if entries is None or entry is None:
            raise RefusedError(404, f"rank {rank} of engine {engine!r} is not registered")
        if incarnation is not None and entry.info.incarnation != incarnation:
            raise RefusedError(
                409,
                f"rank {rank} of engine {engine!r} is registered with incarnation "
                f"{entry.info.incarnation}, not {incarnation}",
            )
        del entries[rank]
        if not entries:
            del self._engines[engine]
        return entry.info

    def ranks(self, engine: str, now: float) -> list[RankInfo]:
        """Every live rank of ``engine`` by rank; ``RefusedError`` 503 unless all are registered."""
        entries = self._live(engine, now) or {}
        if len(entries) < self.expected_ranks:
            raise RefusedError(
                503,
                f"not ready: {len(entries)} of {self.expected_ranks} ranks registered",
                registered=len(entries),
                expected=self.expected_ranks,
            )
        return [entries[rank].info for rank in sorted(entries)]

    def rank(self, engine: str, rank: int, now: float) -> RankInfo:
        entries = self._live(engine, now)
        entry = None if entries is None else entries.get(rank)
        if entry is None:
            raise RefusedError(404, f"rank {rank} of engine {engine!r} is not registered")
        return entry.info

    def health(self, now: float) -> Health:
        self.expire(now)
        engines = {
            name: EngineStatus(len(e), self.expected_ranks, len(e) >= self.expected_ranks)
            for name, e in sorted(self._engines.items())
        }
        waiting = [name for name, s in engines.items() if not s.ready]
        if not engines:
            return Health(False, "not ready: no ranks registered", engines)
        if waiting:
            return Health(False, f"not ready: {len(waiting)} engine(s) waiting for ranks", engines)
        return Health(True, "ready", engines)

    def expire(self, now: float) -> list[RankInfo]:
        """Drop every expired entry; return what was dropped."""
        dropped: list[RankInfo] = []
        for engine in list(self._engines):
            dropped.extend(self._expire_engine(engine, now))
        return dropped

    def __len__(self) -> int:
        return sum(len(e) for e in self._engines.values())

    def _live(self, engine: str, now: float) -> dict[int, _Entry] | None:
        self._expire_engine(engine, now)
        return self._engines.get(engine)

    def _expire_engine(self, engine: str, now: float) -> list[RankInfo]:
        entries = self._engines.get(engine)
        if entries is None:
            return []
        dead = [rank for rank, entry in entries.items() if entry.expires_at <= now]
        dropped = [entries.pop(rank).info for rank in dead]
        for info in dropped:
            _log.info(
                "expired: engine %s rank %d (incarnation %d, %s:%d)",
                info.engine,
                info.rank,
                info.incarnation,
                info.host,
                info.port,
            )
        if not entries:
            del self._engines[engine]
        return dropped
