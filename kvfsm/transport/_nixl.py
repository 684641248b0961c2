"""The one place that imports NIXL, and how its errors are classified.

The CUDA 12 wheel (``nixl-cu12``) installs the module ``nixl_cu12``; the meta-package ``nixl``
installs ``nixl``. Both have the same ``_api``.
"""

from __future__ import annotations

try:
    from nixl_cu12._api import (  # type: ignore[import-untyped,unused-ignore]
        nixl_agent,
        nixl_agent_config,
        nixl_thread_sync_t,
    )
except ImportError:  # pragma: no cover - the other packaging of the same library
    from nixl._api import (  # type: ignore[import-not-found,no-redef,unused-ignore]
        nixl_agent,
        nixl_agent_config,
        nixl_thread_sync_t,
    )

__all__ = [
    "describe",
    "is_remote_disconnect",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_thread_sync_t",
]


def is_remote_disconnect(exc: BaseException) -> bool:
    """NIXL raised because the remote agent is gone (``NIXL_ERR_REMOTE_DISCONNECT``): the peer,
    not the transfer, failed. NIXL has then dropped the peer's metadata."""
    return type(exc).__name__ == "nixlRemoteDisconnectError"


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
