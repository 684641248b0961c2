"""The demo's plan: what both ranks do with each request, made from ``(options, seed)``.

Both ranks (and the demo process) generate the same plan from the seed, so nothing per room
crosses a pipe: for each request its room id, its source pages and aux row, how its pages are cut
into 1..``max_chunks`` chunks, and whether (and where) it is aborted: by prefill before decode's
pages arrive, before ``init``, between chunks or right after the last chunk; or by decode a few
iterations after it sent its page list.

**Sources are deterministic**: word ``w`` of page ``p`` of K/V buffer ``b`` is a hash of
``(seed, b, p, w)`` (aux rows likewise), so decode checks what landed without asking prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.workload.options import DemoOptions

__all__ = ["Request", "fill_sources", "make_plan"]

Pages = npt.NDArray[np.int32]
#: Word-hash multipliers for the deterministic sources (odd, so distinct inputs spread).
_MUL: Final = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


@dataclass(frozen=True, slots=True)
class Request:
    """One room as both ranks run it. ``abort_side`` is ``"prefill"``, ``"decode"`` or ``""``;
    ``abort_at`` for prefill: -1 before decode's pages arrive, 0 before ``init``, k in
    1..chunks right after chunk k was handed over (in flight; k = ``len(chunks)``: the last);
    for decode: iterations after ``send_metadata``."""

    room: int
    src: list[int]
    src_aux: int
    cuts: list[int]
    abort_side: str = ""
    abort_at: int = 0

    def chunks(self) -> list[Pages]:
        """The source pages, cut at ``cuts``."""
        return np.split(np.asarray(self.src, np.int32), self.cuts)


def make_plan(opts: DemoOptions, seed: int, first_room: int = 0) -> Iterator[Request]:
    """The requests, in order, lazily (a long run does not hold its plan in memory). A later
    batch of the same ranks (``first_room`` > 0, see ``("run", first_room)``) gets room ids
    from ``first_room`` on and plans of its own; the sources stay those of ``seed``."""
    rng = np.random.default_rng(seed if first_room == 0 else (seed, first_room))
    for room in range(first_room, first_room + opts.requests):
        n = int(rng.integers(0, opts.max_room_pages + 1))  # 0: an aux-only room
        src = ((int(rng.integers(opts.num_pages)) + np.arange(n)) % opts.num_pages).astype(np.int32)
        if rng.random() < 0.5:
            rng.shuffle(src)
        # The last chunk is not empty (it is the one that brings the count to n) unless n == 0.
        extra = int(rng.integers(opts.max_chunks)) if n > 0 else 0
        cuts = sorted(int(c) for c in rng.integers(0, max(n, 1), size=extra))
        side, at = "", 0
        if opts.abort_rate > 0 and rng.random() < opts.abort_rate:
            if rng.random() < 0.5:
                side, at = "prefill", int(rng.integers(-1, len(cuts) + 2))
            else:
                side, at = "decode", int(rng.integers(0, 4))
        yield Request(room, src.tolist(), int(rng.integers(opts.aux_rows)), cuts, side, at)


def _pattern(
    seed: int, buffer: int, pages: npt.NDArray[np.integer[Any]], words: int
) -> npt.NDArray[np.uint32]:
    """The deterministic contents of ``pages`` of one buffer, as uint32 words."""
    with np.errstate(over="ignore"):
        p = pages.astype(np.uint32)[:, None] * np.uint32(_MUL[0])
        w = np.arange(words, dtype=np.uint32)[None, :] * np.uint32(_MUL[2])
        base = np.uint32((seed * _MUL[3] + buffer * _MUL[1] + 0x5BD1E995) & 0xFFFFFFFF)
        x = p ^ w ^ base
        return x ^ (x >> np.uint32(15))


def _aux_buffer_id(opts: DemoOptions) -> int:
    return 2 * opts.layers  # after the K and V buffers


def fill_sources(
    opts: DemoOptions, seed: int, kv: list[npt.NDArray[np.uint8]], aux: npt.NDArray[np.uint8]
) -> None:
    """What prefill's sources hold (and what decode compares with): see the module docstring."""
    for b, buf in enumerate(kv):
        rows = np.arange(buf.shape[0])
        buf.view(np.uint32)[:] = _pattern(seed, b, rows, buf.shape[1] // 4)
    aux.view(np.uint32)[:] = _pattern(
        seed, _aux_buffer_id(opts), np.arange(aux.shape[0]), aux.shape[1] // 4
    )
