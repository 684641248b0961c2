"""An abort storm: many rooms, aborted from either side at random points. None may wedge.

A prefill process and a decode process (one manager each, real NIXL over DRAM) run ROOMS rooms
from one seeded plan. A room is left alone, or aborted by one side at one point:

    prefill  before_init      the sender exists, init() was not called
             between_chunks   after the first of two chunks, before the last
             after_last       right after the last chunk was sent (races its completion)
    decode   before_init      the receiver exists, init() was not called: prefill never hears of
                              it, so its sender ends by its Bootstrapping deadline (shortened here)
             before_metadata  after init(), before send_metadata()
             after_metadata   a few ms after send_metadata(), while chunks may be in flight

Then it checks what the design promises: every room ends Success or Failed on both sides (no
wedge), every Failed has a reason, every decode room becomes ``settled`` (no transfer can touch
its pages any more), every room nobody aborted succeeds with the right bytes. It prints counts by
outcome and reason. Run it as-is (no GPU needed; ``--seed N`` for another storm):

    python examples/abort_storm.py

It ends with ``abort_storm: OK`` (exit status 0), or lists what went wrong and exits 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent

import numpy as np
import numpy.typing as npt

from kvfsm import KVPoll
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.rooms import RoomConfig
from kvfsm.states import TERMINAL, Role
from kvfsm.transport import Layout, Region

ENGINE, ROOMS, PAGES_PER_ROOM = "abort-storm", 96, 4
BUFFERS, PAGES, PAGE_BYTES, AUX_ROWS, AUX_BYTES = 8, 512, 2048, 128, 64
POINTS = {
    "prefill": ("before_init", "between_chunks", "after_last"),
    "decode": ("before_init", "before_metadata", "after_metadata"),
}
# Short deadlines so that a room nobody will ever finish (decode aborted before init) fails in
# seconds, not the production 300 s. That is law 3, bounded time, doing its job.
CONFIG = ManagerConfig(
    rooms=RoomConfig(deadlines={Role.SENDER: {KVPoll.Bootstrapping: 2.0}}),
    register_interval_s=1.0,
)
#: room -> (side, point) or None; room -> (src pages, dst pages, src aux row, dst aux row)
Plan = dict[int, tuple[str, str] | None]
Result = dict[int, tuple[int, str, bool]]  # room -> (status, reason, settled)


def make_plan(seed: int, abort_rate: float) -> Plan:
    rng = random.Random(seed)
    plan: Plan = {}
    for room in range(ROOMS):
        side = rng.choice(["prefill", "decode"]) if rng.random() < abort_rate else None
        plan[room] = None if side is None else (side, rng.choice(POINTS[side]))
    return plan


def pages(room: int) -> tuple[list[int], list[int]]:
    src = [(room * 7 + 3 * k) % PAGES for k in range(PAGES_PER_ROOM)]
    dst = [PAGES - 1 - PAGES_PER_ROOM * room - k for k in range(PAGES_PER_ROOM)]
    return src, dst


def layout(filled: bool) -> tuple[Layout, list[npt.NDArray[np.uint8]], npt.NDArray[np.uint8]]:
    """Numpy buffers and their regions; prefill's page p of buffer b holds (37 b + p) % 251."""
    kv = [np.zeros((PAGES, PAGE_BYTES), np.uint8) for _ in range(BUFFERS)]
    aux = np.zeros((AUX_ROWS, AUX_BYTES), np.uint8)
    if filled:
        for b, buf in enumerate(kv):
            buf[:] = ((37 * b + np.arange(PAGES)) % 251).astype(np.uint8)[:, None]
        aux[:] = (np.arange(AUX_ROWS) % 251).astype(np.uint8)[:, None]
    regions = tuple(
        Region(f"kv{b}", buf.ctypes.data, buf.nbytes, PAGE_BYTES) for b, buf in enumerate(kv)
    )
    return (
        Layout(kv=regions, aux=(Region("aux0", aux.ctypes.data, aux.nbytes, AUX_BYTES),)),
        kv,
        aux,
    )


