"""``kvfsm.sglang._states``: SGLang's per-type state buffers and request indices as kvfsm's
state groups and layout rows. Pure: made-up addresses, no NIXL."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvfsm.sglang._errors import UnsupportedError
from kvfsm.sglang._states import INDEXED, REFUSED, RING_ROW, SLOT_ONE, StateMap

#: (name, buffers, items per buffer, bytes per item): Mamba's conv and SSM tensors of two
#: layers, an SWA pool's K and V of one layer.
TYPES = (("mamba", 4, 6, 64), ("swa", 2, 40, 128))


def args_for(types: Any = TYPES, *, skip: tuple[str, ...] = ()) -> SimpleNamespace:
    addr = 0x10_0000
    ptrs, lens, items = [], [], []
    for name, buffers, count, size in types:
        group = []
        for _ in range(buffers if name not in skip else 0):
            group.append(addr)
            addr += count * size
        ptrs.append(group)
        lens.append([count * size] * len(group))
        items.append([size] * len(group))
    return SimpleNamespace(
        state_types=[t[0] for t in types],
        state_data_ptrs=ptrs,
        state_data_lens=lens,
        state_item_lens=items,
    )


def placed(args: Any) -> StateMap:
    """The map with each registered type's rows laid out one after another, as a layout
    lays them out when every buffer of a type has the same item count."""
    states = StateMap.from_kv_args(args)
    counts = {name: count for name, _b, count, _s in TYPES}
    firsts = np.cumsum([0] + [counts[n] for n in states.names])
    return states.placed([(int(firsts[i]), counts[n]) for i, n in enumerate(states.names)])


def test_each_state_type_is_a_group_of_its_own_buffers_in_kvargs_order() -> None:
    states = StateMap.from_kv_args(args_for())
    assert states.names == ("mamba", "swa")
    assert states.groups == (4, 2)
    assert states.items == (64,) * 4 + (128,) * 2
    assert len(states.ptrs) == len(states.lens) == 6


def test_request_indices_become_layout_rows_type_after_type() -> None:
    states = placed(args_for())
    assert states.rows([[5], [0, 39, 7]]) == [5, 6 + 0, 6 + 39, 6 + 7]
    assert states.rows([np.array([2], np.int32), None]) == [2]  # SGLang hands numpy arrays too
    assert states.rows([None, np.array([], np.int32)]) is None
    assert states.rows(None) is None


def test_an_index_past_its_own_type_is_refused_not_taken_for_the_next_types() -> None:
    states = placed(args_for())
    # Row 6 would exist in the layout (SWA's first): as a Mamba index it is out of range.
    assert states.rows([[6], [1]]) == "state type 'mamba': index 6 is outside its 6 items"
    assert "index -1" in str(states.rows([[0], [-1]]))


def test_mamba_moves_one_slot_per_request() -> None:
    got = placed(args_for()).rows([[1, 2], [3]])
    assert got == "state type 'mamba' moves one slot per request, not 2"


def test_indices_for_a_type_without_buffers_are_refused() -> None:
    states = placed(args_for(skip=("mamba",)))
    assert states.names == ("swa",)
    assert states.rows([None, [3]]) == [3]
    assert "state type 0, but this rank registered no buffers" in str(states.rows([[1], [3]]))
    assert "state type 2" in str(states.rows([None, [3], [0]]))


def test_a_ring_row_entry_names_its_row_and_is_checked_as_sglang_checks_it() -> None:
    states = StateMap.from_kv_args(args_for((("dsa_tail", 2, 4, 64),))).placed([(0, 4)])
    assert states.rows([[3, 6, 2, 0, 1, 8]]) == [3]  # live slots 6, 7 and 0 of row 3
    assert states.rows([[]]) is None  # no live token: nothing moves
    assert "6 values, not 2" in str(states.rows([[3, 1]]))
    assert "segment (6, 3) exceeds the ring of 8 slots" in str(states.rows([[3, 6, 3, 0, 0, 8]]))
    assert "ring size 0" in str(states.rows([[3, 0, 0, 0, 0, 0]]))
    assert "index 4 is outside its 4 items" in str(states.rows([[4, 0, 1, 0, 0, 8]]))


def test_an_unknown_state_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedError, match=r"'hyena' is not one SGLang"):
        StateMap.from_kv_args(args_for((("hyena", 1, 4, 64),)))


def test_every_sglang_state_type_is_moved_or_refused_by_name() -> None:
    from sglang.srt.disaggregation.base.conn import StateType

    assert {t.value for t in StateType} == INDEXED | SLOT_ONE | RING_ROW | set(REFUSED)


def test_lists_that_do_not_line_up_are_refused() -> None:
    args = args_for()
    args.state_item_lens[1] = [128]
    with pytest.raises(ValueError, match=r"'swa': 2 state_data_ptrs, 2 state_data_lens, 1"):
        StateMap.from_kv_args(args)
    with pytest.raises(ValueError, match="2 state types in the layout, 1 here"):
        StateMap.from_kv_args(args_for(skip=("mamba",))).placed([(0, 1), (1, 1)])
