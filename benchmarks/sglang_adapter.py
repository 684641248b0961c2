"""What the SGLang adapter costs on the scheduler thread, against kvfsm's bare facades, in one run.

One prefill manager and one decode manager (``KvfsmKVManager``, one rank each, real NIXL over
UCX, DRAM, a real bootstrap server) in this process. The same requests are driven twice, by a
loop shaped like SGLang's schedulers (create, poll until WaitingForInput, ``send_metadata``,
``init``, ``send``, poll until Success, ``clear``), many requests in flight:

* facades - straight through ``SenderRoom`` / ``ReceiverRoom`` (``manager.kvfsm.sender(room)``);
* adapter - through ``KvfsmKVSender`` / ``KvfsmKVReceiver``, as SGLang calls them.

Reported: requests per second, caller-thread CPU per request (``time.thread_time``: what the
scheduler thread pays; the loop thread's work is the same in both), and the median cost of one
``poll()``. Ratios are adapter / facades.

Run: ``python benchmarks/sglang_adapter.py`` (``--requests N``, ``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvfsm import KVPoll
from kvfsm.sglang import (
    BASES,
    KvfsmKVBootstrapServer,
    KvfsmKVManager,
    KvfsmKVReceiver,
    KvfsmKVSender,
)
from kvfsm.sglang._bases import DisaggregationMode, KVArgs

LAYERS, PAGES, PAGE_BYTES, AUX_ROWS = 4, 1024, 4096, 256
PAGES_PER_REQUEST = 4


def kv_args(buffers: list[np.ndarray], aux: np.ndarray) -> KVArgs:
    args = KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs = [b.ctypes.data for b in buffers]
    args.kv_data_lens = [b.nbytes for b in buffers]
    args.kv_item_lens = [b.shape[1] for b in buffers]
    args.kv_data_mem_kinds = ["DRAM"] * len(buffers)
    args.aux_data_ptrs, args.aux_data_lens = [aux.ctypes.data], [aux.nbytes]
    args.aux_item_lens = [aux.shape[1]]
    args.state_data_ptrs = []
    args.gpu_id, args.page_size, args.system_dp_rank = 0, 16, 0
    return args


def drive(pairs: list[tuple[Any, Any]], pages: list[np.ndarray], rows: list[int]) -> None:
    """One scheduler loop over both sides until every request ended."""
    waiting = list(range(len(pairs)))
    sent: list[int] = []
    metadata_sent: set[int] = set()
    give_up = time.monotonic() + 60
    while waiting or sent:
        if time.monotonic() > give_up:
            stuck = [pairs[i] for i in waiting + sent]
            raise RuntimeError(f"requests did not finish in 60 s: {stuck[:4]}")
        for i in list(waiting):
            sender, receiver = pairs[i]
            if i not in metadata_sent and receiver.poll() == KVPoll.WaitingForInput:
                receiver.send_metadata(pages[i], rows[i])  # once: then it leaves the queue
                metadata_sent.add(i)
            if sender.poll() == KVPoll.WaitingForInput:
                sender.init(PAGES_PER_REQUEST, rows[i])
                sender.send(pages[i])
                waiting.remove(i)
                sent.append(i)
        for i in list(sent):
            sender, receiver = pairs[i]
            if sender.poll() in (KVPoll.Success, KVPoll.Failed) and receiver.poll() in (
                KVPoll.Success,
                KVPoll.Failed,
            ):
                if not sender.poll() == receiver.poll() == KVPoll.Success:
                    raise RuntimeError(f"request failed: {sender.reason!r} / {receiver.reason!r}")
                sender.clear()
                receiver.clear()
                sent.remove(i)
        time.sleep(0)


def run_batch(
    mode: str, prefill: KvfsmKVManager, decode: KvfsmKVManager, *, first: int, n: int, addr: str
) -> tuple[float, float]:
    rng = np.random.default_rng(first)
    # Scattered, but disjoint within the batch: a decode engine refuses a receiver whose pages
    # another live room holds (one owner per destination), as an allocator would never do.
    order = rng.permutation(PAGES).astype(np.int32)
    pages = [order[i * PAGES_PER_REQUEST : (i + 1) * PAGES_PER_REQUEST] for i in range(n)]
    rows = [i % AUX_ROWS for i in range(n)]
    wall, cpu = time.perf_counter(), time.thread_time()
    pairs: list[tuple[Any, Any]] = []
    for i in range(n):
        room = first + i
        if mode == "facades":
            receiver: Any = decode.new_receiver(room)
            receiver.init(decode.peer_for(addr, 0))
            pairs.append((prefill.new_sender(room), receiver))
        else:
            receiver = KvfsmKVReceiver(decode, addr, room)
            receiver.init(0)
            pairs.append((KvfsmKVSender(prefill, addr, room), receiver))
    drive(pairs, pages, rows)
    return time.perf_counter() - wall, time.thread_time() - cpu


def poll_ns(conn: Any, n: int = 20000) -> float:
    samples = []
    for _ in range(20):
        start = time.perf_counter_ns()
        for _ in range(n // 20):
            conn.poll()
        samples.append((time.perf_counter_ns() - start) / (n // 20))
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64, help="requests in flight")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    server = KvfsmKVBootstrapServer("127.0.0.1", 0)
    src = [np.ones((PAGES, PAGE_BYTES), np.uint8) for _ in range(2 * LAYERS)]
    dst = [np.zeros((PAGES, PAGE_BYTES), np.uint8) for _ in range(2 * LAYERS)]
    src_aux, dst_aux = np.ones((AUX_ROWS, 64), np.uint8), np.zeros((AUX_ROWS, 64), np.uint8)
    sargs = SimpleNamespace(
        host="127.0.0.1", disaggregation_bootstrap_port=server.port, tp_size=1, dp_size=1
    )
    prefill = KvfsmKVManager(kv_args(src, src_aux), DisaggregationMode.PREFILL, sargs, False)
    decode = KvfsmKVManager(kv_args(dst, dst_aux), DisaggregationMode.DECODE, sargs, False)
    addr = f"127.0.0.1:{server.port}"
    try:
        while not decode.try_ensure_parallel_info(addr):
            time.sleep(0.01)
        totals: dict[str, list[tuple[float, float]]] = {"facades": [], "adapter": []}
        room = 1
        for _ in range(a.rounds):
            for mode in ("facades", "adapter"):  # interleaved: drift hits both alike
                wall = cpu = 0.0
                for start in range(0, a.requests, a.batch):
                    n = min(a.batch, a.requests - start)
                    w, c = run_batch(mode, prefill, decode, first=room, n=n, addr=addr)
                    room += n
                    wall, cpu = wall + w, cpu + c
                totals[mode].append((wall, cpu))
        probe = KvfsmKVSender(prefill, addr, room)
        adapter_poll, facade_poll = poll_ns(probe), poll_ns(probe._room)
        probe.clear()
    finally:
        decode.close()
        prefill.close()
        server.close()

    def best(mode: str) -> tuple[float, float]:
        return min(w for w, _ in totals[mode]), min(c for _, c in totals[mode])

    (fw, fc), (aw, ac) = best("facades"), best("adapter")
    out = {
        "bases": BASES,
        "requests": a.requests,
        "in_flight": a.batch,
        "facades_req_per_s": a.requests / fw,
        "adapter_req_per_s": a.requests / aw,
        "throughput_ratio": fw / aw,
        "facades_caller_cpu_us_per_req": fc / a.requests * 1e6,
        "adapter_caller_cpu_us_per_req": ac / a.requests * 1e6,
        "caller_cpu_ratio": ac / fc,
        "facade_poll_ns": facade_poll,
        "adapter_poll_ns": adapter_poll,
    }
    if a.json:
        print(json.dumps(out))
        return
    print(
        f"SGLang adapter vs bare facades ({a.requests} requests, {a.batch} in flight, best of "
        f"{a.rounds}; base classes: {BASES})"
    )
    print(
        f"  requests/s        facades {out['facades_req_per_s']:8.0f}   adapter "
        f"{out['adapter_req_per_s']:8.0f}   ratio {out['throughput_ratio']:.2f}"
    )
    print(
        f"  caller CPU us/req facades {out['facades_caller_cpu_us_per_req']:8.1f}   adapter "
        f"{out['adapter_caller_cpu_us_per_req']:8.1f}   ratio {out['caller_cpu_ratio']:.2f}"
    )
    print(f"  poll() ns         facades {facade_poll:8.0f}   adapter {adapter_poll:8.0f}")


if __name__ == "__main__":
    main()
