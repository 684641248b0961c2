"""The e2e suite keeps its servers' logs when a test fails (and removes them when all passed):
this hook records failures so the module's fixtures can tell."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.e2e.servers import FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.parent is not None:
        item.parent.stash[FAILED] = True
