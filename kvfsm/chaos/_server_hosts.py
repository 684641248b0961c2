"""``ServerHosts``: the two network namespaces of :class:`~kvfsm.chaos._netns.TwoHosts` made
into two server hosts that this (the root) namespace reaches too, so that a real SGLang prefill
and decode run on "two machines" while the router, the reference server and the campaign's
client stay here.

Three wires::

    root ns ──mgmt──> prefill ns ──veth (the data link)── decode ns <──mgmt── root ns

* The data link is :class:`TwoHosts`' veth pair; prefill and decode reach each other only over
  it: the bootstrap request, kvfsm's control channel and NIXL's UCX TCP traffic (UCX is held to
  the veth by :meth:`TwoHosts.ucx_env`).
* Each namespace has a management link to the root namespace (its own veth pair, a /30): the
  router's requests, the health checks, ``/abort_request`` and the status servers' reads come
  over it. It is never cut: a cut of the data link leaves the servers reachable from here, as a
  partition between two racks leaves both reachable from a third.
* Each server listens on a *service address* on its namespace's ``lo`` (a /32), reached from
  the root namespace through its management link and from the other namespace through the data
  link. The router hands decode the prefill's address as the bootstrap host, so decode's
  connections to it take the data link and die with it. On ``lo``, the address outlives the
  data link going down (an address on a downed device stops being local to its host).

:meth:`cut` extends the data link's cut to the service addresses (a blackhole route to the
other side's service address as well as to its veth address); :meth:`restore` puts back the
routes a downed device took with it.

The addresses come from one /24 of 10.0.0.0/8 that the root namespace has no route into, picked
at random per run: data link .1 and .2, service addresses .11 and .12, management /30s .64 and
.68. Names are unique per run; everything is removed on exit, as :class:`TwoHosts` removes its
own (the management pairs go with their namespace).
"""

from __future__ import annotations

import ipaddress
import json
import random
import subprocess
from dataclasses import dataclass
from typing import Final

from kvfsm.chaos._netns import CutMode, Host, TwoHosts, _ip

__all__ = ["ServerHosts", "free_subnet"]

#: The management link's end inside each namespace.
_MGMT_DEVICE: Final = "mgmt"


def _root_routes() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    nets = []
    for route in json.loads(out or "[]"):
        dst = str(route.get("dst", ""))
        if not dst or dst == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
        except ValueError:
            continue
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def free_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps no route of the root namespace (so that the host
    routes this module adds there send nothing of the machine's own traffic astray)."""
    rng = rng or random.Random()
    taken = _root_routes()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 255)}.0/24")
        if not any(net.overlaps(t) and t.prefixlen > 0 for t in taken):
            return net
    raise RuntimeError("no free /24 in 10.0.0.0/8 for the server hosts")


@dataclass(frozen=True, slots=True)
class _Mgmt:
    """A namespace's management link: the root end's device and address, the namespace
    end's address."""

    root_device: str
    root_address: str
    ns_address: str


class ServerHosts(TwoHosts):
    """Two server hosts (see the module doc). ``service(host)`` is the address a server on
    ``host`` listens on; start it with ``command(host)`` before its command and
    ``ucx_env(host)`` in its environment."""

    def __init__(self, subnet: ipaddress.IPv4Network | None = None) -> None:
        net = subnet or free_subnet()
        super().__init__(str(net))
        self.subnet = net
        self._service = {"prefill": str(net[11]), "decode": str(net[12])}
        token = self.prefill.netns.removeprefix("kvfsm-").removesuffix("-p").split("-")[-1]
        self._mgmt = {
            "prefill": _Mgmt(f"kvm{token}p", str(net[65]), str(net[66])),
            "decode": _Mgmt(f"kvm{token}d", str(net[69]), str(net[70])),
        }

    def service(self, host: Host) -> str:
        return self._service[host.role]

    def _create(self) -> None:
        super()._create()
        for host in self.hosts:
            m = self._mgmt[host.role]
            _ip("link", "add", m.root_device, "type", "veth",
                "peer", "name", _MGMT_DEVICE, "netns", host.netns)  # fmt: skip
            _ip("addr", "add", f"{m.root_address}/30", "dev", m.root_device)
            _ip("addr", "add", f"{m.ns_address}/30", "dev", _MGMT_DEVICE, netns=host.netns)
            _ip("link", "set", "dev", m.root_device, "up")
            _ip("link", "set", "dev", _MGMT_DEVICE, "up", netns=host.netns)
            service = self.service(host)
            _ip("addr", "add", f"{service}/32", "dev", "lo", netns=host.netns)
            # From here: over the management link. From the other namespace: over the data
            # link, through the other end's veth address.
            _ip("route", "add", f"{service}/32", "via", m.ns_address, "dev", m.root_device)
            self._route_service(self.other(host), host)

    def _route_service(self, at: Host, to: Host) -> None:
        _ip("route", "replace", f"{self.service(to)}/32", "via", to.address,
            "dev", at.device, netns=at.netns)  # fmt: skip

    def close(self) -> None:
        # The root ends go with their namespaces too; removed first, and by name, so that a
        # namespace kept alive by a straggling process leaves nothing in the root namespace.
        for m in self._mgmt.values():
            _ip("link", "del", m.root_device, check=False)
        super().close()

    def cut(self, mode: CutMode = "blackhole") -> None:
        super().cut(mode)
        if mode == "blackhole":
            for host in self.hosts:
                _ip("route", "replace", "blackhole", f"{self.service(self.other(host))}/32",
                    netns=host.netns)  # fmt: skip

    def restore(self) -> None:
        super().restore()
        # A blackhole replaced the routes to the service addresses; a downed device took its
        # routes with it. Either way they are put back.
        for host in self.hosts:
            self._route_service(host, self.other(host))

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (
            f"{super().describe()}; prefill serves on {self.service(p)}, decode on "
            f"{self.service(d)}, both reached from here over management links"
        )
