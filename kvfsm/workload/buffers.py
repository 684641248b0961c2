"""A rank's KV pages as numpy arrays, and the checks made on them.

Every workload (``kvfsm run``, ``kvfsm demo``, the chaos ranks, the benchmarks and the tests)
builds its buffers here, so that a layout registered with NIXL always has the same shape: ``layers``
x K and V buffers of ``num_pages`` rows, an aux buffer, and optionally a state buffer.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvfsm.transport import Layout, Region

__all__ = [
    "Shape",
    "compare_room",
    "fill_random",
    "make_buffers",
    "make_layout",
    "make_state",
    "page_digests",
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
