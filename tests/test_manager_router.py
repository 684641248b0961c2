"""The one command router of a rank (``kvfsm.manager.CommandRouter``): every command type goes to
exactly one of the transport and the control channel, neither hands commands to the other, hooks
reach the sinks, and shutdown closes control, then progress, then transport, whatever fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvfsm.manager import CONTROL_COMMANDS, TRANSPORT_COMMANDS, CommandRouter
from kvfsm.rooms import CommandSink, Inbox, RoomConfig, RoomKey
from kvfsm.rooms._registry import Registry
from kvfsm.states import (
    Command,
    KVPoll,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
)
from kvfsm.transport import AgentProgress

KEY = RoomKey(7, 1)
ONE_OF_EACH: tuple[Command, ...] = (
    PostChunk(0, b"", b"", is_last=True),
    ReleaseHandles(),
    ResolvePeer(0),
    SendMetadata(b"", 0),
    ReportOutcome(KVPoll.Success),
    ReportSettled(),
)


class Recorder(CommandSink):
    """Records what reaches it, and the order sinks are closed in (``closed``, shared)."""

    def __init__(
        self,
        name: str,
        closed: list[str],
        fail_close: bool = False,
        closing: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.closed = closed
        self.fail_close = fail_close
        self.closing = closing
        self.inbox: Inbox | None = None
        self.commands: list[Command] = []
        self.hooks: list[tuple[str, RoomKey, Role]] = []

    def attach(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def submit(self, key: RoomKey, command: Command) -> None:
        assert key == KEY
        self.commands.append(command)

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        self.hooks.append(("spawned", key, role))

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        self.hooks.append(("reaped", key, role))

    async def aclose(self) -> None:
        self.closed.append(self.name)
        if self.closing is not None:
            self.closing()
        if self.fail_close:
            raise RuntimeError(f"{self.name} failed to close")


class _Nixl:
    def __init__(self) -> None:
        self.progressed = 0

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.progressed += 1
        return {}


class _Agent:
    def __init__(self) -> None:
        self.nixl = _Nixl()


def test_every_command_type_has_one_sink() -> None:
    assert set(TRANSPORT_COMMANDS).isdisjoint(CONTROL_COMMANDS)
    assert set(TRANSPORT_COMMANDS) | set(CONTROL_COMMANDS) == set(Command.__subclasses__())
    assert {type(command) for command in ONE_OF_EACH} == set(Command.__subclasses__())


def test_data_path_commands_go_to_the_transport_the_rest_to_the_control_channel() -> None:
    closed: list[str] = []
    control, transport = Recorder("control", closed), Recorder("transport", closed)
    router = CommandRouter(control, transport)
    for command in ONE_OF_EACH:
        router.submit(KEY, command)
    assert [type(c) for c in transport.commands] == list(TRANSPORT_COMMANDS)
    assert [type(c) for c in control.commands] == list(CONTROL_COMMANDS)


def test_a_rank_without_a_transport_refuses_data_path_commands() -> None:
    control = Recorder("control", [])
    router = CommandRouter(control)
    for command in ONE_OF_EACH:
        if isinstance(command, TRANSPORT_COMMANDS):
            with pytest.raises(TypeError, match=type(command).__name__):
                router.submit(KEY, command)
        else:
            router.submit(KEY, command)
    assert [type(c) for c in control.commands] == list(CONTROL_COMMANDS)


@pytest.mark.asyncio
async def test_the_registry_attaches_both_sinks_and_calls_their_hooks() -> None:
    closed: list[str] = []
    control, transport = Recorder("control", closed), Recorder("transport", closed)
    registry = Registry(CommandRouter(control, transport), RoomConfig(strict=True))
    assert control.inbox is registry
    assert transport.inbox is registry
    registry.spawn(KEY, Role.SENDER)
    await registry.shutdown(grace_s=1.0)
    expected = [("spawned", KEY, Role.SENDER), ("reaped", KEY, Role.SENDER)]
    assert control.hooks == expected
    assert transport.hooks == expected


@pytest.mark.asyncio
async def test_shutdown_closes_control_then_progress_then_transport_even_if_one_fails() -> None:
    closed: list[str] = []
    agent = _Agent()
    progress = AgentProgress(agent, lambda: False, 0.001)  # type: ignore[arg-type]
    control = Recorder("control", closed, fail_close=True)
    # The progress loop is stopped by the time the transport closes.
    transport = Recorder("transport", closed, closing=lambda: closed.append(repr(progress.running)))
    router = CommandRouter(control, transport, progress)
    router.attach(_NoInbox())
    await asyncio.sleep(0)
    assert agent.nixl.progressed == 1  # started with the router
    with pytest.raises(RuntimeError, match="control failed to close"):
        await router.aclose()
    assert closed == ["control", "transport", "False"]


class _NoInbox:
    """An inbox nothing is delivered to (the router only hands it on)."""

    def deliver(self, key: RoomKey, event: object) -> bool:
        return False

    def current(self, role: Role, room_id: int) -> RoomKey | None:
        return None

    def leg_of(self, key: RoomKey) -> int:
        return 0

    def role_of(self, key: RoomKey) -> Role | None:
        return None

    def run_woken(self) -> None:
        pass

    def ended(self, key: RoomKey) -> bool:
        return True
