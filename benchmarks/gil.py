"""GIL theft: how much of a scheduler-shaped Python loop kvfsm's threads take while they move rooms.

SGLang's scheduler is one Python thread that does CPU work each iteration (batching, sampling
bookkeeping) and calls ``poll()`` on every live room. kvfsm's loop and poster threads live in
the same process and share its GIL: every bytecode they run is one the scheduler does not.

One process, one kvfsm engine (``RoomEngine`` + ``NixlTransport``, real NIXL over DRAM) against
a separate "decode" process (``_nixl_peer.py``, as in ``transfer.py``). On the main thread, the
scheduler loop: each iteration runs ``--work-us`` of pure-Python work (calibrated at start),
polls every live room, and advances the rooms that are ready (create, decode's page list,
``init``, ``send`` per chunk, ``clear`` when done), keeping ``--window`` rooms in flight. Phases
of ``--seconds`` each, alternated so load on the machine hits both alike:

* idle: the engine is up with 0 rooms; the loop does only its work (there is nothing to poll);
* busy: the same loop keeps ``--window`` rooms of ``--room-pages`` x 64 KiB in flight, as fast
  as kvfsm completes them (full rate for this loop);
* raw (the baseline, after each busy phase): the loop does only its work, as when idle, while
  a plain thread writes the same rooms (two chunks each) through raw NIXL at the rate the busy
  phase reached: the least any engine moving those bytes in this process could cost the loop
  (its copies, the GIL at each NIXL call's entry and exit, nothing else).

Reported: iterations per second in each phase and their ratio (the target is >= 0.90; busy
over idle), ``ratio_raw`` (raw over idle: what the bytes alone cost) and ``kvfsm_vs_raw`` (busy
over raw: what kvfsm costs beyond them), rooms and GB/s moved while busy, the process CPU per
wall second in each phase, and kvfsm's threads' CPU (by name, as ``top -H`` shows them). Each
round is one idle, one busy and one raw phase; the best round (highest ratio) is reported with
the spread over ``--rounds``.

Where the loop's time went, per phase (``scheduler_*``, fractions of wall time unless named
otherwise): ``running`` (its CPU time), ``waiting_for_cpu`` (runnable, no core free: the OS's
share), ``waiting_other`` (blocked: on the GIL, as the loop never sleeps), ``rooms_share``
(its own part in moving the rooms: kvfsm's calls and the loop's bookkeeping around them) and
``gil_handovers_per_s`` (its voluntary context switches: each one a hand-over of the GIL to
another thread and the wait to win it back) and ``work_cpu_us`` (the CPU time of one
iteration's work: the same work in every phase, so a higher figure than idle's is that work
running slower on the same core). ``machine_busy_cores`` is the whole machine's load in the
phase, every process's (the decode peer's too).

SGLang's own NIXL backend is not driven here: ``gil_backends.py`` drives it and kvfsm's adapter
through SGLang's backend interface, each against a real decode process.

Run: ``python benchmarks/gil.py`` (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np
from transfer import (  # benchmarks/ is on sys.path
    _FENCE,
    KIB,
    STALL_S,
    Bench,
    Kvfsm,
    Peer,
    RawNixl,
    _descs,
    _source,
)

from kvfsm.rooms._runtime import thread_table
from kvfsm.states import TERMINAL, DestinationReceived, KVPoll

PAGE = 64 * KIB
MERGE_BYTES = 8 << 20  # kvfsm's TransferConfig.merge_max_bytes


def _work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i % 7
    return x


def calibrate(work_us: float) -> int:
    """Iterations of ``_work`` that take about ``work_us`` on this thread, alone."""
    n = 1000
    while True:
        t0 = time.perf_counter()
        _work(n)
        dt = time.perf_counter() - t0
        if dt > 0.02:
            return max(1, int(n * work_us * 1e-6 / dt))
        n *= 2


def scheduler_times() -> tuple[float, float]:
    """The calling (scheduler) thread's CPU seconds so far, and its seconds spent runnable but
    waiting for a CPU (``/proc/thread-self/schedstat``, Linux; zeros elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu_ns, wait_ns, _ = f.read().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(cpu_ns) / 1e9, int(wait_ns) / 1e9


def machine_busy() -> tuple[int, int]:
    """Jiffies the whole machine spent busy and in all, so far (``/proc/stat``; zeros
    elsewhere): every process's CPU, the decode peer's too."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait


def scheduler_switches() -> int:
    """The calling thread's voluntary context switches so far (Linux; 0 elsewhere). A loop that
    never sleeps blocks only to hand the GIL to another thread, so each one is a GIL hand-over
    (the forced switch after ``sys.getswitchinterval()``) and the wait to win it back."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def scheduler_share(before: tuple[float, float], wall: float) -> dict[str, float]:
    """Since ``before`` (:func:`scheduler_times`), the scheduler thread's wall time split into
    running, waiting for a CPU (the OS's share: other threads and processes on the cores), and
    the rest: waiting for the GIL, mostly (the loop never sleeps)."""
    cpu, waiting = (now - then for now, then in zip(scheduler_times(), before, strict=True))
    return {
        "scheduler_running": cpu / wall,
        "scheduler_waiting_for_cpu": waiting / wall,
        "scheduler_waiting_other": max(0.0, 1 - (cpu + waiting) / wall),
    }


def _thread_cpu() -> dict[str, float]:
    out: dict[str, float] = {}
    for row in thread_table():
        cpu = row["cpu_s"]  # None where /proc is not readable
        out[str(row["name"])] = float(cpu) if isinstance(cpu, (int, float)) else 0.0
    return out


class RawWriter:
    """The baseline engine: one plain thread writing rooms through raw NIXL at a fixed rate
    (the same pages and destinations as the busy phase's rooms). Each time it wakes it posts
    every room due by then as one request of at most 8 MiB, sorted by destination, as kvfsm's
    transport merges a batch's chunks: a thread posting each chunk alone needs the GIL back
    several times per chunk, and against a loop that never releases it (5 ms forced switches)
    reaches about 80 rooms/s here, not the busy phase's 500. Every request is checked DONE and
    released before the next."""

    def __init__(self, bench: Bench, pages: int) -> None:
        self.raw = raw = bench.resource("raw", lambda: RawNixl(bench))
        assert raw.remote is not None
        self.local = raw.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(bench.src_addr, pages, PAGE), bench.mem
        )
        self.remote = raw.agent.prep_xfer_dlist(
            raw.remote, _descs(bench.peer.base, pages, PAGE), bench.mem
        )
        self.pages = pages

    def close(self) -> None:
        self.raw.agent.release_dlist_handle(self.remote)
        self.raw.agent.release_dlist_handle(self.local)

    def run(
        self, stop: threading.Event, rooms_per_s: float, room_pages: int, out: list[int]
    ) -> None:
        agent = self.raw.agent
        rng = np.random.default_rng(7)
        slots = self.pages // room_pages
        per_request = max(1, MERGE_BYTES // (room_pages * PAGE))
        src = np.arange(room_pages, dtype=np.int32)
        t0 = time.perf_counter()
        rooms = 0
        while not stop.is_set():
            due = int((time.perf_counter() - t0) * rooms_per_s) + 1
            while rooms < due and not stop.is_set():
                n = min(due - rooms, per_request)
                dst = np.concatenate(
                    [
                        rng.permutation(np.arange(lo, lo + room_pages, dtype=np.int32))
                        for lo in (((rooms + k) % slots) * room_pages for k in range(n))
                    ]
                )
                order = np.argsort(dst, kind="stable")
                s, d = np.tile(src, n)[order], dst[order]
                handle = agent.make_prepped_xfer("WRITE", self.local, s, self.remote, d)
                try:  # released on every path, a failed or stalled request's too
                    state = agent.transfer(handle)
                    stall = time.perf_counter() + STALL_S
                    while state == "PROC" and time.perf_counter() < stall:
                        state = agent.check_xfer_state(handle)
                finally:
                    agent.release_xfer_handle(handle)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL request ended {state}")
                rooms += n
                out[0] = rooms
            delay = t0 + rooms / rooms_per_s - time.perf_counter()
            if delay > 0:
                stop.wait(delay)  # (releases the GIL)


def raw_phase(
    writer: RawWriter, rooms_per_s: float, seconds: float, n_work: int, *, room_pages: int
) -> dict[str, Any]:
    """The idle loop for ``seconds`` while ``writer`` moves ``rooms_per_s`` rooms a second."""
    stop = threading.Event()
    moved = [0]
    errors: list[BaseException] = []

    def write() -> None:
        try:
            writer.run(stop, rooms_per_s, room_pages, moved)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=write, name="raw-writer", daemon=True)
    thread.start()
    try:
        result = phase(None, seconds, n_work, window=0, room_pages=room_pages, base=0)
    finally:
        stop.set()
        thread.join(30)
    if errors:
        raise RuntimeError("raw NIXL writer failed") from errors[0]
    result["rooms_per_s"] = moved[0] / seconds
    result["gb_per_s"] = moved[0] * room_pages * PAGE / seconds / 1e9
    return result


