"""A decode rank in the test's own process, for the control-plane tests against a prefill
process (``tests/helpers/prefill_process.py``): a real NIXL agent whose pages the prefill process
writes, a ``ControlPlane`` behind the manager's command router, and a room engine."""

from __future__ import annotations

import os

import numpy as np

from kvfsm.control import ChannelConfig, DecodeControl
from kvfsm.manager import router_for
from kvfsm.rooms import ReceiverRoom, RoomConfig, RoomEngine
from kvfsm.states import KVPoll
from kvfsm.transport import Agent
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.waiting import wait_until_sync

__all__ = ["FAST", "Decode"]

#: Heartbeats every 0.2 s, so a link is set up and renewed quickly, but a peer is judged lost only
#: after 2 s of silence: a loop starved for a second by a loaded machine is not a lost peer.
#: Kills and cut connections are seen at once (a closed socket), whatever the silence limit.
FAST = ChannelConfig(heartbeat_s=0.2, liveness_factor=10.0)


class Decode:
    def __init__(
        self,
        port: dict[str, int],
        config: ChannelConfig = FAST,
        rooms: RoomConfig | None = None,
    ) -> None:
        self.kv, self.aux = make_buffers(SHAPE)
        self.expected_kv, self.expected_aux = make_buffers(SHAPE)
        fill_sources(self.expected_kv, self.expected_aux)
        self.agent = Agent(f"decode-{os.getpid()}-{id(self)}", make_layout(self.kv, self.aux))

        async def resolve(rank: int) -> tuple[str, int]:
            return "127.0.0.1", port["port"]

        self.control = DecodeControl(0, self.agent, resolver=resolve, config=config)
        self.engine = RoomEngine(router_for(self.control), rooms).start()
        self.engine.call(self.control.started())

    def receive(self, room: int, dst: list[int], aux_row: int) -> ReceiverRoom:
        receiver = self.engine.receiver(room)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() is not KVPoll.Bootstrapping, timeout=10)
        receiver.send_metadata(np.asarray(dst, np.int32), aux_row)
        return receiver

    def landed(self, src: list[int], dst: list[int], src_aux: int, dst_aux: int) -> bool:
        pages_ok = all(
            np.array_equal(self.kv[b][d], self.expected_kv[b][s])
            for b in range(len(self.kv))
            for s, d in zip(src, dst, strict=True)
        )
        return pages_ok and np.array_equal(self.aux[dst_aux], self.expected_aux[src_aux])

    def close(self) -> None:
        self.engine.close()
        self.agent.close()
