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
from tests.helpers.rooms import pages

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


# -- legs of one request: a shared claim (group) ----------------------------------------------

LEG0, LEG1, LEG2 = RoomKey(30, 5), RoomKey(30, 6), RoomKey(30, 7)


def test_legs_of_one_group_share_its_pages() -> None:
    owners = DestinationOwners()
    assert owners.claim(LEG0, pages(4, 5, 6), 3, pages(2), group=9) is None
    assert owners.claim(LEG1, pages(4, 5, 6), -1, group=9) is None  # a KV-only leg joins
    assert LEG0 in owners
    assert LEG1 in owners
    assert len(owners) == 2
    assert owners.held_pages == 3  # the pages are counted once, not per leg
    assert owners.holder(5) == LEG0  # the first leg is the claim's owner


def test_a_later_leg_naming_other_pages_is_refused() -> None:
    owners = DestinationOwners()
    owners.claim(LEG0, pages(4, 5, 6), 3, group=9)
    for other in (pages(4, 5), pages(4, 5, 7), pages(6, 5, 4), pages(4, 5, 6, 7)):
        assert owners.claim(LEG1, other, -1, group=9) == (
            "a leg of room 30 names other pages than its first leg (room 30 gen 5)"
        )
    assert LEG1 not in owners
    assert owners.holder(7) is None  # a refused leg takes nothing
    assert owners.held_pages == 3


def test_a_dummy_leg_joins_with_no_pages_at_all() -> None:
    owners = DestinationOwners()
    owners.claim(LEG0, pages(4, 5, 6), 3, group=9)
    assert owners.claim(LEG2, b"", -1, group=9) is None
    assert LEG2 in owners
    assert owners.held_pages == 3
    # It holds the group's claim: the first leg releasing does not free the pages.
    owners.release(LEG0)
    assert owners.claim(A, pages(5), 1) == "page 5 already held by room 30 gen 7"  # LEG2
    owners.release(LEG2)
    assert owners.claim(A, pages(5), 1) is None


def test_aux_and_state_rows_are_taken_by_one_leg_of_a_group_only() -> None:
    owners = DestinationOwners()
    # The first leg carries KV only; a later leg brings the aux row and the state rows.
    assert owners.claim(LEG0, pages(1, 2), -1, group=4) is None
    assert owners.claim(LEG1, pages(1, 2), 8, pages(3, 4), group=4) is None
    assert owners.claim(A, pages(9), 8) == "aux row 8 already held by room 30 gen 5"
    assert owners.claim(A, pages(9), 1, pages(4)) == "state row 4 already held by room 30 gen 5"
    # A third leg naming an aux row or state rows again is refused, and takes nothing.
    assert owners.claim(LEG2, pages(1, 2), 7, group=4) == (
        "aux row 7: another leg of the room already holds aux row 8"
    )
    assert owners.claim(A, pages(9), 7) is None  # row 7 was not taken by the refused leg
    assert owners.claim(LEG2, pages(1, 2), -1, pages(5), group=4) == (
        "state rows: a leg of room 30 names other state rows than the leg that holds them"
    )
    assert owners.claim(B, pages(10), 2, pages(5)) is None  # nor state row 5
    assert LEG2 not in owners
    # A leg writing its shard of sharded state (unequal attention TP) names the same rows.
    assert owners.claim(LEG2, pages(1, 2), -1, pages(3, 4), group=4) is None
    assert LEG2 in owners


def test_a_group_leg_cannot_take_an_aux_or_state_row_another_room_holds() -> None:
    owners = DestinationOwners()
    owners.claim(A, pages(20), 6, pages(7))
    owners.claim(LEG0, pages(1, 2), -1, group=4)
    assert owners.claim(LEG1, pages(1, 2), 6, group=4) == "aux row 6 already held by room 17 gen 2"
    assert owners.claim(LEG1, pages(1, 2), 5, pages(7), group=4) == (
        "state row 7 already held by room 17 gen 2"
    )
    assert LEG1 not in owners
    assert owners.claim(B, pages(21), 5) is None  # all or nothing: aux row 5 stayed free


