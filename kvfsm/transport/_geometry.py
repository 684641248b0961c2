"""Layout geometry: descriptor rows and indices of one group of equal regions, and the per-chunk
methods ``Layout`` and ``LayoutSummary`` share (:class:`Geometry`), so both run the same code.

A group is a list of regions ``(addr, nbytes, item_bytes, device)`` with the same item count.
Its descriptor rows are buffer-major: row ``b * items + i`` is item ``i`` of region ``b``. The
functions here assume a validated group (``_layout``'s rules) and check only the indices a caller
hands them, which is what must fail closed: a wrong index would make NIXL write into another
request's page.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, Final, Literal, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = [
    "INT32_MAX",
    "Descs",
    "Geometry",
    "Group",
    "Indices",
    "LayoutError",
    "RegionSpec",
    "StateKind",
    "state_groups",
    "state_plan",
]

#: An ``(N, 3)`` uint64 array of NIXL descriptor rows ``(addr, len, device)``.
Descs: TypeAlias = npt.NDArray[np.uint64]
#: A 1-D int32 array of indices into a ``Descs`` array (or of page ids).
Indices: TypeAlias = npt.NDArray[np.int32]
#: One region on the wire: ``(addr, nbytes, item_bytes, device)``.
RegionSpec: TypeAlias = tuple[int, int, int, int]
Group: TypeAlias = Literal["kv", "aux", "state"]
_UNSIGNED: Final[dict[int, type[np.unsignedinteger[Any]]]] = {4: np.uint32, 8: np.uint64}
#: Indices travel to NIXL as int32, so a group holds at most this many descriptor rows.
INT32_MAX: Final = 2**31 - 1


class LayoutError(ValueError):
    """A region, group or layout is malformed, or an index is outside it."""


def _descs(specs: Sequence[RegionSpec]) -> Descs:
    """Buffer-major descriptor rows of one validated group (see the module docstring).

    The one implementation behind ``Layout.*_descs`` and ``LayoutSummary.*_descs``.
    """
    items = specs[0][1] // specs[0][2] if specs else 0
    out = np.empty((len(specs), items, 3), dtype=np.uint64)
    if specs:
        addr, _, item, device = (np.array(col, dtype=np.uint64) for col in zip(*specs, strict=True))
        out[:, :, 0] = addr[:, None] + np.arange(items, dtype=np.uint64)[None, :] * item[:, None]
        out[:, :, 1] = item[:, None]
        out[:, :, 2] = device[:, None]
    return out.reshape(-1, 3)


def _checked(ids: npt.ArrayLike, bound: int, what: str) -> Indices:
    """``ids`` as a 1-D int32 array, after proving every entry is in ``[0, bound)``."""
    if type(ids) is np.ndarray and ids.dtype == np.int32 and ids.ndim == 1:
        # What the wire carries and the poster passes for every chunk: one reduction and no
        # conversion (a negative int32 read as uint32 is >= 2**31 > bound).
        if ids.size and int(ids.view(np.uint32).max()) >= bound:
            bad = (ids < 0) | (ids >= bound)
            raise LayoutError(f"{what} index {ids[int(bad.argmax())]} out of range [0, {bound})")
        return ids
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise LayoutError(f"{what} indices must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise LayoutError(f"{what} indices must be integers, got dtype {arr.dtype}")
    # One reduction on the good path: a negative int32/int64 viewed as unsigned is at least
    # 2**31 > INT32_MAX >= bound, so ``max() >= bound`` catches it too. (Narrower signed types
    # would not wrap far enough; they take a second reduction.) Find the culprit only on failure.
    if arr.dtype.kind == "i" and arr.dtype.itemsize >= 4:
        out_of_range = bool(arr.view(_UNSIGNED[arr.dtype.itemsize]).max() >= bound)
    else:
        out_of_range = bool(arr.max() >= bound) or bool(arr.min() < 0)
    if out_of_range:
        bad = (arr < 0) | (arr >= bound)
        raise LayoutError(f"{what} index {arr[int(bad.argmax())]} out of range [0, {bound})")
    # Range-checked before the cast, so the cast cannot wrap.
    return arr.astype(np.int32, copy=False)


def _checked_row(row: int, bound: int, what: str) -> int:
    try:
        value = operator.index(row)
    except TypeError:
        raise LayoutError(f"{what} must be an int, got {type(row).__name__} {row!r}") from None
    if isinstance(row, bool) or not 0 <= value < bound:
        raise LayoutError(f"{what} index {row!r} out of range [0, {bound})")
    return value


@functools.lru_cache(maxsize=64)
def _bases(n_regions: int, items: int) -> Indices:
    # First descriptor row of each region. A layout's shape never changes and a sender sees a
    # handful of them, so cache (read-only) instead of paying an arange per chunk.
    base = np.arange(n_regions, dtype=np.int32) * np.int32(items)
    base.flags.writeable = False
    return base


def _spread(n_regions: int, items: int, ids: Indices) -> Indices:
    """Buffer-major descriptor indices of item ids ``ids`` (checked) across ``n_regions``."""
    if n_regions == 1:  # one region: the ids are the descriptor indices
        return ids
    # Cannot overflow: ids < items and n_regions * items <= INT32_MAX (checked by validation).
    return np.add.outer(_bases(n_regions, items), ids).reshape(-1)


def _row_index(n_regions: int, items: int, row: int, what: str) -> Indices:
    ids = np.array([_checked_row(row, items, what)], dtype=np.int32)
    return _spread(n_regions, items, ids)


def _items(specs: Sequence[RegionSpec]) -> int:
    return specs[0][1] // specs[0][2] if specs else 0


class StateKind(NamedTuple):
    """One state type's part of the state group (a model may have several: Mamba's conv and
    temporal pools, an SWA window's K and V, a DSA indexer's keys, ...). Its rows are the
    group's rows ``[first_row, first_row + rows)``; row ``first_row + r`` moves item ``r`` of
    each of its regions, whose first descriptor rows are ``bases``."""

    first_row: int
    rows: int
    bases: Indices
    row_bytes: int


def state_groups(groups: Sequence[int], regions: int) -> tuple[int, ...]:
    """``groups`` (regions per state type, in order) checked against ``regions`` state regions;
    empty means one type holding them all (a layout with one state type says nothing)."""
    if not groups:
        return (regions,) if regions else ()
    counts = tuple(operator.index(g) for g in groups)
    if any(isinstance(g, bool) or g <= 0 for g in counts) or sum(counts) != regions:
        raise LayoutError(
            f"state_groups {list(groups)} must be positive region counts summing to the "
            f"{regions} state regions"
        )
    return counts


@functools.lru_cache(maxsize=64)
def state_plan(specs: tuple[RegionSpec, ...], groups: tuple[int, ...]) -> tuple[StateKind, ...]:
    """The state types of a validated state group, in order (cached: a layout's shape never
    changes). Descriptor rows are region-major: region ``j``'s items come after every earlier
    region's, so a group of equal regions is buffer-major exactly as kv and aux are. A type's
    rows are bounded by its smallest region, as SGLang indexes every buffer of a state type by
    the same slot or page."""
    kinds: list[StateKind] = []
    region = descriptor = first_row = 0
    for count in state_groups(groups, len(specs)):
        members = specs[region : region + count]
        items = [nbytes // item for _, nbytes, item, _ in members]
        bases = np.array(np.cumsum([0, *items[:-1]]) + descriptor, dtype=np.int32)
        bases.flags.writeable = False
        rows = min(items)
        kinds.append(StateKind(first_row, rows, bases, sum(spec[2] for spec in members)))
        region += count
        descriptor += sum(items)
        first_row += rows
    return tuple(kinds)


def _state_kind(kinds: tuple[StateKind, ...], row: int, what: str) -> tuple[int, int]:
    """The position of the type holding group row ``row`` (checked), and the row within it."""
    total = kinds[-1].first_row + kinds[-1].rows if kinds else 0
    value = _checked_row(row, total, what)
    for position, kind in enumerate(kinds):
        if value < kind.first_row + kind.rows:
            return position, value - kind.first_row
    raise AssertionError("unreachable: the row was checked against the total")


def _state_descs(specs: Sequence[RegionSpec]) -> Descs:
    """Region-major descriptor rows of the state group (regions may differ in item count)."""
    parts = [_descs([spec]) for spec in specs]
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)


class Geometry:
    """The per-chunk methods of a layout, written once over two hooks its class provides:
    ``_shape(group)``, ``(regions, items)`` (cheap: called per chunk), and ``_specs(group)``, the
    group's region specs (for descriptor lists and sizes, not per chunk)."""

    __slots__ = ()

    def _shape(self, group: Group) -> tuple[int, int]:
        raise NotImplementedError

    def _specs(self, group: Group) -> Sequence[RegionSpec]:
        raise NotImplementedError

    def _state_kinds(self) -> tuple[StateKind, ...]:
        raise NotImplementedError

    # -- sizes ---------------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes moved per page, summed over the kv regions."""
        return sum(spec[2] for spec in self._specs("kv"))

    def aux_row_bytes(self) -> int:
        """Bytes moved per aux row, summed over the aux regions."""
        return sum(spec[2] for spec in self._specs("aux"))

    def state_row_bytes(self, row: int = 0) -> int:
        """Bytes moved for state row ``row``, summed over its state type's regions."""
        kinds = self._state_kinds()
        return kinds[_state_kind(kinds, row, "state row")[0]].row_bytes

    def state_bytes(self, rows: Indices) -> int:
        """Bytes moved for the state rows ``rows`` (each checked)."""
        kinds = self._state_kinds()
        return sum(kinds[_state_kind(kinds, int(r), "state row")[0]].row_bytes for r in rows)

    def state_type_rows(self) -> tuple[tuple[int, int], ...]:
        """``(first_row, rows)`` of each state type, in order: row ``i`` of type ``t`` is state
        row ``first_row + i`` of the layout (what the chunk commands carry)."""
        return tuple((kind.first_row, kind.rows) for kind in self._state_kinds())

    def state_type_of(self, row: int, what: str = "state row") -> int:
        """Which state type (its position among the layout's) holds state row ``row``."""
        return _state_kind(self._state_kinds(), row, what)[0]

    # -- descriptors ---------------------------------------------------------------------------

    def kv_descs(self) -> Descs:
        """``(len(kv) * num_pages, 3)``; row ``b * num_pages + p`` is page ``p`` of kv ``b``."""
        return _descs(self._specs("kv"))

    def aux_descs(self) -> Descs:
        """``(len(aux) * aux_rows, 3)``; row ``b * aux_rows + r`` is row ``r`` of aux ``b``."""
        return _descs(self._specs("aux"))

    def state_descs(self) -> Descs:
        """One row per item of each state region, region-major: with one state type of equal
        regions, ``(len(state) * state_rows, 3)`` in kv's convention."""
        return _state_descs(self._specs("state"))

    # -- indices -------------------------------------------------------------------------------

    def check_pages(self, pages: npt.ArrayLike, what: str = "page") -> None:
        """Raise ``LayoutError`` naming the first page id outside ``[0, num_pages)``.

        ``pages``: a 1-D integer array (any integer dtype; int32 is what the wire carries).
        """
        _checked(pages, self._shape("kv")[1], what)

    def page_index(
        self, pages: npt.ArrayLike, what: str = "page", *, checked: bool = False
    ) -> Indices:
        """Indices into ``kv_descs()`` for ``pages`` across all kv regions, buffer-major:
        ``[b * num_pages + p for b in range(len(kv)) for p in pages]``, int32.

        Checks ``pages`` as ``check_pages`` does: a wrong index would make NIXL write into
        another request's page, so this fails closed (one numpy reduction). ``checked``: the
        caller already ran ``check_pages`` on this very int32 array (read-only, so it cannot
        have changed since), and the check is skipped.
        """
        regions, items = self._shape("kv")
        if checked and type(pages) is np.ndarray and pages.dtype == np.int32:
            return _spread(regions, items, pages)
        return _spread(regions, items, _checked(pages, items, what))

    def check_row(self, row: int, what: str = "aux row") -> None:
        """Raise ``LayoutError`` unless ``row`` is in ``[0, aux_rows)``."""
        _checked_row(row, self._shape("aux")[1], what)

    def aux_index(self, row: int) -> Indices:
        """Indices into ``aux_descs()`` for ``row`` across all aux regions, int32."""
        return _row_index(*self._shape("aux"), row, "aux row")

    def check_state_row(self, row: int, what: str = "state row") -> None:
        """Raise ``LayoutError`` unless ``row`` is in ``[0, state_rows)``."""
        _state_kind(self._state_kinds(), row, what)

    def state_index(self, row: int) -> Indices:
        """Indices into ``state_descs()`` for ``row`` across its state type's regions, int32."""
        kinds = self._state_kinds()
        position, offset = _state_kind(kinds, row, "state row")
        return kinds[position].bases + np.int32(offset)
