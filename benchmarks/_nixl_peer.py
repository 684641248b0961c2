"""The passive ("decode") side of ``benchmarks/transfer.py``: a NIXL agent in its own process.

Started by the benchmark with ``multiprocessing`` (spawn context) as ``serve(conn, nbytes,
name)``. It creates one NIXL agent (UCX, progress thread off), allocates ``nbytes`` of DRAM
(pre-faulted), registers it, and sends ``("ready", agent_metadata, base_address, nbytes)`` over
the pipe. Then it loops:

* progressing its agent: ``get_new_notifs()`` in a tight loop with a short sleep. With progress
  threads off, the initiator's transfers can stay ``PROC`` forever unless the target's UCX worker
  is progressed too (endpoint wireup and flush need an answer; research ``nixl-and-peers.md``);
* answering pipe commands, one reply each:

  ``("checksum", page_bytes, dst_pages)`` -> ``("ok", crc)``: :func:`checksum_pages` over the
  destination pages named by ``dst_pages`` (packed int32 bytes), in that order;
  ``("clear",)`` -> ``("ok", None)``: zero the buffer;
  ``("quit",)`` -> ``("ok", None)``: deregister and exit.

  A command that fails answers ``("error", text)`` and the peer keeps serving.

It exits on its own when the parent dies (pipe EOF, or ``os.getppid()`` changes) and ignores
SIGINT (Ctrl-C reaches the whole process group; the parent decides when the peer stops).
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PROGRESS_SLEEP_S", "checksum_pages", "serve"]

PROGRESS_SLEEP_S = 50e-6
_CRC_BLOCK_BYTES = 16 << 20  # gather and hash this much at a time (bounded temporaries)


def checksum_pages(buffer: npt.NDArray[np.uint8], page_bytes: int, pages: npt.ArrayLike) -> int:
    """CRC32 of the pages ``pages`` (indices into ``buffer`` seen as ``page_bytes`` rows), in order.

    Both sides use this: the initiator over its source pages, the peer over its destination pages,
    each list in the order of the (source, destination) pairs of a case."""
    rows = buffer[: buffer.nbytes // page_bytes * page_bytes].reshape(-1, page_bytes)
    idx = np.asarray(pages, dtype=np.int64)
    step = max(1, _CRC_BLOCK_BYTES // page_bytes)
    crc = 0
    for lo in range(0, idx.size, step):
        crc = zlib.crc32(np.ascontiguousarray(rows[idx[lo : lo + step]]).data, crc)
    return crc


def _handle(command: tuple[Any, ...], buffer: npt.NDArray[np.uint8], gpu: Any) -> object:
    match command:
        case ("checksum", int(page_bytes), bytes(packed)):
            if gpu is not None:  # VRAM: hash a host copy (untimed)
                buffer = gpu.cpu().numpy()
            return checksum_pages(buffer, page_bytes, np.frombuffer(packed, dtype=np.int32))
        case ("clear",):
            if gpu is not None:
                gpu.zero_()
                return None
            buffer.fill(0)
            return None
        case _:
            raise ValueError(f"unknown command {command!r:.80}")


def serve(conn: Connection, nbytes: int, name: str, mem: str = "DRAM") -> None:
    """Process entry point (see the module docstring). ``mem="VRAM"``: the buffer is on CUDA
    device 0 (torch), registered as VRAM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines go to stdout
    from kvfsm.transport._nixl import nixl_agent, nixl_agent_config

    parent = os.getppid()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    gpu: Any = None
    if mem == "VRAM":
        import torch

        gpu = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        buffer = np.empty(0, dtype=np.uint8)
        base = int(gpu.data_ptr())
    else:
        buffer = np.empty(nbytes, dtype=np.uint8)
        buffer.fill(0)  # fault every page in now, not during the first timed transfer
        base = buffer.ctypes.data
    reg = agent.register_memory([(base, nbytes, 0, "")], mem)
    try:
        conn.send(("ready", agent.get_agent_metadata(), base, nbytes))
        progress = agent.get_new_notifs
        ticks = 0
        while True:
            progress()
            if conn.poll(0):
                try:
                    command = conn.recv()
                except EOFError:
                    return  # the parent is gone
                if command == ("quit",):
                    conn.send(("ok", None))
                    return
                try:
                    reply: tuple[str, object] = ("ok", _handle(command, buffer, gpu))
                except Exception as exc:
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                conn.send(reply)
                continue
            ticks += 1
            if ticks % 4096 == 0 and os.getppid() != parent:
                return
            time.sleep(PROGRESS_SLEEP_S)
    except (BrokenPipeError, ConnectionResetError):
        return
    finally:
        agent.deregister_memory(reg)
