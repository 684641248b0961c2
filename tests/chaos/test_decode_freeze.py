"""A long freeze of the *decode* rank (``decode_freeze_rate``): decode SIGSTOPped past its settle
bound while prefill has chunks in flight to it, then SIGCONT.

Over UCX's TCP transport the bytes of those WRITEs wait in sockets and UCX's buffers while
decode is stopped (decode's own UCX worker is what applies them), and land after it wakes,
maybe after decode declared their pages free: law 4. After the freeze no room may still wait
because of it (law 3), and the pair must go on serving rooms. The first tests drive the
campaign's own scheduling and the decode rank's page hold without processes; the slow ones run
the production campaign with every other fault off and one freeze per episode, over ``tcp``
and over UCX's default transports, for 10 and for 60 s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing import Pipe
from typing import Any, cast

import numpy as np
import pytest

from kvfsm._child import ChildProcess
from kvfsm.chaos._campaign import _Campaign, run_campaign
from kvfsm.chaos._options import CampaignOptions, RoomPlan
from kvfsm.chaos._plan import ControlRates, TransferRates
from kvfsm.chaos._rank import _CANARY, _Live, _Rank
from kvfsm.states import KVPoll
from kvfsm.workload.loop import Phase
from tests.helpers.waiting import wait_until_sync

# -- scheduling, without processes ---------------------------------------------------------


def test_decode_freezes_are_planned_from_their_own_stream() -> None:
    """One decode freeze per episode at rate 1, due in the first half of the span, its length
    in the range; every other fault of the seed is planned exactly as without it (its draws
    come from a stream of their own, three an episode whatever the rate)."""
    base = CampaignOptions(seed=11, decode_freeze_rate=0.0, decode_freeze_s=(5.0, 9.0))
    on, off = _Campaign(dataclasses.replace(base, decode_freeze_rate=1.0)), _Campaign(base)
    span = on.span()
    lengths = []
    for index in range(40):
        planned, plain = on.actions(index, span), off.actions(index, span)
        freezes = [a for a in planned if a[1] == "decode_freeze"]
        assert len(freezes) == 1
        assert 0.0 <= freezes[0][0] <= 0.5 * span
        assert freezes[0][2] == "decode"
        assert [a for a in planned if a[1] != "decode_freeze"] == plain
        assert 5.0 <= on.decode_freeze_len <= 9.0
        assert on.decode_freeze_len == off.decode_freeze_len  # drawn whatever the rate
        lengths.append(on.decode_freeze_len)
    assert len(set(lengths)) == len(lengths)  # seeded, not fixed
    sometimes = _Campaign(dataclasses.replace(base, decode_freeze_rate=0.2))
    made = sum(any(a[1] == "decode_freeze" for a in sometimes.actions(i, span)) for i in range(400))
    assert 50 <= made <= 110


class _StandIn:
    """A rank for ``_Campaign``'s actions: a real process to stop, canned answers."""

    def __init__(self, pid: int, answers: dict[str, Any]) -> None:
        self.pid = pid
        self.answers = answers
        self.asked: list[tuple[Any, ...]] = []

    def ask(self, *request: Any, timeout: float = 30.0) -> Any:
        self.asked.append(request)
        assert timeout >= 30.0
        return self.answers[request[0]]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.fixture
def sleeper() -> Iterator[int]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process.pid
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("in_flight", "exposed", "ended", "frozen"),
    [
        (0, 8, 0.2, False),  # no chunk in flight yet: wait
        (3, 2, 0.2, False),  # chunks, but few decode rooms they could be written to: wait
        (3, 6, 0.2, True),
        (0, 0, 0.6, True),  # 60% of the rooms ended: now or never
    ],
)
def test_a_decode_freeze_waits_for_writes_it_can_catch(
    sleeper: int, in_flight: int, exposed: int, ended: float, frozen: bool
) -> None:
    campaign = _Campaign(CampaignOptions(seed=1, decode_freeze_s=(10.0, 10.0)))
    campaign.decode_freeze_len = 10.0
    campaign.ended = ended
    decode = _StandIn(sleeper, {"exposed": exposed})
    prefill = _StandIn(os.getpid(), {"exposed": in_flight})
    ranks = cast("dict[str, ChildProcess]", {"decode": decode, "prefill": prefill})
    stopped: dict[str, float] = {}
    retry = campaign._act("decode_freeze", "decode", 0, ranks, stopped, set())
    # Asked right before the stop, prefill first: it answers once it has chunks in flight
    # (within 0.2 s while the freeze may still wait), then decode, then the stop.
    assert prefill.asked == [("exposed", 0.2 if ended < 0.6 else 0.0)]
    assert decode.asked == [("exposed", 0.0)]
    tally = campaign.tally
    if not frozen:
        assert retry is not None
        assert retry - time.monotonic() < 0.1
        assert not stopped
        assert not tally.decode_freezes
        assert _state(sleeper) != "T"
        return
    assert retry is None
    wait_until_sync(lambda: _state(sleeper) == "T", timeout=10)
    assert stopped["decode"] - time.monotonic() == pytest.approx(10.0, abs=1.0)
    assert campaign.decode_frozen
    assert tally.decode_freezes == [10.0]
    assert tally.decode_freezes_in_flight == (in_flight > 0)
    assert (tally.decode_freeze_chunks, tally.decode_freeze_exposed) == (in_flight, exposed)
    assert tally.faults["decode_freeze"] == 1
    # Past the silence limit: prefill's rooms bound to decode must fail on the lost link.
    assert [role for _, role in campaign.losses] == ["decode"]