def run_until(step: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def prefill(url: str, plan: Plan, ready: MpEvent, done: MpEvent, out: Queue[object]) -> None:
    # Hold on to the whole tuple: a Layout holds addresses, not the buffers. If the numpy arrays
    # were freed, NIXL would read unmapped memory (UCX reports it as a remote disconnect).
    memory = layout(filled=True)
    with PrefillManager(memory[0], url, engine_id=ENGINE, config=CONFIG) as manager:
        ready.set()
        senders = {room: manager.sender(room) for room in plan}
        for room, sender in senders.items():
            if plan[room] == ("prefill", "before_init"):
                sender.abort("prefill abort before_init")
        started: set[int] = set()

        def step() -> bool:
            for room, sender in senders.items():
                if room in started or sender.poll() is not KVPoll.WaitingForInput:
                    continue
                started.add(room)
                src, _ = pages(room)
                sender.init(len(src), aux_index=room % AUX_ROWS)
                sender.send(np.asarray(src[:2], np.int32))
                if plan[room] == ("prefill", "between_chunks"):
                    sender.abort("prefill abort between_chunks")
                sender.send(np.asarray(src[2:], np.int32))  # after an abort: ignored, no error
                if plan[room] == ("prefill", "after_last"):
                    sender.abort("prefill abort after_last")
            return all(s.poll() in TERMINAL for s in senders.values())

        run_until(step, timeout=30)
        run_until(lambda: all(s.settled for s in senders.values()), timeout=10)
        out.put(("prefill", {r: (int(s.poll()), s.reason, s.settled) for r, s in senders.items()}))
        done.wait(60)  # keep serving (acknowledging decode's aborts) until decode is done
        for sender in senders.values():
            sender.clear()


def decode(url: str, plan: Plan, ready: MpEvent, out: Queue[object]) -> None:
    lay, kv, aux = layout(filled=False)
    with DecodeManager(lay, url, engine_id=ENGINE, config=CONFIG) as manager:
        ready.wait(60)
        receivers = {room: manager.receiver(room) for room in plan}
        for room, receiver in receivers.items():
            if plan[room] == ("decode", "before_init"):
                receiver.abort("decode abort before_init")
            else:
                receiver.init(0)
        rng = random.Random(1)
        late_aborts: dict[int, float] = {}  # room -> when to abort it (after_metadata)

        def step() -> bool:
            now = time.monotonic()
            for room, receiver in receivers.items():
                if room in late_aborts and now >= late_aborts[room]:
                    receiver.abort("decode abort after_metadata")
                    late_aborts[room] = float("inf")
                if room in late_aborts or receiver.poll() is not KVPoll.WaitingForInput:
                    continue
                if plan[room] == ("decode", "before_metadata"):
                    receiver.abort("decode abort before_metadata")
                    continue
                _, dst = pages(room)
                receiver.send_metadata(np.asarray(dst, np.int32), aux_index=room % AUX_ROWS)
                due = now + rng.uniform(0, 0.005)
                late_aborts[room] = due if plan[room] == ("decode", "after_metadata") else 1e18
            return all(r.poll() in TERMINAL for r in receivers.values())

        run_until(step, timeout=30)
        run_until(lambda: all(r.settled for r in receivers.values()), timeout=10)
        result: Result = {}
        for room, receiver in receivers.items():
            status, reason = receiver.poll(), receiver.reason
            if status is KVPoll.Success:  # check the bytes of every room that succeeded
                src, dst = pages(room)
                want = [(37 * b + np.asarray(src)) % 251 for b in range(BUFFERS)]
                good = all(np.all(kv[b][dst] == want[b][:, None]) for b in range(BUFFERS))
                good = good and bool(np.all(aux[room % AUX_ROWS] == room % AUX_ROWS % 251))
                status, reason = (status, "") if good else (KVPoll.Failed, "BYTES MISMATCH")
            result[room] = (int(status), reason, receiver.settled)
            receiver.clear()
        out.put(("decode", result))


def check(plan: Plan, results: dict[str, Result]) -> list[str]:
    problems = []
    for side, result in results.items():
        for room, (status, reason, settled) in sorted(result.items()):
            if status not in (KVPoll.Success, KVPoll.Failed):
                problems.append(f"{side} room {room} wedged in {KVPoll(status).name}")
            if status == KVPoll.Failed and not reason:
                problems.append(f"{side} room {room} failed without a reason")
            if "MISMATCH" in reason:
                problems.append(f"{side} room {room}: bytes differ")
            if side == "decode" and not settled:
                problems.append(f"decode room {room} never settled")
            if plan[room] is None and status != KVPoll.Success:
                problems.append(f"{side} room {room} was not aborted but ended {reason!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--abort-rate", type=float, default=0.67, help="share of rooms aborted")
    args = parser.parse_args()
    plan = make_plan(args.seed, args.abort_rate)
    ctx = mp.get_context("spawn")
    started = time.perf_counter()
    # The registry as its own process, as `kvfsm bootstrap` runs it in a deployment.
    with socket.socket() as probe:  # a free port for it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    registry = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfsm.registry._cli",
            "--port",
            str(port),
            "--expected-ranks",
            "1",
        ],
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    run_until(listening, timeout=20)  # a prefill rank's first registration must succeed
    ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=prefill, args=(url, plan, ready, done, out), name="prefill"),
        ctx.Process(target=decode, args=(url, plan, ready, out), name="decode"),
    ]
    results: dict[str, Result] = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + 90
        while len(results) < 2 and time.monotonic() < deadline:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                break
            try:
                side, result = out.get(timeout=0.5)
                results[side] = result
            except queue.Empty:
                continue
    finally:
        done.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        registry.terminate()
        registry.wait(10)
    if len(results) < 2:
        print(f"abort_storm: FAILED, no result from {sorted({'prefill', 'decode'} - set(results))}")
        return 1
    aborts = Counter("none" if p is None else f"{p[0]} {p[1]}" for p in plan.values())
    print(
        f"{ROOMS} rooms; aborts planned: "
        + ", ".join(f"{k} {n}" for k, n in sorted(aborts.items()))
    )
    for side in ("prefill", "decode"):
        outcomes = Counter(
            f"{KVPoll(status).name}" + (f": {re.sub(r'[0-9]+', 'N', reason)}" if reason else "")
            for status, reason, _ in results[side].values()
        )
        print(f"{side}:")
        for outcome, n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d}  {outcome}")
    problems = check(plan, results)
    for problem in problems:
        print("  PROBLEM:", problem)
    elapsed = time.perf_counter() - started
    if problems:
        print(f"abort_storm: FAILED, {len(problems)} problems")
        return 1
    print(
        f"abort_storm: OK, {ROOMS} rooms terminal on both sides, all decode rooms settled, "
        f"no wedge ({elapsed:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
