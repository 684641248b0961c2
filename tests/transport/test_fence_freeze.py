"""The stale-progress gate on the real thing: a prefill process over UCX's TCP transport (where a
posted WRITE moves only when the writer progresses its agent) is stopped by SIGSTOP right after
``transfer()`` posted a chunk, kept stopped past its lease's end and decode's margin, and let
go. Decode (another process) then checks its pages.

Without the gate the whole chunk lands after the freeze, into pages decode would have settled
and handed out again by then (law 4 broken: this test shows it). With it, the writer's first
act after waking is the gate's refusal; not one byte moves, and the agent is fenced out. With
``exit_fenced_out`` wired (``ManagerConfig.exit_on_fenced_out``, the SGLang adapter's default)
the process then exits with status 75, and still not one byte moves.
"""

from __future__ import annotations

import math
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest

from kvfsm._child import ChildProcess, environ
from kvfsm.manager import FENCED_OUT_EXIT, CommandRouter, exit_fenced_out
from kvfsm.rooms import RoomConfig, RoomEngine
from kvfsm.states import TERMINAL, DestinationReceived, KVPoll
from kvfsm.transport import (
    Agent,
    AgentConfig,
    LayoutSummary,
    Leases,
    NixlTransport,
    TransferConfig,
)
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, page_digests
from kvfsm.workload.peer import PeerProcess
from tests.helpers.interpose import Interposer
from tests.helpers.transport import RecordingControl
from tests.helpers.waiting import stays_true_sync, wait_until_sync

SHAPE = Shape(layers=2, num_pages=64, page_bytes=64 * 1024, aux_rows=8, aux_row_bytes=64)
FENCE = 3
LEASE_S = 1.0
MARGIN_S = 1.0
CANARY = 0x3C
PAGES = list(range(16))  # 16 pages x 4 buffers x 64 KiB: 4 MiB in one chunk