def test_a_decode_freeze_waits_for_a_stopped_rank() -> None:
    campaign = _Campaign(CampaignOptions(seed=1))
    stopped = {"prefill": time.monotonic() + 1.5}
    ranks = cast("dict[str, ChildProcess]", {"decode": None, "prefill": None})
    assert campaign._act("decode_freeze", "decode", 0, ranks, stopped, set()) == stopped["prefill"]
    assert not campaign.tally.decode_freezes


def test_the_check_after_a_resume_counts_the_rooms_still_waiting() -> None:
    campaign = _Campaign(CampaignOptions(seed=1, after_resume_s=5.0))
    resumed = time.monotonic() - 6.0
    waiting = [{"room": 7, "gen": 0, "state": "Bootstrapping", "phase": "BOOTSTRAP"}]
    prefill = _StandIn(0, {"waiting": waiting})
    decode = _StandIn(0, {"waiting": []})
    ranks = cast("dict[str, ChildProcess]", {"decode": decode, "prefill": prefill})
    # A prefill stop ended a second ago: its rooms get their own 5 s after it.
    campaign.disrupted_until = time.monotonic() - 1.0
    due = campaign._act("after_resume", repr(resumed), 0, ranks, {}, set())
    assert due == pytest.approx(campaign.disrupted_until + 5.0)
    assert not prefill.asked
    assert campaign.tally.resume_checks == 0
    campaign.disrupted_until = 0.0
    assert campaign._act("after_resume", repr(resumed), 0, ranks, {}, set()) is None
    assert prefill.asked == decode.asked == [("waiting", resumed)]
    tally = campaign.tally
    assert (tally.resume_checks, tally.waiting_after_resume) == (1, 1)
    assert len(tally.violations) == 1
    assert "prefill room 7 still Bootstrapping" in tally.violations[0]
    # A killed rank is not asked.
    campaign._act("after_resume", repr(resumed), 0, ranks, {}, {"prefill"})
    assert len(prefill.asked) == 1
    assert len(decode.asked) == 2


# -- decode's page hold, without NIXL ------------------------------------------------------


class _Room:
    def __init__(self, status: KVPoll) -> None:
        self.status = status

    def poll(self) -> KVPoll:
        return self.status


def _decode_rank(**changes: Any) -> _Rank:
    opts = CampaignOptions(seed=2, num_pages=64, max_room_pages=4, concurrency=2, **changes)
    conn, _ = Pipe()
    rank = _Rank(conn, "decode", opts, "")
    rank.decode_pages(1)
    return rank


def _room(rank: _Rank, room: int, pages: list[int], aux: int, *, started: float = 0.0) -> _Live:
    plan = RoomPlan(room, tuple(range(len(pages))), 0, (), "", 0)
    item = _Live(
        room=cast("Any", _Room(KVPoll.Transferring)),
        started=started,
        plan=plan,
        dst=np.asarray(pages, np.int32),
        dst_aux=aux,
    )
    item.stopped_at_start = rank.stopped_s
    return item


