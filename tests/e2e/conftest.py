"""The e2e suite's shared servers, and its log keeping: servers' logs are kept when a test
failed (and removed when all passed); the hook below records failures so the fixtures can
tell."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from tests.e2e.servers import (
    ARM_ENV,
    FAILED,
    SharedPrefill,
    free_port,
    keep_logs_if_failed,
    prefill_flags,
    sglang_server,
    stop_all,
    write_model,
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.parent is not None:
        item.parent.stash[FAILED] = True
        item.session.stash[FAILED] = True


@pytest.fixture(scope="package")
def llama(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedPrefill]:
    """A reference server and a kvfsm prefill server for the test model, shared by this
    package's modules (they run on one pytest worker: their ``xdist_group``): each starts
    only its own decode server and router next to them. Launched here, waited for by the
    first module (``SharedPrefill.ready``) while its own servers start too. Stopped after the
    package's last test."""
    log_dir = tmp_path_factory.mktemp("sglang-e2e-shared")
    model = write_model(log_dir / "model")
    bootstrap = free_port()
    corrupt_next = log_dir / "corrupt-next-transfer"
    reference = sglang_server("reference", model, log_dir)
    prefill = sglang_server(
        "prefill",
        model,
        log_dir,
        *prefill_flags(bootstrap),
        "--enable-metrics",
        kvfsm=True,
        env={ARM_ENV: str(corrupt_next)},
    )
    try:
        reference.start()
        prefill.start()
        yield SharedPrefill(log_dir, model, reference, prefill, bootstrap, corrupt_next)
    finally:
        stop_all([prefill, reference])
        keep_logs_if_failed(request, log_dir, request.session.stash.get(FAILED, False))
