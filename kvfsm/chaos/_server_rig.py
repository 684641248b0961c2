"""The servers of ``kvfsm chaos servers``: a reference SGLang server (no disaggregation), a kvfsm
prefill and decode, and SGLang's router in front of them, the router reaching decode through
:class:`~kvfsm.chaos._decode_dropper.DecodeHalfDropper`. Also what the campaign reads of them:
the scheduler process of a server, its status server's counters and failures, and the RSS and
open file descriptors of its process group.
"""

from __future__ import annotations

import os
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfsm.chaos._decode_dropper import DecodeHalfDropper
from kvfsm.chaos._server_scoring import DrainReading
from kvfsm.chaos._servers import (
    DECODE_FLAGS,
    SHIM,
    Server,
    free_port,
    get_json,
    pd_router,
    prefill_flags,
    router_serves,
    sglang_server,
    stop_all,
    write_model,
)

__all__ = ["Rig", "group_usage", "scheduler_pids"]


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces) in parentheses: state ppid pgrp.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def scheduler_pids(server: Server) -> list[int]:
    """The server's scheduler processes (SGLang titles them ``sglang::scheduler...``): where
    kvfsm's rooms live."""
    if server.proc is None:
        return []
    found = []
    for pid in _group(server.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"scheduler" in cmd:
            found.append(pid)
    return found


def group_usage(server: Server) -> tuple[int, int]:
    """(RSS bytes, open fds) summed over the server's process group."""
    if server.proc is None:
        return 0, 0
    rss = fds = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in _group(server.proc.pid):
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, ValueError, IndexError):
            continue
    return rss, fds


@dataclass
class Rig:
    log_dir: Path
    env: dict[str, str]
    shim: Path = SHIM
    reference: Server = field(init=False)
    prefill: Server = field(init=False)
    decode: Server = field(init=False)
    router: Server = field(init=False)
    dropper: DecodeHalfDropper = field(init=False)
    bootstrap_port: int = field(init=False)

    def __post_init__(self) -> None:
        model = write_model(self.log_dir / "model")
        self.bootstrap_port = free_port()

        def kvfsm(name: str, *flags: str) -> Server:
            return sglang_server(
                name, model, self.log_dir, *flags, kvfsm=True, env=self.env, shim=self.shim
            )

        self.reference = sglang_server("reference", model, self.log_dir, shim=self.shim)
        self.prefill = kvfsm("prefill", *prefill_flags(self.bootstrap_port))
        self.decode = kvfsm("decode", *DECODE_FLAGS)
        self.dropper = DecodeHalfDropper(free_port(), self.decode.port)
        # The router reaches decode through the dropper: a Server only for its URL.
        through = Server("decode-via-dropper", [], self.dropper.listen_port, self.log_dir)
        # No retries: a retried request makes new rooms behind the campaign's back and hides
        # the error it scores; no circuit breaker: a worker's failures caused by its peer
        # would take it out.
        self.router = pd_router(
            self.log_dir, [(self.prefill, self.bootstrap_port)], [through], retries=False
        )

    @property
    def servers(self) -> list[Server]:
        return [self.reference, self.prefill, self.decode, self.router]

    def by_name(self, name: str) -> Server:
        return {"prefill": self.prefill, "decode": self.decode, "router": self.router}[name]

    def start(self) -> None:
        self.dropper.start()
        for server in (self.reference, self.prefill, self.decode):
            server.start()
        for server in (self.reference, self.prefill, self.decode):
            server.wait_ready()
        self.router.start()
        self.router.wait_ready()
        self.wait_serving()

    def wait_serving(self, timeout: float = 180.0) -> None:
        """Until the router answers a request through prefill and decode (it routes only to
        workers its health checks, every 5 s, have seen)."""
        give_up = time.monotonic() + timeout
        while not router_serves(self.router):
            if time.monotonic() > give_up:
                raise RuntimeError(f"the router does not serve after {timeout:g}s")
            time.sleep(1.0)

    def restart(self, name: str) -> None:
        """Start ``name`` again, behind the same address and port (its process group killed
        first, whatever is left of it)."""
        server = self.by_name(name)
        server.kill()
        server.start()
        server.wait_ready()

    def stop(self) -> None:
        stop_all([self.router, self.decode, self.prefill, self.reference])
        self.dropper.close()

    def read_drain(self, server: Server) -> DrainReading:
        try:
            stats: dict[str, Any] = get_json(server.status_url + "/stats", timeout=5)
        except (urllib.error.URLError, OSError, ValueError):
            return DrainReading(server.name, -1, -1, read=False)
        rooms = stats.get("rooms", {})
        transport = stats.get("transport", {})
        return DrainReading(
            server.name,
            int(rooms.get("live", 0)),
            int(rooms.get("held_pages", 0)),
            int(transport.get("handles_created", 0)),
            int(transport.get("handles_released", 0)),
        )

    def failures_since(self, server: Server, since: float) -> list[dict[str, Any]]:
        """``/failures`` rows of rooms created at or after ``since`` (``time.time()``: a row's
        ``created`` is the wall clock)."""
        try:
            rows: list[dict[str, Any]] = get_json(server.status_url + "/failures?limit=1000")
        except (urllib.error.URLError, OSError, ValueError):
            return []
        return [{**r, "server": server.name} for r in rows if float(r["created"]) >= since]
