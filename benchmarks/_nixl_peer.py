"""The passive ("decode") side of ``benchmarks/transfer.py``: a NIXL agent in its own process.

Started by the benchmark with ``multiprocessing`` (spawn context) as ``serve(conn, nbytes,
name)``. It creates one NIXL agent (UCX, progress thread off), allocates ``nbytes`` of DRAM
(pre-faulted), registers it, and sends ``("ready", agent_metadata, base_address, nbytes)`` over
the pipe (and, last, every agent's metadata: see ``serve``'s ``agents``). Then it loops:

* progressing its agent: ``get_new_notifs()`` in a tight loop with a short sleep. With progress
  threads off, the initiator's transfers can stay ``PROC`` forever unless the target's UCX worker
  is progressed too (endpoint wireup and flush need an answer, measured: ``docs/reliability.md``);
* answering pipe commands, one reply each:

  ``("checksum", page_bytes, dst_pages)`` -> ``("ok", crc)``: :func:`checksum_pages` over the
  destination pages named by ``dst_pages`` (packed int32 bytes), in that order;
  ``("checksum_rows", geometry, dst_pages)`` -> ``("ok", crc)``: :func:`checksum_rows` (a head
  slice of every row of the destination pages, unequal TP), after checking with
  :func:`stray_bytes` that nothing was written outside that slice (an error if it was);
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

__all__ = [
    "PROGRESS_SLEEP_S",
    "RowGeometry",
    "checksum_pages",
    "checksum_rows",
    "serve",
    "stray_bytes",
]

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


#: One side of a head-sliced case: ``(regions, pages, rows, row_bytes, offset, length)``. The
#: buffer holds ``regions`` KV buffers back to back, each ``pages`` pages of ``rows`` rows (one
#: row per token) of ``row_bytes``; the slice is ``length`` bytes at ``offset`` in every row.
RowGeometry = tuple[int, int, int, int, int, int]


def _rows_view(buffer: npt.NDArray[np.uint8], geometry: RowGeometry) -> npt.NDArray[np.uint8]:
    regions, pages, rows, row_bytes, offset, length = geometry
    if offset < 0 or length <= 0 or offset + length > row_bytes:
        raise ValueError(f"slice ({offset}, {length}) does not fit a {row_bytes}-byte row")
    used = regions * pages * rows * row_bytes
    if used > buffer.nbytes:
        raise ValueError(f"{geometry} needs {used} bytes, the buffer has {buffer.nbytes}")
    return buffer[:used].reshape(regions, pages, rows, row_bytes)


def checksum_rows(
    buffer: npt.NDArray[np.uint8], geometry: RowGeometry, pages: npt.ArrayLike
) -> int:
    """CRC32 of the slice ``geometry`` names in every row of the pages ``pages``, region-major,
    pages in the given order, rows in order: the bytes one prefill rank moves into one decode
    rank with unequal TP. Both sides use it, each with its own geometry (the source with its
    whole rows), so matching CRCs mean every row's slice landed in the right place."""
    view = _rows_view(buffer, geometry)
    regions, _, rows, _, offset, length = geometry
    idx = np.asarray(pages, dtype=np.int64)
    step = max(1, _CRC_BLOCK_BYTES // (rows * length))
    crc = 0
    for b in range(regions):
        for lo in range(0, idx.size, step):
            block = view[b, idx[lo : lo + step], :, offset : offset + length]
            crc = zlib.crc32(np.ascontiguousarray(block).data, crc)
    return crc


def stray_bytes(buffer: npt.NDArray[np.uint8], geometry: RowGeometry) -> int:
    """Non-zero bytes of a zeroed-then-written destination outside the slice of every row
    (and past the regions): a slice written too wide, or at the wrong offset, shows here."""
    view = _rows_view(buffer, geometry)
    offset, length = geometry[4], geometry[5]
    return (
        int(np.count_nonzero(view[..., :offset]))
        + int(np.count_nonzero(view[..., offset + length :]))
        + int(np.count_nonzero(buffer[view.nbytes :]))
    )


def _handle(command: tuple[Any, ...], buffer: npt.NDArray[np.uint8], gpu: Any) -> object:
    match command:
        case ("checksum", int(page_bytes), bytes(packed)):
            if gpu is not None:  # VRAM: hash a host copy (untimed)
                buffer = gpu.cpu().numpy()
            return checksum_pages(buffer, page_bytes, np.frombuffer(packed, dtype=np.int32))
        case ("checksum_rows", tuple(geometry), bytes(packed)):
            if gpu is not None:
                buffer = gpu.cpu().numpy()
            stray = stray_bytes(buffer, geometry)
            if stray:
                raise ValueError(f"{stray} bytes written outside the head slice {geometry}")
            return checksum_rows(buffer, geometry, np.frombuffer(packed, dtype=np.int32))
        case ("clear",):
            if gpu is not None:
                gpu.zero_()
                return None
            buffer.fill(0)
            return None
        case _:
            raise ValueError(f"unknown command {command!r:.80}")


def serve(conn: Connection, nbytes: int, name: str, mem: str = "DRAM", agents: int = 1) -> None:
    """Process entry point (see the module docstring). ``mem="VRAM"``: the buffer is on CUDA
    device 0 (torch), registered as VRAM. ``agents`` > 1: that many agents (several decode
    peers in one process, ``benchmarks/scaling.py``), agent ``i`` named ``name-i`` (agent 0
    ``name``) with slice ``i`` of ``agents`` equal slices of the buffer registered; the ready
    message's last item lists their metadata, agent 0's first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines go to stdout
    from kvfsm.transport._nixl import nixl_agent, nixl_agent_config

    parent = os.getppid()
    config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    every = [nixl_agent(name if i == 0 else f"{name}-{i}", config) for i in range(agents)]
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
    part = nbytes // agents
    regs = [
        agent.register_memory([(base + i * part, part, 0, "")], mem)
        for i, agent in enumerate(every)
    ]
    try:
        metadata = [agent.get_agent_metadata() for agent in every]
        conn.send(("ready", metadata[0], base, nbytes, metadata))
        progress = [agent.get_new_notifs for agent in every]
        ticks = 0
        while True:
            for step in progress:
                step()
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
        for agent, reg in zip(every, regs, strict=True):
            agent.deregister_memory(reg)
