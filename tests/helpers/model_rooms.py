"""A room of the model, run as ``kvfsm.rooms._actor.Room`` runs one: the production
``RoomCore`` behind a mailbox, a deadline timer per state, a settle timeout and a
``Publication``, with the facts the checker reads."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvfsm.rooms._actor import Publication, RoomKey
from kvfsm.rooms._core import Claim, RoomCore
from kvfsm.states import (
    TERMINAL,
    Command,
    DeadlineExpired,
    Event,
    KVPoll,
    MetadataSubmitted,
    Role,
    deadline_of,
)
from tests.helpers.model_world import Cause, Timer

if TYPE_CHECKING:
    from tests.helpers.model_processes import Process


class ModelRoom:
    """One room's task: RoomCore, mailbox, timer, publication. Facts for the checker."""

    def __init__(self, proc: Process, key: RoomKey, publication: Publication) -> None:
        self.proc = proc
        self.key = key
        self.role = proc.side.role
        claim: Claim | None = None
        if self.role is Role.RECEIVER:  # as Room does: one owner per destination (Registry)
            owners = proc.owners

            def claim(event: MetadataSubmitted) -> str | None:
                return owners.claim(key, event.pages, event.aux_index, event.state)

        self.core = RoomCore(self.role, proc.stats, claim=claim)
        self.publication = publication
        self.born = proc.clock.now
        self.mailbox: deque[Event] = deque()
        self._timer: Timer | None = None
        self._scheduled = False
        self._settle_expired = False
        self.reaped = False
        self.gave_up = False  # reaped by its settle timeout, unsettled
        self.terminal_at: float | None = None
        self.settled_at: float | None = None
        #: Every status published, in order (law 1: nothing after the first terminal one).
        self.statuses: list[KVPoll] = [publication.status]
        self.errors: list[BaseException] = []
        #: (room, generation) of every frame that caused an event delivered to this room.
        self.causes: set[Cause] = set()
        self._arm(self.core.state)

    def deliver(self, event: Event) -> None:
        self.mailbox.append(event)
        self._wake()

    def _wake(self) -> None:
        if not self._scheduled and not self.reaped:
            self._scheduled = True
            self.proc.clock.soon(self.proc.side, self._run)

    def _run(self) -> None:
        self._scheduled = False
        if self.reaped:
            return
        core = self.core
        while self.mailbox:
            self._apply(self.mailbox.popleft())
        if core.settled:
            self.proc.reap(self)
        elif core.terminal and self._settle_expired:
            self.gave_up = True
            self.proc.reap(self)

    def _apply(self, event: Event) -> None:
        before = self.core.state
        try:
            commands = self.core.handle(event)
        except Exception as exc:  # the actor's rule: a bug fails this room only
            self.errors.append(exc)
            commands = self.core.fail(f"internal error on {type(event).__name__}: {exc}")
        self._execute(before, commands)

    def _execute(self, before: KVPoll, commands: tuple[Command, ...]) -> None:
        core, pub = self.core, self.publication
        if core.state is not before:
            self._entered(core.state)
        if core.settled and not pub.settled:
            pub.settled = True
            self.settled_at = self.proc.clock.now
            self.proc.room_settled(self)
        for command in commands:
            try:
                self.proc.submit(self.key, command)
            except Exception as exc:
                self.errors.append(exc)
                state = core.state
                self._execute(state, core.fail(f"could not execute {type(command).__name__}"))

    def _entered(self, state: KVPoll) -> None:
        pub = self.publication
        if state is KVPoll.Failed:
            pub.reason = self.core.reason
        pub.status = state
        self.statuses.append(state)
        if state in TERMINAL:
            self.terminal_at = self.proc.clock.now
        self.proc.room_entered(self, state)
        self._arm(state)

    def _arm(self, state: KVPoll) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        clock = self.proc.clock
        if state in TERMINAL:
            if not self.core.settled:
                self._timer = clock.at(
                    clock.now + self.proc.config.settle_timeout_s, self.proc.side, self._on_timer
                )
            return
        seconds = deadline_of(self.role, state, self.proc.config.overrides(self.role))
        self._timer = clock.at(clock.now + seconds, self.proc.side, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.reaped:
            return
        state = self.core.state
        if state in TERMINAL:
            self._settle_expired = True
        else:
            seconds = deadline_of(self.role, state, self.proc.config.overrides(self.role))
            self.mailbox.append(DeadlineExpired(state, seconds))
        self._wake()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
