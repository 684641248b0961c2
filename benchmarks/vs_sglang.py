"""kvfsm's adapter against SGLang 0.5.23's own NIXL backend: the same requests through the same
scheduler loop, side by side in one run.

Both backends are driven through the classes SGLang's schedulers call: kvfsm's
``KvfsmKVManager`` / ``KvfsmKVSender`` / ``KvfsmKVReceiver``, and SGLang's own ``NixlKVManager``
/ ``NixlKVSender`` / ``NixlKVReceiver`` (its source unmodified; ``_backends.py`` says how it is
loaded and configured as a one-rank server). Each backend runs as a pair of processes:

* prefill, the measured process: the backend's prefill manager and, on the main thread, a loop
  shaped like SGLang's prefill scheduler. It keeps ``W`` requests in flight; each iteration it
  creates senders up to ``W``, calls ``poll()`` on every live one, and on WaitingForInput calls
  ``init`` and ``send`` in ``--chunks`` chunks (a chunked prefill), on Success or Failed
  ``clear`` (and ``failure_exception`` on Failed). Each iteration then waits ``--step-us``
  without the GIL, where SGLang's scheduler would wait for a forward pass on the GPU.
* decode, a child process (``_backends.decode_main``): the backend's bootstrap server and decode
  manager, keeping receivers created, ``init``-ed and given their pages (``send_metadata``)
  ahead of prefill in the same room order, as a decode server that got the same requests from
  the router; it checks every finished room's bytes and clears it.

Real NIXL over UCX between the two processes, in DRAM: SGLang's backend registers a GPU
server's KV pool as VRAM; here both backends' pools are declared ``DRAM`` (``kv_data_mem_kinds``),
the one deviation from production. A request is ``--room-pages`` pages of 16 KiB in each of 4 KV
buffers (16: 1 MiB a request) plus an aux row; decode's pages are a random permutation.

One run makes ``--rounds`` rounds; in each, each backend (alternating which goes first) starts a
fresh pair and moves ``--requests`` requests at each of ``--windows`` in flight (after a warm-up).
Reported per backend and window, the median over rounds: requests/s and GB/s; the latency of a
request from its sender's creation to the poll that saw Success, p50 and p99, and the p50 of
its two phases (bootstrap: creation to the first poll that saw WaitingForInput, decode's pages
having reached prefill; send: from there to Success, the ``init``, the sends and the
transfer); the prefill
process's CPU per request (every thread: scheduler, the backend's own threads, NIXL's); the
scheduler thread's CPU per request (``time.thread_time``); decode's process CPU per request; and
the ratios kvfsm / SGLang, each from the medians, against the targets.

Run: ``python benchmarks/vs_sglang.py`` (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
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
    process_cpu,
    thread_cpu,
)

BACKENDS = ("kvfsm", "sglang")
#: (measure, window, bound on kvfsm / SGLang, "min" or "max")
TARGETS = (
    ("rooms_per_s", 8, 3.0, "min"),
    ("rooms_per_s", 64, 3.0, "min"),
    ("process_cpu_us", 1, 1 / 3, "max"),
    ("process_cpu_us", 8, 1 / 3, "max"),
    ("process_cpu_us", 64, 1 / 3, "max"),
    ("p50_ms", 1, 0.5, "max"),
)


class Scheduler:
    """The prefill scheduler's loop over one backend's senders."""

    def __init__(self, be: Kvfsm | SGLangNixl, child: DecodeChild, a: argparse.Namespace) -> None:
        self.be, self.child = be, child
        self.room_pages, self.chunks, self.step = a.room_pages, a.chunks, a.step_us / 1e6
        self.slots = child.pages // a.room_pages
        self.room = 0  # the last room created: decode serves them in the same order
        self.failed: list[str] = []

    def run(self, window: int, requests: int) -> dict[str, Any]:
        live: list[list[Any]] = []
        latencies: list[float] = []
        # Each ended request's two phases: created -> first seen WaitingForInput (bootstrap:
        # decode's pages reach prefill), then -> seen Success or Failed (the sends and the
        # transfer), so that a latency says where it was spent.
        phases: list[tuple[float, float]] = []
        created = 0
        sender_cls, mgr, addr = self.be.sender_cls, self.child.mgr, self.child.addr
        step, clock = self.step, time.perf_counter
        failed0 = len(self.failed)
        decode0, threads0 = process_cpu(self.child.pid), thread_cpu()
        thread0, cpu0, t0 = time.thread_time(), time.process_time(), clock()
        give_up = time.monotonic() + 120
        while len(latencies) < requests:
            while len(live) < window and created < requests:
                self.room += 1
                created += 1
                # (room, sender, created at, first seen WaitingForInput at: 0 until then)
                live.append([self.room, sender_cls(mgr, addr, self.room), clock(), 0.0])
            self._advance(live, latencies, phases)
            if step:
                time.sleep(step)  # the forward pass: the GIL is free
            if time.monotonic() > give_up:
                raise RuntimeError(f"{len(live)} requests did not end within 120 s")
        wall = clock() - t0
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        decode, threads = process_cpu(self.child.pid) - decode0, thread_cpu()
        latencies.sort()
        boot = sorted(b for b, _ in phases)
        send = sorted(x for _, x in phases)
        return {
            "requests": requests,
            "seconds": wall,
            "rooms_per_s": requests / wall,
            "gb_per_s": requests * self.room_pages * PAGE_BYTES * BUFFERS / wall / 1e9,
            "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
            # (none if no request reached WaitingForInput: every one failed before)
            "bootstrap_p50_ms": boot[len(boot) // 2] * 1e3 if boot else math.nan,
            "send_p50_ms": send[len(send) // 2] * 1e3 if send else math.nan,
            "process_cpu_us": cpu / requests * 1e6,
            "scheduler_cpu_us": thread / requests * 1e6,
            "decode_cpu_us": decode / requests * 1e6,
            "failed": len(self.failed) - failed0,
            # The prefill process's other threads, by OS name (kvfsm names its threads).
            "threads_cpu_us": {
                name: round((cpu - threads0.get(name, 0.0)) / requests * 1e6, 1)
                for name, cpu in sorted(threads.items())
                if cpu > threads0.get(name, 0.0)
            },
        }

    def _advance(
        self, live: list[list[Any]], latencies: list[float], phases: list[tuple[float, float]]
    ) -> None:
        """One pass of the scheduler's polls over ``live`` (in place)."""
        keep = []
        for entry in live:
            room, sender, created, waiting = entry
            status = int(sender.poll())
            if not waiting and status == WAITING:
                waiting = entry[3] = time.perf_counter()
                lo = (room % self.slots) * self.room_pages
                src = np.arange(lo, lo + self.room_pages, dtype=np.int32)
                sender.init(self.room_pages, room % AUX_ROWS)
                for chunk in np.array_split(src, self.chunks):  # a chunked prefill
                    sender.send(chunk)
            if status in (SUCCESS, FAILED):
                now = time.perf_counter()
                latencies.append(now - created)
                if waiting:
                    phases.append((waiting - created, now - waiting))
                if status == FAILED:
                    try:
                        sender.failure_exception()
                    except Exception as exc:  # what the scheduler logs
                        self.failed.append(f"room {room}: {exc}")
                sender.clear()
                continue
            keep.append(entry)
        live[:] = keep


