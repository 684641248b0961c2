"""Fixtures for the SGLang adapter tests: a real bootstrap server (SGLang's construction of it)
and short deadlines for every manager the tests build."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer, configure
from tests.helpers.sglang_config import CONFIG, REFUSED_PAIR


@pytest.fixture(autouse=True)
def short_deadlines() -> Iterator[None]:
    configure(CONFIG)
    yield
    configure(None)


@pytest.fixture
def refused_pair() -> Iterator[None]:
    """The managers built in the test have prefill's short Bootstrapping deadline of
    ``REFUSED_PAIR`` (a scenario that can only end by it)."""
    configure(REFUSED_PAIR)
    yield
    configure(CONFIG)


@pytest.fixture
def bootstrap() -> Iterator[KvfsmKVBootstrapServer]:
    """A prefill instance's bootstrap server, built the way SGLang builds it."""
    server = KvfsmKVBootstrapServer(host="127.0.0.1", port=0)
    yield server
    server.close()