def phase(
    runner: Kvfsm | None, seconds: float, n_work: int, *, window: int, room_pages: int, base: int
) -> dict[str, Any]:
    """One phase: the scheduler loop for ``seconds``; with ``runner``, ``window`` rooms in
    flight through it."""
    live: list[tuple[Any, bool]] = []
    rooms = done = iterations = 0
    rooms_s = 0.0  # this thread's wall time in the rooms part of its iterations
    rng = np.random.default_rng(base)
    slots = runner.layout.kv[0].nbytes // PAGE // room_pages if runner is not None else 0
    # Decode's page list for each slot of pages (slots cycle; window << slots), packed as it
    # arrives off the wire, and the two chunks' source pages: built before the clock starts.
    # In production the list comes over the control plane (on kvfsm's loop thread) and the
    # pages from the scheduler's allocator: neither is work this loop would do per room.
    destinations = [
        rng.permutation(np.arange(lo, lo + room_pages, dtype=np.int32)).tobytes()
        for lo in range(0, slots * room_pages, room_pages)
    ]
    src = np.arange(room_pages, dtype=np.int32)
    chunks = (src[: room_pages // 2], src[room_pages // 2 :])  # as a chunked prefill sends
    threads0 = _thread_cpu()
    busy0, all0 = machine_busy()
    work_cpu = 0.0  # this thread's CPU time inside _work: the same work in every phase
    sched0 = scheduler_times()
    switches0 = scheduler_switches()
    cpu0, t0 = time.process_time(), time.perf_counter()
    end = t0 + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        w0 = time.thread_time()
        _work(n_work)
        work_cpu += time.thread_time() - w0
        iterations += 1
        if runner is None:
            continue
        t_rooms = time.perf_counter()
        engine = runner.engine
        while len(live) < window:
            rooms += 1
            sender = engine.sender(base + rooms)
            # Under the runner's write lease, as a production prefill's chunks are.
            dst = destinations[rooms % slots]
            engine.post(sender.key, DestinationReceived(dst, 0, peer="decode", fence=_FENCE))
            live.append((sender, False))
        keep = []
        for sender, handed in live:
            status = sender.poll()
            sent = handed
            if not sent and status is KVPoll.WaitingForInput:
                sender.init(room_pages, -1)
                for chunk in chunks:
                    sender.send(chunk)
                sent = True
            if status in TERMINAL:
                if status is not KVPoll.Success:
                    raise RuntimeError(f"room failed: {sender.reason}")
                sender.clear()
                done += 1
                continue
            keep.append((sender, sent))
        live = keep
        rooms_s += time.perf_counter() - t_rooms
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    share = scheduler_share(sched0, wall)  # now: not the drain below
    switches = scheduler_switches() - switches0
    threads1 = _thread_cpu()
    busy1, all1 = machine_busy()
    # Let the rooms still in flight finish outside the measurement (no timing asserts). Those
    # never handed their pages (spawned by the last iteration) would wait for input until
    # their deadline: abort them.
    for sender, sent in live:
        if not sent:
            sender.abort("benchmark phase over")
    deadline = time.monotonic() + 30
    while live and time.monotonic() < deadline:
        live = [(s, sent) for s, sent in live if s.poll() not in TERMINAL]
        time.sleep(0.001)
    return {
        "iterations_per_s": iterations / wall,
        "rooms_per_s": done / wall,
        "gb_per_s": done * room_pages * PAGE / wall / 1e9,
        "process_cpu_per_s": cpu / wall,
        **share,
        "scheduler_gil_handovers_per_s": switches / wall,
        # Its own part in moving the rooms: kvfsm's calls (create, post, init, send, poll on
        # every live room, clear) and this loop's bookkeeping around them, wall time.
        "scheduler_rooms_share": rooms_s / wall,
        # The same pure-Python work's CPU time per iteration: higher than idle's when it runs
        # slower on the same core (caches refilled after kvfsm's calls and other threads).
        "scheduler_work_cpu_us": work_cpu / max(iterations, 1) * 1e6,
        # Cores busy machine-wide (every process), to compare the phases' load.
        "machine_busy_cores": (busy1 - busy0) / max(all1 - all0, 1) * (os.cpu_count() or 1),
        "kvfsm_threads_cpu_per_s": {
            name: round((cpu1 - threads0.get(name, 0.0)) / wall, 3)
            for name, cpu1 in threads1.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--work-us", type=float, default=500.0, help="CPU work per iteration")
    parser.add_argument("--seconds", type=float, default=3.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3, help="idle+busy rounds; best reported")
    parser.add_argument("--window", type=int, default=16, help="rooms in flight while busy")
    parser.add_argument("--room-pages", type=int, default=16, help="64 KiB pages per room")
    parser.add_argument("--pages", type=int, default=4096, help="64 KiB pages in each buffer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    n_work = calibrate(args.work_us)
    nbytes = args.pages * PAGE
    peer = Peer(nbytes, f"gil-decode-{os.getpid()}")
    rounds: list[dict[str, Any]] = []
    try:
        src = _source(nbytes)
        bench = Bench(peer=peer, src=src, repeat=1, src_addr=src.ctypes.data)
        with bench.stack:
            runner = bench.resource("kvfsm", lambda: Kvfsm(bench, PAGE, args.pages))
            writer = RawWriter(bench, args.pages)
            bench.stack.callback(writer.close)
            shape = {"window": args.window, "room_pages": args.room_pages}
            phase(runner, 0.5, n_work, **shape, base=1 << 40)  # warm-up
            for r in range(args.rounds):
                idle = phase(None, args.seconds, n_work, **shape, base=0)
                busy = phase(runner, args.seconds, n_work, **shape, base=(r + 1) << 32)
                raw = raw_phase(
                    writer,
                    max(busy["rooms_per_s"], 1.0),
                    args.seconds,
                    n_work,
                    room_pages=args.room_pages,
                )
                rounds.append(
                    {
                        "idle": idle,
                        "busy": busy,
                        "raw": raw,
                        "ratio": busy["iterations_per_s"] / idle["iterations_per_s"],
                        "ratio_raw": raw["iterations_per_s"] / idle["iterations_per_s"],
                        "kvfsm_vs_raw": busy["iterations_per_s"] / raw["iterations_per_s"],
                    }
                )
                if not args.json:
                    print(
                        f"round {r}: idle {idle['iterations_per_s']:,.0f} it/s, busy "
                        f"{busy['iterations_per_s']:,.0f} it/s ({busy['rooms_per_s']:,.0f} "
                        f"rooms/s, {busy['gb_per_s']:.2f} GB/s): ratio "
                        f"{rounds[-1]['ratio']:.3f}; raw NIXL at {raw['rooms_per_s']:,.0f} "
                        f"rooms/s: {raw['iterations_per_s']:,.0f} it/s, ratio "
                        f"{rounds[-1]['ratio_raw']:.3f}; kvfsm/raw "
                        f"{rounds[-1]['kvfsm_vs_raw']:.3f}; "
                        f"kvfsm threads' CPU/s {busy['kvfsm_threads_cpu_per_s']}; the loop "
                        f"busy / raw: GIL waits {busy['scheduler_waiting_other']:.3f} / "
                        f"{raw['scheduler_waiting_other']:.3f} of wall, GIL hand-overs/s "
                        f"{busy['scheduler_gil_handovers_per_s']:.0f} / "
                        f"{raw['scheduler_gil_handovers_per_s']:.0f}, its rooms part "
                        f"{busy['scheduler_rooms_share']:.3f}, its work's CPU per iteration "
                        f"idle / busy / raw {idle['scheduler_work_cpu_us']:.0f} / "
                        f"{busy['scheduler_work_cpu_us']:.0f} / "
                        f"{raw['scheduler_work_cpu_us']:.0f} us",
                        flush=True,
                    )
    finally:
        peer.close()
    ratios = [r["ratio"] for r in rounds]
    best = max(rounds, key=lambda r: r["ratio"])
    report = {
        "python": sys.version.split()[0],
        "work_us": args.work_us,
        "window": args.window,
        "room_pages": args.room_pages,
        "loadavg": os.getloadavg()[0],
        "best": best,
        "ratio_best": best["ratio"],
        "ratio_spread": [min(ratios), max(ratios)],
        "ratio_raw_spread": [
            min(r["ratio_raw"] for r in rounds),
            max(r["ratio_raw"] for r in rounds),
        ],
        "kvfsm_vs_raw_spread": [
            min(r["kvfsm_vs_raw"] for r in rounds),
            max(r["kvfsm_vs_raw"] for r in rounds),
        ],
        "rounds": rounds,
        "target": 0.90,
        "meets": best["ratio"] >= 0.90,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"best ratio {best['ratio']:.3f} (spread {min(ratios):.3f} to {max(ratios):.3f}); "
            f"target >= 0.90: {'met' if report['meets'] else 'NOT met'}; raw NIXL at the same "
            f"rate: {report['ratio_raw_spread'][0]:.3f} to {report['ratio_raw_spread'][1]:.3f}; "
            f"kvfsm/raw {report['kvfsm_vs_raw_spread'][0]:.3f} to "
            f"{report['kvfsm_vs_raw_spread'][1]:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
