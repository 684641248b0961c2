"""The model's two engines: what both share (a room registry, links, the watchdog, executing
the routing cores' actions, as ``kvfsm.control._plane.ControlPlane`` does), prefill's (senders,
``PrefillRouting``, the transport) and decode's (receivers, ``DecodeRouting``, its resolver and
connector)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Literal

from kvfsm.control._codec import FrameCodec
from kvfsm.control._frames import (
    PROTOCOL_VERSION,
    Error,
    Frame,
    FrameError,
    Heartbeat,
    Hello,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    check_hello,
)
from kvfsm.control._routing import (
    Action,
    DecodeRouting,
    Deliver,
    GrantLease,
    PrefillRouting,
    RevokeLease,
    Send,
)
from kvfsm.rooms._actor import Publication, RoomKey
from kvfsm.rooms._owners import DestinationOwners
from kvfsm.rooms._stats import RoomStats
from kvfsm.states import (
    Command,
    DestinationReceived,
    Event,
    KVPoll,
    PeerLost,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    SendMetadata,
)
from tests.helpers.model_links import Conn, LinkEnd, LinkLoss
from tests.helpers.model_rooms import ModelRoom
from tests.helpers.model_transport import Transport
from tests.helpers.model_world import DECODE_RANK, PREFILL_RANK, Cause, Side

if TYPE_CHECKING:
    from tests.helpers.model_pair import Pair

_SUCCESS: Final = int(KVPoll.Success)


class Process:
    """What both engines share: a registry of rooms, links, the watchdog, executing actions."""

    side: Side

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.clock = pair.clock
        self.config = pair.config
        self.stats = RoomStats()
        self.owners = DestinationOwners()
        self.codec = FrameCodec()
        self.rooms: dict[RoomKey, ModelRoom] = {}
        self.current: dict[int, RoomKey] = {}
        self.generations = itertools.count(1)
        self.links: dict[object, LinkEnd] = {}
        self.by_gen: dict[int, LinkEnd] = {}
        self.link_gens = itertools.count(1)
        self.incarnation = 11 if self.side is Side.PREFILL else 22
        self.stale_events = 0
        #: The frame being handled: every Deliver it causes is tagged with it (law 5).
        self.cause: Cause | None = None
        self.clock.at(self.config.tick_s, self.side, self._watchdog)

    @property
    def core(self) -> PrefillRouting | DecodeRouting:
        raise NotImplementedError

    # -- registry ------------------------------------------------------------------------------

    def post(self, key: RoomKey, event: Event) -> None:
        """The facades' ``post``: RoomEngine.post, a call_soon_threadsafe onto the loop."""
        self.clock.soon(self.side, lambda: self.deliver(key, event))

    def spawn(self, key: RoomKey, pub: Publication) -> None:
        """Registry.spawn_or_refuse."""
        held = self.current.get(key.room)
        live = self.rooms.get(held) if held is not None else None
        if live is not None and not live.core.terminal:
            pub.reason = f"refused: {self.side.role.value} room {key.room} is already live"
            pub.status = KVPoll.Failed
            pub.settled = True
            self.pair.refused.append((self.side, key))
            return
        room = ModelRoom(self, key, pub)
        self.rooms[key] = room
        self.current[key.room] = key
        self.pair.all_rooms.append(room)
        self.pair.rooms_by[(self.side, key)] = room
        self.room_spawned(key)

    def deliver(self, key: RoomKey, event: Event) -> bool:
        room = self.rooms.get(key)
        if room is None:
            self.stale_events += 1
            return False
        if self.cause is not None:
            room.causes.add(self.cause)
        self.pair.note_delivery(self.side, key, event, self.cause)
        room.deliver(event)
        return True

    def run_woken(self) -> None:
        """Inbox.run_woken: the model's rooms run when its clock runs them."""

    def reap(self, room: ModelRoom) -> None:
        room.reaped = True
        room.cancel_timer()
        if self.rooms.pop(room.key, None) is None:
            return
        if self.current.get(room.key.room) == room.key:
            del self.current[room.key.room]
        if room.key in self.owners and room.publication.settled:
            self.owners.release(room.key)  # Registry.reap: unsettled ones stay held
        self.room_reaped(room.key)

    # hooks, per side
    def room_spawned(self, key: RoomKey) -> None: ...

    def room_reaped(self, key: RoomKey) -> None: ...

    def room_entered(self, room: ModelRoom, state: KVPoll) -> None:
        self.pair.room_entered(room, state)

    def room_settled(self, room: ModelRoom) -> None:
        self.pair.room_settled(room)

    def submit(self, key: RoomKey, command: Command) -> None:
        raise NotImplementedError

    # -- actions -------------------------------------------------------------------------------

    def do(self, actions: Iterable[Action], cause: Cause | None = None) -> None:
        """ControlPlane._do; ``cause`` tags the deliveries with the frame that caused them."""
        for action in actions:
            if isinstance(action, Send):
                end = self.by_gen.get(action.link)
                if end is not None:
                    self.send(end, action.frame)
            elif isinstance(action, Deliver):
                self.deliver_action(action, cause)
            elif isinstance(action, GrantLease):
                self.grant(action)
            elif isinstance(action, RevokeLease):
                self.revoke(action)

    def deliver_action(self, action: Deliver, cause: Cause | None) -> None:
        saved, self.cause = self.cause, cause
        try:
            self.deliver(action.key, action.event)
        finally:
            self.cause = saved

    def grant(self, action: GrantLease) -> None:
        raise AssertionError(f"{self.side.value} got {action}")

    def revoke(self, action: RevokeLease) -> None:
        raise AssertionError(f"{self.side.value} got {action}")

    # -- links ---------------------------------------------------------------------------------

    def send(self, end: LinkEnd, frame: Frame) -> None:
        if end.closed:
            return
        data = self.codec.encode(frame)
        now = self.clock.now
        end.last_sent = now
        conn = end.conn
        if conn.broken:
            return
        other = self.side.other
        arrival = now + self.config.latency_s
        self.clock.at(
            arrival, other, lambda: self.pair.arrive(conn, other, data, arrival), kind="reader"
        )

    def receive(self, end: LinkEnd, data: bytes) -> None:
        end.last_seen = self.clock.now
        for item in end.reader.feed(data):
            if end.closed:
                return
            if isinstance(item, FrameError):
                self.pair.errors.append(f"{self.side.value} could not read a frame: {item!r}")
                continue
            if not end.open:
                if not isinstance(item, Hello):
                    self.pair.errors.append(f"{self.side.value} got {item!r} before Hello")
                    continue
                check_hello(item)
                self.opened(end, item)
                continue
            if isinstance(item, Heartbeat):
                continue
            self.on_frame(end, item)

    def hello(self) -> Hello:
        role: Literal["prefill", "decode"] = "prefill" if self.side is Side.PREFILL else "decode"
        rank = PREFILL_RANK if self.side is Side.PREFILL else DECODE_RANK
        # Decode's Hello grants the first lease (ControlPlane._handshake).
        lease_ms = 0 if self.side is Side.PREFILL else round(self.config.lease_s * 1000)
        margin_ms = 0 if self.side is Side.PREFILL else round(self.config.fence_margin_s * 1000)
        return Hello(
            PROTOCOL_VERSION,
            role,
            rank,
            f"{role}-agent",
            b"",
            b"",
            self.incarnation,
            lease_ms,
            fence_margin_ms=margin_ms,
        )

    def opened(self, end: LinkEnd, hello: Hello) -> None:
        raise NotImplementedError

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        raise NotImplementedError

    def register(self, end: LinkEnd, key: object) -> None:
        end.gen = next(self.link_gens)
        end.open = True
        old = self.links.get(key)
        if old is not None:
            self.lose(old, "replaced by a new connection")
        self.links[key] = end
        self.by_gen[end.gen] = end

    def lose(self, end: LinkEnd, reason: str) -> None:
        """ControlPlane._lose, plus closing the socket (the peer reads the end of the stream)."""
        if end.closed:
            return
        end.closed = True
        if end.open:
            for key, link in list(self.links.items()):
                if link is end:
                    del self.links[key]
            self.by_gen.pop(end.gen, None)
            claimed = self.claimed_on(end.gen)
            self.link_lost(end, reason)
            self.pair.losses.append(LinkLoss(self.side, end.gen, self.clock.now, claimed))
        else:
            self.handshake_failed(end, reason)
        conn = end.conn
        if not conn.broken:
            other = self.side.other
            self.clock.at(
                self.clock.now + self.config.latency_s, other, lambda: self.pair.eof(conn, other)
            )

    def claimed_on(self, gen: int) -> list[RoomKey]:
        raise NotImplementedError

    def link_lost(self, end: LinkEnd, reason: str) -> None:
        self.do(self.core.link_lost(end.gen, reason, self.clock.now))

    def handshake_failed(self, end: LinkEnd, reason: str) -> None: ...

    def _watchdog(self) -> None:
        """ControlPlane._watchdog, plus the writer's heartbeats."""
        clock, config = self.clock, self.config
        clock.at(clock.now + config.tick_s, self.side, self._watchdog)
        now = clock.now
        limit = config.silence_s - config.tick_s
        for end in list(self.links.values()):
            if now - end.last_seen > limit:
                self.lose(end, f"silent for more than {config.silence_s:g}s")
                continue
            self.lease_due(end)
            if now - end.last_sent >= config.heartbeat_s and not end.closed:
                self.send(end, Heartbeat(next(end.beats)))
        self.do(self.core.tick(now))

    def lease_due(self, end: LinkEnd) -> None: ...