class StopAfterTransfer(Interposer):
    """Wraps the raw agent: the first ``transfer()`` once ``armed`` stops the whole process
    (SIGSTOP) as soon as it returns, with the WRITE posted and not yet progressed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.stopped_after: str | None = None

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.inner.transfer(handle, *args, **kwargs)
        if self.armed:
            self.armed = False
            self.stopped_after = str(state)
            os.kill(os.getpid(), signal.SIGSTOP)
        return state


def _writer(
    conn: Connection, margin_s: float, exits: bool, metadata: bytes, summary: bytes
) -> None:
    """The prefill process (UCX_TLS=tcp, inherited, as is its decode peer's)."""
    kv, aux = make_buffers(SHAPE)
    rng = np.random.default_rng(11)
    for buf in (*kv, aux):
        buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
    stop = StopAfterTransfer()
    agent = Agent(
        f"freeze-prefill-{os.getpid()}", make_layout(kv, aux), AgentConfig(interpose=stop)
    )
    leases = Leases(margin_s=margin_s)
    config = TransferConfig(deadline_base_s=30.0, quarantine_s=0.5)
    # ``exits``: what ManagerConfig.exit_on_fenced_out wires (the SGLang adapter's default).
    on_fenced_out = exit_fenced_out if exits else None
    transport = NixlTransport(agent, config, leases=leases, on_fenced_out=on_fenced_out)
    engine = RoomEngine(CommandRouter(RecordingControl(), transport), RoomConfig()).start()
    decode = msgspec.msgpack.decode(summary, type=LayoutSummary)
    engine.call(transport.connect_peer("decode", metadata, decode))

    async def grant() -> None:
        leases.grant(FENCE, time.monotonic() + LEASE_S)

    src = np.asarray(PAGES, np.int32)
    conn.send(os.getpid())
    try:
        # "run": post one chunk; the poster stops the process right after its transfer().
        assert conn.recv() == ("run",)
        engine.call(grant())
        sender = engine.sender(1)
        engine.post(sender.key, DestinationReceived(src.tobytes(), 2, "decode", fence=FENCE))
        wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
        stop.armed = True
        sender.init(len(PAGES), -1)
        # Answered before the send: the process may stop itself (right after the transfer())
        # before this thread runs again, and the parent must not wait for an answer then.
        conn.send(True)
        sender.send(src)
        # "result", after SIGCONT: report once the room settled (the parent then watches what
        # still lands).
        assert conn.recv() == ("result",)
        wait_until_sync(lambda: sender.poll() in TERMINAL, timeout=20)
        wait_until_sync(lambda: sender.settled, timeout=20)
        conn.send(
            {
                "stopped_after": stop.stopped_after,
                "digests": page_digests(kv, src),
                "poll": sender.poll().name,
                "reason": sender.reason,
                "fenced_out": transport.fenced_out,
            }
        )
        conn.recv()  # quit
    finally:
        engine.close()
        transport.close()
        agent.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _freeze_once(mode: str) -> tuple[int, int, list[int], dict[str, Any]]:
    """One writer stopped right after posting its WRITE, kept stopped past lease + margin, let
    go. Returns the pages untouched soon after the stop (what had landed by then was written
    under the lease: legal), the pages untouched at the end, decode's digests at the end, and
    the writer's report (its exit status in mode ``gate-exits``)."""
    margin = math.inf if mode == "no-gate" else MARGIN_S  # inf: the gate never refuses
    exits = mode == "gate-exits"
    with environ({"UCX_TLS": "tcp"}):
        peer = PeerProcess(SHAPE, name=f"freeze-decode-{os.getpid()}")
        summary = msgspec.msgpack.encode(peer.summary)
        writer = ChildProcess(_writer, margin, exits, peer.metadata, summary, what="frozen writer")
    try:
        peer.ask("fill", CANARY)
        pid = writer.greeting
        assert writer.ask("run") is True
        wait_until_sync(lambda: _stopped(pid), timeout=20)
        # Real time on purpose, inside the lease still (it began a few ms ago): whatever the
        # writer pushed into its socket before the stop lands within this (decode progresses
        # all the time), and nothing marks that it did.
        time.sleep(0.2)
        early = peer.ask("digests", np.asarray(PAGES, np.int32).tobytes())
        # Real time on purpose: decode would settle the pages at its last grant + lease +
        # margin on the real clock; the SIGSTOP must last well past that.
        time.sleep(LEASE_S + MARGIN_S + 1.0)
        os.kill(pid, signal.SIGCONT)
        if exits:
            writer.process.join(30)
            result: dict[str, Any] = {"exitcode": writer.process.exitcode}
        else:
            result = writer.ask("result", timeout=60)

        def digests() -> list[Any]:
            got: list[Any] = peer.ask("digests", np.asarray(PAGES, np.int32).tobytes())
            return got

        if mode == "no-gate":
            # What the gate prevents: the chunk lands after the freeze (the test checks it).
            sources = result["digests"]
            wait_until_sync(
                lambda: sum(a == b for a, b in zip(digests(), sources, strict=True)) == len(PAGES),
                timeout=20,
                interval=0.05,
                message="the whole chunk to land after the freeze",
            )
        got = digests()
        if mode != "no-gate":
            # Anything the writer (or its death) let go of would land within a second.
            stays_true_sync(
                lambda: digests() == got,
                duration=1.0,
                interval=0.05,
                message="decode's pages unchanged after the writer settled",
            )
    finally:
        writer.close()
        peer.close()
    filled = [np.full((1, SHAPE.page_bytes), CANARY, np.uint8)] * 4
    canary = page_digests(filled, np.zeros(1, np.int32))[0]
    return sum(d == canary for d in early), sum(d == canary for d in got), got, result


@pytest.mark.parametrize("mode", ["gate", "no-gate", "gate-exits"])
def test_a_write_posted_before_a_freeze_never_lands_after_it(mode: str) -> None:
    # The stop comes right after transfer() returns, but UCX may already have pushed the
    # bytes into the socket inside that call, or another thread may have progressed the agent
    # in the microseconds the stop takes to reach every thread (seen once in a loaded CI run:
    # all 16 pages had landed, under the lease). Such a run has nothing left to fence, so it
    # proves nothing either way: try again, up to three times.
    for _ in range(3):
        untouched_early, untouched, got, result = _freeze_once(mode)
        if untouched_early == len(PAGES):
            break
    else:
        pytest.fail(f"the WRITE moved before the freeze in 3 tries ({untouched_early} untouched)")
    if mode == "gate-exits":
        # The gate refused, the process ended at once; not a page landed, then or since.
        assert result["exitcode"] == FENCED_OUT_EXIT, result
        assert untouched == len(PAGES), untouched
        return
    landed = sum(a == b for a, b in zip(got, result["digests"], strict=True))
    assert result["stopped_after"] == "PROC", result  # posted, nothing moved yet (TCP)
    assert result["poll"] == "Failed", result
    if mode == "gate":
        assert untouched == len(PAGES), (untouched, landed)  # not a page written after it
        assert result["fenced_out"] is not None, result
        assert result["fenced_out"] in result["reason"], result
    else:
        # What the gate prevents: the whole chunk landed after the freeze.
        assert landed == len(PAGES), (untouched, landed)
        assert result["fenced_out"] is None, result
