"""``DestinationOwners``: which receiver room of a decode engine holds each destination.

A receiver room hands its pages, its aux row and its state rows to a sender, which then WRITEs
into them. If two live receiver rooms name the same page, two senders write into it and each
room's bytes may be the other's: no fence or settle can save that (law 4 presumes one owner
per page). So a decode engine keeps one owner per destination and refuses the second:

* ``claim(owner, pages, aux, state)`` is all or nothing. Every index must be non-negative,
  appear once in its own list, and be free; then all of them are held by ``owner``. Otherwise
  nothing changes and the answer says why, naming the overlap and the room that holds it.
* ``release(owner)`` frees everything ``owner`` holds.
* Pages, aux rows and state rows are three index spaces (three pools on the decode side): page
  5 and aux row 5 do not collide.

When the engine releases a claim is the registry's decision (see ``Registry.reap``): when the
room is reaped settled. A room reaped *unsettled* (its settle timeout gave up, or its task died)
keeps its claim for the life of the engine. Its pages may still receive a late WRITE, and the
caller was told so (``settled`` stays False; SGLang's adapter then never frees them). A caller
that reuses them anyway gets its new room refused with a reason naming the unsettled holder:
a loud failure instead of silent corruption, and the leak is counted and logged once.

Cost: the page table is a dense numpy int64 array indexed by page, grown on demand to the
largest index seen (8 bytes per page of the pool), so a claim is a handful of vectorised passes
over the room's own list (a gather, a scatter, and for a list that is not ascending a second
gather) and never a per-page Python loop. Indices at or above ``max_index`` are refused rather
than grown into: a bogus index must not allocate gigabytes. The default, 2**26 (67 M pages,
512 MiB of table if ever reached), is far beyond any KV pool a decode rank holds. Loop thread
only; no clocks, no IO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvfsm.rooms._ports import RoomKey

__all__ = ["DEFAULT_MAX_INDEX", "DestinationOwners"]

#: Indices at or above this are refused (see the module docstring).
DEFAULT_MAX_INDEX: Final = 1 << 26
_FREE: Final = 0  # slot 0 is nobody
_SHOWN: Final = 8  # indices quoted in a refusal
_INT32_MAX: Final = (1 << 31) - 1
_EMPTY: Final = np.zeros(0, np.intp)

_Indices = npt.NDArray[np.intp]


def _indices(packed: bytes) -> _Indices:
    """Packed native int32 as native-width indices (numpy casts int32 index arrays on every
    fancy-indexing pass, so cast once), read unsigned: a negative page becomes >= 2**31, an
    index no table reaches, so the gather's own bounds check catches it."""
    return np.frombuffer(packed, np.uint32).astype(np.intp) if packed else _EMPTY


def _quote(noun: str, values: npt.NDArray[np.integer], verb: str = "") -> str:
    """``page 3 is`` or ``pages [3, 4, 7, ...] (12 pages) are``: a refusal's subject."""
    if values.size == 1:
        return f"{noun} {int(values[0])}" + (f" {verb}" if verb else "")
    shown = ", ".join(str(int(v)) for v in values[:_SHOWN])
    more = ", ..." if values.size > _SHOWN else ""
    plural = {"is": "are", "appears": "appear"}.get(verb, verb)
    return f"{noun}s [{shown}{more}] ({values.size} {noun}s)" + (f" {plural}" if verb else "")


