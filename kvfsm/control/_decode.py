"""``DecodeControl``: decode's end of the control channel. A receiver room's ``init(peer)``
resolves and connects that prefill rank (once per rank; the link is reused) and claims the room
there; decode grants the leases that fence prefill's writes into its pages, and settles a lost
link's pages only by the lease bound, after a steady stretch of its own progress (rules:
:mod:`kvfsm.control._plane`)."""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import anyio
import msgspec

from kvfsm.control._channel import ChannelConfig, Link, Resolver
from kvfsm.control._fingerprint import Fingerprint
from kvfsm.control._frames import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    LeaseRequest,
    RoomAbort,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
)
from kvfsm.control._plane import ControlPlane, cancel_tasks, new_stats
from kvfsm.control._routing import Action, DecodeRouting
from kvfsm.link import describe
from kvfsm.rooms import RoomKey
from kvfsm.states import KVPoll, PeerLost, ReportOutcome, ResolvePeer, Role, SendMetadata
from kvfsm.transport import Agent, ProgressWatch

__all__ = ["DecodeControl"]

_log = logging.getLogger("kvfsm.control")


class DecodeControl(ControlPlane):
    """``DecodeControl(rank, agent, resolver=...)``: connects to the prefill ranks its rooms name,
    through ``resolver``."""

    role: ClassVar = "decode"

    def __init__(
        self,
        rank: int,
        agent: Agent,
        *,
        resolver: Resolver,
        config: ChannelConfig | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        if resolver is None:
            raise ValueError("a decode control plane needs a resolver for prefill ranks")
        config = config if config is not None else ChannelConfig()
        stats = new_stats()
        self._routing = DecodeRouting(config.routing(), stats)
        super().__init__(
            rank,
            agent,
            self._routing,
            stats,
            transport=None,
            config=config,
            fingerprint=fingerprint,
        )
        self._resolver = resolver
        self._connecting: dict[int, asyncio.Future[Link]] = {}
        self._backoff: dict[int, float] = {}  # by peer rank: the last backoff step
        self._backoff_until: dict[int, float] = {}
        #: When decode's agent was progressed (``router_for`` hands it to the progress loop). A
        #: lost link's pages settle only after a steady stretch of progress of
        #: ``fence_margin_s``: a rank that was frozen has bytes queued for it still to take.
        # (A gap limit above the idle progress interval, 50 ms: an idle rank is steady too.)
        self.progress_watch = ProgressWatch(max(self.config.fence_margin_s / 4, 0.1))
        #: Peer ranks a reconnect task is running for (``_owed``).
        self._reconnecting: set[int] = set()
        self._owed_tasks: set[asyncio.Task[None]] = set()

    @property
    def expecting_writes(self) -> bool:
        return self._routing.expecting_writes

    # -- commands and registry hooks ------------------------------------------------------------

    def _resolve_peer(self, key: RoomKey, command: ResolvePeer) -> None:
        self._spawn(self._resolve(key, command.peer_rank))

    def _send_metadata(self, key: RoomKey, command: SendMetadata) -> None:
        frame = RoomMetadata(
            key.room,
            key.generation,
            command.pages,
            command.aux_index,
            command.state,
            command.part,
            prefix=command.prefix,
            rings=command.rings,
        )
        self._do(self._routing.metadata(key, frame))

    def _report_outcome(self, key: RoomKey, command: ReportOutcome) -> None:
        # Decode tells prefill of its own failures only; a success is prefill's to report.
        if command.status is KVPoll.Failed:
            self._do(self._routing.receiver_failed(key, command.reason))

    COMMANDS: ClassVar = {
        ResolvePeer: _resolve_peer,
        SendMetadata: _send_metadata,
        ReportOutcome: _report_outcome,
    }

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        """Forget everything kept for this room."""
        if role is Role.RECEIVER:
            self._do(self._routing.receiver_reaped(key))

    # -- resolving and connecting a prefill rank --------------------------------------------------

    async def _resolve(self, key: RoomKey, peer_rank: int) -> None:
        registry = self._registry
        assert registry is not None
        try:
            link = await self._link_to(peer_rank)
        except Exception as exc:
            registry.deliver(
                key, PeerLost(f"cannot reach prefill rank {peer_rank}: {describe(exc)}")
            )
            return
        if registry.ended(key):
            return  # the room ended while its peer was being resolved: nothing to claim
        self._do(self._routing.bind(key, link.generation, peer_rank))

    async def _link_to(self, peer_rank: int) -> Link:
        link = self._links.get(peer_rank)
        if link is not None and not link.closed:
            return link
        pending = self._connecting.get(peer_rank)
        if pending is not None:
            return await asyncio.shield(pending)
        loop = self._running_loop()
        future: asyncio.Future[Link] = loop.create_future()
        self._connecting[peer_rank] = future
        try:
            # After a failed attempt, wait out a backoff (doubling to reconnect_max_s) before
            # the next one, so rooms aimed at a dead rank do not hammer its address. The
            # waiting room's own deadline still bounds it.
            delay = self._backoff_until.get(peer_rank, 0.0) - loop.time()
            if delay > 0:
                await anyio.sleep(delay)
            address = await self._resolver(peer_rank)
            host, port = address[0], address[1]
            expect_rank = address[2] if len(address) == 3 else peer_rank
            with anyio.fail_after(self.config.connect_timeout_s):
                stream = await anyio.connect_tcp(host, port)
            link = await self._handshake(stream, expect_rank=expect_rank, key=peer_rank)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                step = min(self.config.reconnect_max_s, 2 * self._backoff.get(peer_rank, 0.05))
                self._backoff[peer_rank] = step
                self._backoff_until[peer_rank] = loop.time() + step
                future.set_exception(exc)
                future.exception()
            raise
        finally:
            del self._connecting[peer_rank]
        self._backoff.pop(peer_rank, None)
        self._backoff_until.pop(peer_rank, None)
        future.set_result(link)
        return link

    async def _owed(self, peer_rank: int, peer: str) -> None:
        """Reconnect to a prefill rank this side owes something (lost rooms to reconcile, aborts
        to tell) without waiting for a new room to need the link, so a prefill room whose decode
        room failed meanwhile is told within one reconnect. Gives up once nothing is owed (what
        is owed expires with its TTL, or settles)."""
        try:
            while self._routing.owes(peer):
                link = self._links.get(peer_rank)
                if link is not None and not link.closed:
                    return  # connected again (a room needed it): the link paid what was owed
                try:
                    await self._link_to(peer_rank)
                except Exception as exc:
                    _log.info("reconnecting to prefill rank %d failed: %s", peer_rank, exc)
                    await anyio.sleep(self.config.reconnect_max_s / 4)
                else:
                    self.stats["reconnects_owed"] += 1
                    return
        finally:
            self._reconnecting.discard(peer_rank)

    def _lost(self, link: Link) -> None:
        if (
            isinstance(link.key, int)
            and link.key not in self._reconnecting
            and self._routing.owes(link.peer_id)
            and self._loop is not None
            and not self._closing
        ):
            # A task of its own, not the task group's: _lose also runs from plain callbacks,
            # and aclose cancels and awaits it.
            self._reconnecting.add(link.key)
            task = self._loop.create_task(self._owed(link.key, link.peer_id))
            self._owed_tasks.add(task)
            task.add_done_callback(self._owed_tasks.discard)

    async def _stop_tasks(self) -> None:
        await cancel_tasks(self._owed_tasks)

    # -- the handshake ---------------------------------------------------------------------------

    def _hello(self, nonce: bytes) -> Hello:
        return Hello(
            PROTOCOL_VERSION,
            "decode",
            self.rank,
            self.agent.name,
            self.agent.metadata(),
            msgspec.msgpack.encode(self.agent.layout.summary()),
            self.incarnation,
            round(self.config.lease_s * 1000),
            nonce,
            self.fingerprint,
            max(1, round(self.config.fence_margin_s * 1000)),
        )

    def _pair(self, theirs: Fingerprint) -> tuple[Fingerprint, Fingerprint]:
        return theirs, self.fingerprint

    def _opened(self, link: Link, hello_sent: float, now: float) -> list[Action]:
        return self._routing.link_opened(link.generation, link.peer_id, link.hello.rank, now)

    def _tick(self, now: float, stalled_s: float) -> list[Action]:
        # (A stall shows in the agent's progress: steady_for starts again after it.)
        return self._routing.tick(now, self.progress_watch.steady_for(now))

    # -- frames ----------------------------------------------------------------------------------

    def _lease_requested(self, link: Link, frame: LeaseRequest, now: float) -> list[Action]:
        round_trip = link.round_trip
        round_trip.asked(frame, now)  # the round trip of the grant it echoes
        actions = self._routing.lease_requested(link.generation, frame, now)
        if actions:  # the grant goes out now
            round_trip.grant(frame.seq, now)
        return actions

    def _outcome(self, link: Link, frame: RoomOutcome, now: float) -> list[Action]:
        return self._routing.on_outcome(link.generation, frame)

    def _settled(self, link: Link, frame: RoomSettled, now: float) -> list[Action]:
        return self._routing.on_settled(link.generation, frame)

    def _abort(self, link: Link, frame: RoomAbort, now: float) -> list[Action]:
        return self._routing.on_abort(link.generation, frame)

    FRAMES: ClassVar = {
        LeaseRequest: _lease_requested,
        RoomOutcome: _outcome,
        RoomSettled: _settled,
        RoomAbort: _abort,
        Error: ControlPlane._on_error,
    }
