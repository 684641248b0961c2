"""Process-wide settings of the SGLang adapter: environment variables, or :func:`configure`.

SGLang builds the backend's classes itself with fixed signatures, so nothing kvfsm-specific can
be passed to them; these are read when a manager or bootstrap server is built.

``KVFSM_SECRET``       shared secret (at least 16 bytes) that signs registry writes and every
                       control frame; set the same value on prefill and decode. Unset: no
                       authentication (acceptable on a private network only).
``KVFSM_HOST``         where prefill ranks' control channels listen. Default: SGLang's ``--host``;
                       a wildcard (0.0.0.0) is advertised as the address routing to the registry.
``KVFSM_STATUS_PORT``  serve ``/rooms``, ``/stats``, ``/metrics`` per rank from this port
                       upwards (port + registry rank); unset: no status server.
"""

from __future__ import annotations

import os
import threading

from kvfsm.manager import ManagerConfig

__all__ = ["configure", "manager_config", "secret"]

_lock = threading.Lock()
_configured: ManagerConfig | None = None


def configure(config: ManagerConfig | None) -> None:
    """Use ``config`` for the managers built after this call in this process (None: defaults
    from the environment). For embedding and tests; deployments use the variables above."""
    global _configured  # noqa: PLW0603 - one process-wide setting, by design
    with _lock:
        _configured = config


def secret() -> bytes | None:
    value = os.environ.get("KVFSM_SECRET")
    return value.encode() if value else None


def manager_config() -> ManagerConfig:
    with _lock:
        if _configured is not None:
            return _configured
    # SGLang's bootstrap server is started after the scheduler ranks: let the first
    # registration wait for it, as SGLang's own backends retry theirs.
    return ManagerConfig(secret=secret(), register_wait_s=120.0)