class PrefillProcess(Process):
    """The prefill engine: senders, PrefillRouting, Leases and the transport around the ledger."""

    side = Side.PREFILL
    transport_class: type[Transport] = Transport

    def __init__(self, pair: Pair) -> None:
        self.routing = PrefillRouting(pair.config.routing())
        super().__init__(pair)
        self.transport = self.transport_class(self)

    @property
    def core(self) -> PrefillRouting:
        return self.routing

    def do(self, actions: Iterable[Action], cause: Cause | None = None) -> None:
        actions = list(actions)
        for action in actions:
            if isinstance(action, Send) and isinstance(action.frame, RoomSettled):
                frame = action.frame
                self.pair.settled_answers.add((action.link, frame.room, frame.generation))
        super().do(actions, cause)

    def room_spawned(self, key: RoomKey) -> None:
        self.do_spawned(key, self.routing.sender_spawned(key, self.clock.now))

    def do_spawned(self, key: RoomKey, actions: list[Action]) -> None:
        """A held page list delivered at spawn: its cause is the metadata frame it came in."""
        for action in actions:
            cause = None
            if isinstance(action, Deliver) and isinstance(action.event, DestinationReceived):
                cause = self.pair.held_metadata_cause(key, action.event)
            self.do([action], cause)

    def room_reaped(self, key: RoomKey) -> None:
        self.do(self.routing.sender_reaped(key))

    def submit(self, key: RoomKey, command: Command) -> None:
        """ControlPlane.submit on prefill (PostChunk and ReleaseHandles go to the transport)."""
        now = self.clock.now
        if isinstance(command, (PostChunk, ReleaseHandles)):
            self.transport.submit(key, command)
        elif isinstance(command, ReportOutcome):
            actions = self.routing.sender_outcome(key, command.status, command.reason, now)
            for action in actions:
                if (
                    isinstance(action, Send)
                    and isinstance(action.frame, RoomOutcome)
                    and action.frame.status == _SUCCESS
                ):
                    self.pair.success_from[RoomKey(action.frame.room, action.frame.generation)] = (
                        key
                    )
            self.do(actions)
        elif isinstance(command, ReportSettled):
            self.do(self.routing.sender_settled(key, now))
        else:
            raise TypeError(f"prefill cannot execute {command!r}")

    def grant(self, action: GrantLease) -> None:
        self.transport.leases.grant(action.fence, action.until, action.margin_s)
        self.transport.schedule_pump()

    def revoke(self, action: RevokeLease) -> None:
        self.transport.leases.revoke(action.fence)
        self.transport.schedule_pump()

    def accept(self, conn: Conn) -> None:
        """The listener accepted decode's connection: send our Hello (the first lease counts
        from here)."""
        end = LinkEnd(self, conn)
        conn.ends[Side.PREFILL] = end
        end.hello_sent = self.clock.now
        self.send(end, self.hello())

    def opened(self, end: LinkEnd, hello: Hello) -> None:
        peer_id = f"{hello.role}-{hello.rank}-{hello.incarnation}"
        end.peer_id = peer_id
        self.transport.connect_peer(peer_id)  # _connect_data_path, before the link is opened
        self.register(end, peer_id)
        now = self.clock.now
        self.do(
            self.routing.link_opened(
                end.gen,
                peer_id,
                now,
                end.hello_sent,
                hello.lease_ms,
                margin_ms=hello.fence_margin_ms,
            )
        )

    def claimed_on(self, gen: int) -> list[RoomKey]:
        return self.routing.bound_to(gen)

    def lease_due(self, end: LinkEnd) -> None:
        self.do(self.routing.lease_due(end.gen, self.clock.now))

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        """ControlPlane._on_frame on prefill."""
        gen, now, core = end.gen, self.clock.now, self.routing
        if isinstance(frame, LeaseGrant):
            self.do(core.lease_granted(gen, frame.seq, frame.lease_ms, now))
        elif isinstance(frame, RoomClaim):
            self.do(core.on_claim(gen, frame, now), (frame.room, frame.generation))
        elif isinstance(frame, RoomMetadata):
            self.pair.metadata_seen.append((gen, frame))
            self.do(core.on_metadata(gen, frame, now), (frame.room, frame.generation))
        elif isinstance(frame, RoomAbort):
            self.do(core.on_abort(gen, frame, now), (frame.room, frame.generation))
        elif isinstance(frame, Reconcile):
            self.do(core.on_reconcile(gen, frame, now))
        elif isinstance(frame, Error):
            cause = None if frame.room is None else (frame.room, frame.generation)
            self.do(core.on_error(gen, frame), cause)
        else:
            self.pair.errors.append(f"prefill got {frame!r}")


