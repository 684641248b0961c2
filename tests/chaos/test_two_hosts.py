"""Prefill and decode on two "hosts": two network namespaces joined by a veth pair.

Real processes, real NIXL on UCX TCP over the veth (its byte counters must show the KV), a real
registry and control channel across it, and the link cut under transfers in flight.

These need root and iproute2 (CI has both). Without them they fail, saying why; they are
skipped only when ``KVFSM_NO_NETNS=1`` is set explicitly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from kvfsm.chaos import _cli, _netns
from kvfsm.chaos._campaign import run_campaign
from kvfsm.chaos._netns import NetnsError, TwoHosts, check_environment
from kvfsm.chaos._options import CampaignOptions
from kvfsm.chaos._plan import ControlRates, TransferRates
from kvfsm.chaos._two_hosts import run_demo_two_hosts, run_link_cut
from kvfsm.workload.demo_report import ok
from kvfsm.workload.options import DemoOptions
from tests.helpers.netns import require_netns


@pytest.fixture
def netns() -> None:
    """Namespaces can be made here, or the test fails with the reason (skip only on request)."""
    require_netns()


DEMO = [sys.executable, "-m", "kvfsm.cli", "demo"]


def _ours() -> set[str]:
    """kvfsm's namespaces that this test run answers for: those named after this process or
    after a process that is gone (a child that leaked them). Another live run's namespaces on
    the same machine (a second suite, a campaign started by hand) are not ours to count."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("kvfsm-")}
    return {name for name in names if not _owned_by_another_live_process(name)}


def _owned_by_another_live_process(name: str) -> bool:
    match = _netns._NAME.match(name)
    if match is None:
        return False
    pid = int(match.group(1))
    return pid != os.getpid() and _netns._alive(pid)


def _connect(hosts: TwoHosts, address: str, port: int) -> int:
    """Exit status of a TCP connect from the decode namespace (0 connected, 1 refused, 2 no
    answer within a second)."""
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=1).close()\n"
        "except ConnectionRefusedError:\n"
        "    sys.exit(1)\n"
        "except OSError:\n"
        "    sys.exit(2)\n"
    )
    return hosts.run(hosts.decode, sys.executable, "-c", code).returncode


# -- the environment check (runs anywhere) ---------------------------------------------------


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_netns.shutil, "which", lambda name: "/usr/sbin/ip")
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match=r"needs root.*KVFSM_NO_NETNS=1"):
        check_environment()


def test_no_iproute2_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_netns.shutil, "which", lambda name: None)
    with pytest.raises(NetnsError, match="iproute2"):
        check_environment()


# -- the namespaces ------------------------------------------------------------------------


@pytest.mark.usefixtures("netns")
def test_two_hosts_wire_cut_restore_and_teardown() -> None:
    before = _ours()
    with TwoHosts() as hosts, TwoHosts() as other:
        names = {hosts.prefill.netns, hosts.decode.netns, other.prefill.netns, other.decode.netns}
        assert len(names) == 4  # parallel runs never share a name
        assert names <= _ours()
        p = hosts.prefill
        listing = hosts.run(p, "ip", "-o", "addr", "show", "dev", p.device).stdout
        assert f"{p.address}/24" in listing
        # Only lo and the veth end exist in there, and UCX lists devices from /sys.
        assert hosts.run(p, "ls", "/sys/class/net").stdout.split() == ["lo", p.device]
        assert hosts.command(p, {"UCX_TLS": "tcp"})[:4] == ["ip", "netns", "exec", p.netns]
        assert _connect(hosts, p.address, 9) == 1  # reachable: nothing listens, refused
        with hosts.wire_bytes() as delta:
            for mode in ("blackhole", "down"):
                hosts.cut(mode)  # type: ignore[arg-type]
                assert _connect(hosts, p.address, 9) == 2  # no answer at all
                hosts.restore()
                assert _connect(hosts, p.address, 9) == 1
            assert delta()["decode_tx"] > 0
    assert _ours() == before


