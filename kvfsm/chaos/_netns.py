"""``TwoHosts``: two Linux network namespaces joined by a veth pair, as two machines on one wire.

Prefill runs in one namespace and decode in the other; the only way between them is the veth
pair, so the control channel, the registry lookups and NIXL's UCX TCP traffic all cross it
(and its byte counters show it), and the link can be cut under them. Needs root and iproute2's
``ip`` (``ip netns``, veth); everything is done by running ``ip``, nothing is imported.

    with TwoHosts() as hosts:
        prefix = hosts.command(hosts.prefill, env=hosts.ucx_env(hosts.prefill))
        ...                      # start processes with that prefix (``ip netns exec NAME ...``)
        hosts.cut()              # both directions silently dropped
        hosts.restore()

Names are unique per run (``kvfsm-<pid>-<token>-p`` / ``-d``), so parallel runs never collide;
the veth ends are created directly inside their namespaces, so their names never exist in the
root namespace. Everything is removed on exit, after an error or Ctrl-C too; namespaces of
this prefix whose creating process is gone (a run killed with SIGKILL) are removed on entry.

**Cutting.** ``cut()`` installs a blackhole route to the other side in each namespace: every
packet either way is dropped silently, as a dead switch or a pulled cable between two switches
would. Neither kernel reports anything to the sockets (no RST, no ICMP, no carrier change), so
what notices is what a real partition leaves: the control channel's heartbeat silence and the
data path's own deadlines. ``cut("down")`` sets the prefill end down instead (both ends lose
carrier); established TCP sockets see that no sooner (measured: see docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Literal

__all__ = ["Host", "NetnsError", "TwoHosts", "check_environment", "remove_stale"]

#: Every namespace this module creates is named ``<PREFIX><pid>-<token>-<p|d>``.
PREFIX: Final = "kvfsm-"
_NAME: Final = re.compile(rf"^{re.escape(PREFIX)}(\d+)-([0-9a-f]+)-[pd]$")
_IP_TIMEOUT_S: Final = 30.0

CutMode = Literal["blackhole", "down"]


class NetnsError(RuntimeError):
    """The namespaces cannot be made here (not root, no ``ip``, no netns support), or an ``ip``
    command failed; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class Host:
    """One side: its namespace, its end of the veth pair and that end's address."""

    role: str
    netns: str
    device: str
    address: str
    prefix_len: int


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise NetnsError(
            "`ip` (iproute2) is not installed: TwoHosts needs it (apt-get install iproute2)"
        ) from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def check_environment() -> None:
    """Raise :class:`NetnsError` with a clear message unless namespaces can be made here."""
    if shutil.which("ip") is None:
        raise NetnsError(
            "`ip` (iproute2) is not on PATH: the two-host tests need it (apt-get install "
            "iproute2); set KVFSM_NO_NETNS=1 to skip them deliberately"
        )
    if os.geteuid() != 0:
        raise NetnsError(
            "the two-host tests create network namespaces and a veth pair, which needs root "
            f"(running as uid {os.geteuid()}); run them as root (CI does) or set "
            "KVFSM_NO_NETNS=1 to skip them deliberately"
        )
    _ip("netns", "list")  # no netns support (an old kernel, a locked-down container) fails here


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    # ``ip netns list`` prints "NAME" or "NAME (id: N)" per line.
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Remove namespaces of ours whose creating process is gone; return their names."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


def _delete_namespace(name: str) -> None:
    # Delete the veth first: a process that outlived its run (it would keep the namespace
    # alive after its name is gone) must not keep the pair, and the peer end, around.
    for device in ("veth-prefill", "veth-decode"):
        _ip("link", "del", device, netns=name, check=False)
    _ip("netns", "del", name, check=False)


