"""What a room costs: the actor runtime against a bare dict-table FSM, in one run.

Measured here, side by side:

* floor   - the same sender + receiver event sequence applied to a bare dict-table FSM (the
            tables of kvfsm.states, one lookup and one store per event): no actor, no
            transitions, no bookkeeping. The cheapest thing that could be called a room.
* core    - the same sequence through ``RoomCore``: state changes along the dispatch compiled
            from the shared per-role ``transitions`` machines (``kvfsm.rooms._machine``), plus
            the ledger and payload checks. No loop.
* engine  - full lifecycles through the real engine: a caller thread drives sender and
            receiver facades like SGLang's scheduler (create, init, poll, send_metadata, send,
            poll, clear) while the loop thread runs one task per room; the null transport
            (``LoopbackSink``) completes chunks on the next loop iteration and routes control
            messages between the pair. CPU is process CPU (both threads) per room pair.
* ablation - core and engine again with every state change fired through ``transitions``'
            own ``Event.trigger`` on the built machine (the room as the model), as kvfsm did
            before the compiled dispatch: what the dispatch saves. Same edges, same checks.
* runtime ablation - the engine again with each room's task run by an ``asyncio.Task`` of its
            own (a Future per wait: before ``RoomScheduler``), and again with a loop timer per
            deadline (``call_at``/``cancel``: before ``DeadlineQueue``). What each saves.
* poll()  - median cost of one facade ``poll()`` from the caller thread.
* memory  - bytes per live room with 10,000 rooms parked in Bootstrapping (task, mailbox,
            deadline timer, publication, facade), from tracemalloc and from RSS.
* flight recorder - what each room's timeline costs (targets: 3 us of CPU per room, 2 KiB per
            live room). CPU: pairs driven through the registry on one thread (the loop's
            thread alone: no caller thread whose GIL hand-offs blur a difference of a few
            microseconds), with and without ``RoomConfig(flight_recorder=False)``,
            interleaved, the median of the paired differences; and the engine rows again
            without it. Bytes: the memory figure again without it, and one timeline at its
            fullest (a long room, compacted).

Run: ``python benchmarks/room_lifecycle.py`` (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfsm.rooms import RoomConfig, RoomCore, RoomEngine
from kvfsm.rooms import _registry as registry_module
from kvfsm.rooms._deadlines import DeadlineQueue, Entry
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._machine import MACHINES
from kvfsm.rooms._ports import Publication, RoomKey
from kvfsm.rooms._registry import Registry
from kvfsm.rooms._scheduler import RoomScheduler
from kvfsm.rooms._timeline import ENCODERS, SLOTS, compact, new_timeline
from kvfsm.states import (
    TABLES,
    TERMINAL,
    ChunkDone,
    ChunkSubmitted,
    DestinationReceived,
    Event,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerResolved,
    PostChunk,
    Role,
    TransferCompleted,
    TransferConfirmed,
)

TARGETS = {"poll_ns_median": 1000.0, "cpu_us_per_room": 60.0, "bytes_per_live_room": 32768.0}
#: What the flight recorder may cost: CPU per room (a pair is two rooms) and bytes per live room.
RECORDER_TARGETS = {"cpu_us_per_room": 3.0, "bytes_per_live_room": 2048.0}

PAGES = np.arange(100, 104, dtype=np.int32)
PACKED = PAGES.tobytes()
SENDER_EVENTS: list[Event] = [
    DestinationReceived(PACKED, 3),
    Initialized(num_pages=4, aux_index=1),
    ChunkSubmitted(PACKED),
    ChunkDone(0),
]
RECEIVER_EVENTS: list[Event] = [
    Initialized(peer_rank=0),
    PeerResolved(0),
    MetadataSubmitted(PACKED, 3),
    TransferConfirmed(0),
]


def best_of(runs: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(runs))


# -- floor and core (no loop) ------------------------------------------------------------------


class _FloorRoom:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = KVPoll.Bootstrapping


def floor_us_per_room(n: int) -> float:
    sender_table, receiver_table = TABLES[Role.SENDER], TABLES[Role.RECEIVER]
    # The floor must also complete the transfer: it applies the derived event explicitly.
    sender_events = [*SENDER_EVENTS, TransferCompleted()]
    receiver_events = [*RECEIVER_EVENTS, TransferCompleted()]

    def run() -> float:
        start = time.process_time()
        for _ in range(n):
            s, r = _FloorRoom(), _FloorRoom()
            for event in sender_events:
                s.state = sender_table[s.state][type(event)]
            for event in receiver_events:
                r.state = receiver_table[r.state][type(event)]
            assert s.state is KVPoll.Success
            assert r.state is KVPoll.Success
        return (time.process_time() - start) / n * 1e6

    return best_of(3, run)


def core_us_per_room(n: int) -> float:
    def run() -> float:
        start = time.process_time()
        for _ in range(n):
            s, r = RoomCore(Role.SENDER), RoomCore(Role.RECEIVER)
            for event in SENDER_EVENTS:
                s.handle(event)
            for event in RECEIVER_EVENTS:
                r.handle(event)
            assert s.state is KVPoll.Success
            assert r.state is KVPoll.Success
        return (time.process_time() - start) / n * 1e6

    return best_of(3, run)


# -- the engine ----------------------------------------------------------------------------------


def _loop_thread_time(engine: RoomEngine) -> float:
    async def read() -> float:
        return time.thread_time()

    return float(engine.call(read()))


@contextlib.contextmanager
def firing_transitions() -> Any:
    """Ablation: fire each state change through ``transitions``' ``Event.trigger`` on the built
    machine, the room as the model (what kvfsm did before the compiled dispatch). Self-edges
    are not fired, as then."""
    original = RoomCore._fire

    def fire(self: RoomCore, event: Event, dest: KVPoll) -> None:
        if dest is not self.state:
            MACHINES[self.role].events[type(event).__name__].trigger(self)
            assert self.state is dest

    RoomCore._fire = fire  # type: ignore[method-assign]
    try:
        yield
    finally:
        RoomCore._fire = original  # type: ignore[method-assign]


class _TaskPerRoom(RoomScheduler):
    """Ablation: each room's task run by an ``asyncio.Task`` of its own, waiting on a Future
    between events (what kvfsm did before its run queue). The same room coroutine, the same
    wake-ups: only what resumes it differs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._waits: dict[int, asyncio.Future[None]] = {}

    def start(self, room: Any) -> None:
        room.coro = room.run()
        room.suspended = False
        name = f"kvfsm-{room.role.value}-{room.key.room}-{room.key.generation}"
        self._loop.create_task(self._drive(room), name=name)

    async def _drive(self, room: Any) -> None:
        coro = room.coro
        while True:
            try:
                coro.send(None)
            except StopIteration:
                room.coro = None
                return
            wait = self._waits[id(room)] = self._loop.create_future()
            room.suspended = True
            await wait

    def wake(self, room: Any) -> None:
        if room.suspended:
            room.suspended = False
            self._waits.pop(id(room)).set_result(None)


