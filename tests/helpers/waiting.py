"""Polling for a condition in tests."""

from __future__ import annotations

import time
from typing import Any


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    """Return once ``predicate()`` is true; ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.001)