class _Table:
    """Owners of one index space (pages, or state rows).

    ``owner[i]`` is 0 when index ``i`` is free, else ``slot << 32 | position``: the holder's
    slot, and for a list that is not ascending where ``i`` sits in it (0 otherwise). Writing
    positions is what commits such a list, and it doubles as the duplicate check: an index that
    appears twice keeps only one of its positions, which one gather back reveals. No scratch
    array, no sort.
    """

    __slots__ = ("noun", "where", "owner", "_positions", "limit")

    def __init__(self, noun: str, where: str, limit: int) -> None:
        self.noun = noun
        self.where = where
        self.limit = limit
        self.owner = np.zeros(0, np.int64)
        self._positions = np.arange(0, dtype=np.int64)

    def take(self, idx: _Indices, slot: int) -> str | npt.NDArray[np.int64] | None:
        """Hold ``idx`` (non-empty, from :func:`_indices`) for ``slot``, all or nothing. None
        when taken; a problem (str) when ``idx`` is invalid; the current owner values per index
        when some are held by others (nothing taken)."""
        owner = self.owner
        try:
            # The bounds check is the gather's own: a negative page reads as >= 2**31 (see
            # _indices), so it is out of range like an index beyond the table.
            held = owner.take(idx)  # (take and count_nonzero beat [] and any() 1.5x to 3x)
        except IndexError:
            top = int(idx.max())
            if top >= self.limit:
                signed = idx.astype(np.int32)  # back to what the caller sent
                if top > _INT32_MAX:
                    return f"{_quote(self.noun, signed[signed < 0], 'is')} negative"
                bad = signed[signed >= self.limit]
                return f"{_quote(self.noun, bad, 'is')} beyond the table's limit of {self.limit}"
            self._grow(top + 1)
            owner = self.owner
            held = owner.take(idx)
        if np.count_nonzero(held):
            return held
        base = slot << 32
        # Allocators hand out pages mostly in ascending order, and a strictly increasing list
        # has no duplicates: one scatter commits it.
        if idx.size == 1 or not np.count_nonzero(idx[1:] <= idx[:-1]):
            owner[idx] = base
            return None
        n = idx.size
        if n > self._positions.size:
            self._positions = np.arange(max(n, 2 * self._positions.size), dtype=np.int64)
        marks = self._positions[:n] + base
        owner[idx] = marks
        mismatch = owner.take(idx) != marks
        if np.count_nonzero(mismatch):
            owner[idx] = _FREE  # every one of them was free before
            twice = np.unique(idx[mismatch])
            return f"{_quote(self.noun, twice, 'appears')} more than once in {self.where}"
        return None

    def _grow(self, needed: int) -> None:
        size = min(self.limit, max(needed, 2 * self.owner.size, 1024))
        owner = np.zeros(size, np.int64)
        owner[: self.owner.size] = self.owner
        self.owner = owner


class _Claim:
    __slots__ = ("aux", "group", "members", "owner", "packed", "pages", "state")

    def __init__(self, owner: RoomKey, pages: _Indices, aux: int, state: _Indices) -> None:
        self.owner = owner
        self.pages = pages
        self.aux = aux
        self.state = state
        #: The legs of one request that share this claim (see ``claim``'s ``group``).
        self.group: int | None = None
        self.members: set[RoomKey] = {owner}
        self.packed = b""


