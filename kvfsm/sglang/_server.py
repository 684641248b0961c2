"""``KvfsmKVBootstrapServer``: the bootstrap registry of one prefill instance, as SGLang starts it
(``host``, ``port`` from ``--host`` and ``--disaggregation-bootstrap-port``) in its main process.

It is kvfsm's registry (kvfsm/bootstrap/_registry_server.py) on a daemon thread with its own
event loop: SGLang constructs the server and keeps the object, and never calls anything on it
again.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from kvfsm.bootstrap import BootstrapServer
from kvfsm.sglang._bases import BaseKVBootstrapServer
from kvfsm.sglang._settings import secret

__all__ = ["KvfsmKVBootstrapServer"]

_log = logging.getLogger("kvfsm.sglang")

#: SGLang does not tell the bootstrap server how many ranks to expect. Lookups of single ranks
#: do not need the number; only the registry's "all ranks registered" health does.
_ANY_NUMBER_OF_RANKS = 1 << 16


class KvfsmKVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int):
        self.host = host
        self._server = BootstrapServer(
            host, port, expected_ranks=_ANY_NUMBER_OF_RANKS, ttl_s=30.0, secret=secret()
        )
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._server.start())
            except BaseException as exc:  # the port is taken, say: raised by __init__
                failure.append(exc)
                self._loop.close()
                self._stopped.set()
                started.set()
                return
            started.set()
            try:
                self._loop.run_forever()
            finally:
                self._loop.run_until_complete(self._server.stop())
                self._loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="kvfsm-bootstrap", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        self.port = self._server.port
        _log.info("kvfsm bootstrap server on %s", self._server.url)

    @property
    def url(self) -> str:
        return self._server.url

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (SGLang never does: the process ends). Idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
