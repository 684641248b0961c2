"""kvfsm's adapter and SGLang's own NIXL backend, each as SGLang's scheduler sees it: what the
benchmarks that drive both through SGLang's interface share (``gil_backends.py``,
``vs_sglang.py``).

* :func:`backend` - one backend's classes: ``KvfsmKVManager`` / ``KvfsmKVSender`` /
  ``KvfsmKVReceiver`` (kvfsm's adapter, as SGLang loads it for
  ``--disaggregation-transfer-backend nixl``), or SGLang 0.5.23's own ``NixlKVManager`` /
  ``NixlKVSender`` / ``NixlKVReceiver`` (its source unmodified).
* :func:`kv_args` - SGLang's ``KVArgs`` over DRAM buffers (``BUFFERS`` KV buffers of
  ``pages`` x ``PAGE_BYTES`` and an aux buffer), the same for both backends. SGLang's backend
  would register its KV pool as VRAM on a GPU server; here every buffer is declared ``DRAM``
  (``kv_data_mem_kinds``), the one deviation from production, and NIXL moves it over UCX.
* :func:`decode_main` - the decode process (run as ``python benchmarks/_backends.py --decode
  NAME``): the backend's bootstrap server (SGLang runs it in the HTTP server's process, not in
  a scheduler's) and its decode manager, keeping ``--ahead`` receivers created, ``init``-ed
  and given their pages (``send_metadata``) ahead of prefill, in the same room order, checking
  every finished room's bytes and clearing it.
* :class:`DecodeChild` - prefill's side of that: starts it, sets up prefill's manager against
  its bootstrap server, and collects its counts at the end.
* :func:`thread_cpu`, :func:`process_cpu` - CPU seconds from ``/proc`` (Linux).

SGLang's NIXL backend imports ``nixl._api`` (from the ``nixl`` meta-package); where only the
``nixl-cu12`` wheel is installed, as here, the SGLang side is given ``nixl_cu12`` under that
name. Its managers read SGLang's published configuration (``override_server_args``) and
parallel context (ranks 0, no pipeline group), which a one-rank server would have published.
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
from typing import IO, Any

import numpy as np

__all__ = [
    "AUX_ROWS",
    "BUFFERS",
    "FAILED",
    "FILL",
    "PAGE_BYTES",
    "SUCCESS",
    "WAITING",
    "DecodeChild",
    "Kvfsm",
    "SGLangNixl",
    "backend",
    "decode_main",
    "kv_args",
    "process_cpu",
    "thread_cpu",
]

KIB = 1024
PAGE_BYTES = 16 * KIB
BUFFERS = 4  # K and V of two layers
AUX_ROWS, AUX_BYTES = 256, 64  # one per live room: decode refuses a row held by another
WAITING, SUCCESS, FAILED = 2, 4, 0  # KVPoll's ints, the same in both backends
FILL = 7  # every byte of prefill's KV buffers
#: The bytes of each page decode checks after Success (and clears before): its first and last.
EDGES = np.array([0, PAGE_BYTES - 1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_args(fill: int, pages: int) -> tuple[Any, list[np.ndarray]]:
    """SGLang's ``KVArgs`` with every field either backend's manager reads (one rank, no state
    pool, not MLA), over freshly allocated DRAM buffers (returned, to keep them alive)."""
    from kvfsm.sglang._bases import KVArgs

    kv = [np.full((pages, PAGE_BYTES), fill, np.uint8) for _ in range(BUFFERS)]
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
    # SGLang's backend registers a GPU server's pool as VRAM; on this machine it is DRAM.
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


def decode_main(name: str, ahead: int, room_pages: int, pages: int) -> None:
    """Serve receivers ``ahead`` rooms ahead of prefill until prefill names its last room on
    stdin (or closes it); see each room up to that one end, then print counts."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    be = backend(name)
    _server, port = be.bootstrap_server()  # held: it serves until this process ends
    print(json.dumps({"port": port}), flush=True)
    stop = threading.Event()
    go = sys.stdin.readline()  # prefill registered with the bootstrap server
    # Then one line: the last room prefill made (or none: stdin closed), and the end.
    last: list[int] = []

    def wait_for_stop() -> None:
        with contextlib.suppress(ValueError):
            last.append(int(sys.stdin.readline()))
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    counts = {"succeeded": 0, "failed": 0, "wrong_bytes": 0}
    with be.configured(port):
        args, buffers = kv_args(0, pages)
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
        slots = pages // room_pages
        live: list[list[Any]] = []
        room = 0
        drain_until = 0.0
        while True:
            if stop.is_set():
                # Prefill has seen each of its rooms end; those whose end decode has not seen
                # yet are waited for (bounded), so that every room's bytes are checked.
                drain_until = drain_until or time.monotonic() + 30
                if not last or time.monotonic() > drain_until:
                    break
                live = [entry for entry in live if entry[0] <= last[0]]
                if not live:
                    break
            while len(live) < ahead and not stop.is_set():
                room += 1
                receiver = be.receiver_cls(mgr, addr, room)
                receiver.init(0)
                live.append([room, receiver, None])
            moved = False
            keep_live = []
            for entry in live:
                r, receiver, ends = entry
                status = int(receiver.poll())
                if ends is None and status == WAITING:
                    lo = (r % slots) * room_pages
                    dst = np.random.default_rng(r).permutation(
                        np.arange(lo, lo + room_pages, dtype=np.int32)
                    )
                    # The bytes the check below reads (each page's first and last), cleared so
                    # that Success must have written them (clearing whole pages cost decode 4x
                    # the check's time, harness work both backends' pairs paid alike).
                    ends = entry[2] = (dst[:, None], EDGES)
                    for buffer in kv:
                        buffer[ends] = 0
                    receiver.send_metadata(dst, r % AUX_ROWS, None, decode_prefix_len=0)
                    moved = True
                if status in (SUCCESS, FAILED):
                    counts["succeeded" if status == SUCCESS else "failed"] += 1
                    # Prefill's pages all hold FILL: each page's first and last byte, everywhere.
                    if status == SUCCESS and any(np.any(b[ends] != FILL) for b in kv):
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


