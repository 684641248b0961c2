"""``PrefillControl``: prefill's end of the control channel. It listens, authenticates each
decode that connects, loads that decode's NIXL agent into its transport, and fences every write by
the lease of the decode link that sent the pages (rules: :mod:`kvfsm.control._plane`)."""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any, ClassVar

import anyio
import msgspec
from anyio.abc import SocketStream

from kvfsm.control._admission import Admission, Throttled
from kvfsm.control._channel import PEER_ERRORS, ChannelConfig, Link, Sealer
from kvfsm.control._fingerprint import (
    Fingerprint,
    link_plan,
    link_slot,
    stage_buffers,
    stage_state,
    stage_types,
)
from kvfsm.control._frames import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    clip_reason,
)
from kvfsm.control._plane import ControlPlane, new_stats
from kvfsm.control._routing import Action, GrantLease, PrefillRouting, RevokeLease, Send
from kvfsm.control._stage_rows import StageRows
from kvfsm.control._state_plan import state_link_plan
from kvfsm.link import AcceptErrors, RawConnection, accept_forever, describe, peer_host, tune
from kvfsm.rooms import RoomKey
from kvfsm.states import ReportOutcome, ReportSettled, Role
from kvfsm.transport import NO_KV, Agent, LayoutSummary, Leases, NixlTransport, state_groups

__all__ = ["PrefillControl"]

_log = logging.getLogger("kvfsm.control")


