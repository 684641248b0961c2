"""Discovery (``kvfsm.control._discovery``): a prefill rank's ``Registration`` against a real
registry over HTTP, and decode's ``registry_resolver`` reading it back."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import pytest_asyncio

from kvfsm.control import ChannelConfig, PrefillControl
from kvfsm.control._discovery import Registration, registry_resolver
from kvfsm.manager import router_for
from kvfsm.registry import BootstrapClient, BootstrapServer, NotFoundError, UnreachableError
from kvfsm.rooms import RoomEngine
from kvfsm.transport import Agent, Leases, NixlTransport
from kvfsm.workload.buffers import Shape, make_buffers, make_layout
from tests.helpers.waiting import wait_until

SHAPE = Shape(layers=1, num_pages=4, page_bytes=256, aux_rows=2, aux_row_bytes=64)


class Prefill:
    """A started prefill control plane (its listener bound), as a Registration publishes it."""

    def __init__(self, rank: int) -> None:
        kv, aux = make_buffers(SHAPE)
        self.agent = Agent(f"discovery-{rank}-{os.getpid()}", make_layout(kv, aux))
        self.transport = NixlTransport(self.agent, leases=Leases())
        self.control = PrefillControl(
            rank, self.agent, transport=self.transport, config=ChannelConfig()
        )
        self.engine = RoomEngine(router_for(self.control)).start()
        self.engine.call(self.control.started())

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        self.agent.close()


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    made = Prefill(rank=3)
    yield made
    made.close()


@pytest_asyncio.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    async with BootstrapServer(expected_ranks=4) as s:
        yield s


@pytest.mark.asyncio
async def test_a_registration_publishes_the_ranks_identity(
    server: BootstrapServer, prefill: Prefill
) -> None:
    control, agent = prefill.control, prefill.agent
    async with BootstrapClient(server.url) as client:
        registration = Registration(
            client, control, engine="e1", tp_rank=1, tp_size=2, dp_rank=1, dp_size=2
        )
        await registration.register_once()
        got = await client.rank("e1", 3)
    assert (got.tp_rank, got.tp_size, got.dp_rank, got.dp_size) == (1, 2, 1, 2)
    assert (got.host, got.port) == ("127.0.0.1", control.port)  # the channel's bind address
    assert (got.agent, got.incarnation) == (agent.name, control.incarnation)
    assert msgspec.msgpack.decode(got.layout) == msgspec.msgpack.decode(
        msgspec.msgpack.encode(agent.layout.summary())
    )
    # An advertised host overrides the channel's bind address.
    async with BootstrapClient(server.url) as client:
        await Registration(client, control, engine="e2", host="node-7").register_once()
        assert (await client.rank("e2", 3)).host == "node-7"


@pytest.mark.asyncio
async def test_the_resolver_reads_back_the_control_address(
    server: BootstrapServer, prefill: Prefill
) -> None:
    control = prefill.control
    async with BootstrapClient(server.url) as client:
        await Registration(client, control, engine="e3", host="10.9.9.9").register_once()
        resolve = registry_resolver(client, "e3")
        assert await resolve(3) == ("10.9.9.9", control.port)
        with pytest.raises(NotFoundError, match="rank 1 of engine 'e3' is not registered"):
            await resolve(1)


@pytest.mark.asyncio
async def test_run_keeps_registering_through_a_registry_outage(
    prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    """``run`` registers at once and every interval; a registry that is down is logged and
    retried, never fatal, and the rank is back in the table once the registry is."""
    control = prefill.control
    async with BootstrapServer(expected_ranks=4) as first:
        port = first.port
        client = BootstrapClient(first.url, timeout_s=0.5)
        registration = Registration(client, control, engine="e4", interval_s=0.05)
        task = asyncio.create_task(registration.run())
        try:
            await wait_until(
                lambda: _registered(client, "e4", 3), message="rank 3 of e4 in the registry"
            )
            await first.stop()
            with pytest.raises(UnreachableError):
                await client.rank("e4", 3)
            failed = "bootstrap registration failed (retrying)"
            with caplog.at_level("WARNING", logger="kvfsm.registry"):
                await wait_until(
                    lambda: caplog.text.count(failed) >= 3, message="three failed rounds"
                )
            assert not task.done()  # an outage is not fatal
            async with BootstrapServer(port=port, expected_ranks=4):
                await wait_until(
                    lambda: _registered(client, "e4", 3), message="rank 3 of e4 in the registry"
                )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.close()


async def _registered(client: BootstrapClient, engine: str, rank: int) -> bool:
    try:
        await client.rank(engine, rank)
    except (NotFoundError, UnreachableError):
        return False
    return True