@pytest.mark.parametrize("other_group", [None, 10])
def test_another_room_is_still_refused_on_any_page_of_a_group(other_group: int | None) -> None:
    owners = DestinationOwners()
    owners.claim(LEG0, pages(4, 5, 6), 3, group=9)
    owners.claim(LEG1, pages(4, 5, 6), -1, group=9)
    problem = owners.claim(A, pages(1, 6), 1, group=other_group)
    assert problem == "page 6 already held by room 30 gen 5"
    assert A not in owners
    assert owners.holder(1) is None
    # Once its first leg released, the group still holds them in its other leg's name.
    owners.release(LEG0)
    assert owners.claim(A, pages(6), 1, group=other_group) is not None


def test_pages_are_held_until_the_last_leg_releases_in_any_order() -> None:
    for order in ((LEG0, LEG1, LEG2), (LEG2, LEG0, LEG1), (LEG1, LEG2, LEG0)):
        owners = DestinationOwners()
        owners.claim(LEG0, pages(4, 5, 6), 3, pages(1), group=9)
        owners.claim(LEG1, pages(4, 5, 6), -1, group=9)
        owners.claim(LEG2, b"", -1, group=9)
        for leg in order[:-1]:
            assert owners.release(leg)
            assert leg not in owners
            assert owners.held_pages == 3
            assert owners.holder(4) in owners  # a leg that still holds them
            assert owners.claim(A, pages(4), 0) is not None
            problem = owners.claim(A, pages(40), 3)
            holder = owners.holder(4)
            assert holder is not None
            assert problem == f"aux row 3 already held by room 30 gen {holder.generation}"
            assert owners.claim(A, pages(40), 0, pages(1)) is not None
        assert owners.release(order[-1])
        assert not owners.release(order[-1])
        assert len(owners) == 0
        assert owners.held_pages == 0
        assert owners.holder(4) is None
        assert owners.claim(A, pages(4, 5, 6), 3, pages(1)) is None


def test_a_group_reused_after_all_its_legs_released_starts_fresh() -> None:
    owners = DestinationOwners()
    owners.claim(LEG0, pages(4, 5, 6), 3, group=9)
    owners.claim(LEG1, pages(4, 5, 6), -1, group=9)
    owners.release(LEG0)
    owners.release(LEG1)
    # New legs under the same group number: other pages are not "other than the first leg's",
    # and the old aux row is not "already held by another leg".
    fresh, again = RoomKey(31, 8), RoomKey(31, 9)
    assert owners.claim(fresh, pages(7, 8), -1, group=9) is None
    assert owners.claim(again, pages(7, 8), 3, group=9) is None
    assert owners.holder(7) == fresh
    assert owners.holder(4) is None
    assert owners.held_pages == 2


def test_a_leg_of_a_refused_first_claim_cannot_join() -> None:
    owners = DestinationOwners()
    owners.claim(A, pages(5), 1)
    # The request's first leg is refused (page 5 is A's): its group holds nothing...
    assert owners.claim(LEG0, pages(4, 5, 6), 3, group=9) == "page 5 already held by room 17 gen 2"
    assert owners.holder(4) is None
    # ...so a later leg naming the same pages claims them afresh and is refused the same way,
    # rather than joining a claim that never was.
    assert owners.claim(LEG1, pages(4, 5, 6), -1, group=9) == (
        "page 5 already held by room 17 gen 2"
    )
    assert LEG1 not in owners
    assert owners.holder(4) is None
    assert owners.held_pages == 1


def test_a_dummy_leg_can_create_a_group_and_the_pages_of_the_next_leg_count() -> None:
    # A dummy leg first (it names nothing) and a KV leg after it: whichever leg is applied
    # first, the request's pages are held once the leg that names them is in.
    owners = DestinationOwners()
    owners.claim(B, pages(6), 2)
    assert owners.claim(LEG2, b"", -1, group=9) is None
    # Taking them into the dummy's claim is all or nothing like any claim.
    assert owners.claim(LEG0, pages(4, 5, 6), 3, group=9) == "page 6 already held by room 18 gen 3"
    assert owners.claim(LEG0, pages(4, 5), 2, group=9) == "aux row 2 already held by room 18 gen 3"
    assert owners.holder(4) is None
    owners.release(B)
    assert owners.claim(LEG0, pages(4, 5, 6), 3, group=9) is None
    assert owners.holder(5) is not None
    assert owners.held_pages == 3
    assert owners.claim(A, pages(5), 1) is not None
    owners.release(LEG2)
    owners.release(LEG0)
    assert owners.held_pages == 0
    assert owners.holder(5) is None


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


# -- the property test, with legs ------------------------------------------------------------