class _TimerPerDeadline(DeadlineQueue):
    """Ablation: a loop timer per armed deadline (``call_at``, then ``cancel``), as before
    the deadline queue."""

    def arm(self, when: float, callback: Callable[[], None]) -> Entry:
        return [when, 0, callback, self._loop.call_at(when, callback)]

    def cancel(self, entry: Entry) -> None:
        if entry[2] is not None:
            entry[2] = None
            entry[3].cancel()


@contextlib.contextmanager
def ablated_runtime(scheduler: type[RoomScheduler], deadlines: type[DeadlineQueue]) -> Any:
    """Engines built inside use these for their rooms' tasks and deadlines."""
    saved = {name: getattr(registry_module, name) for name in ("RoomScheduler", "DeadlineQueue")}
    setattr(registry_module, "RoomScheduler", scheduler)  # noqa: B010 (a module's global)
    setattr(registry_module, "DeadlineQueue", deadlines)  # noqa: B010
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(registry_module, name, value)


def engine_lifecycles(n: int, concurrency: int, *, recorder: bool = True) -> dict[str, float]:
    """Drive ``n`` sender+receiver pairs through one engine, ``concurrency`` in flight
    (``recorder``: with each room's flight recorder)."""
    with RoomEngine(LoopbackSink(), RoomConfig(flight_recorder=recorder)) as engine:
        # warm-up: first rooms pay for imports and code-object caches
        _drive(engine, min(n, 500), concurrency, base=10_000_000)
        gc.collect()
        loop_cpu0 = _loop_thread_time(engine)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        failed = _drive(engine, n, concurrency, base=0)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        loop_cpu = _loop_thread_time(engine) - loop_cpu0
        stats = engine.stats()
    return {
        "rooms": n,
        "concurrency": concurrency,
        "failed": failed,
        "rooms_per_s": n / wall,
        "cpu_us_per_room": cpu / n * 1e6,
        "loop_cpu_us_per_room": loop_cpu / n * 1e6,
        "caller_cpu_us_per_room": (cpu - loop_cpu) / n * 1e6,
        "late_events": stats["late_events"],
        "live_after": stats["live"],
    }


