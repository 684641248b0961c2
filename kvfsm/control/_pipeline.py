"""A prefill rank's place in its pipeline (``pp_size > 1``): the status consensus of its stages.

SGLang's scheduler polls a request's bootstrap only on pipeline stage 0, with
``poll_pp_consensus()``, and acts on the answer on every stage (it forwards the answer down the
PP chain: SGLang's ``disaggregation/utils.py``). So stage 0 must know every stage's status of
the room: each later stage streams its senders' statuses to stage 0 (``_stages``: ``StageFeed``
-> ``StageLink`` -> ``StageHub`` -> ``StageBook``).

How the stages find each other: stage 0 binds its hub before its first registration and
publishes the port in its registry row (``RankInfo.stage_port``); a later stage looks up stage
0's row of its own pipeline (same DP and attention-TP rank) in the same registry, as decode
finds prefill ranks, retrying until it is there. Nothing here blocks the caller: the lookups and
links run on the manager's loop.

Decisions:

* A pipeline is one group: ``group`` names engine, DP rank and attention-TP rank, and a link or
  hub of another group is refused at its hello.
* Stage 0 that restarts comes back with a new port; the stages of a pipeline restart together
  in SGLang (one process group), so a later stage does not look its stage 0 up again.
* Every call that the adapter makes per room is a no-op without pipeline parallelism.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from kvfsm.control._stage_links import StageHub, StageLink
from kvfsm.control._stages import StageBook, StageFeed
from kvfsm.registry import BootstrapClient, BootstrapError
from kvfsm.states import KVPoll

if TYPE_CHECKING:
    from kvfsm.control._channel import ChannelConfig
    from kvfsm.control._discovery import Registration

__all__ = ["PipelineStage"]

_log = logging.getLogger("kvfsm.pipeline")


class _Published(Protocol):
    def poll(self) -> KVPoll: ...


class PipelineStage:
    """Stage ``stage`` of ``stages`` of one prefill pipeline. Stage 0 holds the book and the
    hub, later stages a feed and its link. ``root_rank``: stage 0's registry rank."""

    def __init__(
        self,
        *,
        stage: int,
        stages: int,
        group: str,
        root_rank: int,
        engine_id: str,
        channel: ChannelConfig,
        secret: bytes | None,
    ) -> None:
        if not 0 <= stage < stages or stages < 2:
            raise ValueError(f"pipeline stage {stage} of {stages}")
        self.stage = stage
        self.stages = stages
        self.group = group
        self.root_rank = root_rank
        self.engine_id = engine_id
        self.channel = channel
        self.secret = secret
        self.book: StageBook | None = None
        self.hub: StageHub | None = None
        self.feed: StageFeed | None = None
        self.link: StageLink | None = None
        #: Per room id, the sender whose status the feed reads (a reused id: the newest).
        self._tracked: dict[int, _Published] = {}
        self._task: asyncio.Task[None] | None = None
        if stage == 0:
            self.book = StageBook(stages)
            self.hub = StageHub(
                self.book,
                stages=stages,
                group=group,
                host=channel.host,
                secret=secret,
                heartbeat_s=channel.heartbeat_s,
                liveness_factor=channel.liveness_factor,
            )
        else:
            self.feed = StageFeed()

    # -- start-up and shutdown (loop thread) -----------------------------------------------------

    async def start(self, registration: Registration, client: BootstrapClient) -> None:
        """Stage 0: bind the hub and put its port in the registration (call before the first
        registration). Then run the hub, or find stage 0 and run the link, as a task."""
        if self.hub is not None:
            registration.stage_port = await self.hub.bind()
            self._task = asyncio.get_running_loop().create_task(self.hub.run())
        else:
            self._task = asyncio.get_running_loop().create_task(self._feed_stage_zero(client))

    async def _feed_stage_zero(self, client: BootstrapClient) -> None:
        assert self.feed is not None
        delay = 0.05
        while True:
            try:
                info = await client.rank(self.engine_id, self.root_rank)
            except BootstrapError as exc:
                _log.debug("pipeline stage 0 (rank %d) not registered yet: %s", self.root_rank, exc)
            else:
                if info.stage_port:
                    break
                _log.warning(
                    "registry rank %d is not a pipeline stage 0 (no stage port)", self.root_rank
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
        _log.info(
            "pipeline stage %d of %d reports to stage 0 at %s:%d",
            self.stage,
            self.stages,
            info.host,
            info.stage_port,
        )
        self.link = StageLink(
            self.feed,
            stage=self.stage,
            stages=self.stages,
            group=self.group,
            address=(info.host, info.stage_port),
            secret=self.secret,
            heartbeat_s=self.channel.heartbeat_s,
            liveness_factor=self.channel.liveness_factor,
        )
        await self.link.run()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                _log.exception("pipeline stage %d: its task failed", self.stage)

    # -- per room (any thread) -------------------------------------------------------------------

    def track(self, room: int, sender: _Published) -> None:
        """A sender was built for ``room``: a later stage reports its status from now on."""
        if self.feed is not None:
            self._tracked[room] = sender
            self.feed.track(room, sender.poll)

    def release(self, room: int, sender: _Published) -> None:
        """The scheduler released ``sender``: stage 0 forgets the room (a later stage tells it
        so), unless a newer sender of the same id took its place."""
        if self.feed is not None:
            if self._tracked.get(room) is sender:
                del self._tracked[room]
                self.feed.untrack(room)
        elif self.book is not None:
            loop = self._loop()
            if loop is not None:
                loop.call_soon_threadsafe(self.book.drop, room)

    def consensus(self, room: int, own: KVPoll) -> tuple[KVPoll, str]:
        """Stage 0: the MIN over every stage (``StageBook.consensus``); elsewhere ``own``."""
        if self.book is None:
            return own, ""
        return self.book.consensus(room, own)

    @property
    def ready(self) -> bool:
        """Stage 0: every later stage's feed is connected; a later stage: its link is up."""
        if self.hub is not None:
            return len(self.hub.feeds) == self.stages - 1
        return self.link is not None and self.link.connected

    def entries(self) -> int:
        """Per-room entries held (leak checks): a later stage's tracked senders, stage 0's
        reports from every stage."""
        if self.book is not None:
            return sum(self.book.rooms(stage) for stage in range(1, self.stages))
        return len(self._tracked)

    def _loop(self) -> asyncio.AbstractEventLoop | None:
        task = self._task
        return None if task is None else task.get_loop()
