"""Two NIXL agents in this process, DRAM to DRAM, for the data path's module tests: a writer
with random bytes in its buffers, connected to a zeroed receiver, plus a chunk ledger and the
transport's counters. Both agents run without a progress thread, as the transport's do: a
WRITE between them completes only while both are progressed (:meth:`Pair.progress`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Any

import numpy as np

from kvfsm.rooms import RoomKey
from kvfsm.states import PostChunk
from kvfsm.transport import Agent, AgentConfig, Leases, Region
from kvfsm.transport._agent import Peer
from kvfsm.transport._chunks import Xfer, post_xfer, prepare
from kvfsm.transport._config import TransferConfig, TransportStats
from kvfsm.transport._ledger import ChunkLedger, Post
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, make_state, page_digests

__all__ = ["HYBRID", "KEY", "SHAPE", "Pair", "chunk", "ints"]

SHAPE = Shape(layers=2, num_pages=16, page_bytes=512, aux_rows=4, aux_row_bytes=64, state_rows=4)
KEY = RoomKey(1, 1)
#: ``Pair.accept``'s default peer: the pair's own connected generation.
OWN_PEER = object()
_NAMES = itertools.count()
#: A hybrid model's state pools as ``(rows, row_bytes)`` per pool, grouped by state type: a
#: Mamba-like type of two pools (conv, temporal), an SWA-like one of one pool, and a type
#: whose pools differ in rows (its rows are bounded by the smaller). Global state rows:
#: type 0 is rows 0-4, type 1 rows 5-11, type 2 rows 12-14.
HYBRID: tuple[tuple[tuple[int, int], ...], ...] = (
    ((5, 64), (5, 192)),
    ((7, 32),),
    ((3, 16), (4, 48)),
)


def ints(values: list[int]) -> bytes:
    return np.asarray(values, np.int32).tobytes()


def chunk(src: list[int], dst: list[int], **kw: Any) -> PostChunk:
    kw.setdefault("is_last", False)
    return PostChunk(chunk=kw.pop("index", 0), src=ints(src), dst=ints(dst), peer="decode", **kw)


class Side:
    """One agent and its buffers (random bytes on the writing side, zeros on the other)."""

    def __init__(
        self,
        role: str,
        seed: int | None,
        config: AgentConfig | None = None,
        *,
        hybrid: bool = False,
    ) -> None:
        self.kv, self.aux = make_buffers(SHAPE)
        state = make_state(SHAPE)
        assert state is not None
        self.state = state
        #: With ``hybrid``, the state pools of :data:`HYBRID`, in order (``state`` unused).
        self.pools = [
            np.zeros(shape, np.uint8) for kind in (HYBRID if hybrid else ()) for shape in kind
        ]
        if seed is not None:
            rng = np.random.default_rng(seed)
            for buf in (*self.kv, self.aux, self.state, *self.pools):
                buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
        name = f"chunks-{role}-{os.getpid()}-{next(_NAMES)}"
        layout = make_layout(self.kv, self.aux, self.state)
        if hybrid:
            layout = dataclasses.replace(
                layout,
                state=tuple(
                    Region(f"state{i}", pool.ctypes.data, pool.nbytes, pool.shape[1])
                    for i, pool in enumerate(self.pools)
                ),
                state_groups=tuple(len(kind) for kind in HYBRID),
                keepalive=(*layout.keepalive, *self.pools),
            )
        self.agent = Agent(name, layout, config)

    def pages(self, pages: list[int]) -> list[int]:
        return page_digests(self.kv, np.asarray(pages, np.int32))


class Pair:
    def __init__(self, config: AgentConfig | None = None, *, hybrid: bool = False) -> None:
        """``config``: the writer's (an ``interpose`` to watch or steer its NIXL calls);
        ``hybrid``: both sides hold the state pools of :data:`HYBRID`."""
        self.mine = Side("p", seed=3, config=config, hybrid=hybrid)
        self.theirs = Side("d", seed=None, hybrid=hybrid)
        agent = self.theirs.agent
        self.peer = self.mine.agent.connect("decode", agent.metadata(), agent.layout.summary())
        self.stats = TransportStats()
        self.leases: Leases | None = None
        self.ledger = self.ledger_with(None)

    def ledger_with(
        self, leases: Leases | None, config: TransferConfig | None = None
    ) -> ChunkLedger:
        self.leases = leases
        config = config or TransferConfig()
        self.ledger = ChunkLedger(
            deadline_s=config.deadline_s,
            quarantine_s=config.quarantine_s,
            leases=leases,
            stats=self.stats,
        )
        return self.ledger

    def accept(self, command: PostChunk, peer: Peer | object | None = OWN_PEER) -> list[Any]:
        """What the transport does with ``command`` (``prepare``, then the ledger), one chunk at
        a time: ``[Post(record)]``, or the chunk's end. ``peer``: the connected generation the
        chunk names (default: this pair's own peer; None: no generation is connected)."""
        prepared = prepare(
            self.stats,
            KEY,
            command,
            layout=self.mine.agent.layout,
            peer=self.peer if peer is OWN_PEER else peer,  # type: ignore[arg-type]
        )
        if isinstance(prepared, list):
            return prepared
        return self.ledger.accepted(prepared, time.monotonic())  # the pump's clock

    def record(self, command: PostChunk) -> Xfer:
        (post,) = self.accept(command)
        assert type(post) is Post
        assert isinstance(post.record, Xfer)
        return post.record

    def post(self, record: Xfer) -> None:
        post_xfer(self.mine.agent, self.leases, self.stats, record)

    def settle(self, record: Xfer) -> list[str]:
        """What the pump would do: wait for every posted handle, then release it. Both agents
        run without a progress thread, and here both are in this process: the receiving one
        must be progressed too, or a WRITE into it never completes."""
        nixl = self.mine.agent.nixl
        states = list(record.states)
        for i, handle in enumerate(record.handles[: len(states)]):  # the posted ones
            for _ in range(100_000):
                if states[i] != "PROC":
                    break
                self.progress()
                states[i] = nixl.check_xfer_state(handle)
        while record.handles:
            nixl.release_xfer_handle(record.handles.pop())
            self.stats.handles_released += 1
        return states

    def progress(self) -> None:
        """Progress the receiver (the writer is progressed by whoever checks its handles)."""
        self.theirs.agent.nixl.get_new_notifs()

    def close(self) -> None:
        self.mine.agent.disconnect(self.peer)
        self.mine.agent.close()
        self.theirs.agent.close()
        created = self.stats.handles_created + self.stats.flush_handles_created
        assert created == self.stats.handles_released + self.stats.handles_released_at_post
