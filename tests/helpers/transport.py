"""The prefill side of the data-path tests, in the test's own process: source pages full of
random bytes, a NIXL agent, a ``NixlTransport`` behind the manager's command router, a room engine,
and a control channel stand-in that records what rooms tell their peer. The decode side is a
``kvfsm.workload.peer.PeerProcess``."""

from __future__ import annotations

import itertools
import os
import random
import threading

import numpy as np

from kvfsm.manager import CommandRouter
from kvfsm.rooms import CommandSink, Inbox, RoomConfig, RoomEngine, RoomKey, SenderRoom
from kvfsm.states import Command, DestinationReceived, KVPoll, ReportOutcome
from kvfsm.transport import Agent, NixlTransport, TransferConfig
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, make_state
from kvfsm.workload.peer import PeerProcess
from tests.helpers.waiting import wait_until_sync

__all__ = ["SHAPE", "Prefill", "RecordingControl"]

SHAPE = Shape()


class RecordingControl(CommandSink):
    """Stands in for the control channel: records what rooms tell their peer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[RoomKey, Command]] = []

    def attach(self, inbox: Inbox) -> None:
        pass

    def submit(self, key: RoomKey, command: Command) -> None:
        with self.lock:
            self.log.append((key, command))

    def outcomes(self, key: RoomKey) -> list[Command]:
        with self.lock:
            return [c for k, c in self.log if k == key and isinstance(c, ReportOutcome)]


class Prefill:
    """This process's side: source pages full of random bytes, an agent, a transport, an engine."""

    def __init__(self, config: TransferConfig | None = None, shape: Shape = SHAPE) -> None:
        self.kv, self.aux = make_buffers(shape)
        self.state = make_state(shape)
        rng = np.random.default_rng(1)
        for buf in [*self.kv, self.aux, *([] if self.state is None else [self.state])]:
            buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
        layout = make_layout(self.kv, self.aux, self.state)
        self.agent = Agent(f"prefill-{os.getpid()}-{id(self)}", layout)
        self.control = RecordingControl()
        self.transport = NixlTransport(self.agent, config)
        self.engine = RoomEngine(CommandRouter(self.control, self.transport), RoomConfig()).start()

    def connect(self, peer: PeerProcess, peer_id: str = "decode") -> int:
        connected = self.engine.call(
            self.transport.connect_peer(peer_id, peer.metadata, peer.summary)
        )
        return int(connected.generation)

    def room(  # noqa: PLR0917 - reads like the scheduler's own call sequence
        self,
        room: int,
        src: list[int],
        dst: list[int],
        chunks: int = 1,
        aux: tuple[int, int] = (0, 0),
        peer_id: str = "decode",
    ) -> SenderRoom:
        """Create a sender, hand it decode's pages, init and send it in ``chunks`` chunks."""
        sender = self.engine.sender(room)
        packed = np.asarray(dst, np.int32).tobytes()
        self.engine.post(sender.key, DestinationReceived(packed, aux[1], peer=peer_id))
        wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
        sender.init(len(src), aux[0])
        bounds = sorted(
            {0, len(src), *random.sample(range(len(src) + 1), min(chunks - 1, len(src)))}
        )
        for lo, hi in itertools.pairwise(bounds):
            sender.send(np.asarray(src[lo:hi], np.int32))
        if len(bounds) == 1:  # no pages at all: one empty, last chunk
            sender.send(np.empty(0, np.int32))
        return sender

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        stats = self.transport.snapshot()
        self.agent.close()
        assert stats["handles_created"] == stats["handles_released"], stats
        assert stats["in_flight"] == 0, stats
        agent = self.agent
        assert agent.dlists_prepped == agent.dlists_released > 0
        assert agent.peers_added == agent.peers_removed > 0