def _drive(engine: RoomEngine, n: int, concurrency: int, base: int) -> int:
    """A scheduler-shaped loop: each iteration polls every room in flight and advances the
    ones that are ready; it yields the CPU briefly when nothing moved (like a GPU step)."""
    next_id, done, failed = 0, 0, 0
    flight: list[list[Any]] = []  # [stage, sender, receiver]
    while done < n:
        while len(flight) < concurrency and next_id < n:
            sender = engine.sender(base + next_id)
            receiver = engine.receiver(base + next_id)
            receiver.init(0)
            flight.append([0, sender, receiver])
            next_id += 1
        moved = False
        keep: list[list[Any]] = []
        for entry in flight:
            stage, sender, receiver = entry
            if stage == 0 and receiver.poll() is KVPoll.WaitingForInput:
                # Each room its own pages and aux row, as an allocator would (a decode engine
                # refuses a receiver whose destinations another live room holds).
                slot = (receiver.room - base) % (4 * concurrency)
                receiver.send_metadata(PAGES + 4 * slot, slot)
                entry[0] = stage = 1
                moved = True
            if stage == 1 and sender.poll() is KVPoll.WaitingForInput:
                sender.init(4, 1)
                sender.send(PAGES)
                entry[0] = stage = 2
                moved = True
            s, r = sender.poll(), receiver.poll()
            if s in TERMINAL and r in TERMINAL:
                failed += s is KVPoll.Failed or r is KVPoll.Failed
                sender.clear()
                receiver.clear()
                done += 1
                moved = True
                continue
            keep.append(entry)
        flight = keep
        if not moved:
            time.sleep(0)
    return failed


