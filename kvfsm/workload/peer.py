"""A passive decode rank in its own OS process: the far end of the data path without a control
plane or receiver rooms (``kvfsm run``, the benchmarks and the transport tests use it).

The process owns a real KV layout (:func:`~kvfsm.workload.buffers.make_buffers`) registered with its
own NIXL agent, hands its agent metadata and layout summary to the parent, then keeps its agent
progressed (with progress threads off, a target that is never progressed leaves the writer's
handles in progress) and answers the parent's questions about what landed. The parent may SIGKILL
or SIGSTOP it; it exits by itself if the parent dies.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kvfsm._child import ChildProcess
from kvfsm.transport import Agent, LayoutSummary
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, make_state, page_digests

__all__ = ["PeerProcess"]


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