class PrefillControl(ControlPlane):
    """``PrefillControl(rank, agent, transport=NixlTransport(agent, ...))``: listens on
    ``config.host:config.port`` (:attr:`port` once started), connects each decode link's agent
    through the transport, and its transport's ``leases`` fence every write by the lease of the
    decode link that sent the pages."""

    role: ClassVar = "prefill"
    transport: NixlTransport

    def __init__(
        self,
        rank: int,
        agent: Agent,
        *,
        transport: NixlTransport,
        config: ChannelConfig | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        if transport is None or transport.leases is None:
            # Unfenced writes would break law 4 under a freeze: refuse to run that way.
            raise ValueError("a prefill control plane needs its NixlTransport, with leases")
        config = config if config is not None else ChannelConfig()
        stats = new_stats()
        self._routing = PrefillRouting(config.routing(), stats)
        super().__init__(
            rank,
            agent,
            self._routing,
            stats,
            transport=transport,
            config=config,
            fingerprint=fingerprint,
        )
        self._leases: Leases = transport.leases
        self._outbox_max = config.outbox_max_bytes
        # Connections in their handshake and links, by peer host (kvfsm.control._admission).
        self._admission = Admission(
            max_unauthenticated=config.max_unauthenticated,
            max_unauthenticated_per_host=config.max_unauthenticated_per_host,
            max_links=config.max_links,
            max_links_per_host=config.max_links_per_host,
        )
        self._hosts: dict[anyio.CancelScope, str] = {}  # handshakes in progress -> peer host
        self._refusals = Throttled(_log)
        self._accept_errors = AcceptErrors(_log, f"prefill rank {rank} control", stats=self.stats)

    # -- commands and registry hooks ------------------------------------------------------------

    def _report_outcome(self, key: RoomKey, command: ReportOutcome) -> None:
        self._do(self._routing.sender_outcome(key, command.status, command.reason, self._now()))

    def _report_settled(self, key: RoomKey, command: ReportSettled) -> None:
        self._do(self._routing.sender_settled(key, self._now()))

    COMMANDS: ClassVar = {ReportOutcome: _report_outcome, ReportSettled: _report_settled}

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        """A claim or page list may be waiting for this sender room."""
        if role is Role.SENDER:
            assert self._registry is not None
            leg = self._registry.leg_of(key)
            self._do(self._routing.sender_spawned(key, self._now(), leg))

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        """Forget everything kept for this room."""
        if role is Role.SENDER:
            self._do(self._routing.sender_reaped(key))

    def _lease(self, action: GrantLease | RevokeLease) -> None:
        if isinstance(action, GrantLease):
            self._leases.grant(action.fence, action.until, action.margin_s)
        else:
            self._leases.revoke(action.fence)

    # -- listening -------------------------------------------------------------------------------

    async def _listen(self, tg: Any) -> None:
        listener = await anyio.create_tcp_listener(
            local_host=self.config.host, local_port=self.config.port
        )
        self._port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        for one in listener.listeners:
            tg.start_soon(self._serve, one)
        tg.start_soon(self._close_on_exit, listener)

    async def _close_on_exit(self, listener: Any) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            self._accept_errors.close()
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _serve(self, listener: Any) -> None:
        """Accept for ever (``kvfsm.link.accept_forever``: an accept error never ends the
        listener). Refusing to serve while the registry still advertises this port would fail
        every room of every decode. Accepted on the raw socket, not through anyio's listener:
        its streams start reading at once, which is memory an unauthenticated peer would choose.
        Until it is authenticated, a connection is read only as far as the handshake asks."""
        raw: socket.socket = listener.extra(anyio.abc.SocketAttribute.raw_socket)
        loop = self._running_loop()

        async def accepted(sock: socket.socket) -> None:
            tune(sock)
            assert self._tg is not None
            self._tg.start_soon(self._accepted, RawConnection(sock, loop))

        await accept_forever(raw, accepted, self._accept_errors, backoff_max_s=1.0)

    async def _accepted(self, stream: RawConnection) -> None:
        """One connection to prefill's port, until it is authenticated or gone. At most
        ``max_unauthenticated`` wait at once, ``max_unauthenticated_per_host`` from one host: a
        new one over a cap sheds the oldest of its host, or of all (a flood of idle or slow
        connections cannot keep out the decode ranks that come later, and one host's flood
        sheds only its own)."""
        host = peer_host(stream.sock)
        with anyio.CancelScope() as scope:
            self._hosts[scope] = host
            for shed in self._admission.arrived(scope, host):
                assert isinstance(shed, anyio.CancelScope)
                shed.cancel()
                self.stats["unauthenticated_shed"] += 1
            try:
                await self._handshake(stream, expect_rank=None, key=None, scope=scope)
            except PEER_ERRORS as exc:  # the peer's doing: bad bytes, a timeout, a hang-up
                self.stats["handshakes_failed"] += 1
                _log.debug("handshake failed: %s", exc)
            except Exception as exc:
                self.stats["handshakes_failed"] += 1
                self._unexpected("in a handshake", exc)
            finally:
                self._admission.released(scope)
                self._hosts.pop(scope, None)
        if scope.cancelled_caught:
            with contextlib.suppress(Exception):
                await stream.aclose()

    # -- the handshake ---------------------------------------------------------------------------

    def _hello(self, nonce: bytes) -> Hello:
        return Hello(
            PROTOCOL_VERSION,
            "prefill",
            self.rank,
            self.agent.name,
            b"",
            b"",
            self.incarnation,
            0,
            nonce,
            self.fingerprint,
            0,
        )

    def _authenticated(self, scope: anyio.CancelScope | None) -> None:
        # No longer counts against the unauthenticated caps.
        if scope is not None:
            self._admission.authenticated(scope)

    def _registered(self, link: Link, scope: anyio.CancelScope | None) -> None:
        if scope is not None:
            self._admission.opened(scope, link.generation)

    def _lost(self, link: Link) -> None:
        self._admission.closed(link.generation)

    async def _take_slot(
        self,
        stream: SocketStream | RawConnection,
        codec: Sealer,
        peer_id: str,
        theirs: Hello,
        scope: anyio.CancelScope | None,
    ) -> None:
        """Take this link's place within ``max_links`` and ``max_links_per_host``, or refuse it
        (an ``Error`` naming the bound, a counter, a throttled warning): never a link already
        open, and before its NIXL metadata is loaded."""
        if scope is None:
            return
        host = self._hosts.get(scope, "")
        old = self._links.get(peer_id)
        replaces = None if old is None else old.generation
        refusal = self._admission.take_slot(scope, host, replaces)
        if refusal is None:
            return
        self.stats["links_refused"] += 1
        reason = clip_reason(
            f"prefill rank {self.rank} refused a control link from {host} "
            f"({theirs.role} rank {theirs.rank}, agent {theirs.agent!r}): {refusal}"
        )
        self._refusals.warning(self._now(), f"control link refused: {reason}")
        await self._refuse(stream, codec, reason, log=False)

    def _pair(self, theirs: Fingerprint) -> tuple[Fingerprint, Fingerprint]:
        return self.fingerprint, theirs

    async def _admit(
        self,
        stream: SocketStream | RawConnection,
        codec: Sealer,
        peer_id: str,
        theirs: Hello,
        scope: anyio.CancelScope | None,
    ) -> None:
        """Take the link's place (``_take_slot``), then load decode's NIXL metadata. A refusal
        is told to decode in an ``Error`` frame naming NIXL's error (two decode processes with
        one agent name get ``NIXL_ERR_NOT_ALLOWED``): otherwise it would see only a closed
        connection."""
        await self._take_slot(stream, codec, peer_id, theirs, scope)
        try:
            summary, _ = self._their_layout(theirs)
            layout = self.agent.layout
            # Unequal attention TP: the head slice of each page this rank writes there.
            plan = link_plan(self.fingerprint, theirs.fingerprint)
            piece = NO_KV if plan == "none" else plan
            assert not isinstance(piece, str)
            state = state_link_plan(
                self.fingerprint,
                theirs.fingerprint,
                layout.state_specs(),
                summary.state,
                layout.state_groups,
            )
            await self.transport.connect_peer(peer_id, theirs.agent_metadata, summary, piece, state)
        except Exception as exc:
            self.stats["handshakes_refused"] += 1
            reason = clip_reason(
                f"prefill rank {self.rank} refused decode agent {theirs.agent!r}: "
                f"{describe(exc, typed=True)}"
            )
            await self._refuse(stream, codec, reason)  # raises: the handshake fails

    def _their_layout(self, theirs: Hello) -> tuple[LayoutSummary, StageRows | None]:
        """Decode's layout summary as this rank pairs with it (a pipeline stage's span of its
        layers and its own state types), and the translation of decode's state rows into that
        summary's numbering (``StageRows``; None where none is needed). Raises ValueError
        naming why the two cannot pair.

        A pure function of the two hellos and this rank's layout: the admission computes it
        to connect the peer, and the link's opening computes it again rather than keeping it
        across the awaits between the two, where another handshake of the same decode agent
        could take or replace a kept one."""
        summary = msgspec.msgpack.decode(theirs.layout, type=LayoutSummary)
        # A pipeline stage: its buffers pair with its span of decode's layers only.
        local_kv = len(self.agent.layout.kv)
        buffers = stage_buffers(self.fingerprint, theirs.fingerprint, local_kv, len(summary.kv))
        if isinstance(buffers, str):
            raise ValueError(buffers)
        if buffers is not None:
            summary = summary.select_kv(buffers)
        layout = self.agent.layout
        remote_groups = state_groups(summary.state_groups, len(summary.state))
        regions = stage_state(
            self.fingerprint, theirs.fingerprint, layout.state_groups, remote_groups
        )
        if isinstance(regions, str):
            raise ValueError(regions)
        if regions is None:
            return summary, None
        stage = summary.select_state(regions, layout.state_groups)
        kinds = stage_types(self.fingerprint, theirs.fingerprint)
        assert not isinstance(kinds, str)  # stage_state paired them
        return stage, StageRows.plan(summary.state_type_rows(), stage.state_type_rows(), kinds)

    def _opened(self, link: Link, hello_sent: float, now: float) -> list[Action]:
        theirs = link.hello
        leg, legs = link_slot(self.fingerprint, theirs.fingerprint)
        # (its admission paired the same hellos and layout: this cannot raise here)
        _, rows = self._their_layout(theirs)
        return self._routing.link_opened(
            link.generation,
            link.peer_id,
            now,
            hello_sent,
            theirs.lease_ms,
            leg=leg,
            legs=legs,
            margin_ms=theirs.fence_margin_ms,
            host=self._admission.host_of(link.generation),
            rows=rows,
        )

    # -- the watchdog's ticks ---------------------------------------------------------------------

    def _link_due(self, link: Link, now: float) -> list[Action]:
        # Leases are asked for on a timer, not when idle: a busy link must renew. Each request
        # echoes decode's last grant (the link's round trip, measured on every live link).
        actions = self._routing.lease_due(link.generation, now)
        return [
            Send(a.link, link.round_trip.ask(a.frame.seq, now))
            if isinstance(a, Send) and isinstance(a.frame, LeaseRequest)
            else a
            for a in actions
        ]

    def _tick(self, now: float, stalled_s: float) -> list[Action]:
        return self._routing.tick(now, stalled_s)

    # -- frames ----------------------------------------------------------------------------------

    def _lease_granted(self, link: Link, frame: LeaseGrant, now: float) -> list[Action]:
        link.round_trip.answered(frame.seq, now)
        return self._routing.lease_granted(link.generation, frame.seq, frame.lease_ms, now)

    def _claim(self, link: Link, frame: RoomClaim, now: float) -> list[Action]:
        return self._routing.on_claim(link.generation, frame, now)

    def _metadata(self, link: Link, frame: RoomMetadata, now: float) -> list[Action]:
        return self._routing.on_metadata(link.generation, frame, now)

    def _abort(self, link: Link, frame: RoomAbort, now: float) -> list[Action]:
        return self._routing.on_abort(link.generation, frame, now)

    def _reconcile(self, link: Link, frame: Reconcile, now: float) -> list[Action]:
        return self._routing.on_reconcile(link.generation, frame, now)

    FRAMES: ClassVar = {
        LeaseGrant: _lease_granted,
        RoomClaim: _claim,
        RoomMetadata: _metadata,
        RoomAbort: _abort,
        Reconcile: _reconcile,
        Error: ControlPlane._on_error,
    }
