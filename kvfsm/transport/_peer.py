"""A passive decode rank in its own OS process: the far end of the data path until the control
plane and receiver rooms run there (tests, ``kvfsm run`` and the benchmarks use it).

The process owns a real KV layout (``layers`` x K and V buffers of ``num_pages`` pages, and an aux
buffer) registered with its own NIXL agent, hands its agent metadata and layout summary to the
parent, then keeps its agent progressed (with progress threads off, a target that is never
progressed leaves the writer's handles in progress) and answers the parent's questions about
what landed. The parent may SIGKILL or SIGSTOP it; it exits by itself if the parent dies.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvfsm._child import ChildProcess
from kvfsm.transport._agent import Agent
from kvfsm.transport._layout import Layout, LayoutSummary, Region


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 4
    num_pages: int = 512
    page_bytes: int = 4096  # per K or V buffer
    aux_rows: int = 64
    aux_row_bytes: int = 256
    state_rows: int = 0  # per-request state rows (hybrid models); 0: no state buffer
    state_row_bytes: int = 512


def make_buffers(shape: Shape) -> tuple[list[npt.NDArray[np.uint8]], npt.NDArray[np.uint8]]:
    kv = [np.zeros((shape.num_pages, shape.page_bytes), np.uint8) for _ in range(2 * shape.layers)]
    aux = np.zeros((shape.aux_rows, shape.aux_row_bytes), np.uint8)
    return kv, aux


def make_state(shape: Shape) -> npt.NDArray[np.uint8] | None:
    if not shape.state_rows:
        return None
    return np.zeros((shape.state_rows, shape.state_row_bytes), np.uint8)


def make_layout(
    kv: list[npt.NDArray[np.uint8]],
    aux: npt.NDArray[np.uint8],
    state: npt.NDArray[np.uint8] | None = None,
) -> Layout:
    regions = tuple(
        Region(f"{'kv'[i % 2]}{i // 2}", buf.ctypes.data, buf.nbytes, buf.shape[1])
        for i, buf in enumerate(kv)
    )
    states: tuple[Region, ...] = ()
    if state is not None:
        states = (Region("state0", state.ctypes.data, state.nbytes, state.shape[1]),)
    return Layout(
        kv=regions,
        aux=(Region("aux0", aux.ctypes.data, aux.nbytes, aux.shape[1]),),
        state=states,
        keepalive=(*kv, aux, *([] if state is None else [state])),
    )


def page_digests(kv: list[npt.NDArray[np.uint8]], pages: npt.NDArray[np.int32]) -> list[int]:
    """One CRC per page over that page in every K and V buffer, in order."""
    out = []
    for page in pages.tolist():
        crc = 0
        for buf in kv:
            crc = zlib.crc32(buf[page].data, crc)
        out.append(crc)
    return out


def _serve(conn: Connection, shape: Shape, name: str) -> None:
    parent = os.getppid()
    kv, aux = make_buffers(shape)
    state = make_state(shape)
    layout = make_layout(kv, aux, state)
    agent = Agent(f"{name}-{os.uname().nodename}-pid{os.getpid()}-{os.urandom(4).hex()}", layout)
    conn.send((agent.metadata(), msgspec.msgpack.encode(layout.summary())))
    progress = agent.nixl.get_new_notifs
    try:
        while True:
            progress()
            if conn.poll(0.0002):
                request: Any = conn.recv()
                op = request[0]
                if op == "quit":
                    break
                if op == "fill":
                    for buf in kv:
                        buf.fill(request[1])
                    aux.fill(request[1])
                    conn.send(True)
                elif op == "digests":
                    conn.send(page_digests(kv, np.frombuffer(request[1], np.int32)))
                elif op == "aux":
                    conn.send(aux[request[1]].tobytes())
                elif op == "state":
                    conn.send(b"" if state is None else state[request[1]].tobytes())
                elif op == "pid":
                    conn.send(os.getpid())
            elif os.getppid() != parent:
                break
    except (EOFError, OSError):
        pass
    finally:
        agent.close()


class PeerProcess(ChildProcess):
    """Start with ``PeerProcess(shape)``; ``metadata`` and ``summary`` describe its agent."""

    def __init__(self, shape: Shape, name: str = "decode") -> None:
        self.shape = shape
        super().__init__(_serve, shape, name, what="decode peer")
        metadata, summary = self.greeting
        self.metadata: bytes = metadata
        self.summary = msgspec.msgpack.decode(summary, type=LayoutSummary)


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.001)


def compare_room(
    kv: Sequence[npt.NDArray[np.uint8]],
    want_kv: Sequence[npt.NDArray[np.uint8]],
    aux: npt.NDArray[np.uint8],
    want_aux: npt.NDArray[np.uint8],
    *,
    dst: npt.ArrayLike,
    src: npt.ArrayLike,
    dst_aux: int,
    src_aux: int,
) -> tuple[int, int]:
    """``(checked, mismatched)`` bytes of a room: its destination pages of every buffer in ``kv``
    against the source pages of ``want_kv``, and its aux row against the source row."""
    src_pages, dst_pages = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    checked = mismatched = 0
    for got, want in zip(kv, want_kv, strict=True):
        differ = got[dst_pages] != want[src_pages]
        checked += differ.size
        mismatched += int(np.count_nonzero(differ))
    differ_aux = aux[dst_aux] != want_aux[src_aux]
    return checked + differ_aux.size, mismatched + int(np.count_nonzero(differ_aux))
