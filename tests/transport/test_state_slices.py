"""``StatePiece``: the descriptors and indices of a link's blocks of each state item, checked
against hand-computed addresses, and the checks that keep a bad piece away from NIXL."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.transport import LayoutError, StatePiece
from kvfsm.transport._state_slices import DESTINATION, SOURCE, check_state_piece

# Two state types: type 0 of two regions (3 items of 32 bytes, 4 items of 16), type 1 of one
# region (5 items of 8 bytes). Type 0 has 3 rows (its smallest region), type 1 has 5.
SPECS = ((1000, 96, 32, 0), (2000, 64, 16, 0), (3000, 40, 8, 0))
GROUPS = (2, 1)
PIECE = StatePiece((((0, 8, 8), (16, 24, 8)), ((4, 0, 4),), ()))


def test_descriptors_list_each_block_of_each_item_region_by_region() -> None:
    descs = PIECE.descs(SPECS, SOURCE)
    region0 = [(1000 + 32 * i + off, 8, 0) for i in range(3) for off in (0, 16)]
    region1 = [(2000 + 16 * i + 4, 4, 0) for i in range(4)]
    assert descs.tolist() == [list(r) for r in region0 + region1]
    # The destination side uses the destination offsets, in the same block order.
    dst = PIECE.descs(SPECS, DESTINATION)
    assert dst[:2].tolist() == [[1008, 8, 0], [1024, 8, 0]]


def test_a_row_moves_its_item_of_every_region_of_its_type() -> None:
    # Row 2 of type 0: item 2 of region 0 (descriptors 4, 5) and of region 1 (6 + 2 = 8).
    assert PIECE.index(SPECS, GROUPS, SOURCE, 2).tolist() == [4, 5, 8]
    # Type 1 (rows 3 to 7) moves nothing over this link.
    assert PIECE.index(SPECS, GROUPS, SOURCE, 4).tolist() == []
    assert PIECE.index(SPECS, GROUPS, SOURCE, 2).dtype == np.int32
    with pytest.raises(LayoutError, match="state row 8 is outside"):
        PIECE.index(SPECS, GROUPS, SOURCE, 8)
    assert PIECE.row_bytes(GROUPS, 0) == 20
    assert PIECE.row_bytes(GROUPS, 1) == 0


def test_whole_pieces_and_empty_ones() -> None:
    whole = StatePiece.whole([32, 16, 8])
    assert whole.descs(SPECS, SOURCE).shape == (3 + 4 + 5, 3)
    assert not whole.moves_nothing
    assert StatePiece(((), (), ())).moves_nothing
    assert StatePiece(((), (), ())).descs(SPECS, SOURCE).shape == (0, 3)


@pytest.mark.parametrize(
    ("blocks", "reason"),
    [
        ((((0, 0, 8),),), "state piece for 1 regions, local 3, remote 3"),
        ((((0, 0, 0),), (), ()), "is empty"),
        ((((-8, 0, 8),), (), ()), "is empty"),
        ((((0, 28, 8),), (), ()), "does not fit items of 32 \\(local\\) and 32 \\(remote\\)"),
        (((), ((12, 0, 8),), ()), "does not fit"),
    ],
)
def test_a_piece_that_does_not_fit_is_refused(blocks: object, reason: str) -> None:
    with pytest.raises(LayoutError, match=reason):
        check_state_piece(StatePiece(blocks), SPECS, SPECS)  # type: ignore[arg-type]
