"""The servers of ``kvfsm chaos servers``: a reference SGLang server (no disaggregation), a kvfsm
prefill and decode, and SGLang's router in front of them, the router reaching decode through
:class:`~kvfsm.chaos._decode_dropper.DecodeHalfDropper`. Given
:class:`~kvfsm.chaos._server_hosts.ServerHosts`, prefill and decode run in its two network
namespaces, joined by a data link the campaign can cut, and the rest stays here; without it
everything shares this host's loopback. Also what the campaign reads of them:
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
from kvfsm.chaos._server_hosts import ServerHosts
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
    """The servers. ``prefills`` and ``decodes`` kvfsm servers of each role (1 or 2): faults of
    a role land on its first (``prefill``, ``decode``); the others serve on beside it, and the
    router spreads requests over all of them."""

    log_dir: Path
    env: dict[str, str]
    shim: Path = SHIM
    hosts: ServerHosts | None = None
    prefills: int = 1
    decodes: int = 1
    reference: Server = field(init=False)
    prefill_servers: list[Server] = field(init=False)
    decode_servers: list[Server] = field(init=False)
    router: Server = field(init=False)
    #: One per decode server: the router reaches each through its own.
    droppers: list[DecodeHalfDropper] = field(init=False)

    def __post_init__(self) -> None:
        if not (1 <= self.prefills <= 2 and 1 <= self.decodes <= 2):
            raise ValueError(
                f"1 or 2 prefill and decode servers, not {self.prefills} and {self.decodes}"
            )
        model = write_model(self.log_dir / "model")
        hosts = self.hosts

        def kvfsm(name: str, role: str, *flags: str) -> Server:
            if hosts is None:
                return sglang_server(
                    name, model, self.log_dir, *flags, kvfsm=True, env=self.env, shim=self.shim
                )
            host = hosts.prefill if role == "prefill" else hosts.decode
            return sglang_server(
                name,
                model,
                self.log_dir,
                *flags,
                kvfsm=True,
                env={**self.env, **hosts.ucx_env(host)},
                shim=self.shim,
                host=hosts.service(host),
                prefix=hosts.command(host),
            )

        def named(role: str, i: int) -> str:
            return role if i == 0 else f"{role}-{i + 1}"

        self.reference = sglang_server("reference", model, self.log_dir, shim=self.shim)
        bootstrap_ports = [free_port() for _ in range(self.prefills)]
        self.prefill_servers = [
            kvfsm(named("prefill", i), "prefill", *prefill_flags(port))
            for i, port in enumerate(bootstrap_ports)
        ]
        self.decode_servers = [
            kvfsm(named("decode", i), "decode", *DECODE_FLAGS) for i in range(self.decodes)
        ]
        self.droppers = [
            DecodeHalfDropper(free_port(), d.port, target_host=d.host) for d in self.decode_servers
        ]
        # The router reaches each decode through its dropper: a Server only for its URL.
        through = [
            Server(f"{d.name}-via-dropper", [], dropper.listen_port, self.log_dir)
            for d, dropper in zip(self.decode_servers, self.droppers, strict=True)
        ]
        # No retries: a retried request makes new rooms behind the campaign's back and hides
        # the error it scores; no circuit breaker: a worker's failures caused by its peer
        # would take it out.
        self.router = pd_router(
            self.log_dir,
            list(zip(self.prefill_servers, bootstrap_ports, strict=True)),
            through,
            retries=False,
        )

    @property
    def prefill(self) -> Server:
        """The prefill server faults of prefill land on."""
        return self.prefill_servers[0]

    @property
    def decode(self) -> Server:
        """The decode server faults of decode land on."""
        return self.decode_servers[0]

    @property
    def kvfsm_servers(self) -> list[Server]:
        return [*self.prefill_servers, *self.decode_servers]

    @property
    def servers(self) -> list[Server]:
        return [self.reference, *self.kvfsm_servers, self.router]

    def by_name(self, name: str) -> Server:
        return {"prefill": self.prefill, "decode": self.decode, "router": self.router}[name]

    def arm_drops(self, requests: int) -> None:
        """Reset the next ``requests`` router-to-decode requests at each decode's dropper (the
        router picks the decode: each may be the one)."""
        for dropper in self.droppers:
            dropper.arm(requests)

    def disarm_drops(self) -> None:
        for dropper in self.droppers:
            dropper.disarm()

    def start(self) -> None:
        for dropper in self.droppers:
            dropper.start()
        # The router too, at once: it adds each worker when its health checks pass, so it is
        # ready to route within a check or two of the last worker's start, not after its own.
        for server in (self.reference, *self.kvfsm_servers, self.router):
            server.start()
        for server in (self.reference, *self.kvfsm_servers, self.router):
            server.wait_ready()
        self.wait_serving()

    def wait_serving(self, timeout: float = 180.0) -> None:
        """Until the router answers a request through prefill and decode (it routes only to
        workers its health checks, every second, have seen)."""
        give_up = time.monotonic() + timeout
        while not router_serves(self.router):
            if time.monotonic() > give_up:
                raise RuntimeError(f"the router does not serve after {timeout:g}s")
            time.sleep(1.0)

    @staticmethod
    def restart_server(server: Server) -> None:
        """Start ``server`` again, behind the same address and port (its process group killed
        first, whatever is left of it)."""
        server.kill()
        server.start()
        server.wait_ready()

    def exited(self) -> list[tuple[Server, str]]:
        """kvfsm servers whose process has exited, each with why: the line its log gives for
        it (kvfsm's ``exiting (status 75): NIXL agent fenced out ...``), else its exit
        status."""
        out = []
        for server in self.kvfsm_servers:
            code = None if server.proc is None else server.proc.poll()
            if code is None:
                continue
            why = f"exit status {code}"
            for line in reversed(server.log_tail(400).splitlines()):
                if "exiting (status" in line:
                    why = line[line.index("exiting (status") :][:300]
                    break
            out.append((server, why))
        return out

    def stop(self) -> None:
        stop_all([self.router, *reversed(self.kvfsm_servers), self.reference])
        for dropper in self.droppers:
            dropper.close()

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
