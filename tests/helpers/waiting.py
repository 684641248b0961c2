"""Waiting in tests for a condition, not for a length of time.

:func:`wait_until` (on an event loop) and :func:`wait_until_sync` (from a thread, or a sync
test) check ``predicate`` every ``interval`` seconds and return as soon as it is true. After
``timeout`` seconds they fail with a :class:`ConditionTimeoutError` (an ``AssertionError``)
that says what they waited for (the ``message``, or the predicate's source line) and for how
long. A test that needs the condition gets it the moment it holds, however fast or slow the
machine is; the timeout is only the bound past which it is a failure.

:func:`wait_until` measures time on its loop's clock: under ``looptime`` both the interval and
the timeout are virtual.

Some checks are about what must *not* happen: no progress while idle, no late write after a
release. Nothing marks the moment such a thing would have happened, so they watch for a stretch
of time: :func:`stays_true` and :func:`stays_true_sync` check ``predicate`` every ``interval``
for ``duration`` seconds and fail the moment it is false (a sleep followed by one assertion
would see only the end). The duration is the spec of the check, and its caller says why it is
long enough.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

__all__ = [
    "ConditionTimeoutError",
    "stays_true",
    "stays_true_sync",
    "wait_until",
    "wait_until_sync",
]

#: How often a condition is checked when the caller does not say: often enough that a test
#: waits at most a millisecond past the moment it holds, cheap enough for two workers on two
#: cores (each check is one predicate call).
INTERVAL_S = 0.001


class ConditionTimeoutError(AssertionError):
    """A condition did not become true in time (a test failure, and distinguishable from an
    assertion that failed inside the predicate)."""


def _describe(predicate: Callable[[], object], message: str | None) -> str:
    if message is not None:
        return message
    try:
        source = inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)
    return source if len(source) <= 300 else source[:300] + " ..."


def _failure(predicate: Callable[[], object], message: str | None, waited: float) -> str:
    return f"waited {waited:.3g} s for {_describe(predicate, message)}: it never became true"


def wait_until_sync(
    predicate: Callable[[], object],
    *,
    timeout: float = 20.0,
    interval: float = INTERVAL_S,
    message: str | None = None,
) -> None:
    """Block until ``predicate()`` is true; :class:`ConditionTimeoutError` after ``timeout``
    seconds."""
    start = time.monotonic()
    deadline = start + timeout
    while not predicate():
        now = time.monotonic()
        if now > deadline:
            raise ConditionTimeoutError(_failure(predicate, message, now - start))
        # Between two checks of the condition: the only wait here.
        time.sleep(interval)


async def wait_until(
    predicate: Callable[[], object | Awaitable[object]],
    *,
    # A bound of its own, not asyncio.timeout: the failure then says what never became true.
    timeout: float = 20.0,  # noqa: ASYNC109
    interval: float = INTERVAL_S,
    message: str | None = None,
) -> None:
    """Await until ``predicate()`` (a plain or an async callable) is true;
    :class:`ConditionTimeoutError` after ``timeout`` seconds of the running loop's clock."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        now = loop.time()
        if now > deadline:
            raise ConditionTimeoutError(_failure(predicate, message, now - start))
        # Between two checks of the condition: the only wait here.
        await asyncio.sleep(interval)


def stays_true_sync(
    predicate: Callable[[], object],
    *,
    duration: float,
    interval: float = 0.01,
    message: str | None = None,
) -> None:
    """``predicate()`` holds throughout the next ``duration`` seconds; ``AssertionError`` the
    moment it does not."""
    start = time.monotonic()
    while True:
        if not predicate():
            waited = time.monotonic() - start
            raise AssertionError(
                f"{_describe(predicate, message)} stopped being true after {waited:.3g} s "
                f"(it had to hold for {duration:g} s)"
            )
        left = start + duration - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(interval, left))


async def stays_true(
    predicate: Callable[[], object],
    *,
    duration: float,
    interval: float = 0.01,
    message: str | None = None,
) -> None:
    """``predicate()`` holds throughout the next ``duration`` seconds of the running loop's
    clock; ``AssertionError`` the moment it does not."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        if not predicate():
            waited = loop.time() - start
            raise AssertionError(
                f"{_describe(predicate, message)} stopped being true after {waited:.3g} s "
                f"(it had to hold for {duration:g} s)"
            )
        left = start + duration - loop.time()
        if left <= 0:
            return
        await asyncio.sleep(min(interval, left))