def test_pages_of_a_room_that_lived_through_a_stop_are_held_and_checked_again() -> None:
    rank = _decode_rank(after_resume_s=5.0)
    checks = rank.checks
    assert checks is not None
    first, second = rank.take_pages(1), rank.take_pages(2)
    assert first is not None
    assert second is not None
    plain = _room(rank, 1, [int(p) for p in first[0]], int(first[1][0]))
    lived = _room(rank, 2, [int(p) for p in second[0]], int(second[1][0]))
    rank.stopped_s += 12.0  # this process was stopped while both were live...
    plain.stopped_at_start = rank.stopped_s  # ... but the first joined after it
    rank.now = 100.0
    free = len(rank.pages)
    rank.release_pages(plain)
    assert len(rank.pages) == free + 1  # back at once
    rank.release_pages(lived)
    assert len(rank.pages) == free + 1  # held: not handed out
    assert [h.room for h in rank.held] == [2]
    assert rank.holds["rooms"] == 1
    assert rank.holds["pages"] == 2
    page = int(lived.dst[0]) if lived.dst is not None else -1
    assert (rank.kv[0][page] == _CANARY).all()  # canaried when freed
    rank.kv[1][page, 17] ^= 0xFF  # a WRITE queued before the stop lands now
    rank.now = 104.9
    rank.iterated()
    assert rank.held
    assert checks.late_writes == 0
    rank.now = 105.0
    rank.iterated()
    assert not rank.held
    assert checks.late_writes == 1 == rank.holds["late_writes"]
    assert f"page {page} changed after room 2 settled" in checks.late_notes[0]
    assert len(rank.pages) == free + 3
    assert len(rank.aux_pool) == rank.aux_pool.size


def test_held_pages_go_back_early_rather_than_starve_the_plan() -> None:
    rank = _decode_rank()
    everything = rank.take_pages(len(rank.pages))
    assert everything is not None
    item = _room(rank, 3, [int(p) for p in everything[0]], int(everything[1][0]))
    rank.stopped_s += 5.0
    rank.release_pages(item)
    assert len(rank.pages) == 0
    assert rank.held
    rank.live = [_room(rank, 4, [], 0)]
    assert rank.take_pages(2) is None  # a live room will free pages: wait for them
    assert rank.held
    rank.live = []
    assert rank.take_pages(2) is not None  # nothing live: checked and given back now
    assert not rank.held
    assert rank.holds["released_early"] == 1


def test_waiting_lists_rooms_created_before_the_resume_that_are_not_terminal() -> None:
    rank = _decode_rank()
    old, ended = _room(rank, 5, [], 0, started=1.0), _room(rank, 6, [], 0, started=1.0)
    young = _room(rank, 7, [], 0, started=9.0)
    cast("_Room", ended.room).status = KVPoll.Failed  # terminal, not yet stepped by the loop
    settling = _room(rank, 8, [], 0, started=1.0)
    settling.phase = Phase.SETTLING
    rank.live = [old, ended, young, settling]
    waiting = rank._waiting(5.0)
    assert [(w["room"], w["state"], w["phase"]) for w in waiting] == [
        (5, "Transferring", "BOOTSTRAP")
    ]


# -- the campaign --------------------------------------------------------------------------

