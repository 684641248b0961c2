"""GIL theft through SGLang's backend interface: kvfsm's adapter and SGLang's own NIXL backend.

``gil.py`` measures kvfsm's engine on its own (its facades, a passive NIXL peer as decode). Here
one scheduler-shaped loop calls what SGLang's prefill scheduler calls, on each backend's classes:
``KvfsmKVSender`` over ``KvfsmKVManager`` (kvfsm), and SGLang 0.5.23's own ``NixlKVSender`` over
``NixlKVManager`` (its source unmodified). Each backend runs in processes of its own, one after
the other in the same run, so that one backend's threads never run during the other's phases:

* prefill, the measured process: the backend's prefill manager and, on the main thread, the loop
  of ``gil.py``. Each iteration does ``--work-us`` of pure-Python work, then calls ``poll()`` on
  every live sender and advances the ready ones (``init``, ``send`` in two chunks, ``clear`` on
  Success), ``--window`` rooms in flight while busy. Idle phases have the manager up and no
  rooms; idle and busy phases alternate, ``--rounds`` of each.
* decode, a child process (``_backends.decode_main``): the backend's bootstrap server and its
  decode manager, keeping ``--ahead`` receivers ahead of prefill in the same room order,
  checking every finished room's bytes and clearing it.

Both backends get the same buffers (``_backends.kv_args``: 4 KV buffers of 1,024 pages x 16 KiB
and an aux buffer, declared DRAM, real NIXL over UCX between the two processes), rooms of
``--room-pages`` pages per buffer (16: 1 MiB a room) and the same room order. Reported per
backend: iterations/s idle and busy and their ratio (best round, and the spread), rooms/s and
GB/s while busy, failed rooms, the process CPU per second, and the CPU per second of the
threads other than the scheduler's, by OS thread name (``/proc``: kvfsm names its threads,
SGLang's show as ``python``).

Run: ``python benchmarks/gil_backends.py`` (``--json`` for one JSON object; ``--backends sglang``
for one backend).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

# benchmarks/ is on sys.path
from _backends import (
    AUX_ROWS,
    BUFFERS,
    FAILED,
    FILL,
    PAGE_BYTES,
    SUCCESS,
    WAITING,
    DecodeChild,
    Kvfsm,
    SGLangNixl,
    backend,
    thread_cpu,
)
from gil import _work, calibrate, scheduler_share, scheduler_times

PAGES = 1024
BACKENDS = ("kvfsm", "sglang")


class Prefill:
    """The measured side: one backend's prefill manager and the scheduler loop."""

    def __init__(self, be: Kvfsm | SGLangNixl, mgr: Any, addr: str, room_pages: int) -> None:
        self.be, self.mgr, self.addr, self.room_pages = be, mgr, addr, room_pages
        self.room = 0  # the last room created: decode serves them in the same order
        self.failed: list[str] = []

    def phase(self, busy: bool, seconds: float, n_work: int, window: int) -> dict[str, Any]:
        live: list[list[Any]] = []
        done = iterations = 0
        slots = PAGES // self.room_pages
        threads0 = thread_cpu()
        main0 = scheduler_times()
        cpu0, t0 = time.process_time(), time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            _work(n_work)
            iterations += 1
            if not busy:
                continue
            while len(live) < window:
                self.room += 1
                live.append([self.room, self.be.sender_cls(self.mgr, self.addr, self.room), False])
            done += self._advance(live, slots)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        share = scheduler_share(main0, wall)  # now: not the drain below
        threads1 = thread_cpu()
        # The rooms still in flight finish outside the measurement, so that the next phase
        # starts with none (and decode's receivers stay in step with prefill's senders).
        give_up = time.monotonic() + 60
        while live and time.monotonic() < give_up:
            self._advance(live, slots)
            time.sleep(0.0005)
        if live:
            raise RuntimeError(f"{len(live)} rooms did not end within 60 s of the phase's end")
        return {
            "seconds": wall,
            "rooms": done,
            "iterations_per_s": iterations / wall,
            "rooms_per_s": done / wall,
            "gb_per_s": done * self.room_pages * PAGE_BYTES * BUFFERS / wall / 1e9,
            "process_cpu_per_s": cpu / wall,
            # Two processes' threads share these 2 vCPUs: what the OS took, apart from the GIL.
            **share,
            "threads_cpu_per_s": {
                name: round((s - threads0.get(name, 0.0)) / wall, 3)
                for name, s in sorted(threads1.items())
                if s - threads0.get(name, 0.0) > 0.0005 * wall
            },
        }

    def _advance(self, live: list[list[Any]], slots: int) -> int:
        """One pass of the scheduler's polls over ``live`` (in place); returns rooms ended."""
        ended = 0
        keep = []
        for entry in live:
            room, sender, sent = entry
            status = int(sender.poll())
            if not sent and status == WAITING:
                lo = (room % slots) * self.room_pages
                src = np.arange(lo, lo + self.room_pages, dtype=np.int32)
                half = self.room_pages // 2
                sender.init(self.room_pages, room % AUX_ROWS)
                sender.send(src[:half])  # two chunks, as a chunked prefill would
                sender.send(src[half:])
                entry[2] = True
            if status in (SUCCESS, FAILED):
                if status == FAILED:
                    try:
                        sender.failure_exception()
                    except Exception as exc:  # what the scheduler logs
                        self.failed.append(f"room {room}: {exc}")
                sender.clear()
                ended += 1
                continue
            keep.append(entry)
        live[:] = keep
        return ended


