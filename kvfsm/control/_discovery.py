"""Glue between the bootstrap registry and the control channel.

A prefill rank publishes where its control channel listens (:class:`Registration`, which keeps
re-registering: registration is the registry's heartbeat, and a rank that stops refreshing
expires). A decode rank finds a prefill rank through :func:`registry_resolver`, which is the
``Resolver`` a decode :class:`~kvfsm.control._plane.ControlPlane` takes. A restarted prefill
rank registers a new incarnation and port; the next resolve finds it.
"""

from __future__ import annotations

import logging

import anyio
import msgspec

from kvfsm.control._channel import Resolver
from kvfsm.control._plane import ControlPlane
from kvfsm.registry import BootstrapClient, BootstrapError, RankInfo

__all__ = ["Registration", "registry_resolver"]

_log = logging.getLogger("kvfsm.registry")


def registry_resolver(client: BootstrapClient, engine: str) -> Resolver:
    """Resolve prefill ranks of ``engine`` through the registry (one HTTP GET per new link)."""

    async def resolve(rank: int) -> tuple[str, int]:
        info = await client.rank(engine, rank)
        return info.host, info.port

    return resolve


class Registration:
    """Keeps a prefill rank's control address registered while :meth:`run` runs."""

    def __init__(
        self,
        client: BootstrapClient,
        control: ControlPlane,
        *,
        engine: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        dp_by_room: bool = True,
        http_port: int = 0,
        host: str | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.client = client
        self.control = control
        self.interval_s = interval_s
        self._fields = {
            "engine": engine,
            "rank": control.rank,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "dp_rank": dp_rank,
            "pp_rank": pp_rank,
            "dp_size": dp_size,
            "pp_size": pp_size,
            "dp_by_room": dp_by_room,
            "http_port": http_port,
        }
        #: Pipeline stage 0: the port its stage hub listens on, once bound (``_stages``).
        self.stage_port = 0
        self._host = host

    def info(self) -> RankInfo:
        control = self.control
        return RankInfo(
            **self._fields,  # type: ignore[arg-type]
            host=self._host or control.config.host,
            port=control.port,
            agent=control.agent.name,
            layout=msgspec.msgpack.encode(control.agent.layout.summary()),
            incarnation=control.incarnation,
            stage_port=self.stage_port,
        )

    async def register_once(self) -> None:
        await self.client.register(self.info())

    async def run(self) -> None:
        """Register now and every ``interval_s``; registry outages are logged, not fatal."""
        while True:
            try:
                await self.client.register(self.info())
            except BootstrapError as exc:
                _log.warning("bootstrap registration failed (retrying): %s", exc)
            await anyio.sleep(self.interval_s)