class _Shared:
    """The model of one claim: its destinations, its first owner and the legs holding it."""

    def __init__(self, owner: RoomKey, pages: list[int], aux: int, state: list[int]) -> None:
        self.owner = owner
        self.pages = pages
        self.aux = aux
        self.state = state
        self.members = {owner}


class GroupedOwnersMachine(RuleBasedStateMachine):
    """Random claims (alone or as legs of a few groups) and releases, in any order; a model of
    plain lists and sets says what must happen."""

    def __init__(self) -> None:
        super().__init__()
        self.owners = DestinationOwners(max_index=64)
        self.claims: list[_Shared] = []
        self.of: dict[RoomKey, _Shared] = {}
        self.groups: dict[int, _Shared] = {}

    def _held(self) -> tuple[dict[int, _Shared], dict[int, _Shared], dict[int, _Shared]]:
        held: tuple[dict[int, _Shared], ...] = ({}, {}, {})
        for claim in self.claims:
            held[0].update(dict.fromkeys(claim.pages, claim))
            if claim.aux >= 0:
                held[1][claim.aux] = claim
            held[2].update(dict.fromkeys(claim.state, claim))
        return held  # type: ignore[return-value]

    @staticmethod
    def _valid(indices: list[int]) -> bool:
        return all(0 <= i < 64 for i in indices) and len(set(indices)) == len(indices)

    @rule(
        key=st.sampled_from(KEYS),
        page_list=st.sampled_from([[], [1, 2], [2, 1], [3], [2, 5], [1, 2, 2], [7, 70]]),
        aux=st.integers(-1, 3),
        state_list=st.sampled_from([[], [1], [2], [1, 1]]),
        group=st.sampled_from([None, 1, 2]),
    )
    def claim(
        self, key: RoomKey, page_list: list[int], aux: int, state_list: list[int], group: int | None
    ) -> None:
        args = (key, pages(*page_list), aux, pages(*state_list), group)
        if key in self.of:
            with pytest.raises(ValueError, match="already holds"):
                self.owners.claim(*args)
            return
        held_pages, held_aux, held_state = self._held()
        shared = self.groups.get(group) if group is not None else None
        state_ok = self._valid(state_list) and not set(state_list) & held_state.keys()
        aux_ok = aux < 0 or aux not in held_aux
        if shared is not None:  # a later leg of a live group: it joins, or is refused
            takes_pages = bool(page_list) and not shared.pages
            ok = (
                (not page_list or page_list == shared.pages or takes_pages)
                and (not takes_pages or self._valid(page_list))
                and not (takes_pages and set(page_list) & held_pages.keys())
                and (aux < 0 or (shared.aux < 0 and aux_ok))
                # A leg names the group's state rows again (its shard of sharded state), or
                # takes them when no leg has.
                and (
                    not state_list or state_list == shared.state or (not shared.state and state_ok)
                )
            )
        else:
            ok = (
                self._valid(page_list)
                and not set(page_list) & held_pages.keys()
                and aux_ok
                and state_ok
            )
        problem = self.owners.claim(*args)
        if not ok:
            assert problem is not None, args
            return
        assert problem is None, (args, problem)
        if shared is None:
            shared = _Shared(key, page_list, aux, state_list)
            self.claims.append(shared)
            if group is not None:
                self.groups[group] = shared
        else:
            shared.members.add(key)
            if page_list and not shared.pages:
                shared.pages = page_list
            if aux >= 0:
                shared.aux = aux
            if state_list:
                shared.state = state_list
        self.of[key] = shared

    @rule(key=st.sampled_from(KEYS))
    def release(self, key: RoomKey) -> None:
        assert self.owners.release(key) == (key in self.of)
        shared = self.of.pop(key, None)
        if shared is None:
            return
        shared.members.discard(key)
        if not shared.members:  # the last leg: everything it held is free
            self.claims.remove(shared)
            self.groups = {g: c for g, c in self.groups.items() if c is not shared}

    @invariant()
    def matches_the_model(self) -> None:
        held = self._held()[0]
        for page in range(8):
            holder = self.owners.holder(page)
            assert (holder is None) == (page not in held), page
            assert holder is None or holder in held[page].members  # a leg that holds it
        assert self.owners.held_pages == len(held)
        assert len(self.owners) == len(self.of)
        for key in KEYS:
            assert (key in self.owners) == (key in self.of)


GroupedOwnersMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None
)
test_grouped_owners_against_a_model = GroupedOwnersMachine.TestCase
