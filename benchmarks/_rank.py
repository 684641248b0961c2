"""One bare rank (NIXL agent over DRAM, engine, control plane; fenced data path on prefill) for
the benchmarks that run a prefill and a decode process: ``benchmarks/idle.py`` and
``benchmarks/peer_loss.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvfsm.control import ChannelConfig, ControlPlane, DecodeControl, PrefillControl
from kvfsm.manager import router_for
from kvfsm.rooms import RoomEngine
from kvfsm.transport import Agent, Leases, NixlTransport
from kvfsm.workload.buffers import Shape, make_buffers, make_layout


@dataclass
class Rank:
    agent: Agent
    control: ControlPlane
    engine: RoomEngine
    transport: NixlTransport | None = None

    def close(self) -> None:
        self.engine.close()
        if self.transport is not None:
            self.transport.close()
        self.agent.close()


def start_rank(shape: Shape, channel: ChannelConfig, *, name: str, port: int = 0) -> Rank:
    """A prefill rank (``port`` 0: it listens; its port is ``rank.control.port``) or a decode
    rank that reaches the prefill rank listening on ``port`` of loopback."""
    kv, aux = make_buffers(shape)
    agent = Agent(f"{name}-{os.getpid()}", make_layout(kv, aux))
    transport = None
    if port == 0:
        transport = NixlTransport(agent, leases=Leases(margin_s=channel.fence_margin_s))
        control = PrefillControl(0, agent, transport=transport, config=channel)
    else:

        async def resolve(rank: int) -> tuple[str, int]:
            return "127.0.0.1", port

        control = DecodeControl(0, agent, resolver=resolve, config=channel)
    engine = RoomEngine(router_for(control)).start()
    engine.call(control.started())
    return Rank(agent, control, engine, transport)
