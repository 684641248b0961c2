"""The engine API: one manager per rank, built from a layout, a bootstrap address and options.

A manager owns everything a rank needs: its NIXL agent with the layout registered, the room
engine (the loop thread and the room tasks), the control channel and, on prefill, the data path
and the registration in the bootstrap registry. Rooms are handed out as facades whose calls
mirror SGLang's scheduler sequence:

    prefill   sender(room) -> poll until WaitingForInput -> init(num_pages, aux_index)
              -> send(page_indices) per chunk (the last may be empty) -> poll -> clear
    decode    receiver(room) -> init(prefill_rank) -> poll until WaitingForInput
              -> send_metadata(page_indices, aux_index) -> poll -> clear

``abort()`` and ``failure_exception()`` exist on both. Thread-safety: every facade call may be
made from any thread and never blocks (``poll`` reads a published value; the rest post an event
and return). Building and closing a manager block (NIXL registration, binding sockets, the
first registration) and belong to setup and teardown.

Tensor parallelism: each TP rank runs its own manager; rank ``r`` of prefill serves rank ``r`` of
decode (equal TP), and the caller all-reduces ``poll()`` over its ranks with MIN, as SGLang does.
Unequal attention TP is one room per prefill/decode rank pair that moves something (a leg,
``receiver(room, leg=, group=)``, ``sender(room, leg=)``; docs/heterogeneous-tp.md). Pipeline
stages on prefill: each stage runs its own manager (``pp_rank``, ``pp_size``, ``stage_root``),
and stage 0 learns the others' room statuses (``pipeline``; docs/pipeline.md).

The engine's sink is one :class:`CommandRouter` (built by :func:`router_for`): each command type
goes to the transport or to the control channel, decided here once, so neither of them forwards
commands to the other; on decode it also runs the agent's progress loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

from kvfsm.control import (
    ChannelConfig,
    ControlPlane,
    DecodeControl,
    Fingerprint,
    PipelineStage,
    PrefillControl,
    Registration,
    Resolver,
    registry_resolver,
)
from kvfsm.peer_book import PeerBook
from kvfsm.registry import BootstrapClient, BootstrapError, NotReadyError, UnreachableError
from kvfsm.rooms import (
    CommandSink,
    Inbox,
    ReceiverRoom,
    RoomConfig,
    RoomEngine,
    RoomKey,
    SenderRoom,
)
from kvfsm.states import (
    Command,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
)
from kvfsm.status import StatusServer
from kvfsm.transport import (
    Agent,
    AgentConfig,
    AgentProgress,
    Layout,
    Leases,
    NixlTransport,
    TransferConfig,
)

__all__ = [
    "FENCED_OUT_EXIT",
    "CommandRouter",
    "DecodeManager",
    "ManagerConfig",
    "PrefillManager",
    "default_agent_name",
    "exit_fenced_out",
    "router_for",
]

_log = logging.getLogger("kvfsm.manager")
#: The control channel's Hello carries the agent name in at most 256 characters.
_AGENT_NAME_MAX = 256
_HOST_MAX = 63  # one DNS label


#: The data path's commands; every other command type is the control channel's.
TRANSPORT_COMMANDS: Final[tuple[type[Command], ...]] = (PostChunk, ReleaseHandles)
CONTROL_COMMANDS: Final[tuple[type[Command], ...]] = (
    ResolvePeer,
    SendMetadata,
    ReportOutcome,
    ReportSettled,
)


class CommandRouter(CommandSink):
    """A rank's one command sink: each command type goes to ``transport`` or to ``control``.

    The route is a table by exact command type (one lookup per command on the hot path). A
    command with no route (a new type not wired here, or a data-path command on a rank with no
    transport) raises, which fails the room that emitted it. Hooks go to both sinks (a sink
    that has no use for one inherits the no-op). ``progress``: an agent progress loop that
    shares the engine's life (decode, which has no pump), started after both sinks are
    attached. ``aclose`` closes the control channel first (its queued frames still go out while
    the data path runs), then the progress loop, then the transport.
    """

    def __init__(
        self,
        control: CommandSink,
        transport: CommandSink | None = None,
        progress: AgentProgress | None = None,
    ) -> None:
        self.control = control
        self.transport = transport
        self.progress = progress
        routes: dict[type[Command], Callable[[RoomKey, Command], None]] = {
            kind: control.submit for kind in CONTROL_COMMANDS
        }
        if transport is not None:
            routes.update((kind, transport.submit) for kind in TRANSPORT_COMMANDS)
        self._routes = routes
        self._sinks = (control,) if transport is None else (transport, control)

    def attach(self, inbox: Inbox) -> None:
        for sink in self._sinks:
            sink.attach(inbox)
        if self.progress is not None:
            self.progress.start()

    def submit(self, key: RoomKey, command: Command) -> None:
        route = self._routes.get(type(command))
        if route is None:
            raise TypeError(f"no sink for {type(command).__name__} on this rank")
        route(key, command)

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        for sink in self._sinks:
            sink.room_spawned(key, role)

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        for sink in self._sinks:
            sink.room_reaped(key, role)

    def rooms_ran(self) -> None:
        for sink in self._sinks:
            sink.rooms_ran()

    async def aclose(self) -> None:
        try:
            await self.control.aclose()
        finally:
            try:
                if self.progress is not None:
                    await self.progress.aclose()
            finally:
                if self.transport is not None:
                    await self.transport.aclose()


def router_for(control: ControlPlane) -> CommandRouter:
    """The sink an engine needs around ``control``: prefill's transport beside it; on decode,
    the progress loop of its agent, paced by the control plane's ``expecting_writes``. The
    managers use it, and so does anything that builds a ``ControlPlane`` itself."""
    if isinstance(control, PrefillControl):
        return CommandRouter(control, control.transport)
    assert isinstance(control, DecodeControl)
    progress = AgentProgress(
        control.agent,
        lambda: control.expecting_writes,
        control.config.progress_interval_s,
        control.progress_watch,
    )
    return CommandRouter(control, progress=progress)


#: The exit status of a process ended by ``exit_on_fenced_out`` (EX_TEMPFAIL: restart it).
FENCED_OUT_EXIT: Final = 75


def exit_fenced_out(reason: str) -> None:
    """End this process now (``ManagerConfig.exit_on_fenced_out``): its NIXL agent is fenced
    out and may hold WRITEs that must never move. ``os._exit``, not ``sys.exit``: no cleanup
    runs, since a destructor that closed the agent would push them."""
    _log.critical("exiting (status %d): %s", FENCED_OUT_EXIT, reason)
    for handler in logging.getLogger().handlers + _log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(FENCED_OUT_EXIT)


def default_agent_name(role: str, engine_id: str, rank: int) -> str:
    """A NIXL agent name that no other process picks, without configuration.

    NIXL refuses a second remote agent under a name it already knows (``NIXL_ERR_NOT_ALLOWED``),
    so two ranks with the same role, engine and rank (two processes on one host, or a rank
    restarted before its peer forgot it) must still differ: the name carries the host, the
    pid, and a random incarnation (pids are reused, and containers share them across hosts).
    It stays readable in logs, e.g. ``kvfsm-decode-default-r0-node7-pid1234-a1b2c3d4``, and
    within the Hello's 256 characters (a long engine id is clipped, never the unique part).
    """
    host = socket.gethostname().split(".")[0][:_HOST_MAX] or "host"
    unique = f"-{host}-pid{os.getpid()}-{secrets.token_hex(4)}"
    prefix = f"kvfsm-{role}-{engine_id}-r{rank}"
    return prefix[: _AGENT_NAME_MAX - len(unique)] + unique


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """Everything configurable about a rank, with production defaults."""

    rooms: RoomConfig = field(default_factory=RoomConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    #: Shared secret for the registry and the control channel (overrides channel.secret).
    secret: bytes | None = None
    #: How often a prefill rank refreshes its registration (keep well under the registry TTL).
    register_interval_s: float = 5.0
    #: How long a prefill rank's first registration keeps retrying while the registry is not
    #: up yet (SGLang starts its bootstrap server after the scheduler ranks); 0: one attempt.
    register_wait_s: float = 0.0
    #: How long one request to the bootstrap registry may take before the registry counts as
    #: unreachable (a decode room whose prefill rank cannot be looked up fails with that).
    registry_timeout_s: float = 2.0
    use_uvloop: bool = True
    #: Serve ``/rooms``, ``/stats`` and (with ``metrics``) ``/metrics`` on this port of
    #: ``status_host``; 0 picks a free port; None: no status server.
    status_port: int | None = None
    status_host: str = "127.0.0.1"
    #: Keep Prometheus metrics (needs ``prometheus-client``: ``pip install kvfsm[metrics]``).
    metrics: bool = False
    #: The model layout and parallel shape this rank declares in its handshake; a peer whose
    #: declaration does not pair with it is refused there (``kvfsm.control.Fingerprint``; the
    #: rules: docs/protocol.md, "The handshake").
    #: None: nothing declared (pairs only with peers that declare nothing).
    fingerprint: Fingerprint | None = None
    #: Prefill: when the stale-progress gate fences the NIXL agent out (the process was
    #: stopped or starved with a WRITE in flight past its lease; ``kvfsm.transport.Leases``),
    #: exit the process at once with status ``FENCED_OUT_EXIT`` so its supervisor restarts
    #: it. False: the rank stays up and fails every room with the reason until restarted.
    exit_on_fenced_out: bool = False

    def __post_init__(self) -> None:
        # aiohttp reads a total of 0 as no timeout at all: a registry that never answers would
        # hold every lookup until its room's deadline.
        if not self.registry_timeout_s > 0:
            raise ValueError(f"registry_timeout_s must be > 0, got {self.registry_timeout_s!r}")

    def channel_config(self) -> ChannelConfig:
        if self.secret is None:
            return self.channel
        return dataclasses.replace(self.channel, secret=self.secret)

    def registry_client(self, base_url: str) -> BootstrapClient:
        """A client of the registry at ``base_url`` with this rank's secret and request bound."""
        return BootstrapClient(base_url, secret=self.secret, timeout_s=self.registry_timeout_s)


