"""``ServerHosts``: the two namespaces of the server campaign, with real sockets.

What the campaign relies on, checked with a TCP listener on each service address: this (the
root) namespace reaches both servers whatever happens to the data link; each side reaches the
other only over the data link (the veth's byte counters move), and a cut (down or black hole)
separates them until it is restored. Needs root and iproute2, as the other two-host tests do;
skipped only when ``KVFSM_NO_NETNS=1`` is set.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvfsm.chaos._netns import CutMode, Host
from kvfsm.chaos._server_hosts import ServerHosts, free_subnet
from tests.helpers.netns import require_netns

PORT = 18765


@pytest.fixture
def hosts() -> Iterator[ServerHosts]:
    require_netns()
    with ServerHosts() as made:
        listeners = [_listen(made, host) for host in made.hosts]
        try:
            yield made
        finally:
            for proc in listeners:
                proc.kill()
                proc.wait(10)
                assert proc.stdout is not None
                proc.stdout.close()


def _listen(hosts: ServerHosts, host: Host) -> subprocess.Popen[bytes]:
    """A TCP listener on ``host``'s service address that accepts and closes, until killed."""
    code = (
        "import socket\n"
        f"s = socket.create_server(({hosts.service(host)!r}, {PORT}))\n"
        "print('up', flush=True)\n"
        "while True:\n"
        "    s.accept()[0].close()\n"
    )
    proc = subprocess.Popen(
        [*hosts.command(host), sys.executable, "-c", code], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"up"
    return proc


def _from_root(address: str) -> bool:
    try:
        socket.create_connection((address, PORT), timeout=2).close()
    except OSError:
        return False
    return True


def _from(hosts: ServerHosts, host: Host, address: str) -> bool:
    code = f"import socket\nsocket.create_connection(({address!r}, {PORT}), timeout=2).close()\n"
    return hosts.run(host, sys.executable, "-c", code).returncode == 0


def _reach(hosts: ServerHosts) -> dict[str, bool]:
    p, d = hosts.prefill, hosts.decode
    return {
        "root->prefill": _from_root(hosts.service(p)),
        "root->decode": _from_root(hosts.service(d)),
        "decode->prefill": _from(hosts, d, hosts.service(p)),
        "prefill->decode": _from(hosts, p, hosts.service(d)),
    }


ALL = dict.fromkeys(("root->prefill", "root->decode", "decode->prefill", "prefill->decode"), True)


def test_the_root_namespace_reaches_both_and_each_side_reaches_the_other_over_the_data_link(
    hosts: ServerHosts,
) -> None:
    assert _reach(hosts) == ALL
    with hosts.wire_bytes() as delta:
        assert _from(hosts, hosts.decode, hosts.service(hosts.prefill))
        moved = delta()
    # A connect and a close cross the veth: its counters show them, both ways.
    assert moved["decode_tx"] > 0, moved
    assert moved["prefill_rx"] > 0, moved
    # The root namespace's traffic takes the management links, never the data link.
    with hosts.wire_bytes() as delta:
        assert _from_root(hosts.service(hosts.prefill))
        assert _from_root(hosts.service(hosts.decode))
        assert delta() == {"prefill_rx": 0, "prefill_tx": 0, "decode_rx": 0, "decode_tx": 0}


@pytest.mark.parametrize("mode", ["blackhole", "down"])
def test_a_cut_separates_the_two_sides_only_and_a_restore_joins_them_again(
    hosts: ServerHosts, mode: CutMode
) -> None:
    hosts.cut(mode)
    cut = {**ALL, "decode->prefill": False, "prefill->decode": False}
    assert _reach(hosts) == cut
    hosts.restore()
    # A device set up again takes a moment to pass traffic (carrier, neighbour discovery).
    give_up = time.monotonic() + 10
    while (now := _reach(hosts)) != ALL and time.monotonic() < give_up:
        time.sleep(0.2)
    assert now == ALL


def test_the_subnet_picked_overlaps_no_route_of_this_namespace() -> None:
    if os.environ.get("KVFSM_NO_NETNS") == "1":
        pytest.skip("KVFSM_NO_NETNS=1: two-host (network namespace) tests skipped on request")
    cmd = ["ip", "-4", "-o", "route", "show", "table", "all"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    routes = [
        ipaddress.ip_network(line.split()[0] if "/" in line.split()[0] else f"{line.split()[0]}/32")
        for line in out.splitlines()
        if line.split() and line.split()[0][0].isdigit()
    ]
    for _ in range(20):
        net = free_subnet()
        assert net.prefixlen == 24
        assert net.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
        assert not any(net.overlaps(r) for r in routes if r.prefixlen > 0), net
