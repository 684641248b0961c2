"""Measurements behind docs/reliability.md (Write fencing): real NIXL (UCX), DRAM, two processes.

Run: ``python -m tests.transport.fence_probe [--tls tcp] [--json]``. Three probes:

* ``window``: on the production poster path (``NixlTransport`` fenced by ``Leases``), the time
  from the lease check's return to the entry of ``transfer()``: what a freeze in between
  leaves unfenced. Idle, and with a GIL-hungry Python thread in the process (a scheduler).
* ``transfer``: how long ``transfer()`` takes per chunk size (one contiguous run per K/V
  buffer): on the shared-memory (CMA) path that is the synchronous copy, where a freeze
  mid-copy leaves the rest of the chunk to land after the freeze.
* ``target``: can the page owner refuse writes? Decode calls ``remove_remote_agent`` on the
  writer's name (it never added it), and deregisters its memory; then prefill posts a WRITE
  with the registration it loaded earlier, and we look at what landed.
* ``queued``: how much of a posted WRITE is still queued in the writer when it stops
  progressing (a freeze right after ``transfer()``, or a writer that stops being scheduled):
  the target counts the pages that landed while the writer does nothing for a while, then
  again after the writer progresses once. Over TCP the rest lands only then, however late.
* ``flush``: the *target* stopped (SIGSTOP) while a WRITE to it is in flight; the writer
  keeps progressing, then releases the handle and posts a flush (the pump's: an 8-byte READ
  of the target's first region, ``Peer.flush``). What the WRITE and the flush report while
  the target is stopped, how long after SIGCONT the flush is DONE, and how many pages had
  landed by then and a second later (the data path's rule 2 rests on: all of them, at DONE).

Not collected by pytest (no ``test_`` prefix): it takes a while and reports numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import threading
import time
import zlib
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kvfsm._child import ChildProcess
from kvfsm.rooms import RoomConfig, RoomEngine
from kvfsm.states import TERMINAL, DestinationReceived
from kvfsm.transport import Agent, AgentConfig, LayoutSummary, Leases, NixlTransport
from kvfsm.transport._agent import Peer
from kvfsm.workload.buffers import Shape, make_buffers, make_layout
from kvfsm.workload.peer import PeerProcess
from tests.helpers.interpose import Interposer
from tests.helpers.waiting import wait_until_sync

FENCE = 1


# -- window -------------------------------------------------------------------------------------


class TimedLeases(Leases):
    """Records when each ``valid()`` returns (the poster is the only caller from another
    thread; the loop's calls are told apart by thread)."""

    __slots__ = ("poster_checks",)

    def __init__(self) -> None:
        super().__init__()
        self.poster_checks: list[int] = []

    def valid(self, fence: int, now: float) -> bool:
        ok = super().valid(fence, now)
        if threading.current_thread().name.startswith("kvfsm-poster"):
            self.poster_checks.append(time.perf_counter_ns())
        return ok


class EntryClock(Interposer):
    """``AgentConfig.interpose``: records the entry time and duration of every transfer()."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[int] = []
        self.durations: list[int] = []

    def transfer(self, handle: Any) -> Any:
        t0 = time.perf_counter_ns()
        self.entries.append(t0)
        state = self.inner.transfer(handle)
        self.durations.append(time.perf_counter_ns() - t0)
        return state


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def window(rooms: int = 1500) -> dict[str, Any]:
    shape = Shape(layers=2, num_pages=256, page_bytes=4096, aux_rows=8, aux_row_bytes=64)
    peer = PeerProcess(shape, name=f"probe-decode-{os.getpid()}")
    kv, aux = make_buffers(shape)
    clock = EntryClock()
    config = AgentConfig(interpose=clock)
    agent = Agent(f"probe-prefill-{os.getpid()}", make_layout(kv, aux), config)
    leases = TimedLeases()
    transport = NixlTransport(agent, leases=leases)
    engine = RoomEngine(transport, RoomConfig()).start()
    out: dict[str, Any] = {}
    try:
        engine.call(transport.connect_peer("decode", peer.metadata, peer.summary))

        async def grant() -> None:
            leases.grant(FENCE, time.monotonic() + 3600)

        engine.call(grant())
        for label, spinners in (("idle", 0), ("gil_busy", 1)):
            stop = threading.Event()
            threads = [threading.Thread(target=_spin, args=(stop,)) for _ in range(spinners)]
            for t in threads:
                t.start()
            leases.poster_checks.clear()
            clock.entries.clear()
            senders = []
            for room in range(rooms):
                sender = engine.sender(10_000 * spinners + room)
                page = np.asarray([room % shape.num_pages], np.int32)
                engine.post(
                    sender.key, DestinationReceived(page.tobytes(), 0, "decode", fence=FENCE)
                )
                senders.append((sender, page))
            for sender, page in senders:
                wait_until_sync(lambda s=sender: s.poll().value >= 2)
                sender.init(1)
                sender.send(page)
            rooms_now = [s for s, _ in senders]
            wait_until_sync(lambda r=rooms_now: all(s.poll() in TERMINAL for s in r), timeout=120)
            stop.set()
            for t in threads:
                t.join()
            pairs = list(zip(leases.poster_checks, clock.entries, strict=True))
            out[label] = _summary([(b - a) / 1e3 for a, b in pairs])
        out["transfer_4k_pages_us"] = _summary([d / 1e3 for d in clock.durations])
    finally:
        engine.close()
        transport.close()
        agent.close()
        peer.close()
    return out


def _summary(us: list[float]) -> dict[str, float]:
    us = sorted(us)
    return {
        "n": len(us),
        "p50": round(statistics.median(us), 2),
        "p99": round(us[int(0.99 * (len(us) - 1))], 2),
        "max": round(us[-1], 2),
    }


# -- transfer() per chunk size ------------------------------------------------------------------


def transfer_sizes(repeat: int = 15) -> dict[str, Any]:
    page = 64 * 1024
    shape = Shape(layers=1, num_pages=512, page_bytes=page, aux_rows=8, aux_row_bytes=64)
    peer = PeerProcess(shape, name=f"probe-decode-sizes-{os.getpid()}")
    kv, aux = make_buffers(shape)
    for buf in kv:
        buf[:] = 7
    agent = Agent(f"probe-prefill-sizes-{os.getpid()}", make_layout(kv, aux))
    remote = agent.connect("decode", peer.metadata, peer.summary)
    nixl, layout = agent.nixl, agent.layout
    out: dict[str, Any] = {}
    try:
        for pages in (2, 8, 128, 512):  # x 64 KiB x 2 buffers: 256 KiB, 1, 16, 64 MiB
            idx = layout.page_index(np.arange(pages, dtype=np.int32))
            ridx = peer.summary.page_index(np.arange(pages, dtype=np.int32))
            times, states = [], set()
            for _ in range(repeat):
                handle = nixl.make_prepped_xfer("WRITE", agent.local("kv"), idx, remote.kv, ridx)
                t0 = time.perf_counter_ns()
                state = nixl.transfer(handle)
                times.append((time.perf_counter_ns() - t0) / 1e3)
                states.add(state)
                while state == "PROC":
                    state = nixl.check_xfer_state(handle)
                nixl.release_xfer_handle(handle)
            mib = pages * page * 2 / 2**20
            out[f"{mib:g}MiB"] = {**_summary(times), "returned": sorted(states)}
    finally:
        agent.disconnect(remote)
        agent.close()
        peer.close()
    return out


# -- can the target refuse? ----------------------------------------------------------------------


def _target(conn: Connection, shape: Shape, name: str) -> None:
    kv, aux = make_buffers(shape)
    agent = Agent(name, make_layout(kv, aux))
    conn.send((agent.metadata(), msgspec.msgpack.encode(agent.layout.summary())))
    progress = agent.nixl.get_new_notifs
    try:
        while True:
            progress()
            if not conn.poll(0.0002):
                continue
            op, *args = conn.recv()
            if op == "quit":
                break
            if op == "fill":
                for buf in kv:
                    buf.fill(args[0])
                conn.send(True)
            elif op == "crc":
                conn.send([zlib.crc32(buf[args[0]].data) for buf in kv])
            elif op == "remove":
                try:
                    agent.nixl.remove_remote_agent(args[0])
                except Exception as exc:  # what NIXL says is the finding
                    conn.send(f"raised {type(exc).__name__}: {exc}")
                else:
                    conn.send("ok")
            elif op == "deregister":
                for reg in agent._registrations:
                    agent.nixl.deregister_memory(reg)
                agent._registrations.clear()
                conn.send(True)
    except (EOFError, OSError):
        pass


class Target(ChildProcess):
    def __init__(self, shape: Shape, name: str) -> None:
        super().__init__(_target, shape, name, what="probe target")
        metadata, summary = self.greeting
        self.metadata: bytes = metadata
        self.summary = msgspec.msgpack.decode(summary, type=LayoutSummary)


@contextlib.contextmanager
def _writer_and_target(pages: int, name: str) -> Iterator[tuple[Target, Agent, Peer, int]]:
    """A target process of ``pages`` pages (64 KiB) and a writer agent in this process whose
    every source page holds 0x5A, connected to it; yields them and the CRC of one source
    page (what a landed page reads), then takes both down."""
    shape = Shape(layers=1, num_pages=pages, page_bytes=64 * 1024, aux_rows=8, aux_row_bytes=64)
    decode = Target(shape, f"probe-{name}-{os.getpid()}")
    kv, aux = make_buffers(shape)
    for buf in kv:
        buf[:] = 0x5A
    agent = Agent(f"probe-{name}-writer-{os.getpid()}", make_layout(kv, aux))
    remote = agent.connect("decode", decode.metadata, decode.summary)
    try:
        yield decode, agent, remote, zlib.crc32(kv[0][0].data)
    finally:
        agent.disconnect(remote)
        agent.close()
        decode.close()


def target() -> dict[str, Any]:
    with _writer_and_target(64, "target") as (decode, agent, remote, want):
        return _target_probes(decode, agent, remote, want)


def _target_probes(decode: Target, agent: Agent, remote: Peer, want: int) -> dict[str, Any]:
    nixl = agent.nixl
    out: dict[str, Any] = {}

    def write(page: int) -> str:
        idx = agent.layout.page_index(np.asarray([page], np.int32))
        ridx = decode.summary.page_index(np.asarray([page], np.int32))
        try:
            handle = nixl.make_prepped_xfer("WRITE", agent.local("kv"), idx, remote.kv, ridx)
            state = nixl.transfer(handle)
            deadline = time.monotonic() + 5
            while state == "PROC" and time.monotonic() < deadline:
                state = nixl.check_xfer_state(handle)
            nixl.release_xfer_handle(handle)
            return str(state)
        except Exception as exc:
            return f"raised {type(exc).__name__}: {exc}"

    out["remove_remote_agent(writer) on decode"] = decode.ask("remove", agent.name)
    out["remove_remote_agent(unknown name) on decode"] = decode.ask("remove", "no-such")
    decode.ask("fill", 0)
    out["write before deregister"] = write(3)
    out["landed before deregister"] = decode.ask("crc", 3)[0] == want
    decode.ask("fill", 0)
    decode.ask("deregister")
    out["write after decode deregistered"] = write(3)
    time.sleep(0.2)  # the measurement: what landed a moment after a refused-or-not WRITE
    out["landed after deregister"] = decode.ask("crc", 3)[0] == want
    return out


# -- what a writer that stops progressing still holds --------------------------------------------


def queued(pages: int = 256, idle_s: float = 2.0, release: bool = False) -> dict[str, Any]:
    with _writer_and_target(pages, "queued") as (decode, agent, remote, want):
        nixl = agent.nixl
        all_pages = list(range(pages))

        def landed() -> int:
            return sum(decode.ask("crc", p)[0] == want for p in all_pages)

        out: dict[str, Any] = {"bytes": 2 * pages * 64 * 1024}
        decode.ask("fill", 0)
        idx = agent.layout.page_index(np.arange(pages, dtype=np.int32))
        ridx = decode.summary.page_index(np.arange(pages, dtype=np.int32))
        handle = nixl.make_prepped_xfer("WRITE", agent.local("kv"), idx, remote.kv, ridx)
        t0 = time.monotonic()
        out["transfer() returned"] = str(nixl.transfer(handle))
        time.sleep(idle_s)  # no progress: what a frozen writer leaves behind
        out[f"pages landed after {idle_s:g} s without progress"] = landed()
        if release:  # what the pump does with a chunk whose lease is gone, then progress
            nixl.release_xfer_handle(handle)
            end = time.monotonic() + idle_s
            while time.monotonic() < end:
                nixl.get_new_notifs()
            out["pages landed after release, then progressing"] = landed()
        else:
            state = nixl.check_xfer_state(handle)
            while state == "PROC" and time.monotonic() - t0 < idle_s + 10:
                state = nixl.check_xfer_state(handle)
            out["state after progressing"] = str(state)
            out["pages landed after progressing"] = landed()
            nixl.release_xfer_handle(handle)
        out["of pages"] = pages
        return out


# -- what a flush proves when the target is stopped ------------------------------------------------


def flush(pages: int = 256, stopped_s: float = 2.0) -> dict[str, Any]:
    with _writer_and_target(pages, "flush") as (decode, agent, remote, want):
        nixl = agent.nixl
        all_pages = list(range(pages))

        def landed() -> int:
            return sum(decode.ask("crc", p)[0] == want for p in all_pages)

        def progress_for(handle: Any, seconds: float) -> str:
            state = "PROC"
            end = time.monotonic() + seconds
            while state == "PROC" and time.monotonic() < end:
                state = str(nixl.check_xfer_state(handle))
            return state

        out: dict[str, Any] = {"bytes": 2 * pages * 64 * 1024, "of pages": pages}
        decode.ask("fill", 0)
        os.kill(decode.pid, signal.SIGSTOP)
        try:
            idx = agent.layout.page_index(np.arange(pages, dtype=np.int32))
            ridx = decode.summary.page_index(np.arange(pages, dtype=np.int32))
            write = nixl.make_prepped_xfer("WRITE", agent.local("kv"), idx, remote.kv, ridx)
            out["write: transfer()"] = str(nixl.transfer(write))
            out["write: after 0.5 s of progress, target stopped"] = progress_for(write, 0.5)
            nixl.release_xfer_handle(write)  # what the pump does with a held chunk
            assert remote.flush is not None
            local, far = remote.flush
            first = np.zeros(1, np.int32)
            marker = nixl.make_prepped_xfer("READ", local, first, far, first)
            out["flush: transfer()"] = str(nixl.transfer(marker))
            out[f"flush: after {stopped_s:g} s of progress, target stopped"] = progress_for(
                marker, stopped_s
            )
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        t0 = time.monotonic()
        state = progress_for(marker, 10.0)
        out["flush: state after SIGCONT"] = state
        out["flush: DONE this long after SIGCONT (ms)"] = round(1e3 * (time.monotonic() - t0), 2)
        out["pages landed at the flush's DONE"] = landed()
        nixl.release_xfer_handle(marker)
        for _ in range(1000):
            nixl.get_new_notifs()
        time.sleep(1.0)  # the measurement: "a second later"
        out["pages landed a second later"] = landed()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tls", default="", help="UCX_TLS for both processes (e.g. tcp)")
    parser.add_argument("--probes", default="window,transfer,target")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    results: dict[str, Any] = {"UCX_TLS": args.tls or "(default)", "cpus": os.cpu_count()}
    probes = {
        "window": window,
        "transfer": transfer_sizes,
        "target": target,
        "queued": queued,
        "flush": flush,
    }
    for name in args.probes.split(","):
        results[name] = probes[name]()
    if args.json:
        print(json.dumps(results))
    else:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
