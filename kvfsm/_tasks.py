"""Stopping a background task without swallowing the caller's own cancellation.

Every shutdown path here cancels a background task (the completion pump, NIXL progress, the
registry's sweeper, accept loops) and waits for it to end. The usual spelling,
``task.cancel(); with suppress(CancelledError): await task``, also swallows a cancellation of
the *caller* that arrives during that wait (a timeout around ``aclose()``, a cancelled task
group): the caller then carries on as if it had not been cancelled, and an enclosing
``asyncio.timeout`` never fires. :func:`cancel_and_wait` absorbs only the stopped task's
``CancelledError`` and re-raises when the caller was cancelled while it waited.

Nothing of kvfsm is imported here, so every layer can use it.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` (None and finished ones are skipped) and wait until each has ended.

    Their own cancellations end here; an exception a task raises instead propagates, as it
    would from ``await task``. A cancellation of the caller during the wait propagates, once
    every task has been asked to stop."""
    live = [task for task in tasks if task is not None and not task.done()]
    if not live:
        return
    me = asyncio.current_task()
    before = me.cancelling() if me is not None else 0
    for task in live:
        task.cancel()
    for task in live:
        try:
            await task
        except asyncio.CancelledError:
            if me is not None and me.cancelling() > before:
                raise  # the caller was cancelled while it waited: not ours to swallow
