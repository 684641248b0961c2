"""Session-wide test hygiene, and which tests must not run beside which under pytest-xdist."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_REPO = _TESTS.parent

#: ``xdist_group`` per test file (or ``file::test``), relative to the repository. With
#: ``--dist loadgroup`` (``./dev.sh test``) a group's tests all run on one worker, one after
#: another; everything else is spread over the workers test by test.
#:
#: ``sglang-servers``: each of these starts real SGLang servers (a prefill, a decode, a router,
#: and for the e2e rigs a reference server): several processes of about a GB each, CPU-bound
#: for the ~30 s of their start-up and for every batch they serve. Two rigs at once on a
#: two-core machine starve each other past their start-up bounds and SGLang's start-up memory
#: check (tests/e2e/servers.py), so they take turns. A module's rig is module-scoped, and the
#: group also keeps its tests on the worker that started it. They are also marked ``alone``
#: (``ALONE_GROUPS``): beside a rig, a test on the other worker whose loop is starved for a
#: liveness bound (2 s by default) sees its own peer as lost, so the rigs run after the
#: parallel part, with the machine to themselves.
XDIST_GROUPS: dict[str, str] = {
    "tests/e2e/test_sglang_servers.py": "sglang-servers",
    "tests/e2e/test_decode_prefix.py": "sglang-servers",
    "tests/e2e/test_model_shapes.py": "sglang-servers",
    "tests/e2e/test_unservable_shapes.py": "sglang-servers",
    "tests/e2e/test_kv_checksum.py": "sglang-servers",
    "tests/e2e/test_prefill_killed.py": "sglang-servers",
    "tests/e2e/test_server_campaign.py": "sglang-servers",
    "tests/test_examples.py::test_sglang_cpu_pd_example_runs": "sglang-servers",
}

#: Groups whose tests are also marked ``alone``: ``./dev.sh test`` runs them after the parallel
#: part, one at a time, with nothing beside them.
ALONE_GROUPS = frozenset({"sglang-servers"})


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(_REPO):
            continue
        where = path.relative_to(_REPO).as_posix()
        name = getattr(item, "originalname", item.name)
        group = XDIST_GROUPS.get(f"{where}::{name}") or XDIST_GROUPS.get(where)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if group in ALONE_GROUPS:
                item.add_marker(pytest.mark.alone)
    if config.getoption("loadgroup", False):  # an xdist worker, under --dist loadgroup
        _tell_groups(items)


def _tell_groups(items: list[pytest.Item]) -> None:
    """pytest-xdist tells the scheduler a test's group by appending ``@group`` to the node id a
    worker reports, which it writes into the item's ``_nodeid``. pytest 9.2 keeps a structured
    ``_id`` instead: that write is lost without a word, and every group is spread over the
    workers as if unmarked. Where an item has a structured id, the suffix is written there (the
    string xdist writes, in the form its scheduler parses); elsewhere xdist's own write works."""
    for item in items:
        structured = getattr(item, "_id", None)
        if structured is None or not hasattr(type(structured), "parse") or "@" in item.nodeid:
            continue
        marks = item.iter_markers("xdist_group")
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        )
        if names:
            suffixed = f"{item.nodeid}@{'_'.join(names)}"
            item._id = type(structured).parse(suffixed)  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_implicit_event_loop(request: pytest.FixtureRequest) -> None:
    """looptime's plugin asks the loop policy for the current loop in every test. In a sync test
    that runs before any async one, that call creates a loop nobody closes, and its
    ResourceWarning (an error under ``filterwarnings = error``) then fails some later, unrelated
    test. Sync tests say explicitly that there is no current loop."""
    if request.node.get_closest_marker("asyncio") is None:
        asyncio.set_event_loop(None)
