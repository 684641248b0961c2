"""``KvfsmKVBootstrapServer``: the bootstrap registry of one prefill instance, as SGLang starts it
(``host``, ``port`` from ``--host`` and ``--disaggregation-bootstrap-port``) in its main process.

It is kvfsm's registry (``kvfsm.registry.BootstrapServer``) on a daemon thread with its own
event loop (``kvfsm.registry.RegistryThread``): SGLang constructs the server and keeps the
object, and never calls anything on it again. A port that is taken raises from the constructor.
"""

from __future__ import annotations

import logging

from kvfsm.registry import RegistryThread
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
        self._registry = RegistryThread(
            host,
            port=port,
            expected_ranks=_ANY_NUMBER_OF_RANKS,
            ttl_s=30.0,
            secret=secret(),
            quiet=True,
        )
        self.port = self._registry.port
        _log.info("kvfsm bootstrap server on %s", self._registry.url)

    @property
    def url(self) -> str:
        return self._registry.url

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (SGLang never does: the process ends). Idempotent."""
        self._registry.close()
