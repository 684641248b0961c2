"""The processes a two-host campaign (``kvfsm chaos --two-hosts``) runs inside the network
namespaces besides its ranks: the bootstrap registry in prefill's namespace, and a source of
hostile connections in decode's, so that both reach prefill across the veth as a peer would.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection
from typing import Protocol

from kvfsm._child import ChildProcess
from kvfsm.chaos._hostile import send_hostile
from kvfsm.registry import RegistryThread

__all__ = ["AnyRegistry", "NetnsRegistry", "helper_main"]


class AnyRegistry(Protocol):
    """The registry a campaign restarts: a thread of the campaign process, or
    :class:`NetnsRegistry`."""

    @property
    def url(self) -> str: ...

    def restart(self, down_s: float) -> None: ...

    def close(self) -> None: ...


def helper_main(conn: Connection, host: str, secret: bytes | None, serve_registry: bool) -> None:
    """A helper process inside a namespace (two hosts): the registry on ``host``
    (``("restart", down_s)``), or a source of hostile connections (``("hostile", kind, host,
    port)``). Quits when told or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the campaign process stops us
    parent = os.getppid()
    registry = (
        RegistryThread(host, secret=secret, ttl_s=5.0, quiet=True) if serve_registry else None
    )
    try:
        conn.send(registry.url if registry is not None else "")
        while os.getppid() == parent:
            if not conn.poll(0.2):
                continue
            request = conn.recv()
            if request[0] == "quit":
                break
            if request[0] == "restart" and registry is not None:
                registry.restart(float(request[1]))
                conn.send(None)
            elif request[0] == "hostile":
                _, kind, to_host, port = request
                conn.send(send_hostile(to_host, int(port), kind, secret=secret, timeout=3.0))
            else:
                conn.send(None)
    except (EOFError, OSError):
        pass
    finally:
        if registry is not None:
            registry.close()


class NetnsRegistry:
    """The registry in a helper process in the prefill namespace (two hosts)."""

    def __init__(self, child: ChildProcess) -> None:
        self.child = child
        self.url = str(child.greeting)

    def restart(self, down_s: float) -> None:
        self.child.ask("restart", down_s, timeout=30)

    def close(self) -> None:
        self.child.close()
