"""A decode rank in its own OS process, for control-plane fault tests that kill or stop decode:
a real ``DecodeManager`` (default agent name unless one is given) that reaches the prefill
process's control port through a fixed resolver, driven by the parent over a pipe.

Commands: ``("claim", room)``: a receiver that names prefill rank 0 and waits (its claim goes to
prefill at once); ``("metadata", room, dst_pages, dst_aux)``: send its page list once it is
WaitingForInput; ``("abort", room)``; ``("status", room)`` -> (status int, reason, settled);
``("landed", room, src, dst, src_aux, dst_aux)`` -> bool (the bytes prefill's sources hold);
``("name",)`` -> the NIXL agent name; ``("quit",)``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvfsm._child import ChildProcess
from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig
from kvfsm.rooms import ReceiverRoom
from kvfsm.states import KVPoll
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.waiting import ConditionTimeoutError, wait_until_sync


def _serve(conn: Connection, port: int, config: ChannelConfig, name: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kv, aux = make_buffers(SHAPE)
    want_kv, want_aux = make_buffers(SHAPE)
    fill_sources(want_kv, want_aux)

    async def resolve(rank: int) -> tuple[str, int]:
        return "127.0.0.1", port

    manager = DecodeManager(
        make_layout(kv, aux),
        None,
        resolver=resolve,
        config=ManagerConfig(channel=config, use_uvloop=False),
        name=name,
    )
    conn.send(manager.agent.name)
    rooms: dict[int, ReceiverRoom] = {}
    parent = os.getppid()
    try:
        while True:
            if not conn.poll(0.05):
                if os.getppid() != parent:
                    break
                continue
            request: Any = conn.recv()
            op = request[0]
            if op == "quit":
                break
            if op == "claim":
                receiver = rooms[request[1]] = manager.receiver(request[1])
                receiver.init(0)
                conn.send(True)
            elif op == "metadata":
                _, room, dst, dst_aux = request
                receiver = rooms[room]
                # Still Bootstrapping after that: send_metadata answers for it (the test sees).
                with contextlib.suppress(ConditionTimeoutError):
                    wait_until_sync(
                        lambda r=receiver: r.poll() is not KVPoll.Bootstrapping,
                        timeout=10,
                    )
                receiver.send_metadata(np.asarray(dst, np.int32), dst_aux)
                conn.send(int(receiver.poll()))
            elif op == "abort":
                rooms[request[1]].abort("decode aborted it")
                conn.send(True)
            elif op == "status":
                receiver = rooms[request[1]]
                conn.send((int(receiver.poll()), receiver.reason, receiver.settled))
            elif op == "landed":
                _, room, src, dst, src_aux, dst_aux = request
                ok = all(
                    np.array_equal(kv[b][d], want_kv[b][s])
                    for b in range(len(kv))
                    for s, d in zip(src, dst, strict=True)
                )
                conn.send(ok and np.array_equal(aux[dst_aux], want_aux[src_aux]))
            elif op == "name":
                conn.send(manager.agent.name)
    except (EOFError, OSError):
        pass
    finally:
        manager.close()


class DecodeProcess(ChildProcess):
    def __init__(self, port: int, config: ChannelConfig, name: str | None = None) -> None:
        super().__init__(_serve, port, config, name, what="decode")
        self.name: str = self.greeting