class DecodeChild:
    """Prefill's end of a decode process: ``with DecodeChild(...) as child:`` starts it and sets
    up prefill's manager against its bootstrap server (``child.mgr``, ``child.addr``, with the
    backend configured as a one-rank server would be); leaving it closes decode's stdin, which
    ends it, and ``child.counts`` then holds what decode saw (succeeded, failed, wrong_bytes)."""

    def __init__(
        self,
        be: Kvfsm | SGLangNixl,
        name: str,
        *,
        ahead: int,
        room_pages: int,
        pages: int,
        fill: int,
    ) -> None:
        self.be, self.fill, self.pages = be, fill, pages
        argv = [sys.executable, os.path.abspath(__file__), "--decode", name, "--ahead", str(ahead)]
        self._argv = [*argv, "--room-pages", str(room_pages), "--pages", str(pages)]
        self.mgr: Any = None
        self.addr = ""
        self.counts: dict[str, int] = {}
        self.pid = 0
        self._buffers: list[np.ndarray] = []

    def __enter__(self) -> DecodeChild:
        self._proc = subprocess.Popen(
            self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self._proc.pid
        self._stack = contextlib.ExitStack()
        try:
            port = int(json.loads(self._stdout.readline())["port"])
            self._stack.enter_context(self.be.configured(port))
            args, self._buffers = kv_args(self.fill, self.pages)
            self.mgr = self.be.manager("prefill", args, port)
            self.addr = f"127.0.0.1:{port}"
            self._stdin.write("go\n")
            self._stdin.flush()
            if not json.loads(self._stdout.readline()).get("ready"):
                raise RuntimeError("decode side did not come up")
        except BaseException:
            self._end(kill=True)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._end(kill=exc[0] is not None)

    #: The last room prefill made: set before leaving, decode then waits (up to 30 s) to see
    #: each room up to it end, so that it checks all of them.
    last_room = 0

    @property
    def _stdin(self) -> IO[str]:
        assert self._proc.stdin is not None
        return self._proc.stdin

    @property
    def _stdout(self) -> IO[str]:
        assert self._proc.stdout is not None
        return self._proc.stdout

    def _end(self, kill: bool) -> None:
        try:
            if not kill:
                self._stdin.write(f"{self.last_room}\n")
                self._stdin.close()
                self.counts = json.loads(self._stdout.readline())
                self._proc.wait(30)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._stack.close()


# -- CPU accounting ------------------------------------------------------------------------------


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


def process_cpu(pid: int) -> float:
    """CPU seconds so far of process ``pid``, all its threads (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the decode process of gil_backends / vs_sglang")
    parser.add_argument("--decode", required=True, choices=("kvfsm", "sglang"))
    parser.add_argument("--ahead", type=int, required=True)
    parser.add_argument("--room-pages", type=int, required=True)
    parser.add_argument("--pages", type=int, required=True)
    a = parser.parse_args()
    decode_main(a.decode, a.ahead, a.room_pages, a.pages)