class TwoHosts:
    """Two namespaces, ``prefill`` and ``decode``, joined by a veth pair (see the module doc).

    ``subnet`` is the /24 (or smaller) the two ends take their first two addresses from; any
    private range works, since nothing outside the two namespaces sees it.
    """

    def __init__(self, subnet: str = "10.77.0.0/24", mtu: int | None = None) -> None:
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or net.num_addresses < 4:
            raise ValueError(f"subnet must be an IPv4 network with room for two hosts: {subnet}")
        first, second = net[1], net[2]
        token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.prefill = Host(
            "prefill", f"{PREFIX}{token}-p", "veth-prefill", str(first), net.prefixlen
        )
        self.decode = Host(
            "decode", f"{PREFIX}{token}-d", "veth-decode", str(second), net.prefixlen
        )
        self.mtu = mtu
        self._created: list[str] = []
        self._cut: CutMode | None = None
        self.stale_removed: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> TwoHosts:
        check_environment()
        self.stale_removed = remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        p, d = self.prefill, self.decode
        for host in (p, d):
            _ip("netns", "add", host.netns)
            self._created.append(host.netns)
        # Created inside the namespaces: the names never exist in the root namespace.
        _ip(
            "link", "add", p.device, "netns", p.netns,
            "type", "veth", "peer", "name", d.device, "netns", d.netns,
        )  # fmt: skip
        for host in (p, d):
            _ip("addr", "add", f"{host.address}/{host.prefix_len}", "dev", host.device,
                netns=host.netns)  # fmt: skip
            if self.mtu is not None:
                _ip("link", "set", "dev", host.device, "mtu", str(self.mtu), netns=host.netns)
            # lo too: a process talking to its own host's address goes through it.
            _ip("link", "set", "dev", "lo", "up", netns=host.netns)
            _ip("link", "set", "dev", host.device, "up", netns=host.netns)

    def close(self) -> None:
        """Remove both namespaces and the pair. Idempotent; a Ctrl-C in the middle is held
        until everything is removed, then raised."""
        interrupted: BaseException | None = None
        while self._created:
            name = self._created[-1]
            try:
                _delete_namespace(name)
            except KeyboardInterrupt as exc:  # finish the clean-up first
                interrupted = exc
                continue
            self._created.pop()
        self._cut = None
        if interrupted is not None:
            raise interrupted

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.prefill, self.decode

    def other(self, host: Host) -> Host:
        return self.decode if host is self.prefill else self.prefill

    # -- running things in a namespace ---------------------------------------------------------

    def command(self, host: Host, env: Mapping[str, str] | None = None) -> list[str]:
        """The prefix that runs a command in ``host``'s namespace (with ``env`` added):
        ``ip netns exec NAME [env K=V ...]``. ``ip netns exec`` execs the command in place
        (same pid, inherited file descriptors) after mounting the namespace's own /sys, which
        is where UCX lists network devices."""
        prefix = ["ip", "netns", "exec", host.netns]
        if env:
            prefix += ["env", *(f"{k}={v}" for k, v in env.items())]
        return prefix

    def run(self, host: Host, *cmd: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in ``host``'s namespace and wait for it (output captured)."""
        return subprocess.run(
            [*self.command(host), *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    @staticmethod
    def ucx_env(host: Host) -> dict[str, str]:
        """Environment for a NIXL (UCX) process on ``host``: TCP only, on the veth only.

        Without it UCX would pick shared memory (``sysv``/``posix``/``cma``), which works
        between namespaces of one kernel and would never touch the wire. NIXL leaves UCX
        settings that the environment already has alone, so these win over its defaults."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device}

    # -- the wire ------------------------------------------------------------------------------

    def counters(self, host: Host) -> tuple[int, int]:
        """``(rx_bytes, tx_bytes)`` of ``host``'s veth end, as the kernel counts them."""
        out = _ip("-s", "-j", "link", "show", "dev", host.device, netns=host.netns)
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    @property
    def is_cut(self) -> bool:
        return self._cut is not None

    def cut(self, mode: CutMode = "blackhole") -> None:
        """Cut the link (see the module doc). Idempotent for the same mode."""
        if self._cut == mode:
            return
        if self._cut is not None:
            self.restore()
        p, d = self.prefill, self.decode
        if mode == "blackhole":
            for host in (p, d):
                _ip("route", "add", "blackhole", f"{self.other(host).address}/32",
                    netns=host.netns)  # fmt: skip
        elif mode == "down":
            _ip("link", "set", "dev", p.device, "down", netns=p.netns)
        else:  # pragma: no cover - Literal
            raise ValueError(f"unknown cut mode {mode!r}")
        self._cut = mode

    def restore(self) -> None:
        """Undo :meth:`cut`. Idempotent."""
        mode, self._cut = self._cut, None
        p, d = self.prefill, self.decode
        if mode == "blackhole":
            for host in (p, d):
                _ip("route", "del", "blackhole", f"{self.other(host).address}/32",
                    netns=host.netns, check=False)  # fmt: skip
        elif mode == "down":
            # Setting a device down removes its routes; setting it up brings the subnet's back.
            _ip("link", "set", "dev", p.device, "up", netns=p.netns)

    @contextlib.contextmanager
    def wire_bytes(self) -> Iterator[Callable[[], dict[str, int]]]:
        """``with hosts.wire_bytes() as delta:`` ... ``delta()`` gives the bytes each veth end
        sent and received since the ``with`` began."""
        before = {h.role: self.counters(h) for h in self.hosts}

        def delta() -> dict[str, int]:
            out: dict[str, int] = {}
            for h in self.hosts:
                rx, tx = self.counters(h)
                out[f"{h.role}_rx"] = rx - before[h.role][0]
                out[f"{h.role}_tx"] = tx - before[h.role][1]
            return out

        yield delta

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (
            f"netns {p.netns} ({p.device} {p.address}) <-veth-> netns {d.netns} "
            f"({d.device} {d.address})"
        )