class DestinationOwners:
    """One owner per destination page, aux row and state row of a decode engine."""

    __slots__ = (
        "_aux",
        "_by_owner",
        "_claims",
        "_free",
        "_groups",
        "_pages",
        "_state",
        "held_pages",
    )

    def __init__(self, *, max_index: int = DEFAULT_MAX_INDEX) -> None:
        if not 1 <= max_index <= _INT32_MAX + 1:  # the table must end below 2**31 (_indices)
            raise ValueError(f"max_index must be in [1, 2**31], got {max_index}")
        self._pages = _Table("page", "the page list", max_index)
        self._state = _Table("state row", "the state rows", max_index)
        self._aux: dict[int, int] = {}  # aux row -> slot (one row per room: a dict is fastest)
        # Slot numbers are recycled, so they stay as small as the number of holders at once
        # (they live in the top half of an int64 owner value).
        self._claims: list[_Claim | None] = [None]  # slot -> claim; slot 0 is _FREE
        self._free: list[int] = []
        self._by_owner: dict[RoomKey, int] = {}
        self._groups: dict[int, int] = {}  # group -> slot of its shared claim
        #: Pages held, all owners together (operators' view of leaks).
        self.held_pages = 0

    def __len__(self) -> int:
        """Owners that hold something (each leg of a shared claim counts)."""
        return len(self._by_owner)

    def __contains__(self, owner: object) -> bool:
        return owner in self._by_owner

    def claim(
        self,
        owner: RoomKey,
        pages: bytes,
        aux_index: int,
        state: bytes = b"",
        group: int | None = None,
    ) -> str | None:
        """Hold ``pages`` and ``state`` (packed native int32, as the facade packs them) and aux
        row ``aux_index`` (negative: none) for ``owner``, all or nothing. Returns None when
        taken, else why not (and nothing was taken). An owner claims once (``ValueError``).

        ``group``: the legs of one decode request (unequal TP: one room per prefill rank that
        feeds it) write disjoint head slices of the *same* pages, so they share one claim. The
        first leg of a group takes the pages; a later leg must name exactly the same pages and
        joins (or names none: a dummy leg; a group only dummies opened takes the pages of the
        first leg that names them); the aux row and state rows are taken by whichever
        leg names them (one leg does). The pages are free again once every member has
        released."""
        if owner in self._by_owner:
            raise ValueError(f"room {owner.room} gen {owner.generation} already holds its pages")
        if group is not None and group in self._groups:
            return self._join(self._groups[group], owner, pages, aux_index, state)
        if aux_index >= 0:
            holder = self._aux.get(aux_index)
            if holder is not None:
                return f"aux row {aux_index} already held by {self._name(holder)}"
        page_idx, state_idx = _indices(pages), _indices(state)
        slot = self._free[-1] if self._free else len(self._claims)
        problem = self._take(slot, page_idx, state_idx)
        if problem is not None:
            return problem
        if self._free:
            self._free.pop()
        else:
            self._claims.append(None)
        claim = self._claims[slot] = _Claim(owner, page_idx, aux_index, state_idx)
        if group is not None:
            claim.group, claim.packed = group, pages
            self._groups[group] = slot
        self._by_owner[owner] = slot
        self.held_pages += page_idx.size
        if aux_index >= 0:
            self._aux[aux_index] = slot
        return None

    def _join(
        self, slot: int, owner: RoomKey, pages: bytes, aux_index: int, state: bytes
    ) -> str | None:
        claim = self._claims[slot]
        assert claim is not None
        # A dummy leg names no pages: it only joins. A leg naming pages joins a claim that
        # names the same ones, or takes them into a claim that a dummy leg opened with none
        # (the legs are rooms of their own: which one's metadata is applied first is not fixed).
        page_idx = _EMPTY
        if pages and pages != claim.packed:
            if claim.packed:
                return (
                    f"a leg of room {owner.room} names other pages than its first leg "
                    f"(room {claim.owner.room} gen {claim.owner.generation})"
                )
            page_idx = _indices(pages)
        # State rows likewise: under unequal attention TP every leg that writes a shard of the
        # request's state names the same rows; the first to name them takes them.
        state_idx = _EMPTY
        if state:
            named = _indices(state)
            if not claim.state.size:
                state_idx = named
            elif not np.array_equal(named, claim.state):
                return (
                    f"state rows: a leg of room {owner.room} names other state rows than the "
                    "leg that holds them"
                )
        if aux_index >= 0:
            if claim.aux >= 0:
                return (
                    f"aux row {aux_index}: another leg of the room already holds aux row "
                    f"{claim.aux}"
                )
            holder = self._aux.get(aux_index)
            if holder is not None:
                return f"aux row {aux_index} already held by {self._name(holder)}"
        problem = self._take(slot, page_idx, state_idx)
        if problem is not None:
            return problem
        if state_idx.size:
            claim.state = state_idx
        if page_idx.size:
            claim.pages, claim.packed = page_idx, pages
            self.held_pages += page_idx.size
        if aux_index >= 0:
            claim.aux = aux_index
            self._aux[aux_index] = slot
        claim.members.add(owner)
        self._by_owner[owner] = slot
        return None

    def _take(self, slot: int, page_idx: _Indices, state_idx: _Indices) -> str | None:
        """Hold pages and state rows for ``slot``, both or neither; else why not."""
        if page_idx.size:
            problem = self._pages.take(page_idx, slot)
            if problem is not None:
                return self._refusal(self._pages, page_idx, problem)
        if state_idx.size:
            problem = self._state.take(state_idx, slot)
            if problem is not None:
                if page_idx.size:
                    self._pages.owner[page_idx] = _FREE  # all or nothing
                return self._refusal(self._state, state_idx, problem)
        return None

    def release(self, owner: RoomKey) -> bool:
        """Free everything ``owner`` holds (for a leg: once the last leg of its group
        released). False if it held nothing."""
        slot = self._by_owner.pop(owner, None)
        if slot is None:
            return False
        claim = self._claims[slot]
        assert claim is not None
        claim.members.discard(owner)
        if claim.members:  # the other legs of the request still hold the pages
            if claim.owner == owner:  # name a leg that holds them (holder(), refusals)
                claim.owner = min(claim.members)
            return True
        if claim.group is not None:
            del self._groups[claim.group]
        if claim.pages.size:
            self._pages.owner[claim.pages] = _FREE
            self.held_pages -= claim.pages.size
        if claim.state.size:
            self._state.owner[claim.state] = _FREE
        if claim.aux >= 0:
            del self._aux[claim.aux]
        self._claims[slot] = None
        self._free.append(slot)
        return True

    def holder(self, page: int) -> RoomKey | None:
        """Who holds ``page`` (tests, operators)."""
        table = self._pages.owner
        if not 0 <= page < table.size or table[page] == _FREE:
            return None
        claim = self._claims[int(table[page]) >> 32]
        return None if claim is None else claim.owner

    def _name(self, slot: int) -> str:
        claim = self._claims[slot]
        assert claim is not None
        return f"room {claim.owner.room} gen {claim.owner.generation}"

    def _refusal(self, table: _Table, idx: _Indices, problem: str | npt.NDArray[np.int64]) -> str:
        if isinstance(problem, str):
            return problem
        taken = problem != _FREE
        slots = problem[taken] >> 32
        holders = np.unique(slots)
        others = holders.size - 1
        also = f" and {others} other room{'s' if others > 1 else ''}" if others else ""
        who = self._name(int(slots[0]))
        return f"{_quote(table.noun, idx[taken])} already held by {who}{also}"