class _Manager:
    """What both roles share: the agent, the engine and the bootstrap client."""

    def __init__(
        self,
        role: str,
        layout: Layout,
        bootstrap_url: str,
        *,
        engine_id: str,
        rank: int,
        config: ManagerConfig | None,
        name: str | None,
    ) -> None:
        self.config = config if config is not None else ManagerConfig()
        self.engine_id = engine_id
        self.rank = rank
        self.bootstrap_url = bootstrap_url
        agent_name = name or default_agent_name(role, engine_id, rank)
        self.agent = Agent(agent_name, layout, self.config.agent)
        self._client: BootstrapClient | None = None
        self._closed = False
        self.engine: RoomEngine | None = None
        self.control: ControlPlane | None = None
        self.metrics: Any = None
        self.status: StatusServer | None = None
        self.peers: PeerBook | None = None
        if self.config.metrics:
            from kvfsm.metrics import RoomMetrics  # noqa: PLC0415 - optional dependency

            self.metrics = RoomMetrics()

    def _bootstrap_client(self) -> BootstrapClient:
        # Built anywhere; its aiohttp session opens on first use, on the engine's loop.
        if self._client is None:
            self._client = self.config.registry_client(self.bootstrap_url)
        return self._client

    def _start(self, control: ControlPlane) -> None:
        self.control = control
        self.engine = RoomEngine(
            router_for(control),
            self.config.rooms,
            use_uvloop=self.config.use_uvloop,
            # Short: the OS keeps 15 bytes of a thread's name (top -H, py-spy).
            name=f"kvfsm-loop-{control.role[0]}{self.rank}",
            observer=self.metrics,
        ).start()
        self.engine.call(control.started())
        transport = getattr(self, "transport", None)  # prefill's: it holds the write leases
        self.peers = PeerBook(control, None if transport is None else transport.leases)
        self.engine.call(self._install_recorder(self.peers))
        if self.metrics is not None:
            registry = self.engine.registry_on_loop()
            self.metrics.watch(
                registry.rooms,
                deadlines=self.config.rooms.deadlines,
                links=self.peers.links,
                control=lambda: dict(control.stats),
            )
        if self.config.status_port is not None:
            self.status = StatusServer(
                self.engine,
                metrics=self.metrics,
                extra_stats=self._status_extra,
                peers=self.peers,
                host=self.config.status_host,
                port=self.config.status_port,
            )
            self.engine.call(self.status.start())

    async def _install_recorder(self, peers: PeerBook) -> None:
        """Rooms' timelines name their peers from the book and show chunks in bytes."""
        registry = self._engine().registry_on_loop()
        registry.peer_namer = peers.name
        registry.page_bytes = self.agent.layout.page_bytes()

    def _engine(self) -> RoomEngine:
        if self.engine is None:
            raise RuntimeError("manager is not started")
        return self.engine

    def stats(self) -> dict[str, Any]:
        """Room counters and control-channel counters (any thread)."""
        out: dict[str, Any] = {"rooms": self._engine().stats()}
        if self.control is not None:
            out["control"] = dict(self.control.stats)
        return out

    def _status_extra(self) -> dict[str, Any]:
        """What ``/stats`` serves beside the rooms and threads (loop thread)."""
        return {} if self.control is None else {"control": dict(self.control.stats)}

    def close(self) -> None:
        """Abort live rooms, let them settle, stop the loop, release NIXL. Idempotent."""
        if self._closed:
            return
        self._closed = True
        engine = self.engine
        if engine is not None:
            if self.status is not None:
                try:
                    engine.call(self.status.stop(), timeout=10)
                except Exception:
                    _log.exception("stopping the status server failed")
            if self._client is not None:
                try:
                    engine.call(self._client.close(), timeout=10)
                except Exception:
                    _log.exception("closing the bootstrap client failed")
            engine.close()
        self._close_data_path()
        self.agent.close()

    def _close_data_path(self) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class PrefillManager(_Manager):
    """A prefill rank: listens for decode ranks, registers itself, sends rooms' KV."""

    def __init__(
        self,
        layout: Layout,
        bootstrap_url: str,
        *,
        engine_id: str = "default",
        rank: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        stage_root: int | None = None,
        dp_by_room: bool = True,
        http_port: int = 0,
        host: str | None = None,
        config: ManagerConfig | None = None,
        name: str | None = None,
    ) -> None:
        """``pp_size > 1``: this rank is pipeline stage ``pp_rank``; ``stage_root`` is the
        registry rank of stage 0 of its pipeline (same DP and TP rank), whom a later stage
        reports its rooms' statuses to (``kvfsm.control.PipelineStage``).

        ``dp_by_room`` (published to decode): room ``r`` is served by DP rank
        ``r % dp_size``. False: something else picks the DP rank, and each room's is
        registered (:meth:`register_dp_rank`) for decode to look up. ``http_port`` (published):
        the engine's serving HTTP port, where a decode asks for a request's recompute."""
        super().__init__(
            "prefill",
            layout,
            bootstrap_url,
            engine_id=engine_id,
            rank=rank,
            config=config,
            name=name,
        )
        # Fenced: every chunk is posted only under the write lease of the decode link that sent
        # its pages (law 4), checked right before the post; and the agent is never progressed
        # when bytes queued across a freeze could land past decode's margin (each decode's
        # Hello tells its own; this rank's setting stands in only for a peer that does not).
        leases = Leases(margin_s=self.config.channel.fence_margin_s)
        self.transport = NixlTransport(
            self.agent,
            config=self.config.transfer,
            observer=self.metrics,
            leases=leases,
            on_fenced_out=exit_fenced_out if self.config.exit_on_fenced_out else None,
        )
        self._registration_task: asyncio.Task[None] | None = None
        self.pipeline: PipelineStage | None = None
        self.dp_rank = dp_rank
        try:
            control = PrefillControl(
                rank,
                self.agent,
                transport=self.transport,
                config=self.config.channel_config(),
                fingerprint=self.config.fingerprint,
            )
            self._start(control)
            registration = Registration(
                self._bootstrap_client(),
                control,
                engine=engine_id,
                tp_rank=tp_rank,
                tp_size=tp_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                pp_rank=pp_rank,
                pp_size=pp_size,
                dp_by_room=dp_by_room,
                http_port=http_port,
                host=host,
                interval_s=self.config.register_interval_s,
            )
            if pp_size > 1:
                if stage_root is None:
                    raise ValueError("a pipeline stage needs stage_root: stage 0's registry rank")
                self.pipeline = PipelineStage(
                    stage=pp_rank,
                    stages=pp_size,
                    group=f"{engine_id}/dp{dp_rank}/tp{tp_rank}",
                    root_rank=stage_root,
                    engine_id=engine_id,
                    channel=control.config,
                    secret=control.config.secret,
                )
                self._engine().call(self.pipeline.start(registration, self._bootstrap_client()))
            self._registration_task = self._engine().call(
                self._keep_registered(registration), timeout=self.config.register_wait_s + 30.0
            )
        except BaseException:
            self.close()
            raise

    async def _keep_registered(self, registration: Registration) -> asyncio.Task[None]:
        # The first registration must succeed (fail fast), within register_wait_s of retries.
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.register_wait_s
        delay = 0.05
        while True:
            try:
                await registration.register_once()
                break
            except BootstrapError as exc:
                if isinstance(exc, UnreachableError | NotReadyError) and loop.time() < give_up:
                    _log.info("bootstrap registry not reachable yet (retrying): %s", exc)
                    await asyncio.sleep(min(delay, max(0.0, give_up - loop.time())))
                    delay = min(2 * delay, 1.0)
                    continue
                raise
        return asyncio.get_running_loop().create_task(registration.run())

    @property
    def port(self) -> int:
        """The control channel's listening port."""
        assert self.control is not None
        return self.control.port

    async def register_dp_rank(self, room: int, *, wait_s: float = 5.0) -> None:
        """Publish that ``room`` runs on this rank's DP rank (an engine whose DP ranks are not
        picked by room id: ``dp_by_room=False``), for decode to look up. On the engine's
        loop. Retried while the registry is unreachable, for up to ``wait_s``; then, or on a
        refusal, raises the registry client's ``BootstrapError``."""
        client = self._bootstrap_client()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        delay = 0.05
        while True:
            try:
                await client.register_dp_rank(room, self.dp_rank)
                return
            except UnreachableError:
                if loop.time() + delay >= give_up:
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _status_extra(self) -> dict[str, Any]:
        # The data path too: an operator must see at once that this rank was fenced out.
        out = super()._status_extra()
        out["transport"] = self.transport.snapshot()
        out["fenced_out"] = self.transport.fenced_out
        return out

    def sender(self, room: int, *, leg: int = 0) -> SenderRoom:
        """A new prefill room (non-blocking; a duplicate live room id is published Failed).
        ``leg``: one of the rooms of a request written into several decode ranks."""
        return self._engine().sender(room, leg=leg)

    def close(self) -> None:
        task, engine = self._registration_task, self.engine
        if task is not None and engine is not None and not self._closed:
            engine.loop.call_soon_threadsafe(task.cancel)
        if self.pipeline is not None and engine is not None and not self._closed:
            try:
                engine.call(self.pipeline.aclose(), timeout=10)
            except Exception:
                _log.exception("stopping the pipeline stage failed")
        super().close()

    def _close_data_path(self) -> None:
        self.transport.close()


