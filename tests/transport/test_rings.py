"""The remap of DSA tail ring slots between rings of different sizes (``_rings``), against
SGLang 0.5.23's own ``build_dsa_tail_transfer_blocks`` over its own entries
(``get_dsa_tail_state_indices``) for every request length and both speculative slot counts;
and the bad segments that fail the chunk (and so its room) rather than post anything."""

from __future__ import annotations

import itertools
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from kvfsm.transport import LayoutError
from kvfsm.transport._rings import ring_blocks

with warnings.catch_warnings():  # its imports warn of kernels this CPU lacks
    warnings.simplefilter("ignore")
    sglang_utils = pytest.importorskip("sglang.srt.disaggregation.utils")

POOL = 8
SLOT_BYTES = (24, 8)  # key ring, score ring
ROWS = 6


def _entry(extra: int, row: int, seq_len: int) -> list[int]:
    pool = SimpleNamespace(kpool_use_compress=True, index_kpool=POOL, tail_extra_slots=extra)
    return [int(x) for x in sglang_utils.get_dsa_tail_state_indices(pool, row, seq_len)]


def _specs(extra: int, base: int) -> tuple[tuple[int, int, int, int], ...]:
    """A Mamba region first (another state type), then the key and score rings."""
    ring = POOL + extra
    return (
        (base, ROWS * 32, 32, 0),
        *((base + 2**20 * (k + 1), ROWS * ring * b, ring * b, 0) for k, b in enumerate(SLOT_BYTES)),
    )


@pytest.mark.parametrize(("src_extra", "dst_extra"), [(0, 3), (3, 0), (2, 5), (1, 0)])
def test_blocks_equal_sglangs_for_every_length(src_extra: int, dst_extra: int) -> None:
    local, remote = _specs(src_extra, 1 << 30), _specs(dst_extra, 1 << 34)
    for seq_len, (src_row, dst_row) in itertools.product(range(1, 70), [(0, 5), (4, 1)]):
        src, dst = _entry(src_extra, src_row, seq_len), _entry(dst_extra, dst_row, seq_len)
        if not src:
            continue
        # Mamba row 3 first, then the ring row: the ring row's position is 1.
        rows = np.asarray([3, ROWS + src_row], np.int32), np.asarray([2, ROWS + dst_row], np.int32)
        got = ring_blocks(
            rings=(1, 2),
            local=local,
            local_groups=(1, 2),
            remote=remote,
            remote_groups=(1, 2),
            src_rows=rows[0],
            dst_rows=rows[1],
            src_rings=np.asarray([1, *src[1:]], "<i4").tobytes(),
            dst_rings=np.asarray([1, *dst[1:]], "<i4").tobytes(),
        )
        want = sglang_utils.build_dsa_tail_transfer_blocks(
            [s[0] for s in local[1:]],
            [s[2] for s in local[1:]],
            [s[0] for s in remote[1:]],
            src,
            dst,
            [s[2] for s in remote[1:]],
        )
        assert got is not None
        pairs = [
            (int(a), int(b), int(n))
            for (a, n, _), (b, m, _) in zip(got.local, got.remote, strict=True)
            if n == m
        ]
        assert len(pairs) == len(got.local) == len(want), seq_len
        assert sorted(pairs) == sorted(want), (seq_len, src, dst)
        assert got.nbytes == sum(n for _, _, n in want)


def _blocks(src: list[int], dst: list[int], src_at: int = 0, dst_at: int = 0) -> object:
    return _ring_blocks(
        np.asarray([src_at, *src], "<i4").tobytes(), np.asarray([dst_at, *dst], "<i4").tobytes()
    )


def _ring_blocks(src_rings: bytes, dst_rings: bytes) -> object:
    return ring_blocks(
        rings=(1, 2),
        local=_specs(0, 1 << 30),
        local_groups=(1, 2),
        remote=_specs(3, 1 << 34),
        remote_groups=(1, 2),
        src_rows=np.asarray([ROWS + 1], np.int32),
        dst_rows=np.asarray([ROWS + 2], np.int32),
        src_rings=src_rings,
        dst_rings=dst_rings,
    )


@pytest.mark.parametrize(
    ("src", "dst", "where", "message"),
    [
        ([0, 3, 0, 0, 8], [5, 4, 0, 0, 11], (0, 0), "ring live slots differ: 3 on prefill"),
        ([0, 3, 0, 0, 8], [9, 3, 0, 0, 11], (0, 0), r"decode ring segment \(9, 3\) exceeds"),
        ([0, 3, 0, 0, 8], [0, 3, 0, 0, 0], (0, 0), "decode ring of 0 slots"),
        ([0, 3, 0, 0, 8], [1, 3, 0, 0, 11], (0, 4), "decode ring segments name state row"),
        ([0, 3, 0, 0, 8], [1, 3, 0, 0, 12], (0, 0), "are not slots of one size"),
    ],
)
def test_bad_segments_raise_naming_what(
    src: list[int], dst: list[int], where: tuple[int, int], message: str
) -> None:
    with pytest.raises(LayoutError, match=message):
        _blocks(src, dst, *where)


def test_a_ring_row_without_segments_is_refused() -> None:
    with pytest.raises(LayoutError, match="have no live segments"):
        _ring_blocks(b"", b"")
