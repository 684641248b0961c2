"""Teardown that a Ctrl-C cannot cut short.

A workload's teardown is bounded (every join has a timeout), and cutting it short would leave an
agent registered or a child process running; so a SIGINT during it is held until it is over, then
raised as ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["sigint_deferred"]


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold SIGINT while the block runs (main thread only); raise it once the block is over."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        hits.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if hits:
        raise KeyboardInterrupt
