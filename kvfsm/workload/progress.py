"""A live progress line on stderr (stdout is the summary's)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """A ``\\r`` progress line on stderr, at most ten times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.last, self.shown = total, enabled, 0.0, False

    def show(self, done: int, ok: int, failed: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < 0.1):
            return
        self.last, self.shown = now, True
        width = 30
        filled = width * done // self.total if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r  [{bar}] {done}/{self.total}  ok {ok}  failed {failed} ")
        sys.stderr.flush()

    def end(self) -> None:
        """End the line, if one was shown."""
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
