"""Tensor parallelism: two prefill ranks send to two decode ranks, rank r to rank r.

With TP=2 each rank holds half of the KV heads, so each rank has its own buffers and its own
``Layout``, and runs its own manager (its own NIXL agent, loop thread and control channel).
Prefill rank r registers as ``rank=r, tp_rank=r, tp_size=2`` in a registry that expects 2 ranks;
decode rank r names it with ``receiver.init(r)``. A request is one room id on every rank.

Like SGLang's schedulers, each side's loop all-reduces a room's ``poll()`` over its ranks with MIN:
the request is Success only when every rank succeeded, and any rank's Failed (0) fails it. Here
both ranks of a side live in one process (two managers), so the all-reduce is a plain ``min``;
across processes it would be ``torch.distributed.all_reduce(op=MIN)`` on the same integers.

No GPU needed (NIXL moves DRAM over UCX). Run it as-is:

    python examples/tp2_pair.py

It prints each request's per-rank and reduced status on both sides and ends with
``tp2_pair: OK`` (exit status 0), or says what went wrong and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.synchronize import Event as MpEvent

import numpy as np
import torch

from kvfsm import KVPoll
from kvfsm.manager import DecodeManager, PrefillManager
from kvfsm.registry import BootstrapServer
from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.transport import Layout

ENGINE, TP = "tp2-pair", 2
LAYERS, PAGES, PAGE_TOKENS, HEADS, HEAD_DIM, AUX_ROWS = 4, 64, 16, 8, 64, 16
# request (room id) -> (prefill source pages, decode destination pages, prefill aux, decode aux);
# the same page ids on every rank: each rank moves its own half of the heads.
ROOMS = {
    2000 + i: (list(range(3 * i, 3 * i + 3)), [PAGES - 1 - 3 * i - k for k in range(3)], i, 15 - i)
    for i in range(8)
}


def kv_buffers(tp_rank: int, filled: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's shard: ``HEADS // TP`` heads per page. ``filled``: deterministic per rank."""
    shape = (PAGES, PAGE_TOKENS, HEADS // TP, HEAD_DIM)
    gen = torch.Generator().manual_seed(tp_rank)
    kv = [
        torch.randn(shape, generator=gen).to(torch.bfloat16)
        if filled
        else torch.zeros(shape, dtype=torch.bfloat16)
        for _ in range(2 * LAYERS)
    ]
    aux = torch.arange(AUX_ROWS * 16, dtype=torch.int32).reshape(AUX_ROWS, 16) + 1000 * tp_rank
    return kv, aux if filled else torch.zeros_like(aux)


def all_reduce_min(rooms: Sequence[SenderRoom | ReceiverRoom]) -> KVPoll:
    """What SGLang's scheduler does with a request's polls across its TP ranks."""
    return KVPoll(min(int(room.poll()) for room in rooms))


def run_until(step: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Call ``step`` (one scheduler iteration) until it says it is done, or time out."""
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def prefill(url: str, ready: MpEvent, done: MpEvent) -> None:
    shards = [kv_buffers(r, filled=True) for r in range(TP)]
    with contextlib.ExitStack() as managers_closed:
        managers = [
            managers_closed.enter_context(
                PrefillManager(
                    Layout.from_tensors(kv, [aux]),
                    url,
                    engine_id=ENGINE,
                    rank=r,
                    tp_rank=r,
                    tp_size=TP,
                )
            )
            for r, (kv, aux) in enumerate(shards)
        ]
        ok = serve_prefill(managers, ready, done)
    sys.exit(0 if ok else 1)


def serve_prefill(managers: list[PrefillManager], ready: MpEvent, done: MpEvent) -> bool:
    ready.set()  # both ranks registered: the registry now answers for rank 0 and rank 1
    requests = {room: [m.sender(room) for m in managers] for room in ROOMS}
    started: set[int] = set()

    def scheduler_step() -> bool:
        for room, ranks in requests.items():
            status = all_reduce_min(ranks)
            # Start a request only when every rank has decode's pages (the MIN is WaitingForInput).
            if room not in started and status is KVPoll.WaitingForInput:
                src, _, src_aux, _ = ROOMS[room]
                for sender in ranks:  # each rank sends its shard of the same pages
                    sender.init(len(src), aux_index=src_aux)
                    sender.send(np.asarray(src, np.int32))
                started.add(room)
        return all(all_reduce_min(r) in (KVPoll.Success, KVPoll.Failed) for r in requests.values())

    run_until(scheduler_step)
    ok = True
    for room, ranks in requests.items():
        status = all_reduce_min(ranks)
        ok = ok and status is KVPoll.Success
        per_rank = " ".join(f"r{r}={s.poll().name}" for r, s in enumerate(ranks))
        print(f"[prefill] room {room}: {per_rank} -> {status.name}", flush=True)
        for sender in ranks:
            sender.clear()
    done.wait(30)  # keep serving until decode has checked its bytes
    return ok


def decode(url: str, ready: MpEvent) -> None:
    shards = [kv_buffers(r, filled=False) for r in range(TP)]
    with contextlib.ExitStack() as managers_closed:
        managers = [
            managers_closed.enter_context(
                DecodeManager(Layout.from_tensors(kv, [aux]), url, engine_id=ENGINE, rank=r)
            )
            for r, (kv, aux) in enumerate(shards)
        ]
        bad = serve_decode(managers, shards, ready)
    sys.exit(1 if bad else 0)


def serve_decode(
    managers: list[DecodeManager],
    shards: list[tuple[list[torch.Tensor], torch.Tensor]],
    ready: MpEvent,
) -> int:
    sources = [kv_buffers(r, filled=True) for r in range(TP)]  # to check what lands
    ready.wait(60)
    requests = {room: [m.receiver(room) for m in managers] for room in ROOMS}
    for ranks in requests.values():
        for r, receiver in enumerate(ranks):
            receiver.init(r)  # decode rank r reads from prefill rank r (equal TP)
    sent: set[int] = set()

    def scheduler_step() -> bool:
        for room, ranks in requests.items():
            if room not in sent and all_reduce_min(ranks) is KVPoll.WaitingForInput:
                _, dst, _, dst_aux = ROOMS[room]
                for receiver in ranks:
                    receiver.send_metadata(np.asarray(dst, np.int32), aux_index=dst_aux)
                sent.add(room)
        return all(all_reduce_min(r) in (KVPoll.Success, KVPoll.Failed) for r in requests.values())

    run_until(scheduler_step)
    bad = 0
    for room, ranks in requests.items():
        src, dst, src_row, dst_row = ROOMS[room]
        same = all(
            all(torch.equal(kv[b][dst], skv[b][src]) for b in range(len(kv)))
            and torch.equal(aux[dst_row], saux[src_row])
            for (kv, aux), (skv, saux) in zip(shards, sources, strict=True)
        )
        status = all_reduce_min(ranks)
        bad += not (status is KVPoll.Success and same)
        per_rank = " ".join(f"r{r}={s.poll().name}" for r, s in enumerate(ranks))
        print(
            f"[decode]  room {room}: {per_rank} -> {status.name}, both shards "
            f"{'match' if same else 'MISMATCH'}",
            flush=True,
        )
        for receiver in ranks:
            receiver.clear()
    return bad


@contextlib.contextmanager
def registry(expected_ranks: int) -> Iterator[str]:
    """The bootstrap registry on its own event loop thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=expected_ranks)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server.url
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def main() -> int:
    ctx = mp.get_context("spawn")
    started = time.perf_counter()
    with registry(expected_ranks=TP) as url:
        ready, done = ctx.Event(), ctx.Event()
        p = ctx.Process(target=prefill, args=(url, ready, done), name="prefill")
        d = ctx.Process(target=decode, args=(url, ready), name="decode")
        p.start()
        d.start()
        d.join(60)
        done.set()
        p.join(60)
        for proc in (p, d):
            if proc.is_alive():  # stuck: never leave a child behind
                proc.kill()
                proc.join()
    if p.exitcode == 0 and d.exitcode == 0:
        elapsed = time.perf_counter() - started
        print(f"tp2_pair: OK, {len(ROOMS)} requests x {TP} ranks in {elapsed:.1f} s")
        return 0
    print(f"tp2_pair: FAILED (prefill exit {p.exitcode}, decode exit {d.exitcode})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