@pytest.mark.usefixtures("netns")
def test_teardown_after_ctrl_c_and_stale_namespaces_go() -> None:
    before = _ours()
    names: set[str] = set()

    def interrupted() -> None:
        with TwoHosts() as hosts:
            names.update((hosts.prefill.netns, hosts.decode.netns))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert names
    assert not names & _ours()
    # A run killed with SIGKILL leaves its namespaces; the next run removes them.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{_netns.PREFIX}{dead.pid}-0abc-p"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with TwoHosts() as hosts:
        assert stale in hosts.stale_removed
        assert stale not in _ours()
    assert _ours() == before


# -- the demo across the namespaces ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("netns")
def test_demo_across_two_hosts_crosses_the_veth() -> None:
    before = _ours()
    summary = run_demo_two_hosts(DemoOptions(requests=60, progress=False, seed=11))
    assert ok(summary), summary["failures"]
    assert summary["succeeded"] == 60
    assert summary["mismatched_bytes"] == 0
    assert summary["checked_bytes"] > 0
    two = summary["two_hosts"]
    assert two["ucx"]["prefill"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "veth-prefill"}
    # Every byte decode checked went out of prefill's veth end and into decode's.
    assert two["crossed_wire"]
    assert two["wire"]["prefill_tx_bytes"] >= summary["bytes"]
    assert two["wire"]["decode_rx_bytes"] >= summary["bytes"]
    assert _ours() == before


