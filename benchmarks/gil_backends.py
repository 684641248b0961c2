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
* decode, a child process: the backend's bootstrap server (SGLang runs it in the HTTP server's
  process, not in a scheduler's) and its decode manager. It keeps ``--ahead`` receivers created,
  ``init``-ed and given their pages (``send_metadata``) ahead of prefill, in the same room
  order, and clears each one on Success. It sleeps 0.5 ms whenever nothing moved.

Both backends get the same buffers (4 KV buffers of 1,024 pages x 16 KiB and an aux buffer, in
DRAM, real NIXL over UCX between the two processes), rooms of ``--room-pages`` pages per buffer
(16: 1 MiB a room) and the same room order. Reported per backend: iterations/s idle and busy
and their ratio (best round, and the spread), rooms/s and GB/s while busy, failed rooms, the
process CPU per second, and the CPU per second of the threads other than the scheduler's, by OS
thread name (``/proc``: kvfsm names its threads, SGLang's show as ``python``).

SGLang's NIXL backend imports ``nixl._api`` (from the ``nixl`` meta-package); where only the
``nixl-cu12`` wheel is installed, as here, the SGLang side is given ``nixl_cu12`` under that
name. Its managers read SGLang's published configuration (``override_server_args``) and
parallel context (ranks 0, no pipeline group), which a one-rank server would have published.

Run: ``python benchmarks/gil_backends.py`` (``--json`` for one JSON object; ``--backends sglang``
for one backend).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
from gil import _work, calibrate, scheduler_share, scheduler_times  # benchmarks/ is on sys.path

KIB = 1024
PAGE_BYTES = 16 * KIB
BUFFERS = 4
PAGES = 1024
AUX_ROWS, AUX_BYTES = 64, 64
WAITING, SUCCESS, FAILED = 2, 4, 0  # KVPoll's ints, the same in both backends
FILL = 7  # every byte of prefill's KV buffers
BACKENDS = ("kvfsm", "sglang")


# -- the two backends, through SGLang's interface ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kv_args(fill: int) -> tuple[Any, list[np.ndarray]]:
    """SGLang's ``KVArgs`` with every field either backend's manager reads (one rank, no state
    pool, not MLA), over freshly allocated DRAM buffers (returned, to keep them alive)."""
    from kvfsm.sglang._bases import KVArgs

    kv = [np.full((PAGES, PAGE_BYTES), fill, np.uint8) for _ in range(BUFFERS)]
    aux = np.zeros((AUX_ROWS, AUX_BYTES), np.uint8)
    a = KVArgs()
    a.engine_rank = a.pp_rank = a.system_dp_rank = a.gpu_id = 0
    a.rust_http_port = a.kv_layout = a.prefill_end_layer = a.ib_device = None
    a.swa_kv_cache_layout = a.mla_compression_ratios = None
    a.kv_cache_dtype_str = "bfloat16"
    a.prefill_start_layer = a.num_draft_entries = 0
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [PAGE_BYTES] * BUFFERS
    a.kv_layer_ids = [i // 2 for i in range(BUFFERS)]  # K and V of each layer
    a.kv_data_mem_kinds = ["DRAM"] * BUFFERS
    a.kv_head_num = a.total_kv_head_num = 1
    a.page_size = 16
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.ctypes.data], [aux.nbytes], [AUX_BYTES]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_layer_ids = [], [], []
    a.state_conv_shard_groups = []
    a.is_hybrid_mla_backend = False
    return a, [*kv, aux]


class Kvfsm:
    """kvfsm's adapter, as SGLang loads it for ``--disaggregation-transfer-backend nixl``."""

    def __init__(self) -> None:
        from kvfsm.sglang import (
            KvfsmKVBootstrapServer,
            KvfsmKVManager,
            KvfsmKVReceiver,
            KvfsmKVSender,
        )

        self._server_cls, self._manager_cls = KvfsmKVBootstrapServer, KvfsmKVManager
        self.sender_cls, self.receiver_cls = KvfsmKVSender, KvfsmKVReceiver

    @contextlib.contextmanager
    def configured(self, port: int) -> Iterator[None]:
        yield  # kvfsm reads the ServerArgs it is handed

    def bootstrap_server(self) -> tuple[Any, int]:
        server = self._server_cls("127.0.0.1", 0)
        return server, int(server.port)

    def manager(self, mode: str, args: Any, port: int) -> Any:
        from kvfsm.sglang._bases import DisaggregationMode

        sargs = SimpleNamespace(
            host="127.0.0.1",
            disaggregation_bootstrap_port=port,
            tp_size=1,
            dp_size=1,
            pp_size=1,
            enable_dp_attention=False,
            dist_init_addr=None,
        )
        return self._manager_cls(args, DisaggregationMode(mode), sargs, False)


class SGLangNixl:
    """SGLang 0.5.23's own NIXL backend (``sglang.srt.disaggregation.nixl.conn``)."""

    def __init__(self) -> None:
        if "nixl" not in sys.modules:
            with contextlib.suppress(ImportError):
                import nixl._api  # noqa: F401  (the meta-package, where installed)
        if "nixl._api" not in sys.modules:
            import nixl_cu12
            import nixl_cu12._api

            sys.modules["nixl"], sys.modules["nixl._api"] = nixl_cu12, nixl_cu12._api
        from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
        from sglang.srt.disaggregation.nixl.conn import (
            NixlKVManager,
            NixlKVReceiver,
            NixlKVSender,
        )

        self._server_cls, self._manager_cls = CommonKVBootstrapServer, NixlKVManager
        self.sender_cls, self.receiver_cls = NixlKVSender, NixlKVReceiver

    @contextlib.contextmanager
    def configured(self, port: int) -> Iterator[None]:
        from sglang.srt.runtime_context import get_context, get_parallel

        overrides = {"disaggregation_bootstrap_port": port, "host": "127.0.0.1", "device": "cpu"}
        with get_context().override_server_args(**overrides):
            ranks = ("attn_tp", "attn_cp", "attn_dcp", "attn_dp", "dcp", "dp", "pp", "tp")
            get_parallel().override_permanently(**{f"{r}_rank": 0 for r in ranks}, pp_group=None)
            yield

    def bootstrap_server(self) -> tuple[Any, int]:
        port = _free_port()
        return self._server_cls("127.0.0.1", port), port

    def manager(self, mode: str, args: Any, port: int) -> Any:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        return self._manager_cls(args, DisaggregationMode(mode), None, False)


def backend(name: str) -> Kvfsm | SGLangNixl:
    return Kvfsm() if name == "kvfsm" else SGLangNixl()


# -- decode: the child process -------------------------------------------------------------------


def decode_main(name: str, ahead: int, room_pages: int) -> None:
    """Serve receivers ``ahead`` rooms ahead of prefill until stdin closes; then print counts."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    be = backend(name)
    _server, port = be.bootstrap_server()  # held: it serves until this process ends
    print(json.dumps({"port": port}), flush=True)
    stop = threading.Event()
    go = sys.stdin.readline()  # prefill registered with the bootstrap server
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    counts = {"succeeded": 0, "failed": 0, "wrong_bytes": 0}
    with be.configured(port):
        args, buffers = _kv_args(0)
        kv = buffers[:BUFFERS]
        mgr = be.manager("decode", args, port)
        addr = f"127.0.0.1:{port}"
        give_up = time.monotonic() + 60
        while go and not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > give_up:  # prefill never registered: say so, do not hang
                print(json.dumps({"ready": False}), flush=True)
                os._exit(1)
            time.sleep(0.01)
        print(json.dumps({"ready": True}), flush=True)
        slots = PAGES // room_pages
        live: list[list[Any]] = []
        room = 0
        while not stop.is_set():
            while len(live) < ahead:
                room += 1
                receiver = be.receiver_cls(mgr, addr, room)
                receiver.init(0)
                live.append([room, receiver, None])
            moved = False
            keep_live = []
            for entry in live:
                r, receiver, pages = entry
                status = int(receiver.poll())
                if pages is None and status == WAITING:
                    lo = (r % slots) * room_pages
                    pages = entry[2] = np.random.default_rng(r).permutation(
                        np.arange(lo, lo + room_pages, dtype=np.int32)
                    )
                    for buffer in kv:  # cleared, so that Success must have written them
                        buffer[pages] = 0
                    receiver.send_metadata(pages, r % AUX_ROWS, None, decode_prefix_len=0)
                    moved = True
                if status in (SUCCESS, FAILED):
                    counts["succeeded" if status == SUCCESS else "failed"] += 1
                    # Prefill's pages all hold FILL: each page's first and last byte, everywhere.
                    if status == SUCCESS and any(np.any(b[pages][:, [0, -1]] != FILL) for b in kv):
                        counts["wrong_bytes"] += 1
                    receiver.clear()
                    moved = True
                    continue
                keep_live.append(entry)
            live = keep_live
            if not moved:
                time.sleep(0.0005)
    print(json.dumps(counts), flush=True)
    sys.stdout.flush()
    os._exit(0)  # SGLang's C extensions can crash the interpreter's teardown on a CPU machine


# -- prefill: the measured process ---------------------------------------------------------------


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads other than the main one, summed by OS name
    (``/proc/self/task``; Linux)."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    main_tid = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main_tid:
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
            fields = rest.split()
            name = head.split("(", 1)[1]
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


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
    argv = [sys.executable, __file__, "--decode", name, "--ahead", str(a.ahead)]
    child = subprocess.Popen(
        [*argv, "--room-pages", str(a.room_pages)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        port = int(json.loads(child.stdout.readline())["port"])
        with be.configured(port):
            args, _buffers = _kv_args(a.prefill_fill)
            mgr = be.manager("prefill", args, port)
            child.stdin.write("go\n")
            child.stdin.flush()
            if not json.loads(child.stdout.readline()).get("ready"):
                raise RuntimeError("decode side did not come up")
            prefill = Prefill(be, mgr, f"127.0.0.1:{port}", a.room_pages)
            prefill.phase(True, 1.0, a.n_work, a.window)  # warm-up
            rounds = []
            for _ in range(a.rounds):
                idle = prefill.phase(False, a.seconds, a.n_work, a.window)
                busy = prefill.phase(True, a.seconds, a.n_work, a.window)
                ratio = busy["iterations_per_s"] / idle["iterations_per_s"]
                rounds.append({"idle": idle, "busy": busy, "ratio": ratio})
        child.stdin.close()
        decode = json.loads(child.stdout.readline())
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
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
    parser.add_argument("--decode", help=argparse.SUPPRESS)  # the child's role
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one backend's prefill, as a child
    parser.add_argument("--n-work", type=int, help=argparse.SUPPRESS)  # the parent's calibration
    # Tests: prefill's bytes other than what decode checks for, to prove the check fails.
    parser.add_argument("--prefill-fill", type=int, default=FILL, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.decode:
        decode_main(a.decode, a.ahead, a.room_pages)
    if a.one:
        print(json.dumps(prefill_main(a.one, a)), flush=True)
        os._exit(0)  # see decode_main
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
