"""``kvfsm.sglang._server``: ``KvfsmKVBootstrapServer``, the registry as SGLang starts it, on its
own: closing it, and a port that is taken. (It serving a real pair's ranks is in
``test_conn.py``.)"""

from __future__ import annotations

import threading
import urllib.error

import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer
from tests.helpers.http_json import get_json


def test_bootstrap_server_close_is_idempotent() -> None:
    server = KvfsmKVBootstrapServer("127.0.0.1", 0)
    url = server.url
    get_json(f"{url}/health")
    server.close()
    server.close()
    with pytest.raises(urllib.error.URLError):
        get_json(f"{url}/health")


def registry_threads() -> int:
    return sum(t.name == "kvfsm-registry" for t in threading.enumerate())


def test_bootstrap_server_on_a_port_in_use_raises(bootstrap: KvfsmKVBootstrapServer) -> None:
    before = registry_threads()
    with pytest.raises(OSError, match=r"(?i)address already in use"):
        KvfsmKVBootstrapServer("127.0.0.1", bootstrap.port)
    assert registry_threads() == before  # the failed one left no thread behind
    get_json(f"{bootstrap.url}/health")  # the first one is unaffected