#: What reproduced the late writes: rooms of up to 64 pages of 16 KiB in each of 4 buffers
#: (4 MiB), cut in up to 4 chunks, 8 in flight; every other fault off.
_BIG_ROOMS: dict[str, Any] = {
    "concurrency": 8,
    "page_bytes": 16384,
    "max_room_pages": 64,
    "max_chunks": 4,
    "abort_rate": 0.0,
    "transfer": TransferRates(),
    "control": ControlRates(),
    "sigstop_rate": 0.0,
    "sigkill_rate": 0.0,
    "registry_restart_rate": 0.0,
    "long_freeze_rate": 0.0,
    "reuse_rate": 0.0,
    "oversized_rate": 0.0,
    "hostile_per_episode": 0,
    "decode_freeze_rate": 1.0,
}


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """What a failure shows: the numbers of the fault, and the first violations."""
    return {
        "late_writes": report["late_writes"],
        "decode_freezes": report["decode_freezes"],
        "failed_by_reason": report["failed_by_reason"],
        "unsettled": report["unsettled"],
        "wedged": report["wedged"],
        "liveness": report["liveness"],
        "transport": report["transport"],
        "ucx": report["ucx"],
        "violations": report["violations"][:12],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("transport", "freeze_s", "seed", "episodes", "rooms"),
    [
        # Two episodes over TCP: whether the queued bytes land before or after decode frees
        # their pages on waking is a race between its loop and its UCX worker, so each
        # freeze is a chance (before the fix, about 6 episodes in 10 showed late writes).
        pytest.param("tcp", 10.0, 3, 2, 96, id="tcp-10s"),
        # Over UCX's default transports many WRITEs finish inside transfer() (shared memory,
        # prefill's own copy), stopped decode or not: chunks are in flight for moments, and
        # the freeze may wait seconds for one (more rooms end before it). Larger ones wait
        # for decode as over TCP (fence_probe --probes flush).
        # Rooms enough that some are left however long that wait (a loaded machine: seconds).
        pytest.param("default", 10.0, 13, 1, 256, id="default-10s"),
        # While decode is frozen prefill runs on through the plan, failing up to 4 rooms a
        # second (16 in flight, a 4 s Bootstrapping deadline; 134 to 240 in a minute were
        # seen): the rest are served after the freeze, whose seeds make it due at once.
        pytest.param("tcp", 60.0, 3, 1, 360, id="tcp-60s", marks=pytest.mark.timeout(300)),
        pytest.param("default", 60.0, 13, 1, 520, id="default-60s", marks=pytest.mark.timeout(300)),
    ],
)
def test_a_decode_frozen_with_writes_in_flight(
    transport: str, freeze_s: float, seed: int, episodes: int, rooms: int
) -> None:
    opts = CampaignOptions(
        seed=seed,
        episodes=episodes,
        rooms=rooms,
        transport=transport,
        decode_freeze_s=(freeze_s, freeze_s),
        **_BIG_ROOMS,
    )
    report = run_campaign(opts)
    summary = _summary(report)
    print("decode freeze:", summary)
    assert report["ucx"] == {
        "transport": transport,
        "UCX_TLS": "tcp" if transport == "tcp" else os.environ.get("UCX_TLS"),
    }
    freezes = report["decode_freezes"]
    # Exactly the planned freezes, each caught prefill with chunks in flight to decode rooms
    # whose page lists were out (the campaign waits for such a moment), and was checked on.
    assert freezes["count"] == episodes == report["faults"]["decode_freeze"], summary
    assert freezes["min_s"] == freezes["max_s"] == freeze_s
    assert freezes["with_chunks_in_flight"] == episodes, summary
    assert freezes["rooms_exposed"] >= 4 * episodes, summary
    assert freezes["checks_after_resume"] == episodes, summary
    # The pages of the rooms that lived through it were held back and checked again later.
    assert freezes["rooms_held"] >= 1, summary
    # Law 4: no byte landed in pages decode had declared free.
    assert report["late_writes"] == 0, summary
    # Law 3: nothing still waiting because of the freeze, 5 s after it.
    assert freezes["waiting_after_resume"] == 0, summary
    # The pair goes on serving rooms: a room prefill created right after decode woke may
    # still reach its Bootstrapping deadline before decode, going through the ids prefill
    # failed meanwhile, catches up to it; nearly all must succeed.
    assert freezes["later_rooms"] >= 16, summary
    assert freezes["later_rooms_succeeded"] >= 0.9 * freezes["later_rooms"], summary
    assert report["violations"] == [], summary
    assert report["wedged"] == report["mismatched_bytes"] == report["slow_calls"] == 0
    assert report["unsettled"] == {}, summary
    assert set(report["leaks"].values()) == {0}, report["leaks"]
    assert report["liveness"]["max_s"] <= report["liveness"]["bound_s"]


def _ended(reason: str, started: float, ended: float) -> dict[str, Any]:
    return {
        "status": KVPoll.Failed,
        "mismatched": 0,
        "reason": reason,
        "started_at": started,
        "ended_at": ended,
    }


def test_a_prefill_room_left_to_its_deadline_after_decode_lost_the_link_is_a_violation() -> None:
    """Decode's room ended with its link lost during the freeze; prefill's of the same id then
    waited out Bootstrapping well past the liveness bound: prefill was not told (a violation).
    A decode room that never reached a link (its prefill rank unreachable) does not count."""
    campaign = _Campaign(CampaignOptions(seed=1))
    campaign.freezes = [(10.0, 20.0)]
    plans = [
        cast("RoomPlan", dataclasses.make_dataclass("P", ["room"])(room)) for room in (1, 2, 3)
    ]
    bootstrapping = "deadline expired: Bootstrapping for more than 4s"
    outcomes = {
        "decode": {
            (1, 0): _ended("peer lost: connection to prefill-0-7 closed: ", 9.0, 20.1),
            (2, 0): _ended("peer lost: cannot reach prefill rank 0: EndOfStream", 9.0, 20.1),
            (3, 0): _ended("peer lost: connection to prefill-0-7 closed: ", 9.0, 20.1),
        },
        "prefill": {
            (1, 0): _ended(bootstrapping, 19.0, 26.0),  # 5.9 s after: untold
            (2, 0): _ended(bootstrapping, 19.0, 26.0),  # never claimed: by design
            (3, 0): _ended(bootstrapping, 19.0, 22.0),  # within the bound
        },
    }
    campaign._after_freezes(plans, outcomes)
    assert campaign.tally.untold == 1
    assert campaign.tally.untold_max_s == pytest.approx(5.9)
    assert campaign.tally.violations == [
        "room 1: prefill waited out Bootstrapping 5.90s after decode's room ended"
    ]