def poll_ns_median(calls: int = 200_000) -> float:
    with RoomEngine(LoopbackSink()) as engine:
        room = engine.sender(1)
        poll = room.poll
        batches = []
        for _ in range(calls // 1000):
            start = time.perf_counter_ns()
            for _ in range(1000):
                poll()
            batches.append((time.perf_counter_ns() - start) / 1000)
        return statistics.median(batches)


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_per_live_room(live: int, *, recorder: bool = True) -> dict[str, float]:
    with RoomEngine(LoopbackSink(), RoomConfig(flight_recorder=recorder)) as engine:
        warm = [engine.sender(10_000_000 + i) for i in range(100)]
        _wait(lambda: engine.stats()["live"] == 100)
        gc.collect()
        tracemalloc.start()
        before, rss0 = tracemalloc.take_snapshot(), _rss_bytes()
        rooms = [engine.sender(i) for i in range(live)]
        _wait(lambda: engine.stats()["live"] == live + 100)
        gc.collect()
        after, rss1 = tracemalloc.take_snapshot(), _rss_bytes()
        tracemalloc.stop()
        traced = sum(s.size_diff for s in after.compare_to(before, "filename"))
        assert all(r.poll() is KVPoll.Bootstrapping for r in rooms)
        del warm
    return {
        "live_rooms": live,
        "bytes_per_live_room": traced / live,
        "rss_bytes_per_live_room": (rss1 - rss0) / live,
    }


def actor_us_per_pair(n: int, *, recorder: bool, batch: int = 64) -> float:
    """CPU per sender+receiver pair driven through a registry on this thread's loop: the room
    tasks, the loopback sink and (with ``recorder``) the flight recorder, nothing else."""

    async def main() -> float:
        registry = Registry(LoopbackSink(), RoomConfig(flight_recorder=recorder))

        async def until(predicate: Callable[[], bool]) -> None:
            # A poll, not an Event: the rooms run as the loop turns, and this is what turns it.
            while not predicate():  # noqa: ASYNC110
                await asyncio.sleep(0)

        def published(pubs: list[Publication], state: KVPoll) -> Callable[[], bool]:
            return lambda: all(p.status is state for p in pubs)

        start = time.process_time()
        for base in range(0, n, batch):
            pairs = []
            for i in range(base, min(n, base + batch)):
                s_pub, r_pub = Publication(), Publication()
                s_key, r_key = RoomKey(i, 2 * i + 1), RoomKey(i, 2 * i + 2)
                registry.spawn(s_key, Role.SENDER, s_pub)
                registry.spawn(r_key, Role.RECEIVER, r_pub)
                registry.deliver(r_key, Initialized(peer_rank=0))
                pairs.append((s_key, s_pub, r_key, r_pub, i % batch))
            await until(published([p[3] for p in pairs], KVPoll.WaitingForInput))
            for _, _, r_key, _, slot in pairs:
                registry.deliver(r_key, MetadataSubmitted((PAGES + 4 * slot).tobytes(), slot))
            await until(published([p[1] for p in pairs], KVPoll.WaitingForInput))
            for s_key, _, _, _, _ in pairs:
                registry.deliver(s_key, Initialized(num_pages=4, aux_index=1))
                registry.deliver(s_key, ChunkSubmitted(PACKED))
            await until(lambda: len(registry) == 0)
        elapsed = time.process_time() - start
        assert registry.stats.succeeded == 2 * n, registry.stats
        await registry.shutdown()
        return elapsed / n * 1e6

    return asyncio.run(main())


def recorder_cpu(n: int, runs: int) -> dict[str, Any]:
    """The flight recorder's CPU per room: ``actor_us_per_pair`` with and without, interleaved."""
    on, off = [], []
    actor_us_per_pair(min(n, 500), recorder=True)  # warm-up
    for _ in range(runs):
        off.append(actor_us_per_pair(n, recorder=False))
        on.append(actor_us_per_pair(n, recorder=True))
    return {
        "actor_us_per_pair_with": statistics.median(on),
        "actor_us_per_pair_without": statistics.median(off),
        "actor_with_all": on,
        "actor_without_all": off,
        # a pair is two rooms
        "cpu_us_per_room": statistics.median(a - b for a, b in zip(on, off, strict=True)) / 2,
    }


def full_timeline_bytes(count: int = 1000, steps: int = 200) -> float:
    """Bytes one timeline holds at its fullest: a room of ``steps`` chunks, each step a time,
    a ``ChunkDone`` kept by reference and a posted chunk encoded as an int, as the actor
    records them (compacted past ``SLOTS``). The largest figure seen over the steps."""
    gc.collect()
    tracemalloc.start()
    worst = 0.0
    timelines = [new_timeline() for _ in range(count)]
    base = tracemalloc.get_traced_memory()[0]
    for i in range(steps):
        for timeline in timelines:
            if len(timeline) >= SLOTS:
                compact(timeline)
            timeline.append(time.monotonic())
            timeline.append(ChunkDone(i))
            timeline.append(ENCODERS[PostChunk](PostChunk(i, PACKED, PACKED, False)))
        worst = max(worst, tracemalloc.get_traced_memory()[0] - base)
    tracemalloc.stop()
    del timelines
    return worst / count


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark rooms did not reach the expected state")
        time.sleep(0.001)


# -- report ----------------------------------------------------------------------------------------


def run(rooms: int, concurrency: int, live: int, runs: int = 5) -> dict[str, Any]:
    floor = floor_us_per_room(rooms)
    core = core_us_per_room(rooms)
    # The engine figure is the median of ``runs`` runs, each one compiled-dispatch run then one
    # run firing transitions' trigger (the ablation), interleaved so load hits both alike.
    engines, ablated = [], []
    task_per_room: list[float] = []
    timer_per_deadline: list[float] = []
    no_recorder: list[float] = []
    for _ in range(runs):
        engines.append(engine_lifecycles(rooms, concurrency))
        no_recorder.append(engine_lifecycles(rooms, concurrency, recorder=False)["cpu_us_per_room"])
        with firing_transitions():
            ablated.append(engine_lifecycles(rooms, concurrency)["cpu_us_per_room"])
        with ablated_runtime(_TaskPerRoom, DeadlineQueue):
            task_per_room.append(engine_lifecycles(rooms, concurrency)["cpu_us_per_room"])
        with ablated_runtime(RoomScheduler, _TimerPerDeadline):
            timer_per_deadline.append(engine_lifecycles(rooms, concurrency)["cpu_us_per_room"])
    per_room = [e["cpu_us_per_room"] for e in engines]
    engine: dict[str, Any] = dict(
        sorted(engines, key=lambda e: e["cpu_us_per_room"])[len(engines) // 2]
    )
    engine["runs"] = runs
    engine["cpu_us_per_room_all"] = per_room
    with firing_transitions():
        ablation = {
            "core_us_per_room": core_us_per_room(rooms),
            "engine_cpu_us_per_room": statistics.median(ablated),
            "engine_cpu_us_per_room_all": ablated,
        }
    runtime_ablation = {
        "task_per_room_cpu_us_per_room": statistics.median(task_per_room),
        "task_per_room_all": task_per_room,
        "timer_per_deadline_cpu_us_per_room": statistics.median(timer_per_deadline),
        "timer_per_deadline_all": timer_per_deadline,
    }
    poll_ns = poll_ns_median()
    memory = memory_per_live_room(live)
    memory_off = memory_per_live_room(live, recorder=False)
    recorder = {
        **recorder_cpu(rooms, max(runs, 7)),
        "engine_cpu_us_per_pair_without": statistics.median(no_recorder),
        "engine_cpu_us_per_pair_without_all": no_recorder,
        "bytes_per_live_room": memory["bytes_per_live_room"] - memory_off["bytes_per_live_room"],
        "bytes_per_full_timeline": full_timeline_bytes(),
        "targets": RECORDER_TARGETS,
    }
    return {
        "python": sys.version.split()[0],
        "threads": threading.active_count(),
        "floor_us_per_room": floor,
        "core_us_per_room": core,
        "engine": engine,
        "firing_transitions": ablation,
        "runtime_ablation": runtime_ablation,
        "poll_ns_median": poll_ns,
        "memory": memory,
        "flight_recorder": recorder,
        "ratio_engine_to_floor": engine["cpu_us_per_room"] / floor,
        "ratio_core_to_floor": core / floor,
        "targets": TARGETS,
        "meets": {
            "poll_ns_median": poll_ns <= TARGETS["poll_ns_median"],
            "cpu_us_per_room": engine["cpu_us_per_room"] <= TARGETS["cpu_us_per_room"],
            "bytes_per_live_room": memory["bytes_per_live_room"] <= TARGETS["bytes_per_live_room"],
            "recorder_cpu_us_per_room": recorder["cpu_us_per_room"]
            <= RECORDER_TARGETS["cpu_us_per_room"],
            "recorder_bytes_per_live_room": max(
                recorder["bytes_per_live_room"], recorder["bytes_per_full_timeline"]
            )
            <= RECORDER_TARGETS["bytes_per_live_room"],
        },
    }


def print_table(r: dict[str, Any]) -> None:
    e, m, a = r["engine"], r["memory"], r["firing_transitions"]
    fr = r["flight_recorder"]
    t = r["runtime_ablation"]
    rows = [
        ("floor: bare dict-table FSM, sender+receiver", f"{r['floor_us_per_room']:.2f} us CPU", ""),
        (
            "core: RoomCore (compiled dispatch), sender+receiver",
            f"{r['core_us_per_room']:.1f} us CPU",
            f"{r['ratio_core_to_floor']:.0f}x floor",
        ),
        (
            f"engine: full pair lifecycle ({e['concurrency']} in flight, median of {e['runs']})",
            f"{e['cpu_us_per_room']:.1f} us CPU",
            f"{r['ratio_engine_to_floor']:.0f}x floor; target <= {TARGETS['cpu_us_per_room']:.0f}",
        ),
        ("  of which loop thread", f"{e['loop_cpu_us_per_room']:.1f} us CPU", ""),
        (
            "  of which caller thread (facade, polls)",
            f"{e['caller_cpu_us_per_room']:.1f} us CPU",
            "",
        ),
        (
            "ablation: core / engine firing transitions' trigger",
            f"{a['core_us_per_room']:.1f} / {a['engine_cpu_us_per_room']:.1f} us",
            "each state change an Event.trigger (before the dispatch)",
        ),
        (
            "ablation: engine with an asyncio.Task per room",
            f"{t['task_per_room_cpu_us_per_room']:.1f} us CPU",
            "a Future per wait (before the run queue), medians",
        ),
        (
            "ablation: engine with a loop timer per deadline",
            f"{t['timer_per_deadline_cpu_us_per_room']:.1f} us CPU",
            "call_at and cancel (before the deadline queue)",
        ),
        ("engine throughput", f"{e['rooms_per_s']:,.0f} pairs/s", f"{e['rooms']} pairs"),
        (
            "poll() median",
            f"{r['poll_ns_median']:.0f} ns",
            f"target <= {TARGETS['poll_ns_median']:.0f}",
        ),
        (
            f"memory per live room ({m['live_rooms']:,} live)",
            f"{m['bytes_per_live_room'] / 1024:.1f} KiB traced",
            f"{m['rss_bytes_per_live_room'] / 1024:.1f} KiB RSS; target <= 32 KiB",
        ),
        (
            "flight recorder: engine without it (median)",
            f"{fr['engine_cpu_us_per_pair_without']:.1f} us CPU",
            "per pair, RoomConfig(flight_recorder=False)",
        ),
        (
            "flight recorder: pairs on one thread, with / without",
            f"{fr['actor_us_per_pair_with']:.1f} / {fr['actor_us_per_pair_without']:.1f} us",
            "registry + loopback sink, no caller thread (medians)",
        ),
        (
            "flight recorder: CPU per room",
            f"{fr['cpu_us_per_room']:.2f} us CPU",
            f"median paired difference / 2; target <= {RECORDER_TARGETS['cpu_us_per_room']:.0f}",
        ),
        (
            "flight recorder: bytes per live room",
            f"{fr['bytes_per_live_room']:.0f} B",
            f"{fr['bytes_per_full_timeline']:.0f} B at its fullest; target <= 2048",
        ),
    ]
    width = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:>18}  {c}")
    print("meets targets:", ", ".join(f"{k}={v}" for k, v in r["meets"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rooms", type=int, default=20_000, help="pairs per measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="pairs in flight")
    parser.add_argument("--live", type=int, default=10_000, help="rooms for the memory figure")
    parser.add_argument("--runs", type=int, default=5, help="engine runs; the median is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.rooms, args.concurrency, args.live, args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
