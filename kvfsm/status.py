"""An operator's window into a running rank: live rooms, counters and metrics over HTTP.

``StatusServer`` runs on the engine's own loop (aiohttp) and answers

* ``GET /rooms``: every room that still has a task: role, state, age, deadline remaining, chunks
  in flight, settled, reason (what ``kvfsm rooms --url`` prints);
* ``GET /rooms/<id>``: every room of that id the engine knows, live or among the last finished
  ones, with its state, reason, peer and timeline (``kvfsm rooms --room``; 404 if none);
* ``GET /failures``: the last failed rooms, newest first, with their reason kinds
  (``kvfsm rooms --failed``);
* ``GET /links``: the control links, up or down, with the peer's identity, how long ago it was
  last heard from and whether a write lease on it is live;
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
        peers: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.extra_stats = extra_stats
        self.peers = peers
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
        app.router.add_get("/rooms/{room}", self._room)
        app.router.add_get("/failures", self._failures)
        app.router.add_get("/links", self._links)
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

    async def _room(self, request: web.Request) -> web.Response:
        try:
            room = int(request.match_info["room"])
        except ValueError:
            raise web.HTTPBadRequest(text="a room id is an integer") from None
        rows = self.engine.registry_on_loop().story(room)
        if not rows:
            raise web.HTTPNotFound(text=f"no live or recently finished room {room}")
        return web.json_response(rows, dumps=json.dumps)

    async def _failures(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(1000, int(request.query.get("limit", "1000"))))
        except ValueError:
            raise web.HTTPBadRequest(text="limit is an integer") from None
        rows = self.engine.registry_on_loop().failures(limit)
        return web.json_response(rows, dumps=json.dumps)

    async def _links(self, request: web.Request) -> web.Response:
        rows = [] if self.peers is None else self.peers.links()
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
