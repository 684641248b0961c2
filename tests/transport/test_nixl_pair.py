"""NixlPairSink with real NIXL (UCX, DRAM): bytes that land equal bytes sent, bad page indices fail
one room, and every transfer handle is released once the engine has closed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from kvfsm.rooms import ReceiverRoom, RoomConfig, RoomEngine, SenderRoom
from kvfsm.states import TERMINAL, KVPoll
from kvfsm.transport import NixlPairSink

NUM_PAGES = 1024
PAGE_BYTES = 4096
AUX_ROWS = 64
AUX_ROW_BYTES = 256
REPO = Path(__file__).resolve().parents[2]

Pages = npt.NDArray[np.int32]


@dataclass
class Spec:
    """One room as the test drives it: src[i] is written into dst[i]."""

    rid: int
    src: Pages
    dst: Pages
    src_aux: int
    dst_aux: int
    chunks: list[Pages]
    sender: SenderRoom | None = None
    receiver: ReceiverRoom | None = None
    sent: int = 0
    stage: str = "bootstrap"
    reasons: list[str] = field(default_factory=list)


def random_specs(rng: np.random.Generator, count: int, first_id: int = 0) -> list[Spec]:
    """``count`` rooms with disjoint destination pages and aux rows, random sources and chunks."""
    dst_pool = rng.permutation(NUM_PAGES).astype(np.int32)
    aux_pool = rng.permutation(AUX_ROWS)
    specs, used = [], 0
    for i in range(count):
        n = int(rng.integers(1, NUM_PAGES // count + 1))
        dst = np.sort(dst_pool[used : used + n]) if i % 2 else dst_pool[used : used + n]
        used += n
        src = rng.choice(NUM_PAGES, n, replace=False).astype(np.int32)
        cuts = np.sort(rng.integers(0, n, size=int(rng.integers(0, 4))))
        specs.append(
            Spec(
                rid=first_id + i,
                src=src,
                dst=dst,
                src_aux=int(rng.integers(AUX_ROWS)),
                dst_aux=int(aux_pool[i]),
                chunks=np.split(src, cuts),
            )
        )
    return specs


def drive(engine: RoomEngine, specs: list[Spec], timeout: float = 15.0) -> None:
    """Run every room at once from this thread, scheduler style: poll all, block on none."""
    for spec in specs:
        spec.sender = engine.sender(spec.rid)
        spec.receiver = engine.receiver(spec.rid)
        spec.receiver.init(0)
    deadline = time.monotonic() + timeout
    while True:
        busy = False
        for spec in specs:
            s, r = spec.sender, spec.receiver
            assert s is not None
            assert r is not None
            if spec.stage == "bootstrap" and r.poll() is KVPoll.WaitingForInput:
                r.send_metadata(spec.dst, spec.dst_aux)
                spec.stage = "wait-sender"
            elif spec.stage == "wait-sender" and s.poll() is KVPoll.WaitingForInput:
                s.init(spec.src.size, spec.src_aux)
                spec.stage = "sending"
            elif spec.stage == "sending":
                s.send(spec.chunks[spec.sent])
                spec.sent += 1
                if spec.sent == len(spec.chunks):
                    spec.stage = "sent"
            if s.poll() in TERMINAL and r.poll() in TERMINAL and s.settled and r.settled:
                continue
            busy = True
        if not busy:
            return
        if time.monotonic() > deadline:
            stuck = [(x.rid, x.stage, x.sender, x.receiver) for x in specs]
            pytest.fail(f"rooms not terminal and settled after {timeout}s: {stuck}")
        time.sleep(0.0002)


def landed(sink: NixlPairSink, spec: Spec) -> bool:
    return np.array_equal(sink.dst_kv[spec.dst], sink.src_kv[spec.src]) and np.array_equal(
        sink.dst_aux[spec.dst_aux], sink.src_aux[spec.src_aux]
    )


@pytest.fixture
def sink() -> Iterator[NixlPairSink]:
    pair = NixlPairSink(
        num_pages=NUM_PAGES, page_bytes=PAGE_BYTES, aux_rows=AUX_ROWS, aux_row_bytes=AUX_ROW_BYTES
    )
    rng = np.random.default_rng(7)
    pair.src_kv[:] = rng.integers(0, 256, pair.src_kv.shape, dtype=np.uint8)
    pair.src_aux[:] = rng.integers(0, 256, pair.src_aux.shape, dtype=np.uint8)
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def engine(sink: NixlPairSink) -> Iterator[RoomEngine]:
    eng = RoomEngine(sink, RoomConfig(strict=True)).start()
    try:
        yield eng
    finally:
        eng.close()
    assert eng.registry_on_loop().errors == []
    # Law 4 at the transport: once the engine has closed, no handle is left behind.
    assert sink.in_flight == 0
    assert sink.handles_created == sink.handles_released


def test_fifty_concurrent_rooms_land_every_byte(engine: RoomEngine, sink: NixlPairSink) -> None:
    specs = random_specs(np.random.default_rng(1), 50)
    assert sum(len(s.chunks) for s in specs) > 50  # random chunkings, not one chunk per room
    drive(engine, specs)
    for spec in specs:
        assert spec.sender is not None
        assert spec.receiver is not None
        assert spec.sender.poll() is KVPoll.Success, spec.sender.reason
        assert spec.receiver.poll() is KVPoll.Success, spec.receiver.reason
        assert landed(sink, spec), f"room {spec.rid}: bytes differ"
    stats = sink.stats()
    assert stats["chunks_failed"] == 0
    assert stats["handles_created"] > 0
    assert engine.stats()["succeeded"] == 100


def test_out_of_range_page_fails_only_that_room(engine: RoomEngine, sink: NixlPairSink) -> None:
    specs = random_specs(np.random.default_rng(2), 12)
    bad_dst, bad_src = specs[3], specs[8]
    # Destination: the receiver names a page the decode buffer does not have, in the last chunk
    # of a two-chunk room (chunk 0 is fine and moves for real).
    bad_dst.dst = np.append(bad_dst.dst, np.int32(NUM_PAGES + 5)).astype(np.int32)
    extra = bad_dst.src[:1]
    bad_dst.src = np.append(bad_dst.src, extra).astype(np.int32)
    bad_dst.chunks = [bad_dst.src[:-1], bad_dst.src[-1:]]
    # Source: the prefill side sends a page it does not have.
    bad_src.src = bad_src.src.copy()
    bad_src.src[-1] = 70000
    bad_src.chunks = [bad_src.src]
    created_before = sink.handles_created

    drive(engine, specs)

    for spec in specs:
        assert spec.sender is not None
        assert spec.receiver is not None
        if spec in (bad_dst, bad_src):
            index = str(NUM_PAGES + 5) if spec is bad_dst else "70000"
            assert spec.sender.poll() is KVPoll.Failed
            assert spec.receiver.poll() is KVPoll.Failed
            assert index in spec.sender.reason, spec.sender.reason
            assert "out of range" in spec.sender.reason
            assert index in spec.receiver.reason, spec.receiver.reason  # via PeerFailed
        else:
            assert spec.sender.poll() is KVPoll.Success, spec.sender.reason
            assert spec.receiver.poll() is KVPoll.Success, spec.receiver.reason
            assert landed(sink, spec), f"room {spec.rid}: bytes differ"
    assert sink.chunks_rejected == 2
    # The bad chunks never reached NIXL: one handle per good non-empty chunk, no more.
    good_chunks = sum(
        1
        for spec in specs
        if spec is not bad_src
        for i, chunk in enumerate(spec.chunks)
        if chunk.size or i == len(spec.chunks) - 1
    )
    # Minus bad_dst's chunk 1, and minus its chunk 0 if the failure beat it to the NIXL worker.
    assert sink.chunks_cancelled in (0, 1)
    assert sink.handles_created - created_before == good_chunks - 1 - sink.chunks_cancelled


def test_aborts_mid_transfer_settle_and_release_every_handle(
    engine: RoomEngine, sink: NixlPairSink
) -> None:
    specs = random_specs(np.random.default_rng(3), 40)
    for spec in specs:
        spec.chunks = list(np.array_split(spec.src, 4))
    for spec in specs:
        spec.sender = engine.sender(spec.rid)
        spec.receiver = engine.receiver(spec.rid)
        spec.receiver.init(0)
    deadline = time.monotonic() + 15
    pending = list(specs)
    while pending:
        assert time.monotonic() < deadline, "rooms did not reach the sender's WaitingForInput"
        for spec in list(pending):
            assert spec.sender is not None
            assert spec.receiver is not None
            if spec.stage == "bootstrap" and spec.receiver.poll() is KVPoll.WaitingForInput:
                spec.receiver.send_metadata(spec.dst, spec.dst_aux)
                spec.stage = "wait-sender"
            elif spec.stage == "wait-sender" and spec.sender.poll() is KVPoll.WaitingForInput:
                pending.remove(spec)
        time.sleep(0.0005)
    # Post some chunks, then abort from either side: at once (the chunks are still queued for
    # the NIXL worker) or after a pause (they are posted or done). Each must be accounted for.
    for i, spec in enumerate(specs):
        assert spec.sender is not None
        assert spec.receiver is not None
        spec.sender.init(spec.src.size, spec.src_aux)
        for chunk in spec.chunks[: 1 + i % 3]:
            spec.sender.send(chunk)
        if i % 2 == 0:
            (spec.sender if i % 4 else spec.receiver).abort("test abort")
    time.sleep(0.05)
    for i, spec in enumerate(specs):
        assert spec.sender is not None
        assert spec.receiver is not None
        if i % 2:
            (spec.sender if i % 4 == 1 else spec.receiver).abort("test abort, late")
    deadline = time.monotonic() + 15
    while not all(
        s.sender is not None and s.receiver is not None and s.sender.settled and s.receiver.settled
        for s in specs
    ):
        assert time.monotonic() < deadline, "aborted rooms did not settle"
        time.sleep(0.001)
    for i, spec in enumerate(specs):
        assert spec.sender is not None
        assert spec.receiver is not None
        assert spec.sender.poll() in TERMINAL
        assert spec.receiver.poll() in TERMINAL
        if i % 2 == 0:  # aborted right after its sends: it cannot have finished first
            aborted = spec.sender if i % 4 else spec.receiver
            assert aborted.poll() is KVPoll.Failed
            assert "test abort" in aborted.reason
        # A late abort may find the room already finished; abort() is then a no-op.
    stats = sink.stats()
    assert stats["chunks_cancelled"] > 0  # dropped before posting, reported ChunkFailed
    assert stats["chunks_done"] > 0  # posted before the abort, drained and reported
    assert stats["chunks_done"] + stats["chunks_failed"] == stats["chunks_posted"]
    assert stats["in_flight"] == 0
    assert stats["handles_created"] == stats["handles_released"]


@pytest.mark.parametrize("fault", ["stall", "error"])
def test_transfer_faults_fail_the_room_and_still_release_the_handle(
    sink: NixlPairSink, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """NIXL never times out and reports errors by raising: a handle that stays PROC past the
    stall deadline is released and, after the quarantine, fails its room; a raising check
    fails its room at once. Faults are injected at the agent; the WRITE itself is real."""
    agent = sink._prefill
    assert agent is not None
    real_transfer = agent.transfer

    def transfer(handle: object) -> str:
        real_transfer(handle)
        return "PROC"  # hand every chunk to the pump

    checked: set[int] = set()

    def check(handle: object) -> str:
        # The worker's first check says PROC; the pump's next one raises (or says PROC).
        if fault == "error" and id(handle) in checked:
            raise RuntimeError("injected backend error")
        checked.add(id(handle))
        return "PROC"

    monkeypatch.setattr(agent, "transfer", transfer)
    monkeypatch.setattr(agent, "check_xfer_state", check)
    monkeypatch.setattr(sink, "stall_timeout_s", 0.05)
    monkeypatch.setattr(sink, "quarantine_s", 0.05)
    engine = RoomEngine(sink, RoomConfig(strict=True)).start()
    try:
        specs = random_specs(np.random.default_rng(4), 4)
        drive(engine, specs)
    finally:
        engine.close()
    expected = "stalled in flight" if fault == "stall" else "injected backend error"
    for spec in specs:
        assert spec.sender is not None
        assert spec.receiver is not None
        assert spec.sender.poll() is KVPoll.Failed
        assert expected in spec.sender.reason, spec.sender.reason
        assert spec.receiver.poll() is KVPoll.Failed
    assert (sink.stalls > 0) == (fault == "stall")
    assert sink.in_flight == 0
    assert sink.handles_created == sink.handles_released


def test_sink_closes_only_after_the_engine(sink: NixlPairSink) -> None:
    engine = RoomEngine(sink).start()
    try:
        with pytest.raises(RuntimeError, match="close the RoomEngine"):
            sink.close()
    finally:
        engine.close()
    sink.close()
    sink.close()  # idempotent
    assert sink.in_flight == 0
    assert sink.handles_created == sink.handles_released


def test_kvfsm_run_main_job_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "run", "--rooms", "30", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["rooms"] == 30
    assert summary["succeeded"] == 30
    assert summary["mismatched"] == 0
    assert summary["wedged"] == 0
    assert summary["failed"] == 0
    assert summary["handles_created"] == summary["handles_released"]
    assert summary["in_flight"] == 0