class DecodeProcess(Process):
    """The decode engine: receivers, DecodeRouting, decode's resolver and connector."""

    side = Side.DECODE

    def __init__(self, pair: Pair) -> None:
        self.routing = DecodeRouting(pair.config.routing())
        super().__init__(pair)
        self.connecting: Conn | None = None
        self.waiting: list[RoomKey] = []  # rooms whose _resolve waits for the connection
        #: RoomKeys claimed on each decode link (from the RoomClaim sends).
        self.claims: dict[int, set[RoomKey]] = {}

    @property
    def core(self) -> DecodeRouting:
        return self.routing

    def room_reaped(self, key: RoomKey) -> None:
        self.do(self.routing.receiver_reaped(key))

    def submit(self, key: RoomKey, command: Command) -> None:
        """ControlPlane.submit on decode."""
        if isinstance(command, ResolvePeer):
            self.clock.soon(self.side, lambda: self.resolve(key, command.peer_rank))
        elif isinstance(command, SendMetadata):
            frame = RoomMetadata(
                key.room, key.generation, command.pages, command.aux_index, command.state
            )
            self.do(self.routing.metadata(key, frame))
        elif isinstance(command, ReportOutcome):
            if command.status is KVPoll.Failed:
                self.do(self.routing.receiver_failed(key, command.reason))
        else:
            raise TypeError(f"decode cannot execute {command!r}")

    def do(self, actions: Iterable[Action], cause: Cause | None = None) -> None:
        actions = list(actions)
        for action in actions:
            if isinstance(action, Send) and isinstance(action.frame, RoomClaim):
                key = RoomKey(action.frame.room, action.frame.generation)
                self.claims.setdefault(action.link, set()).add(key)
        super().do(actions, cause)

    # -- _resolve / _link_to -------------------------------------------------------------------

    def resolve(self, key: RoomKey, peer_rank: int) -> None:
        end = self.links.get(peer_rank)
        if end is not None:
            self.bind(key, end)
            return
        self.waiting.append(key)
        if self.connecting is None:
            self.connect()

    def bind(self, key: RoomKey, end: LinkEnd) -> None:
        room = self.rooms.get(key)
        if room is None or room.core.terminal:
            return  # it ended while its peer was being resolved: nothing to claim
        self.do(self.routing.bind(key, end.gen, PREFILL_RANK))

    def connect(self) -> None:
        """Open a connection to prefill: our Hello first, prefill accepts and answers."""
        if self.connecting is not None:
            return
        conn = self.pair.new_conn()
        end = LinkEnd(self, conn)
        conn.ends[Side.DECODE] = end
        self.connecting = conn
        prefill = self.pair.prefill

        def accepted() -> None:
            if not conn.broken:
                prefill.accept(conn)

        def timed_out() -> None:
            if not end.open and not end.closed:
                self.lose(end, "connect timed out")

        now = self.clock.now
        # Accepted before our Hello arrives (scheduled first: it runs first on a tie).
        self.clock.at(now + self.config.latency_s / 2, Side.PREFILL, accepted, kind="reader")
        self.send(end, self.hello())
        self.clock.at(now + self.config.connect_timeout_s, self.side, timed_out)

    def opened(self, end: LinkEnd, hello: Hello) -> None:
        end.peer_id = f"{hello.role}-{hello.rank}-{hello.incarnation}"
        self.register(end, PREFILL_RANK)
        self.do(self.routing.link_opened(end.gen, end.peer_id, hello.rank, self.clock.now))
        if self.connecting is end.conn:
            self.connecting = None
        waiting, self.waiting = self.waiting, []
        for key in waiting:
            self.bind(key, end)

    def handshake_failed(self, end: LinkEnd, reason: str) -> None:
        if self.connecting is not end.conn:
            return
        self.connecting = None
        waiting, self.waiting = self.waiting, []
        for key in waiting:
            self.deliver(key, PeerLost(f"cannot reach prefill rank {PREFILL_RANK}: {reason}"))

    def claimed_on(self, gen: int) -> list[RoomKey]:
        return sorted(self.claims.pop(gen, set()))

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        """ControlPlane._on_frame on decode."""
        gen, now, core = end.gen, self.clock.now, self.routing
        if isinstance(frame, LeaseRequest):
            self.do(core.lease_requested(gen, frame, now))
        elif isinstance(frame, RoomOutcome):
            self.do(core.on_outcome(gen, frame), (frame.room, frame.generation))
        elif isinstance(frame, RoomSettled):
            self.do(core.on_settled(gen, frame), (frame.room, frame.generation))
        elif isinstance(frame, RoomAbort):
            self.do(core.on_abort(gen, frame), (frame.room, frame.generation))
        elif isinstance(frame, Error):
            cause = None if frame.room is None else (frame.room, frame.generation)
            self.do(core.on_error(gen, frame), cause)
        else:
            self.pair.errors.append(f"decode got {frame!r}")