def one_round(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """One backend's round, this process being its prefill."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    windows = [int(w) for w in a.windows.split(",")]
    ahead = max(windows) + 8
    be = backend(name)
    child = DecodeChild(
        be,
        name,
        ahead=ahead,
        room_pages=a.room_pages,
        pages=2 * ahead * a.room_pages,
        fill=a.prefill_fill,
    )
    with child:
        loop = Scheduler(be, child, a)
        loop.run(min(8, max(windows)), a.warmup)
        results, stories = {}, {}
        for w in windows:
            results[str(w)] = loop.run(w, a.requests)
            if a.stories and name == "kvfsm":
                stories[str(w)] = _stories(child.mgr, loop.room, a.stories)
        child.last_room = loop.room
    return {
        "windows": results,
        "stories": stories,
        "failed_prefill": loop.failed[:10],
        "failed_prefill_count": len(loop.failed),
        "decode": child.counts,
    }


def _stories(mgr: Any, last: int, n: int) -> list[dict[str, Any]]:
    """The flight recorder's timelines of kvfsm's rooms ``last - n + 1`` to ``last`` (what
    ``kvfsm rooms --room ID`` shows), each as (ms since the room's creation, what happened)."""
    engine = mgr.kvfsm.engine
    out = []
    for room in range(last - n + 1, last + 1):
        for row in engine.story(room):
            steps = [(e["t_ms"], e["what"]) for e in row["timeline"]]
            out.append({"room": room, "state": row["state"], "timeline": steps})
    return out


#: What each round reports, per backend and window, in the order the table prints them.
MEASURES = (
    "rooms_per_s",
    "gb_per_s",
    "p50_ms",
    "p99_ms",
    "bootstrap_p50_ms",
    "send_p50_ms",
    "process_cpu_us",
    "scheduler_cpu_us",
    "decode_cpu_us",
)


def summarize(rounds: dict[str, list[dict[str, Any]]], windows: list[int]) -> dict[str, Any]:
    backends: dict[str, Any] = {}
    for name, runs in rounds.items():
        per_window = {}
        for w in map(str, windows):
            rows = [r["windows"][w] for r in runs]
            per_window[w] = {m: statistics.median(row[m] for row in rows) for m in MEASURES}
            per_window[w]["failed"] = sum(row["failed"] for row in rows)
            per_window[w]["rounds"] = {m: [round(row[m], 3) for row in rows] for m in MEASURES}
            per_window[w]["threads_cpu_us"] = [row["threads_cpu_us"] for row in rows]
        decode = {
            k: sum(r["decode"].get(k, 0) for r in runs)
            for k in ("succeeded", "failed", "wrong_bytes")
        }
        backends[name] = {
            "windows": per_window,
            "stories": runs[-1].get("stories", {}),  # the last round's
            "decode": decode,
            "failed_prefill": [f for r in runs for f in r["failed_prefill"]][:10],
            "failed_prefill_count": sum(r["failed_prefill_count"] for r in runs),
        }
    out: dict[str, Any] = {"backends": backends}
    if set(BACKENDS) <= set(rounds):
        k, s = backends["kvfsm"]["windows"], backends["sglang"]["windows"]
        out["ratios"] = {
            w: {m: k[w][m] / s[w][m] for m in MEASURES if s[w][m]} for w in map(str, windows)
        }
        targets = []
        for measure, window, bound, kind in TARGETS:
            if str(window) not in out["ratios"]:
                continue
            ratio = out["ratios"][str(window)][measure]
            met = ratio >= bound if kind == "min" else ratio <= bound
            targets.append(
                {
                    "measure": measure,
                    "window": window,
                    "bound": bound,
                    "kind": kind,
                    "ratio": ratio,
                    "met": met,
                }
            )
        out["targets"] = targets
    return out


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"kvfsm vs SGLang's NIXL backend: {report['requests']} requests of "
        f"{report['room_bytes'] / 2**20:g} MiB per window, {report['rounds']} rounds (medians), "
        f"step {report['step_us']:g} us; load {report['loadavg'][0]:.2f} -> "
        f"{report['loadavg'][1]:.2f}"
    )
    head = (
        "req/s",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "boot p50 ms",
        "send p50 ms",
        "proc us/req",
        "sched us/req",
        "decode us/req",
    )
    print(f"{'':7s}{'W':>4s} " + " ".join(f"{h:>13s}" for h in head))
    for w in report["windows"]:
        rows = [(n, b["windows"][str(w)]) for n, b in report["backends"].items()]
        if "ratios" in report:
            rows.append(("ratio", report["ratios"][str(w)]))
        for name, row in rows:
            cells = " ".join(f"{row.get(m, float('nan')):13.2f}" for m in MEASURES)
            print(f"{name:7s}{w:4d} {cells}")
    for name, b in report["backends"].items():
        print(f"{name}: decode {b['decode']}; failed at prefill {b['failed_prefill_count']}")
        for w, rooms in b.get("stories", {}).items():
            for story in rooms:
                steps = ", ".join(f"{t:.2f} {what}" for t, what in story["timeline"])
                print(f"{name} {w} in flight, room {story['room']} ({story['state']}): {steps}")
    for t in report.get("targets", []):
        sign = ">=" if t["kind"] == "min" else "<="
        print(
            f"target {t['measure']} at {t['window']} in flight: kvfsm/SGLang {t['ratio']:.3f} "
            f"{sign} {t['bound']:.3f}: {'met' if t['met'] else 'NOT met'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="kvfsm,sglang")
    parser.add_argument("--windows", default="1,8,64", help="requests in flight, each measured")
    parser.add_argument("--requests", type=int, default=500, help="per window and round")
    parser.add_argument("--warmup", type=int, default=64, help="requests before measuring")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians reported")
    parser.add_argument("--room-pages", type=int, default=16, help="pages per buffer per request")
    parser.add_argument("--chunks", type=int, default=2, help="send() calls per request")
    parser.add_argument(
        "--step-us",
        type=float,
        default=100.0,
        help="GIL-free wait per scheduler iteration (the forward pass)",
    )
    parser.add_argument(
        "--stories",
        type=int,
        default=0,
        help="kvfsm: the flight-recorder timeline of each window's last N rooms (last round)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one backend's round, as a child
    # Tests: prefill's bytes other than what decode checks for, to prove the check fails.
    parser.add_argument("--prefill-fill", type=int, default=FILL, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.one:
        # os._exit either way: SGLang's backend leaves non-daemon threads that would keep this
        # process alive after an error (as after its parent was killed: stdout is gone).
        try:
            print(json.dumps(one_round(a.one, a)), flush=True)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    names = a.backends.split(",")
    windows = [int(w) for w in a.windows.split(",")]
    if 2 * (max(windows) + 8) > AUX_ROWS:
        parser.error(f"at most {AUX_ROWS // 2 - 8} in flight: one aux row per live room")
    load0 = os.getloadavg()[0]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(a.rounds):
        # Alternated: whichever backend goes first in a round, the other goes first in the next.
        for name in names if r % 2 == 0 else names[::-1]:
            # A pair of processes per backend and round: the other backend's threads (SGLang's
            # spin) never run during its requests.
            argv_one = [sys.executable, __file__, "--one", name]
            for flag in (
                "windows",
                "requests",
                "warmup",
                "room_pages",
                "chunks",
                "step_us",
                "stories",
                "prefill_fill",
            ):
                argv_one += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
            limit = 120 + 120 * len(windows)
            out = subprocess.run(
                argv_one, capture_output=True, text=True, timeout=limit, check=False
            )
            if out.returncode != 0 or not out.stdout.strip():
                raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
            rounds[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "requests": a.requests,
        "windows": windows,
        "rounds": a.rounds,
        "room_bytes": a.room_pages * PAGE_BYTES * BUFFERS,
        "chunks": a.chunks,
        "step_us": a.step_us,
        "loadavg": [load0, os.getloadavg()[0]],
        **summarize(rounds, windows),
    }
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print_summary(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
