"""One prefill process and one decode process move KV for a handful of rooms over NIXL.

This is the engine API in its simplest form, the sequence SGLang's schedulers follow:

* a bootstrap registry (here embedded in this process, on a background thread's event loop);
* a prefill process: its KV buffers (torch tensors, one K and one V buffer per layer, plus aux
  rows), a ``Layout`` over them and a ``PrefillManager``, which registers the rank in the registry;
* a decode process: zeroed buffers of the same shape and a ``DecodeManager``;
* per room: decode ``receiver(room)``, ``init(prefill_rank)``, ``send_metadata(pages, aux_row)``;
  prefill ``sender(room)``, and once the pages arrived ``init(num_pages, aux_row)`` and ``send()``
  per chunk. Both ``poll()`` until Success or Failed; decode then checks every byte.

No GPU needed: NIXL's UCX backend moves DRAM between the two processes. Run it as-is:

    python examples/pd_pair.py

It prints each room's outcome on both sides and ends with ``pd_pair: OK`` (exit status 0), or
says what went wrong and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event as MpEvent

import numpy as np
import torch

from kvfsm import KVPoll
from kvfsm.manager import DecodeManager, PrefillManager
from kvfsm.registry import BootstrapServer
from kvfsm.states import TERMINAL
from kvfsm.transport import Layout

ENGINE = "pd-pair"  # the deployment id both sides use in the registry
LAYERS, PAGES, PAGE_TOKENS, HEADS, HEAD_DIM, AUX_ROWS = 4, 64, 16, 4, 64, 16
# room id -> (prefill's source pages, decode's destination pages, prefill aux row, decode aux row)
ROOMS = {
    1000 + i: (list(range(4 * i, 4 * i + 4)), [PAGES - 1 - 4 * i - k for k in range(4)], i, 15 - i)
    for i in range(6)
}


def kv_buffers(filled: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """K and V per layer, ``[pages, page_tokens, heads, head_dim]`` bf16, and int32 aux rows.
    ``filled``: deterministic contents (what prefill computed); else zeros (decode's free pool)."""
    shape = (PAGES, PAGE_TOKENS, HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(shape, generator=gen).to(torch.bfloat16)
        if filled
        else torch.zeros(shape, dtype=torch.bfloat16)
        for _ in range(2 * LAYERS)
    ]
    aux = torch.arange(AUX_ROWS * 16, dtype=torch.int32).reshape(AUX_ROWS, 16)
    return kv, aux if filled else torch.zeros_like(aux)


def wait(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def prefill(url: str, ready: MpEvent, done: MpEvent) -> None:
    kv, aux = kv_buffers(filled=True)
    with PrefillManager(Layout.from_tensors(kv, [aux]), url, engine_id=ENGINE) as manager:
        ready.set()  # registered: decode can now find prefill rank 0 in the registry
        senders = {room: manager.sender(room) for room in ROOMS}
        waiting = dict(senders)
        # The scheduler loop: a room becomes WaitingForInput when decode's page list arrived.
        deadline = time.monotonic() + 20
        while waiting and time.monotonic() < deadline:
            for room, sender in list(waiting.items()):
                if sender.poll() is KVPoll.WaitingForInput:
                    src, _, src_aux, _ = ROOMS[room]
                    sender.init(len(src), aux_index=src_aux)
                    sender.send(np.asarray(src[:3], np.int32))  # chunk 1 (forward pass, part 1)
                    sender.send(np.asarray(src[3:], np.int32))  # chunk 2 reaches num_pages: last
                    del waiting[room]
                elif sender.poll() is KVPoll.Failed:
                    del waiting[room]
            time.sleep(0.001)
        wait(lambda: all(s.poll() in TERMINAL for s in senders.values()))
        for room, sender in senders.items():
            print(f"[prefill] room {room}: {sender.poll().name} {sender.reason}", flush=True)
            sender.clear()
        done.wait(30)  # keep serving until decode has checked its bytes
    sys.exit(0 if all(s.poll() is KVPoll.Success for s in senders.values()) else 1)


def decode(url: str, ready: MpEvent) -> None:
    kv, aux = kv_buffers(filled=False)
    src_kv, src_aux = kv_buffers(filled=True)  # what prefill holds, to check what lands
    with DecodeManager(Layout.from_tensors(kv, [aux]), url, engine_id=ENGINE) as manager:
        ready.wait(60)  # a room's init() looks prefill rank 0 up once: it must be registered
        receivers = {room: manager.receiver(room) for room in ROOMS}
        for receiver in receivers.values():
            receiver.init(0)  # prefill rank 0 serves every room; the engine resolves it
        wait(lambda: all(r.poll() is not KVPoll.Bootstrapping for r in receivers.values()))
        for room, receiver in receivers.items():  # pages reserved: tell prefill where to write
            _, dst, _, dst_aux = ROOMS[room]
            receiver.send_metadata(np.asarray(dst, np.int32), aux_index=dst_aux)
        wait(lambda: all(r.poll() in TERMINAL for r in receivers.values()))
        bad = 0
        for room, receiver in receivers.items():
            src, dst, src_row, dst_row = ROOMS[room]
            same = all(torch.equal(kv[b][dst], src_kv[b][src]) for b in range(len(kv)))
            same = same and torch.equal(aux[dst_row], src_aux[src_row])
            ok = receiver.poll() is KVPoll.Success and same
            bad += not ok
            print(
                f"[decode]  room {room}: {receiver.poll().name}, pages {dst} "
                f"{'match' if same else 'MISMATCH'} {receiver.reason}",
                flush=True,
            )
            receiver.clear()
    sys.exit(1 if bad else 0)


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
    ctx = mp.get_context("spawn")  # fresh interpreters: each process owns its own NIXL agent
    started = time.perf_counter()
    with registry(expected_ranks=1) as url:
        ready, done = ctx.Event(), ctx.Event()
        p = ctx.Process(target=prefill, args=(url, ready, done), name="prefill")
        p.start()
        d = ctx.Process(target=decode, args=(url, ready), name="decode")
        d.start()
        d.join(60)
        done.set()
        p.join(60)
        for proc in (p, d):
            if proc.pid is not None and proc.is_alive():  # stuck: never leave a child behind
                proc.kill()
                proc.join()
    if p.exitcode == 0 and d.exitcode == 0:
        print(f"pd_pair: OK, {len(ROOMS)} rooms in {time.perf_counter() - started:.1f} s")
        return 0
    print(f"pd_pair: FAILED (prefill exit {p.exitcode}, decode exit {d.exitcode})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
