"""Session-wide test hygiene."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(autouse=True)
def _no_implicit_event_loop(request: pytest.FixtureRequest) -> None:
    """looptime's plugin asks the loop policy for the current loop in every test. In a sync test
    that runs before any async one, that call creates a loop nobody closes, and its
    ResourceWarning (an error under ``filterwarnings = error``) then fails some later, unrelated
    test. Sync tests say explicitly that there is no current loop."""
    if request.node.get_closest_marker("asyncio") is None:
        asyncio.set_event_loop(None)
