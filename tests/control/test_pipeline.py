"""``PipelineStage``: how the stages of a prefill pipeline find each other through the registry
and what stage 0's consensus says, with a real registry and real status links on loopback
(the senders are stand-ins whose published status the test sets)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from kvfsm.control import ChannelConfig
from kvfsm.control._pipeline import PipelineStage
from kvfsm.registry import BootstrapClient, BootstrapServer, RankInfo
from kvfsm.states import KVPoll
from tests.helpers.waiting import wait_until

ENGINE = "pp-test"
CHANNEL = ChannelConfig(heartbeat_s=0.1, liveness_factor=3.0)


class Published:
    """A sender's published status, set by the test."""

    def __init__(self, status: KVPoll = KVPoll.Bootstrapping) -> None:
        self.status = status

    def poll(self) -> KVPoll:
        return self.status


def stage(n: int, stages: int = 2, root: int = 0) -> PipelineStage:
    return PipelineStage(
        stage=n,
        stages=stages,
        group=f"{ENGINE}/dp0/tp0",
        root_rank=root,
        engine_id=ENGINE,
        channel=CHANNEL,
        secret=None,
    )


def row(rank: int, stage_port: int = 0) -> RankInfo:
    return RankInfo(
        engine=ENGINE,
        rank=rank,
        tp_rank=0,
        tp_size=1,
        dp_rank=0,
        pp_rank=rank,
        pp_size=2,
        host="127.0.0.1",
        port=40000 + rank,
        agent=f"agent-{rank}",
        layout=msgspec.msgpack.encode({}),
        incarnation=1,
        stage_port=stage_port,
    )


@pytest_asyncio.fixture
async def registry() -> AsyncIterator[BootstrapClient]:
    async with BootstrapServer("127.0.0.1", 0, expected_ranks=2, ttl_s=30.0) as server:
        client = BootstrapClient(server.url)
        try:
            yield client
        finally:
            await client.close()


async def start(pipeline: PipelineStage, client: BootstrapClient) -> Any:
    registration: Any = SimpleNamespace(stage_port=0)
    await pipeline.start(registration, client)
    return registration


@pytest.mark.asyncio
async def test_a_later_stage_finds_stage_zero_and_the_consensus_follows_it(
    registry: BootstrapClient, caplog: pytest.LogCaptureFixture
) -> None:
    zero, one = stage(0), stage(1)
    try:
        # stage 1 starts first: it keeps looking until stage 0's row is there
        with caplog.at_level("DEBUG", logger="kvfsm.pipeline"):
            await start(one, registry)
            registration = await start(zero, registry)
            assert registration.stage_port > 0  # bound before the first registration
            await wait_until(
                lambda: caplog.text.count("not registered yet") >= 2,
                message="stage 1 to look for stage 0 twice in vain",
            )
        assert not one.ready
        await registry.register(row(0, registration.stage_port))
        await wait_until(lambda: zero.ready and one.ready)

        mine, theirs = Published(KVPoll.WaitingForInput), Published()
        zero.track(5, mine)  # stage 0 does not report: it is the one that asks
        assert zero.consensus(5, KVPoll.WaitingForInput) == (KVPoll.Bootstrapping, "")
        one.track(5, theirs)
        await wait_until(lambda: zero.entries() == 1, message="stage 1's report of room 5")
        assert zero.consensus(5, KVPoll.WaitingForInput) == (KVPoll.Bootstrapping, "")
        theirs.status = KVPoll.WaitingForInput
        await wait_until(
            lambda: zero.consensus(5, KVPoll.WaitingForInput)[0] is KVPoll.WaitingForInput
        )
        theirs.status = KVPoll.Failed
        await wait_until(lambda: zero.consensus(5, KVPoll.WaitingForInput)[0] is KVPoll.Failed)
        assert zero.consensus(5, KVPoll.WaitingForInput) == (
            KVPoll.Failed,
            "failed on PP stage 1",
        )
        # A later stage's consensus is its own status: only stage 0 asks.
        assert one.consensus(5, KVPoll.Transferring) == (KVPoll.Transferring, "")

        # The scheduler releases the senders: stage 1 tells stage 0 to forget the room.
        assert one.entries() == 1
        one.release(5, theirs)
        assert one.entries() == 0
        await wait_until(lambda: zero.entries() == 0)
        # A newer sender of the same id is not dropped by the old one's release.
        newer = Published(KVPoll.WaitingForInput)
        one.track(6, Published())
        one.track(6, newer)
        one.release(6, Published())
        assert one.entries() == 1
        await wait_until(lambda: zero.entries() == 1)
        zero.release(6, mine)  # stage 0's own release drops every stage's report
        await wait_until(lambda: zero.entries() == 0)
    finally:
        await one.aclose()
        await zero.aclose()


@pytest.mark.asyncio
async def test_a_lost_stage_fails_stage_zeros_consensus_naming_it(
    registry: BootstrapClient,
) -> None:
    zero, one = stage(0), stage(1)
    try:
        registration = await start(zero, registry)
        await registry.register(row(0, registration.stage_port))
        await start(one, registry)
        await wait_until(lambda: zero.ready)
        one.track(7, Published(KVPoll.WaitingForInput))
        await wait_until(
            lambda: zero.consensus(7, KVPoll.WaitingForInput)[0] is KVPoll.WaitingForInput
        )
        await one.aclose()
        await wait_until(lambda: zero.consensus(7, KVPoll.WaitingForInput)[0] is KVPoll.Failed)
        _, reason = zero.consensus(7, KVPoll.WaitingForInput)
        assert reason.startswith("PP stage 1 lost"), reason
        assert not zero.ready
    finally:
        await one.aclose()
        await zero.aclose()


@pytest.mark.asyncio
async def test_a_root_rank_that_is_not_a_stage_zero_is_not_linked_to(
    registry: BootstrapClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The registry row names no stage port (a misconfigured root rank): the stage keeps
    looking, says so, and links to nothing."""
    one = stage(1)
    try:
        await registry.register(row(0, stage_port=0))
        with caplog.at_level("WARNING", logger="kvfsm.pipeline"):
            await start(one, registry)
            await wait_until(lambda: "is not a pipeline stage 0" in caplog.text)
        assert not one.ready
        assert one.link is None
    finally:
        await one.aclose()


def test_a_pipeline_needs_two_stages_and_a_stage_inside_it() -> None:
    with pytest.raises(ValueError, match="pipeline stage 2 of 2"):
        stage(2)
    with pytest.raises(ValueError, match="pipeline stage 0 of 1"):
        stage(0, stages=1)
