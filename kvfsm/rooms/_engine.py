"""``RoomEngine``: the loop thread, the registry on it, and facades for callers' threads."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

from kvfsm.rooms._config import RoomConfig
from kvfsm.rooms._facade import ReceiverRoom, SenderRoom
from kvfsm.rooms._ports import CommandSink, Observer, Publication, RoomKey
from kvfsm.rooms._registry import Registry
from kvfsm.rooms._runtime import LoopThread
from kvfsm.rooms._timeline import entries
from kvfsm.states import TERMINAL, Event, Role, deadline_of

__all__ = ["RoomEngine", "live_rooms_lines"]

_log = logging.getLogger("kvfsm.runtime")

#: The engines of this process, for ``kill -USR1``'s dump of live rooms (:func:`live_rooms_lines`).
#: Weak: an engine nobody holds any more is not kept alive for a dump.
_ENGINES: Final[weakref.WeakSet[RoomEngine]] = weakref.WeakSet()
#: Timeline entries a dumped room shows (its latest: how it got where it is stuck).
DUMP_TIMELINE: Final = 6


class RoomEngine:
    """Runs rooms on a background event loop and hands out facades.

    ``sink`` executes the rooms' commands (for a rank, the manager's router in front of the
    transport and the control channel); it is attached to the registry on the loop thread when
    the engine starts, and closed (``aclose``) there after the rooms.

    Thread-safety: :meth:`sender`, :meth:`receiver`, :meth:`post` and :meth:`stats` may be
    called from any thread and never block. :meth:`start`, :meth:`close` and :meth:`call`
    block (setup and teardown only). :attr:`registry` belongs to the loop thread.
    """

    def __init__(
        self,
        sink: CommandSink,
        config: RoomConfig | None = None,
        *,
        use_uvloop: bool = True,
        name: str = "kvfsm-loop",
        observer: Observer | None = None,
    ) -> None:
        self.config = config if config is not None else RoomConfig()
        self._observer = observer
        self._sink = sink
        self._registry: Registry | None = None
        self._post: Callable[[RoomKey, Event], None] | None = None
        self._thread = LoopThread(self._main, use_uvloop=use_uvloop, name=name)
        # next() on itertools.count is atomic under the GIL: generations need no lock.
        self._generations = itertools.count(1)
        self._closed = False
        self.name = name
        _ENGINES.add(self)

    # -- lifecycle (blocking) ------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> RoomEngine:
        self._thread.start(timeout)
        return self

    def close(self, timeout: float | None = None) -> None:
        """Abort live rooms, let them settle (``RoomConfig.shutdown_timeout_s``), stop the loop.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        budget = self.config.shutdown_timeout_s + 10.0 if timeout is None else timeout
        self._thread.stop(budget)

    def __enter__(self) -> RoomEngine:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def _main(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_log_loop_exception)
        self._registry = Registry(self._sink, self.config, self._observer)
        # Rooms woken by a drain of callers' posts run in that same loop iteration.
        self._thread.after_drain = self._registry.run_woken
        self._thread.ready()
        await stop.wait()
        await self._registry.shutdown()
        try:  # background tasks of the sink (a pump, a listener) stop here
            await self._sink.aclose()
        except Exception:
            _log.exception("sink shutdown failed")

    # -- callers' side (any thread, non-blocking) ----------------------------------------------

    def sender(self, room: int, *, leg: int = 0) -> SenderRoom:
        """A new prefill-side room. A duplicate live room id (and leg) is published as Failed.
        ``leg``: one of the rooms of a request written into several decode ranks."""
        key, pub = self._spawn(Role.SENDER, room, leg)
        return SenderRoom(key, pub, self._post_event(), max_pages=self.config.max_pages)

    def receiver(self, room: int, *, leg: int = 0, group: int | None = None) -> ReceiverRoom:
        """A new decode-side room. A duplicate live room id (and leg) is published as Failed.

        ``leg``/``group``: one of several receiver rooms of one request, each fed by its own
        prefill rank, sharing the request's pages (see ``Registry.spawn``)."""
        key, pub = self._spawn(Role.RECEIVER, room, leg, group)
        return ReceiverRoom(key, pub, self._post_event(), max_pages=self.config.max_pages)

    def _spawn(
        self, role: Role, room: int, leg: int = 0, group: int | None = None
    ) -> tuple[RoomKey, Publication]:
        key = RoomKey(int(room), next(self._generations))
        pub = Publication()
        registry = self.registry_on_loop()
        if leg or group is not None:
            self._thread.post(registry.spawn_or_refuse, key, role, pub, leg, group)
        else:
            self._thread.post(registry.spawn_or_refuse, key, role, pub)
        return key, pub

    def post(self, key: RoomKey, event: Event) -> None:
        """Deliver ``event`` to room ``key`` from any thread. Never blocks."""
        self._post_event()(key, event)

    def _post_event(self) -> Callable[[RoomKey, Event], None]:
        """``post`` as the facades call it: one C-level partial of the loop thread's ``post``
        and the registry's ``deliver``, bound once (every facade call posts)."""
        post = self._post
        if post is None:
            post = self._post = functools.partial(
                self._thread.post, self.registry_on_loop().deliver
            )
        return post

    def rooms(self, timeout: float = 5.0) -> list[dict[str, object]]:
        """Live rooms (state, age, deadline remaining, in flight, reason): a loop round trip,
        for operators and tests, not for the hot path."""

        async def snapshot() -> list[dict[str, object]]:
            return self.registry_on_loop().snapshot()

        rows: list[dict[str, object]] = self.call(snapshot(), timeout)
        return rows

    def story(self, room: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every room with id ``room`` the engine knows, live or finished, with its timeline
        (``Registry.story``): a loop round trip, for operators and tests."""

        async def read() -> list[dict[str, Any]]:
            return self.registry_on_loop().story(int(room))

        rows: list[dict[str, Any]] = self.call(read(), timeout)
        return rows

    def failures(self, limit: int = 1000, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The last failed rooms the engine remembers, newest first (``Registry.failures``)."""

        async def read() -> list[dict[str, Any]]:
            return self.registry_on_loop().failures(limit)

        rows: list[dict[str, Any]] = self.call(read(), timeout)
        return rows

    def stats(self) -> dict[str, int]:
        """Counters (see :class:`kvfsm.rooms.RoomStats`); plus ``live``: rooms with a task, and
        ``held_pages``: destination pages receiver rooms hold (those of rooms reaped unsettled
        included: a number that only grows is a leak to look into)."""
        registry = self.registry_on_loop()
        snapshot = registry.stats.snapshot()
        snapshot["live"] = len(registry)
        snapshot["held_pages"] = registry.owners.held_pages
        return snapshot

    def dump_rooms(self, last: int = DUMP_TIMELINE) -> list[dict[str, Any]]:
        """Live rooms as ``kill -USR1`` dumps them, read from the signal handler's thread with
        no loop round trip: the loop may be what is stuck. Each read of shared state is one
        C-level copy under the GIL (the room table, a timeline list), so a room may be a step
        behind the loop, never torn. Besides what ``/rooms`` shows: the deadline of the room's
        state (``deadline_s``; with ``deadline_in_s`` it tells how long the room has been in
        it), its peer and its latest timeline entries."""
        registry = self._registry
        if registry is None:
            return []
        now = registry.loop.time()
        rows: list[dict[str, Any]] = []
        for room in registry.rooms():
            row: dict[str, Any] = dict(room.info(now))
            state = room.core.state
            if state not in TERMINAL:
                row["deadline_s"] = deadline_of(
                    room.role, state, self.config.deadlines.get(room.role)
                )
            peer = registry.name_peer(room)
            row["peer"] = peer
            timeline = room.timeline
            if timeline is not None:
                row["timeline"] = entries(list(timeline), room.role, peer, registry.page_bytes)[
                    -last:
                ]
            rows.append(row)
        return rows

    # -- loop side -----------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._thread.loop

    def registry_on_loop(self) -> Registry:
        """The registry. Mutate it only on the loop thread (``call``/``post`` there)."""
        if self._registry is None:
            raise RuntimeError("engine is not started")
        return self._registry

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the loop and wait for its result (tests, setup, teardown)."""
        return self._thread.call(coro, timeout)


def _log_loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    _log.error("event loop: %s", context.get("message"), exc_info=context.get("exception"))


def live_rooms_lines() -> list[str]:
    """What ``kill -USR1`` adds to the stacks faulthandler prints: one JSON line per room engine
    of this process (``"event": "live_rooms"``: its live rooms, :meth:`RoomEngine.dump_rooms`,
    and the names of the process's threads by the ids faulthandler prints), or one line with
    no engine when there is none. ``kvfsm explain`` reads them back."""
    threads = {f"0x{t.ident:016x}": t.name for t in threading.enumerate() if t.ident is not None}
    base = {"event": "live_rooms", "pid": os.getpid(), "threads": threads}
    lines: list[str] = []
    for engine in list(_ENGINES):
        if engine._closed or engine._registry is None:
            continue
        body: dict[str, Any] = {**base, "engine": engine.name}
        try:
            body["rooms"] = engine.dump_rooms()
        except Exception as exc:  # a dump must not fail on a room that changed under it
            body.update(rooms=[], error=f"{type(exc).__name__}: {exc}")
        lines.append(json.dumps(body, separators=(",", ":"), default=str))
    if not lines:
        lines.append(json.dumps({**base, "engine": None, "rooms": []}, separators=(",", ":")))
    return lines
