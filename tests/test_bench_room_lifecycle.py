"""benchmarks/room_lifecycle.py at toy sizes: every row, the runtime ablation included, comes from
rooms that all completed and were all reaped (a benchmark that stopped measuring what it says
would otherwise still print figures)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.bench import run_benchmark


@pytest.mark.slow
def test_every_engine_row_completes_every_pair_and_reports() -> None:
    code = (
        "import json, room_lifecycle as rl\n"
        "from kvfsm.rooms import _registry\n"
        "from kvfsm.rooms._scheduler import RoomScheduler\n"
        "from kvfsm.rooms._deadlines import DeadlineQueue\n"
        "rows = {}\n"
        "rows['engine'] = rl.engine_lifecycles(300, 16)\n"
        "rows['no_recorder'] = rl.engine_lifecycles(300, 16, recorder=False)\n"
        "with rl.ablated_runtime(rl._TaskPerRoom, DeadlineQueue):\n"
        "    rows['task'] = rl.engine_lifecycles(300, 16)\n"
        "with rl.ablated_runtime(RoomScheduler, rl._TimerPerDeadline):\n"
        "    rows['timer'] = rl.engine_lifecycles(300, 16)\n"
        "rows['restored'] = [_registry.RoomScheduler is RoomScheduler,"
        " _registry.DeadlineQueue is DeadlineQueue]\n"
        "rows['timeline_bytes'] = rl.full_timeline_bytes(10, 100)\n"
        "print(json.dumps(rows))\n"
    )
    proc = run_benchmark("room_lifecycle.py", code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows.pop("restored") == [True, True]
    assert rows.pop("timeline_bytes") > 0  # the recorder's memory figure measures something
    for name, row in rows.items():
        assert row["rooms"] == 300, name
        assert row["failed"] == 0, name
        assert row["live_after"] == 0, name  # every room reaped: nothing left on the loop
        assert row["cpu_us_per_room"] > 0, name