def prefill_main(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """One backend's whole measurement, this process being its prefill."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    be = backend(name)
    child = DecodeChild(
        be, name, ahead=a.ahead, room_pages=a.room_pages, pages=PAGES, fill=a.prefill_fill
    )
    with child:
        prefill = Prefill(be, child.mgr, child.addr, a.room_pages)
        prefill.phase(True, 1.0, a.n_work, a.window)  # warm-up
        rounds = []
        for _ in range(a.rounds):
            idle = prefill.phase(False, a.seconds, a.n_work, a.window)
            busy = prefill.phase(True, a.seconds, a.n_work, a.window)
            ratio = busy["iterations_per_s"] / idle["iterations_per_s"]
            rounds.append({"idle": idle, "busy": busy, "ratio": ratio})
        child.last_room = prefill.room
    decode = child.counts
    ratios = [r["ratio"] for r in rounds]
    best = max(rounds, key=lambda r: r["ratio"])
    return {
        "backend": name,
        "ratio_best": best["ratio"],
        "ratio_spread": [min(ratios), max(ratios)],
        "rooms_per_s_busy": [round(r["busy"]["rooms_per_s"], 1) for r in rounds],
        "best": best,
        "rounds": rounds,
        "failed_prefill": prefill.failed[:10],
        "failed_prefill_count": len(prefill.failed),
        "decode": decode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="kvfsm,sglang")
    parser.add_argument("--work-us", type=float, default=500.0, help="CPU work per iteration")
    parser.add_argument("--seconds", type=float, default=3.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3, help="idle+busy rounds; best reported")
    parser.add_argument("--window", type=int, default=16, help="rooms in flight while busy")
    parser.add_argument("--ahead", type=int, default=24, help="decode's receivers ahead")
    parser.add_argument("--room-pages", type=int, default=16, help="pages per buffer per room")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one backend's prefill, as a child
    parser.add_argument("--n-work", type=int, help=argparse.SUPPRESS)  # the parent's calibration
    # Tests: prefill's bytes other than what decode checks for, to prove the check fails.
    parser.add_argument("--prefill-fill", type=int, default=FILL, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.one:
        print(json.dumps(prefill_main(a.one, a)), flush=True)
        os._exit(0)  # see _backends.decode_main
    if PAGES // a.room_pages < a.window + a.ahead:
        parser.error("--window + --ahead rooms must fit in the buffers' page slots")
    # Calibrated once, here, where no backend runs: both backends' loops do the same work per
    # iteration (a backend's threads running during the calibration would shrink it).
    n_work = calibrate(a.work_us)
    reports = {}
    for name in a.backends.split(","):
        # A process per backend: the other's threads must not run during its phases.
        argv_one = [sys.executable, __file__, "--one", name, "--n-work", str(n_work)]
        flags = ("work_us", "seconds", "rounds", "window", "ahead", "room_pages", "prefill_fill")
        for flag in flags:
            argv_one += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
        # Bounded: a backend that wedges fails the run (its decode child ends with its stdin).
        limit = 300 + 4 * a.rounds * a.seconds
        out = subprocess.run(argv_one, capture_output=True, text=True, timeout=limit, check=False)
        if out.returncode != 0 or not out.stdout.strip():
            raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
        reports[name] = json.loads(out.stdout.strip().splitlines()[-1])
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "work_us": a.work_us,
        "work_iterations": n_work,
        "window": a.window,
        "room_bytes": a.room_pages * PAGE_BYTES * BUFFERS,
        "loadavg": os.getloadavg()[0],
        "target": 0.90,
        "backends": reports,
    }
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, r in reports.items():
        b = r["best"]["busy"]
        print(
            f"{name:7s} ratio best {r['ratio_best']:.3f} (spread {r['ratio_spread'][0]:.3f} to "
            f"{r['ratio_spread'][1]:.3f}); busy {b['rooms_per_s']:,.0f} rooms/s, "
            f"{b['gb_per_s']:.2f} GB/s; failed {r['failed_prefill_count']}; "
            f"decode {r['decode']}; threads CPU/s {b['threads_cpu_per_s']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
