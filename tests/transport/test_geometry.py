"""``_geometry`` directly: buffer-major descriptor rows and indices of a group of equal
regions, and the index checks that fail closed (the per-chunk code ``Layout`` and
``LayoutSummary`` share)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.transport._geometry import (
    LayoutError,
    _checked,
    _checked_row,
    _descs,
    _row_index,
    _spread,
)

# two regions of 3 items of 8 bytes, on device 0 and 1
SPECS = [(0x1000, 24, 8, 0), (0x9000, 24, 8, 1)]


def test_descriptor_rows_are_buffer_major() -> None:
    rows = _descs(SPECS)
    assert rows.dtype == np.uint64
    assert rows.tolist() == [
        [0x1000, 8, 0],
        [0x1008, 8, 0],
        [0x1010, 8, 0],
        [0x9000, 8, 1],
        [0x9008, 8, 1],
        [0x9010, 8, 1],
    ]
    assert _descs([]).shape == (0, 3)


def test_indices_spread_item_ids_over_every_region() -> None:
    ids = np.asarray([2, 0], np.int32)
    assert _spread(2, 3, ids).tolist() == [2, 0, 5, 3]
    assert _spread(1, 3, ids).tolist() == [2, 0]  # one region: the ids themselves
    assert _row_index(2, 3, 1, "aux row").tolist() == [1, 4]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 3], "page index 3 out of range [0, 3)"),
        (np.asarray([-1], np.int64), "page index -1 out of range [0, 3)"),
        (np.asarray([-1], np.int8), "page index -1 out of range [0, 3)"),
        # int32, what the wire carries, takes the fast path: the same checks, the same words
        (np.asarray([0, 2, -7], np.int32), "page index -7 out of range [0, 3)"),
        (np.asarray([1, 3], np.int32), "page index 3 out of range [0, 3)"),
        (np.asarray([-(2**31)], np.int32), f"page index {-(2**31)} out of range [0, 3)"),
        ([[0]], "must be a 1-D array"),
        (np.asarray([0.0]), "must be integers"),
    ],
)
def test_a_bad_index_fails_closed_naming_it(ids: object, message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace(")", r"\)")):
        _checked(ids, 3, "page")  # type: ignore[arg-type]


def test_checked_indices_come_back_as_int32_and_empty_is_fine() -> None:
    out = _checked(np.asarray([2, 1], np.int64), 3, "page")
    assert out.dtype == np.int32
    assert out.tolist() == [2, 1]
    assert _checked([], 3, "page").size == 0
    wire = np.asarray([2, 0, 1], np.int32)
    assert _checked(wire, 3, "page") is wire  # int32 is checked, never copied
    assert _checked(wire[:0], 3, "page").size == 0


def test_a_row_must_be_an_int_in_range() -> None:
    assert _checked_row(np.int64(2), 3, "aux row") == 2
    for bad in (3, -1, True):
        with pytest.raises(LayoutError, match="aux row index"):
            _checked_row(bad, 3, "aux row")
    with pytest.raises(LayoutError, match="must be an int"):
        _checked_row(1.0, 3, "aux row")  # type: ignore[arg-type]
