"""A rank's KV pages as numpy arrays, and the checks made on them.

Every workload (``kvfsm run``, ``kvfsm demo``, the chaos ranks, the benchmarks and the tests)
builds its buffers here, so that a layout registered with NIXL always has the same shape: ``layers``
x K and V buffers of ``num_pages`` rows, an aux buffer, and optionally a state buffer. The decode
ranks of ``kvfsm demo`` and of the chaos campaign check their pages with one
:class:`DecodeChecks`: the bytes a room received, and no write after its pages were freed.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvfsm.transport import Layout, Region

__all__ = [
    "DecodeChecks",
    "Shape",
    "ShapeSizes",
    "compare_room",
    "fill_random",
    "make_buffers",
    "make_layout",
    "make_state",
    "page_digests",
    "shape_of",
]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one rank's buffers."""

    layers: int = 4
    num_pages: int = 512
    page_bytes: int = 4096  # per K or V buffer
    aux_rows: int = 64
    aux_row_bytes: int = 256
    state_rows: int = 0  # per-request state rows (hybrid models); 0: no state buffer
    state_row_bytes: int = 512


class ShapeSizes(Protocol):
    """The sizes a workload's options give its buffers (``page_bytes`` apart: see
    :func:`shape_of`)."""

    @property
    def layers(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def aux_rows(self) -> int: ...
    @property
    def aux_row_bytes(self) -> int: ...


def shape_of(sizes: ShapeSizes, *, page_bytes: int) -> Shape:
    """The buffers of one side of a workload: ``sizes``' layers, pages and aux rows, with pages
    of ``page_bytes`` per K or V buffer (each workload's options say how they get that)."""
    return Shape(
        layers=sizes.layers,
        num_pages=sizes.num_pages,
        page_bytes=page_bytes,
        aux_rows=sizes.aux_rows,
        aux_row_bytes=sizes.aux_row_bytes,
    )


def make_buffers(shape: Shape) -> tuple[list[npt.NDArray[np.uint8]], npt.NDArray[np.uint8]]:
    """Zeroed K and V buffers (K of layer 0, V of layer 0, K of layer 1, ...) and the aux buffer."""
    kv = [np.zeros((shape.num_pages, shape.page_bytes), np.uint8) for _ in range(2 * shape.layers)]
    aux = np.zeros((shape.aux_rows, shape.aux_row_bytes), np.uint8)
    return kv, aux


def make_state(shape: Shape) -> npt.NDArray[np.uint8] | None:
    """The state buffer, or ``None`` when ``shape`` has no state rows."""
    if not shape.state_rows:
        return None
    return np.zeros((shape.state_rows, shape.state_row_bytes), np.uint8)


def make_layout(
    kv: list[npt.NDArray[np.uint8]],
    aux: npt.NDArray[np.uint8],
    state: npt.NDArray[np.uint8] | None = None,
) -> Layout:
    """The ``Layout`` of these buffers; it keeps them alive while NIXL has them registered."""
    regions = tuple(
        Region(f"{'kv'[i % 2]}{i // 2}", buf.ctypes.data, buf.nbytes, buf.shape[1])
        for i, buf in enumerate(kv)
    )
    states: tuple[Region, ...] = ()
    if state is not None:
        states = (Region("state0", state.ctypes.data, state.nbytes, state.shape[1]),)
    return Layout(
        kv=regions,
        aux=(Region("aux0", aux.ctypes.data, aux.nbytes, aux.shape[1]),),
        state=states,
        keepalive=(*kv, aux, *([] if state is None else [state])),
    )


def page_digests(kv: list[npt.NDArray[np.uint8]], pages: npt.NDArray[np.int32]) -> list[int]:
    """One CRC per page over that page in every K and V buffer, in order."""
    out = []
    for page in pages.tolist():
        crc = 0
        for buf in kv:
            crc = zlib.crc32(buf[page].data, crc)
        out.append(crc)
    return out


def compare_room(
    kv: Sequence[npt.NDArray[np.uint8]],
    want_kv: Sequence[npt.NDArray[np.uint8]],
    aux: npt.NDArray[np.uint8],
    want_aux: npt.NDArray[np.uint8],
    *,
    dst: npt.ArrayLike,
    src: npt.ArrayLike,
    dst_aux: int,
    src_aux: int,
) -> tuple[int, int]:
    """``(checked, mismatched)`` bytes of a room: its destination pages of every buffer in ``kv``
    against the source pages of ``want_kv``, and its aux row against the source row."""
    src_pages, dst_pages = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    checked = mismatched = 0
    for got, want in zip(kv, want_kv, strict=True):
        differ = got[dst_pages] != want[src_pages]
        checked += differ.size
        mismatched += int(np.count_nonzero(differ))
    differ_aux = aux[dst_aux] != want_aux[src_aux]
    return checked + differ_aux.size, mismatched + int(np.count_nonzero(differ_aux))


def fill_random(rng: np.random.Generator, array: npt.NDArray[np.uint8]) -> None:
    """Random bytes in place (random doubles when the size allows: ~8x faster than bytes)."""
    flat = array.reshape(-1)
    if flat.size % 8 == 0:
        rng.random(out=flat.view(np.float64))
    else:
        flat[:] = np.frombuffer(rng.bytes(flat.size), dtype=np.uint8)


class PlannedRoom(Protocol):
    """What a room was planned to receive (the demo's ``Request``, the campaign's ``RoomPlan``)."""

    @property
    def room(self) -> int: ...
    @property
    def src(self) -> Sequence[int]: ...
    @property
    def src_aux(self) -> int: ...


class CheckedRoom(Protocol):
    """A decode room in a rank's loop: its destination and what its byte check found."""

    dst: npt.NDArray[np.int32] | None
    dst_aux: int
    checked: int
    mismatched: int


class DecodeChecks:
    """A decode rank's two checks on its pages (``kv``) and aux rows (``aux``).

    * **the bytes**: a room that succeeded must hold, in its destination pages and aux row,
      exactly prefill's source pages and row (``want_kv``, ``want_aux``: both ranks compute them
      from the seed): :meth:`landed`;
    * **no late write** (law 4): the pages and aux row of a room that settled are filled with
      ``marker`` and watched until they are handed out again (:meth:`settled`, :meth:`watch`);
      a byte changed in
      between landed after its room settled. :meth:`check` counts such pages and rows (and
      fills them with the marker again, so that one write is counted once) as ``late_writes``,
      with the first notes in ``late_notes``.
    """

    __slots__ = (
        "aux",
        "kv",
        "late_notes",
        "late_writes",
        "marker",
        "owner",
        "want_aux",
        "want_kv",
        "watched_aux",
        "watched_pages",
    )

    #: Notes kept until the holder takes them (``late_notes``).
    MAX_NOTES = 10

    def __init__(
        self,
        kv: Sequence[npt.NDArray[np.uint8]],
        aux: npt.NDArray[np.uint8],
        want_kv: Sequence[npt.NDArray[np.uint8]],
        want_aux: npt.NDArray[np.uint8],
        *,
        marker: int,
    ) -> None:
        self.kv, self.aux, self.want_kv, self.want_aux = kv, aux, want_kv, want_aux
        self.marker = marker
        num_pages = kv[0].shape[0] if kv else 0
        self.watched_pages = np.zeros(num_pages, bool)
        self.watched_aux = np.zeros(aux.shape[0], bool)
        #: The room that last freed each page (-1: none), for the notes.
        self.owner = np.full(num_pages, -1, np.int64)
        self.late_writes = 0
        self.late_notes: list[str] = []

    def landed(self, item: CheckedRoom, plan: PlannedRoom) -> None:
        """``item`` succeeded: count the bytes of its destination pages and aux row, and those
        that differ from ``plan``'s sources (see :func:`compare_room`)."""
        assert item.dst is not None
        checked, mismatched = compare_room(
            self.kv,
            self.want_kv,
            self.aux,
            self.want_aux,
            dst=item.dst,
            src=plan.src,
            dst_aux=item.dst_aux,
            src_aux=plan.src_aux,
        )
        item.checked += checked
        item.mismatched += mismatched

    def settled(self, item: CheckedRoom, plan: PlannedRoom) -> None:
        """``item`` settled: :meth:`watch` its pages and aux row, on behalf of ``plan.room``."""
        assert item.dst is not None
        self.watch(item.dst, [item.dst_aux], plan.room)

    def watch(self, pages: npt.ArrayLike, aux_rows: npt.ArrayLike, owner: int = -1) -> None:
        """``pages`` and ``aux_rows`` are free (``owner``'s room settled): fill them with the
        marker and watch them until they are handed out."""
        pages, aux_rows = np.asarray(pages, np.int64), np.asarray(aux_rows, np.int64)
        for buf in self.kv:
            buf[pages] = self.marker
        self.aux[aux_rows] = self.marker
        self.watched_pages[pages] = True
        self.watched_aux[aux_rows] = True
        self.owner[pages] = owner

    def check(self, pages: npt.ArrayLike, aux_rows: npt.ArrayLike, *, hand_out: bool) -> None:
        """Count the watched ones among ``pages`` and ``aux_rows`` that no longer hold the
        marker; ``hand_out``: they are being handed out, so stop watching them."""
        pages, aux_rows = np.asarray(pages, np.int64), np.asarray(aux_rows, np.int64)
        marked = pages[self.watched_pages[pages]]
        changed = np.zeros(marked.size, bool)
        for buf in self.kv:
            changed |= np.any(buf[marked] != self.marker, axis=1)
        for page in marked[changed].tolist():
            self._late(f"page {page} changed after room {int(self.owner[page])} settled")
        rows = aux_rows[self.watched_aux[aux_rows]]
        rows_changed = rows[np.any(self.aux[rows] != self.marker, axis=1)]
        for row in rows_changed.tolist():
            self._late(f"aux row {row} changed after its room settled")
        # The marker back, whether or not they stay watched: a page handed out must still hold
        # it, or a write its next room misses could pass that room's byte check.
        for buf in self.kv:
            buf[marked[changed]] = self.marker
        self.aux[rows_changed] = self.marker
        if hand_out:
            self.watched_pages[pages] = False
            self.watched_aux[aux_rows] = False

    def check_all(self) -> None:
        """:meth:`check` every watched page and aux row (they stay watched)."""
        self.check(
            np.flatnonzero(self.watched_pages), np.flatnonzero(self.watched_aux), hand_out=False
        )

    def _late(self, note: str) -> None:
        self.late_writes += 1
        if len(self.late_notes) < self.MAX_NOTES:
            self.late_notes.append(note)
