"""What an idle engine costs, before and after it served many rooms.

Two OS processes, a prefill rank and a decode rank (engine, control plane, fenced NIXL data path
over DRAM), serve ``--rooms`` rooms (default 10,000; ``--window`` in flight), of which
``--abort-rate`` (default 20%) are aborted: half of those by decode before it sends its page list
(the case that used to leave a room bound on decode's link for ever and spin its progress loop),
half by decode after it. Then both sit idle, and for ``--idle`` seconds each reports:

* ``cpu_s_per_s``: process CPU time per wall second while idle (all threads: loop, pump, poster,
  progress loop);
* ``entries``: what the control plane's routing core still keeps per room (all 0 means nothing
  leaked), and the engine's live rooms;
* ``rss_mb``.

The same idle measurement is taken before any room, in the same processes: the ratio
``after / before`` is the cost that serving rooms left behind (1.0: none).

Run: ``python benchmarks/idle.py`` (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from _rank import start_rank  # benchmarks/ is the script's directory: on sys.path

from kvfsm._child import ChildProcess
from kvfsm.control import ChannelConfig, ControlPlane
from kvfsm.rooms import ReceiverRoom, RoomEngine, SenderRoom
from kvfsm.states import TERMINAL, KVPoll
from kvfsm.workload.buffers import Shape

SHAPE = Shape(layers=2, num_pages=4096, page_bytes=1024, aux_rows=512, aux_row_bytes=64)
PAGES_PER_ROOM = 4
CHANNEL = ChannelConfig()


def _rss_mb() -> float:
    """Resident memory now (not the peak): pages in /proc/self/statm times the page size."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1])
    return round(resident * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _idle(engine: RoomEngine, control: ControlPlane, seconds: float) -> dict[str, Any]:
    cpu0, t0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0

    async def entries() -> dict[str, int]:
        return control.entries()

    return {
        "cpu_s_per_s": round(cpu / wall, 4),
        "entries": engine.call(entries()),
        "live_rooms": engine.stats()["live"],
        "rss_mb": _rss_mb(),
    }


def _prefill(conn: Connection, rooms: int, window: int) -> None:
    rank = start_rank(SHAPE, CHANNEL, name="idle-prefill")
    engine, control = rank.engine, rank.control
    conn.send(control.port)
    conn.send(_idle(engine, control, conn.recv()[1]))  # ("idle", seconds)
    conn.recv()  # ("serve",)
    live: dict[int, SenderRoom] = {}
    sent: set[int] = set()
    next_room = 0
    while next_room < rooms or live:
        while next_room < rooms and len(live) < window:
            live[next_room] = engine.sender(next_room)
            next_room += 1
        for room, sender in list(live.items()):
            state = sender.poll()
            if state is KVPoll.WaitingForInput and room not in sent:
                slot = room % (SHAPE.num_pages // PAGES_PER_ROOM)
                sender.init(PAGES_PER_ROOM, room % SHAPE.aux_rows)
                sender.send(np.arange(slot * PAGES_PER_ROOM, (slot + 1) * PAGES_PER_ROOM))
                sent.add(room)
            elif state in TERMINAL and sender.settled:
                del live[room]
                sent.discard(room)
        time.sleep(0.0002)
    conn.send("done")
    conn.send(_idle(engine, control, conn.recv()[1]))
    conn.recv()  # ("quit",)
    rank.close()


def _decode(conn: Connection, port: int, rooms: int, window: int, abort_rate: float) -> None:
    rank = start_rank(SHAPE, CHANNEL, name="idle-decode", port=port)
    engine, control = rank.engine, rank.control
    conn.send(True)
    conn.send(_idle(engine, control, conn.recv()[1]))
    conn.recv()  # ("serve",)
    rng = random.Random(1)
    live: dict[int, tuple[ReceiverRoom, str]] = {}
    next_room, outcomes = 0, {"succeeded": 0, "failed": 0}
    reasons: dict[str, int] = {}
    while next_room < rooms or live:
        while next_room < rooms and len(live) < window:
            receiver = engine.receiver(next_room)
            receiver.init(0)
            draw = rng.random()
            plan = "early" if draw < abort_rate / 2 else "late" if draw < abort_rate else "ok"
            live[next_room] = (receiver, plan)
            next_room += 1
        for room, (receiver, plan) in list(live.items()):
            state = receiver.poll()
            if state is KVPoll.WaitingForInput and plan != "sent":
                live[room] = (receiver, "sent" if plan == "ok" else plan)
                if plan == "early":
                    receiver.abort("aborted before the page list")
                    continue
                slot = room % (SHAPE.num_pages // PAGES_PER_ROOM)
                pages = np.arange(slot * PAGES_PER_ROOM, (slot + 1) * PAGES_PER_ROOM)
                receiver.send_metadata(pages, room % SHAPE.aux_rows)
                if plan == "late":
                    receiver.abort("aborted after the page list")
                    live[room] = (receiver, "late-sent")
            elif state in TERMINAL and receiver.settled:
                if state is KVPoll.Success:
                    outcomes["succeeded"] += 1
                else:
                    why = receiver.reason[:60]
                    reasons[why] = reasons.get(why, 0) + 1
                    outcomes["failed"] += 1
                del live[room]
        time.sleep(0.0002)
    conn.send({**outcomes, "failed_by_reason": reasons})
    conn.send(_idle(engine, control, conn.recv()[1]))
    conn.recv()  # ("quit",)
    rank.close()


def _both(ranks: dict[str, ChildProcess], request: tuple[Any, ...], timeout: float) -> Any:
    """Ask both ranks at once (each answers when it is done) and collect the answers."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = {
            name: pool.submit(rank.ask, *request, timeout=timeout) for name, rank in ranks.items()
        }
        return {name: future.result() for name, future in futures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rooms", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--abort-rate", type=float, default=0.2)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of each idle window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # NIXL's Python logger prints INFO lines to stdout, which would break --json; the rank
    # processes inherit this. Set NIXL_LOG_LEVEL yourself to see them.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    prefill = ChildProcess(_prefill, args.rooms, args.window, what="prefill")
    decode = ChildProcess(
        _decode, prefill.greeting, args.rooms, args.window, args.abort_rate, what="decode"
    )
    ranks = {"prefill": prefill, "decode": decode}
    try:
        before = _both(ranks, ("idle", args.idle), args.idle + 30)
        t0 = time.monotonic()
        outcomes = _both(ranks, ("serve",), 3600)["decode"]
        served_s = time.monotonic() - t0
        after = _both(ranks, ("idle", args.idle), args.idle + 30)
    finally:
        decode.close()
        prefill.close()
    report: dict[str, Any] = {
        "rooms": args.rooms,
        "abort_rate": args.abort_rate,
        "served_s": round(served_s, 2),
        "decode_outcomes": outcomes,
        "before": before,
        "after": after,
        "ratio_after_before": {
            side: round(after[side]["cpu_s_per_s"] / max(before[side]["cpu_s_per_s"], 1e-4), 2)
            for side in ("prefill", "decode")
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.rooms} rooms ({args.abort_rate:.0%} aborted) in {served_s:.1f} s: {outcomes}")
        for side in ("prefill", "decode"):
            b, a = before[side], after[side]
            print(
                f"{side:8s} idle CPU {b['cpu_s_per_s']:.4f} -> {a['cpu_s_per_s']:.4f} s/s "
                f"(x{report['ratio_after_before'][side]}), entries after {a['entries']}, "
                f"live rooms {a['live_rooms']}, RSS {b['rss_mb']} -> {a['rss_mb']} MB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