class DecodeManager(_Manager):
    """A decode rank: finds prefill ranks through the registry, receives rooms' KV.

    ``resolver`` replaces the registry lookup (``bootstrap_url`` may then be None): it maps what
    a receiver's ``init(peer)`` names to the prefill rank's control address.
    """

    def __init__(
        self,
        layout: Layout,
        bootstrap_url: str | None,
        *,
        engine_id: str = "default",
        rank: int = 0,
        resolver: Resolver | None = None,
        config: ManagerConfig | None = None,
        name: str | None = None,
    ) -> None:
        if bootstrap_url is None and resolver is None:
            raise ValueError("a decode manager needs a bootstrap_url or a resolver")
        super().__init__(
            "decode",
            layout,
            bootstrap_url or "",
            engine_id=engine_id,
            rank=rank,
            config=config,
            name=name,
        )

        async def resolve(peer_rank: int) -> tuple[str, int] | tuple[str, int, int]:
            return await registry_resolver(self._bootstrap_client(), engine_id)(peer_rank)

        try:
            control = DecodeControl(
                rank,
                self.agent,
                resolver=resolver or resolve,
                config=self.config.channel_config(),
                fingerprint=self.config.fingerprint,
            )
            self._start(control)
        except BaseException:
            self.close()
            raise

    def receiver(self, room: int, *, leg: int = 0, group: int | None = None) -> ReceiverRoom:
        """A new decode room (non-blocking; a duplicate live room id is published Failed).
        ``leg``/``group``: one of several rooms of a request fed by several prefill ranks."""
        return self._engine().receiver(room, leg=leg, group=group)
