"""One owner per destination (``DestinationOwners``): refusals, release, and a property test
of random claim/release sequences against a model made of plain sets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfsm.rooms import RoomKey
from kvfsm.rooms._owners import DestinationOwners
from tests.rooms.helpers import pages

A, B, C = RoomKey(17, 2), RoomKey(18, 3), RoomKey(19, 4)


def test_a_claim_holds_pages_aux_and_state_until_released() -> None:
    owners = DestinationOwners()
    assert owners.claim(A, pages(3, 4, 5), 7, pages(1)) is None
    assert A in owners
    assert owners.holder(4) == A
    assert owners.held_pages == 3
    assert owners.release(A)
    assert A not in owners
    assert owners.holder(4) is None
    assert owners.held_pages == 0
    assert not owners.release(A)  # idempotent
    assert owners.claim(B, pages(3, 4, 5), 7, pages(1)) is None


def test_overlapping_pages_are_refused_naming_them_and_their_holder() -> None:
    owners = DestinationOwners()
    assert owners.claim(A, pages(1, 3, 4, 7, 9, 10), 1) is None
    problem = owners.claim(B, pages(20, 3, 4, 7, 10, 21), 2)
    assert problem == "pages [3, 4, 7, 10] (4 pages) already held by room 17 gen 2"
    # All or nothing: B holds none of the free pages it named, nor its aux row.
    assert B not in owners
    assert owners.holder(20) is None
    assert owners.claim(C, pages(20, 21), 2) is None


def test_overlap_with_several_holders_names_the_first_and_counts_the_rest() -> None:
    owners = DestinationOwners()
    owners.claim(A, pages(1), 1)
    owners.claim(B, pages(2), 2)
    problem = owners.claim(C, pages(*range(12)), 3)
    assert problem == "pages [1, 2] (2 pages) already held by room 17 gen 2 and 1 other room"


def test_a_long_overlap_is_quoted_with_an_ellipsis() -> None:
    owners = DestinationOwners()
    owners.claim(A, pages(*range(100)), 1)
    problem = owners.claim(B, pages(*range(50, 150)), 2)
    assert problem is not None
    assert problem.startswith("pages [50, 51, 52, 53, 54, 55, 56, 57, ...] (50 pages) already")


def test_shared_aux_row_and_shared_state_rows_are_refused() -> None:
    owners = DestinationOwners()
    owners.claim(A, pages(1), 5, pages(8, 9))
    assert owners.claim(B, pages(2), 5) == "aux row 5 already held by room 17 gen 2"
    assert owners.claim(B, pages(2), 6, pages(9)) == "state row 9 already held by room 17 gen 2"
    assert B not in owners
    assert owners.holder(2) is None  # the pages of a refused claim are not kept
    # Three index spaces: page 5, aux row 1 and state row 1 do not collide with each other.
    assert owners.claim(B, pages(5, 8), 1, pages(1)) is None


def test_a_page_twice_in_one_list_is_refused() -> None:
    owners = DestinationOwners()
    assert owners.claim(A, pages(4, 9, 4), 1) == ("page 4 appears more than once in the page list")
    assert owners.claim(A, pages(9, 4, 9, 4, 2), 1) == (
        "pages [4, 9] (2 pages) appear more than once in the page list"
    )
    assert owners.claim(A, pages(1), 1, pages(3, 3)) == (
        "state row 3 appears more than once in the state rows"
    )
    assert A not in owners
    assert owners.holder(4) is None
    assert owners.holder(1) is None
    assert owners.claim(A, pages(4, 9, 2), 1) is None


def test_negative_and_absurd_indices_are_refused_without_growing_the_table() -> None:
    owners = DestinationOwners(max_index=1000)
    assert owners.claim(A, pages(1, -3), 1) == "page -3 is negative"
    assert owners.claim(A, pages(5, 1000, 2**31 - 1), 1) == (
        "pages [1000, 2147483647] (2 pages) are beyond the table's limit of 1000"
    )
    assert owners.claim(A, pages(999), 1) is None
    with pytest.raises(ValueError, match="max_index"):
        DestinationOwners(max_index=0)


def test_an_owner_claims_once() -> None:
    owners = DestinationOwners()
    owners.claim(A, pages(1), 1)
    with pytest.raises(ValueError, match="already holds"):
        owners.claim(A, pages(2), 2)


def test_empty_lists_and_no_aux_row_hold_nothing_but_the_owner() -> None:
    owners = DestinationOwners()
    assert owners.claim(A, b"", -1) is None
    assert owners.claim(B, b"", -1) is None
    assert len(owners) == 2
    assert owners.held_pages == 0


def test_thousands_of_pages_in_any_order() -> None:
    owners = DestinationOwners()
    rng = np.random.default_rng(5)
    pool = rng.permutation(200_000).astype(np.int32)
    first, second = pool[:4096], pool[4096:8192]
    assert owners.claim(A, first.tobytes(), 1) is None
    assert owners.claim(B, np.sort(second).tobytes(), 2) is None
    clash = np.concatenate([pool[8192:9000], first[:4]])
    problem = owners.claim(C, clash.tobytes(), 3)
    assert problem is not None
    assert "(4 pages) already held by room 17 gen 2" in problem
    dup = np.concatenate([pool[9000:12000], pool[9500:9501]])
    problem = owners.claim(C, dup.tobytes(), 3)
    assert problem == f"page {pool[9500]} appears more than once in the page list"
    assert owners.held_pages == 8192
    owners.release(A)
    assert owners.claim(C, clash.tobytes(), 3) is None


# -- the property test -----------------------------------------------------------------------

KEYS = [RoomKey(room, room + 100) for room in range(6)]
index_lists = st.lists(st.integers(-2, 40), max_size=10)


class OwnersMachine(RuleBasedStateMachine):
    """Random claims and releases; a model of plain sets says what must happen."""

    def __init__(self) -> None:
        super().__init__()
        self.owners = DestinationOwners(max_index=64)
        self.model: dict[RoomKey, tuple[set[int], int, set[int]]] = {}

    def _held(self, part: int) -> dict[int, RoomKey]:
        out: dict[int, RoomKey] = {}
        for key, claim in self.model.items():
            items = {claim[1]} if part == 1 else claim[part]
            out.update(dict.fromkeys(items, key))
        return out

    @rule(
        key=st.sampled_from(KEYS),
        page_list=index_lists,
        aux=st.integers(-1, 8),
        state_list=st.lists(st.integers(0, 12), max_size=3),
    )
    def claim(self, key: RoomKey, page_list: list[int], aux: int, state_list: list[int]) -> None:
        if key in self.model:
            with pytest.raises(ValueError, match="already holds"):
                self.owners.claim(key, pages(*page_list), aux, pages(*state_list))
            return
        held_pages, held_aux, held_state = self._held(0), self._held(1), self._held(2)
        valid = (
            all(0 <= p < 64 for p in page_list)
            and len(set(page_list)) == len(page_list)
            and len(set(state_list)) == len(state_list)
        )
        free = (
            not set(page_list) & held_pages.keys()
            and (aux < 0 or aux not in held_aux)
            and not set(state_list) & held_state.keys()
        )
        problem = self.owners.claim(key, pages(*page_list), aux, pages(*state_list))
        if valid and free:
            assert problem is None
            self.model[key] = (set(page_list), aux, set(state_list))
            return
        assert problem is not None
        if "already held by" in problem:
            # It names a room that really holds one of the named destinations.
            named = problem.split("already held by ")[1].split(" and ")[0]
            candidates = {held_pages.get(p) for p in page_list} | {held_aux.get(aux)}
            candidates |= {held_state.get(row) for row in state_list}
            holders = {f"room {k.room} gen {k.generation}" for k in candidates if k is not None}
            assert named in holders

    @rule(key=st.sampled_from(KEYS))
    def release(self, key: RoomKey) -> None:
        assert self.owners.release(key) == (key in self.model)
        self.model.pop(key, None)

    @invariant()
    def matches_the_model(self) -> None:
        held = self._held(0)
        for page in range(64):
            assert self.owners.holder(page) == held.get(page)
        assert self.owners.held_pages == len(held)
        assert len(self.owners) == len(self.model)


OwnersMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_owners_against_a_set_model = OwnersMachine.TestCase
