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
``KVFSM_STATUS_HOST``  the address the status servers listen on (default 127.0.0.1: the
                       rooms' reasons stay on the machine; set the host's address, or 0.0.0.0,
                       for a scraper or an operator on another host).
``KVFSM_HEARTBEAT_S``  control-channel heartbeat period (default 1 s).
``KVFSM_LIVENESS_FACTOR``  a peer silent for this many heartbeats is lost (default 2). Their
                       product is the liveness bound: how fast a dead peer's rooms fail, and
                       how long a live peer's loop thread may go unscheduled before it is taken
                       for dead (raise it on oversubscribed hosts, e.g. several CPU servers on
                       two cores).
``KVFSM_LEASE_S``      decode's write-lease length (default 2 s; renewed every quarter).
``KVFSM_UNCLAIMED_S``  prefill: a request no decode has claimed for this long fails with
                       its reason (default 60 s; its decode half never arrived), instead of
                       holding its pages until SGLang's 300 s bootstrap timeout.
``KVFSM_MAX_LINKS``    prefill: control links at most (default 128); past it a decode's link is
                       refused with an error naming the setting. Raise it where more decode
                       ranks than that read from one prefill rank.
``KVFSM_MAX_LINKS_PER_HOST``  prefill: control links from one peer host at most (default 32).
``KVFSM_REGISTRY_TIMEOUT_S``  how long one request to the bootstrap registry may take before
                       it counts as unreachable (default 2 s); a decode request whose prefill
                       rank cannot be looked up fails with that. Raise it where the registry
                       shares an oversubscribed host.
``KVFSM_EXIT_ON_FENCED_OUT``  ``1`` (default): a prefill scheduler whose NIXL agent was fenced
                       out (stopped or starved past its write lease with a WRITE in flight)
                       exits with status 75, and SGLang's launcher takes the server down for
                       its supervisor to restart, as on any fatal scheduler error; ``0``: it
                       stays up and fails every transfer with the reason until restarted.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from kvfsm.control import ChannelConfig
from kvfsm.manager import ManagerConfig

__all__ = [
    "channel_config",
    "configure",
    "exit_on_fenced_out",
    "manager_config",
    "registry_timeout_s",
    "secret",
]

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
    return ManagerConfig(
        secret=secret(),
        register_wait_s=120.0,
        registry_timeout_s=registry_timeout_s(),
        channel=channel_config(),
        exit_on_fenced_out=exit_on_fenced_out(),
    )


def registry_timeout_s() -> float:
    """``KVFSM_REGISTRY_TIMEOUT_S``: a positive number of seconds (default 2); anything else is
    refused at start-up."""
    return _positive("KVFSM_REGISTRY_TIMEOUT_S", ManagerConfig().registry_timeout_s)


def exit_on_fenced_out() -> bool:
    """``KVFSM_EXIT_ON_FENCED_OUT``: 1 (default) or 0; anything else is refused at start-up."""
    raw = os.environ.get("KVFSM_EXIT_ON_FENCED_OUT", "1").strip()
    if raw not in {"0", "1"}:
        raise ValueError(f"KVFSM_EXIT_ON_FENCED_OUT={raw!r}: expected 0 or 1")
    return raw == "1"


def _positive(variable: str, default: float) -> float:
    raw = os.environ.get(variable)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{variable}={raw!r}: expected a positive number")
    return value


def _count(variable: str, default: int) -> int:
    raw = os.environ.get(variable)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{variable}={raw!r}: expected a positive integer")
    return value


def channel_config() -> ChannelConfig:
    """kvfsm's control-channel defaults with the variables above applied; a value that is not
    a positive number (an integer for the link bounds) is refused at start-up, naming the
    variable."""
    base = ChannelConfig()
    try:
        return dataclasses.replace(
            base,
            heartbeat_s=_positive("KVFSM_HEARTBEAT_S", base.heartbeat_s),
            liveness_factor=_positive("KVFSM_LIVENESS_FACTOR", base.liveness_factor),
            lease_s=_positive("KVFSM_LEASE_S", base.lease_s),
            unclaimed_s=_positive("KVFSM_UNCLAIMED_S", base.unclaimed_s),
            max_links=_count("KVFSM_MAX_LINKS", base.max_links),
            max_links_per_host=_count("KVFSM_MAX_LINKS_PER_HOST", base.max_links_per_host),
        )
    except ValueError as exc:
        raise ValueError(f"kvfsm channel settings from the environment: {exc}") from None
