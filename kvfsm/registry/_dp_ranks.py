"""Which DP rank of a prefill instance serves a room: the registry's second table, without IO
and without a clock.

A prefill instance with several data-parallel ranks serves each room on one of them. When it
picks that rank from the room id (SGLang's ``follow_bootstrap_room``: ``room % dp_size``),
decode computes the same and needs nothing from here. When something else picks it (a load
balancer, a router naming the rank), the prefill rank that got the room registers it here
(``POST /register_dp_rank``) and decode asks for a batch of rooms (``POST /query_dp_ranks``):
SGLang's bootstrap routes, with SGLang's bodies, so SGLang's own decode scheduler can ask kvfsm's
registry directly.

Rules
-----

* A room's entry lives ``ttl_s`` (default 120 s, SGLang's
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL``) after its last registration: long
  enough for decode to see the request and ask, short enough that a table fed thousands of
  rooms a second stays bounded. Registering a room again replaces its rank and restarts its
  clock (a room id reused by a later request).
* At most ``max_rooms`` entries: registering one more drops the oldest. A writer flooding the
  table can then make decode miss an old room's rank (that request waits, then fails at its
  bootstrap deadline), never grow memory. The drops are counted.
* A lookup answers only the rooms it knows, live, as SGLang's does: ``{"<room>": dp_rank}``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

__all__ = ["DP_RANK_TTL_S", "MAX_DP_ROOMS", "DpRankTable"]

#: SGLang's default cleanup interval for the same table.
DP_RANK_TTL_S: Final = 120.0
#: Entries held at once (about 100 bytes each).
MAX_DP_ROOMS: Final = 1 << 20


class DpRankTable:
    """Room id → the DP rank serving it. No IO and no clock: every method takes ``now``."""

    def __init__(self, *, ttl_s: float = DP_RANK_TTL_S, max_rooms: int = MAX_DP_ROOMS) -> None:
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        if isinstance(max_rooms, bool) or not (isinstance(max_rooms, int) and max_rooms >= 1):
            raise ValueError(f"max_rooms must be a positive integer, got {max_rooms}")
        self.ttl_s = float(ttl_s)
        self.max_rooms = max_rooms
        #: Oldest registration first: expiry and eviction pop from the front.
        self._rooms: OrderedDict[int, tuple[int, float]] = OrderedDict()
        #: Entries dropped to stay within ``max_rooms`` since the table was made.
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._rooms)

    def register(self, room: int, dp_rank: int, now: float) -> None:
        """``room`` is served by ``dp_rank`` from ``now`` on."""
        self._rooms.pop(room, None)
        self._rooms[room] = (dp_rank, now + self.ttl_s)
        while len(self._rooms) > self.max_rooms:
            self._rooms.popitem(last=False)
            self.evicted += 1

    def lookup(self, rooms: Iterable[int], now: float) -> dict[str, int]:
        """The DP rank of each of ``rooms`` still registered, keyed by the room id as a
        string (SGLang's JSON answer); unknown and expired rooms are left out."""
        self.expire(now)
        found: dict[str, int] = {}
        for room in rooms:
            entry = self._rooms.get(room)
            # Its own expiry too: expire() stops at the first live entry, and one registered
            # before a change of ttl_s may stand ahead of shorter-lived ones.
            if entry is not None and entry[1] > now:
                found[str(room)] = entry[0]
        return found

    def expire(self, now: float) -> int:
        """Drop the entries whose time ran out by ``now``; how many."""
        dropped = 0
        while self._rooms:
            room, (_, expires_at) = next(iter(self._rooms.items()))
            if expires_at > now:
                break
            del self._rooms[room]
            dropped += 1
        return dropped
