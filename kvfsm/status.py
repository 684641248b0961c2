"""An operator's window into a running rank: live rooms, counters and metrics over HTTP.

``StatusServer`` runs on the engine's own loop (aiohttp) and answers

* ``GET /rooms``: every room that still has a task: role, state, age, deadline remaining, chunks
  in flight, settled, reason (what ``kvfsm rooms --url`` prints);
* ``GET /stats``: the engine's counters (and the control channel's, if any), and kvfsm's
  threads (name as ``top -H`` shows it, OS thread id, CPU seconds);
* ``GET /metrics``: Prometheus text, when metrics are enabled.

It binds to 127.0.0.1 by default; it is read-only, but room ids and reasons are not for the
whole network.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kvfsm.rooms import RoomEngine, thread_table

__all__ = ["StatusServer"]


class StatusServer:
    def __init__(
        self,
        engine: RoomEngine,
        *,
        metrics: Any = None,
        extra_stats: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.extra_stats = extra_stats
        self.host = host
        self._port = port
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    async def start(self) -> None:
        """On the engine's loop."""
        app = web.Application()
        app.router.add_get("/rooms", self._rooms)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._port)
        await site.start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])  # the bound port, when 0 was asked

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _rooms(self, request: web.Request) -> web.Response:
        rows = self.engine.registry_on_loop().snapshot()
        return web.json_response(rows, dumps=json.dumps)

    async def _stats(self, request: web.Request) -> web.Response:
        # kvfsm's threads by name with their OS ids and CPU: what top -H / py-spy show.
        body: dict[str, Any] = {"rooms": self.engine.stats(), "threads": thread_table()}
        if self.extra_stats is not None:
            body.update(self.extra_stats())
        return web.json_response(body)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            raise web.HTTPNotFound(text="metrics are not enabled on this rank")
        return web.Response(
            body=self.metrics.exposition(), content_type="text/plain", charset="utf-8"
        )