# The demo runs production heartbeats (2 s of silence loses a link): two ranks in namespaces
# beside a loaded second xdist worker missed them once on a clean-clone run, so it runs alone.
@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.usefixtures("netns")
def test_kvfsm_demo_two_hosts_flag() -> None:
    done = subprocess.run(
        [*DEMO, "--two-hosts", "--requests", "20", "--json", "--no-progress", "--seed", "5"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    summary = json.loads(done.stdout) if done.stdout.startswith("{") else {}
    verdict = {k: v for k, v in summary.items() if k not in ("layout", "pids", "two_hosts")}
    assert done.returncode == 0, (verdict, done.stderr[-2000:])
    assert summary["succeeded"] == 20
    assert summary["two_hosts"]["crossed_wire"]


# -- cutting the link mid-transfer -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("netns")
@pytest.mark.parametrize("mode", ["blackhole", "down"])
def test_link_cut_mid_transfer(mode: str) -> None:
    """Cut while chunks are on the wire: every room on both sides ends, Failed with a reason
    within its deadline bound or Success with its bytes right; nothing is lost; prefill's
    handles drain; after the restore a full batch succeeds on the same processes."""
    before = _ours()
    report = run_link_cut(mode=mode)  # type: ignore[arg-type]
    assert report.ok, "\n".join(report.problems)
    figures = report.figures
    assert figures["chunks_in_flight_at_cut"] > 0
    for side in ("prefill", "decode"):
        assert figures["cut_batch"][side]["live_at_cut_failed"] > 0
        assert (
            figures["cut_batch"][side]["cut_to_failed_s_max"] <= (figures["deadline_bound_s"][side])
        )
    assert figures["after_restore"]["not_succeeded"] == 0
    assert (
        report.nixl["prefill_final"]["handles_created"]
        == (report.nixl["prefill_final"]["handles_released"])
    )
    assert _ours() == before


# -- a fault campaign across the namespaces ---------------------------------------------------


def test_kvfsm_chaos_two_hosts_flag_sets_the_options() -> None:
    parser = argparse.ArgumentParser()
    _cli.add_parser(parser.add_subparsers())
    opts = _cli.options(parser.parse_args(["chaos", "--two-hosts", "--seed", "3"]))
    assert opts.two_hosts
    opts.validate()
    # Decode's settle bound covers a cut link: bytes TCP holds across the cut may land after the
    # restore, so the margin past the lease keeps the cut term (the lease cannot cover it).
    assert opts.margin_s() >= opts.needed_margin_s() > 2 * opts.link_cut_max_s
    assert opts.settle_after_loss_s() == opts.lease_s + opts.margin_s()


@pytest.mark.slow
@pytest.mark.usefixtures("netns")
# Judges every scheduler-facing call's own time (a 17 MB send_metadata copy among them):
# run alone, not beside another worker's SGLang servers.
@pytest.mark.alone
def test_a_short_campaign_across_two_hosts_has_no_violation() -> None:
    """The campaign with prefill and decode in the two namespaces, NIXL on UCX TCP over the
    veth, and the link cut (blackhole or down) in every episode on top of every other fault
    (a SIGKILL in the second): no wedged room, no late write, no leak, every room settled."""
    before = _ours()
    opts = CampaignOptions(
        seed=20261129,
        episodes=2,
        rooms=16,
        two_hosts=True,
        link_cut_rate=1.0,
        sigkill_rate=1.0,
        # On two hosts a freeze past the settle bound lasts 16.5 to 44 s: too long here
        # (test_a_freeze_past_the_settle_bound_across_two_hosts has its own; decode freezes
        # are tested on one host, tests/chaos/test_decode_freeze.py).
        long_freeze_rate=0.0,
        decode_freeze_rate=0.0,
    )
    report = run_campaign(opts)
    assert report["violations"] == [], report
    assert report["ok"]
    assert report["wedged"] == report["late_writes"] == report["slow_calls"] == 0
    assert set(report["leaks"].values()) == {0}, report["leaks"]
    assert report["unsettled"] == {}
    # Scheduled in both episodes; one due after its episode is over (a SIGKILL of prefill ends
    # the second one fast) is not made.
    assert sum(n for k, n in report["faults"].items() if k.startswith("link_cut_")) >= 1
    assert report["hostile"].get("closed", 0) >= 1
    assert _ours() == before


@pytest.mark.slow
@pytest.mark.usefixtures("netns")
def test_a_remote_disconnect_lets_no_write_land_after_settle() -> None:
    """Found by the two-host campaign: a remote disconnect reported by one handle (injected:
    the peer is in fact alive) fails every room of that peer; over UCX TCP the WRITEs of the
    others were still queued, and used to land in decode pages already declared free. Now the
    peer's chunks are released and quarantined, and the pump progresses the agent meanwhile."""
    opts = CampaignOptions(
        seed=4,
        episodes=3,
        rooms=24,
        two_hosts=True,
        # Drawn once per NIXL handle, and this pair makes few (72 rooms post about 150 chunks):
        # at 0.03 a run made one disconnect, and an unlucky one none.
        transfer=TransferRates(post_disconnect=0.1),
        control=ControlRates(),
        abort_rate=0.0,
        sigstop_rate=0.0,
        sigkill_rate=0.0,
        registry_restart_rate=0.0,
        hostile_per_episode=0,
        link_cut_rate=0.0,
    )
    report = run_campaign(opts)
    assert report["faults"].get("transfer_post_disconnect", 0) >= 1
    assert report["late_writes"] == 0, report["violations"][:5]
    assert report["ok"], report["violations"][:5]


@pytest.mark.slow
@pytest.mark.usefixtures("netns")
def test_a_freeze_past_the_settle_bound_across_two_hosts() -> None:
    """Over UCX TCP the fence stops the frozen prefill from posting once its lease ends, but a
    WRITE posted before may still sit in its UCX worker or socket buffer; decode settles the
    lost link's pages at 11 s (the margin keeps the cut term) and reuses them while prefill is
    still frozen. No byte may land in them when prefill wakes: a WRITE over TCP moves only
    when prefill progresses its agent, and the stale-progress gate refuses that progress (the
    agent is fenced out, and the campaign restarts prefill: ``long_freezes.fenced_out``)."""
    before = _ours()
    opts = CampaignOptions(
        seed=20261203,
        episodes=1,
        # Long enough that the freeze, which waits up to 3 s for chunks in flight, comes
        # before the episode's last room ends (with 24 a fast pair once ended it first).
        rooms=48,
        two_hosts=True,
        long_freeze_rate=1.0,
        long_freeze_factor=(1.5, 1.6),
        link_cut_rate=0.0,
        sigstop_rate=0.0,
        sigkill_rate=0.0,
    )
    report = run_campaign(opts)
    assert report["long_freezes"]["count"] == 1
    print("long freezes:", report["long_freezes"])  # fenced_out: 1 if it caught a WRITE
    assert report["long_freezes"]["min_s"] > report["settle_after_loss_s"] == 11.0
    assert report["late_writes"] == 0, report["violations"][:5]
    assert report["wedged"] == report["mismatched_bytes"] == 0
    assert report["liveness"]["max_s"] <= report["liveness"]["bound_s"]
    assert _ours() == before
