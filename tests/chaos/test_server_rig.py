"""The server campaign's rig as built, before anything starts: which servers, on which
addresses, and what the router is told. (Starting them is tests/e2e/test_server_campaign.py.)"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvfsm.chaos._server_rig import Rig


@contextmanager
def built(tmp_path: Path, prefills: int = 1, decodes: int = 1) -> Iterator[Rig]:
    rig = Rig(tmp_path, {}, prefills=prefills, decodes=decodes)
    try:
        yield rig
    finally:
        rig.stop()  # nothing started: closes the droppers' loops


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_two_prefills_and_two_decodes_are_all_behind_the_router(tmp_path: Path) -> None:
    with built(tmp_path, 2, 2) as rig:
        _check_two_and_two(rig)


def _check_two_and_two(rig: Rig) -> None:
    assert [s.name for s in rig.kvfsm_servers] == ["prefill", "prefill-2", "decode", "decode-2"]
    assert rig.prefill is rig.prefill_servers[0]
    assert rig.decode is rig.decode_servers[0]
    argv = rig.router.argv
    # Each prefill with its own bootstrap port, given to it and to the router.
    prefills = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--prefill"]
    assert [url for url, _ in prefills] == [s.url for s in rig.prefill_servers]
    for (_, port), server in zip(prefills, rig.prefill_servers, strict=True):
        assert _after(server.argv, "--disaggregation-bootstrap-port") == [port]
    assert len({port for _, port in prefills}) == 2
    # Each decode behind its own dropper, which forwards to it.
    assert _after(argv, "--decode") == [d.url for d in rig.droppers]
    assert [(d.target_host, d.target_port) for d in rig.droppers] == [
        (s.host, s.port) for s in rig.decode_servers
    ]
    # Every server's ports are its own.
    ports = [p for s in rig.servers for p in (s.port, s.status_port) if p is not None]
    assert len(ports) == len(set(ports))


def test_on_one_host_every_server_listens_on_loopback(tmp_path: Path) -> None:
    with built(tmp_path) as rig:
        _check_loopback(rig)


def _check_loopback(rig: Rig) -> None:
    for server in rig.servers:
        assert server.host == "127.0.0.1"
    for server in rig.kvfsm_servers:
        assert _after(server.argv, "--host") == ["127.0.0.1"]
        assert server.env["KVFSM_STATUS_HOST"] == "127.0.0.1"
        assert server.argv[0] != "ip"


@pytest.mark.parametrize(("prefills", "decodes"), [(0, 1), (1, 3)])
def test_one_or_two_of_each_role(tmp_path: Path, prefills: int, decodes: int) -> None:
    with pytest.raises(ValueError, match="1 or 2 prefill and decode servers"):
        Rig(tmp_path, {}, prefills=prefills, decodes=decodes)


def test_a_server_that_ended_itself_is_named_with_the_line_its_log_gives(tmp_path: Path) -> None:
    with built(tmp_path, 2, 1) as rig:
        line = "exiting (status 75): NIXL agent fenced out: 2 record(s) of fence 1 may still..."
        ended = rig.prefill_servers[1]
        ended.argv = [sys.executable, "-c", f"print({line!r}); raise SystemExit(75)"]
        plain = rig.decode
        plain.argv = [sys.executable, "-c", "raise SystemExit(3)"]
        for server in (ended, plain):
            server.start()
            assert server.proc is not None
            server.proc.wait(30)
        assert [(s.name, why) for s, why in rig.exited()] == [
            ("prefill-2", line),
            ("decode", "exit status 3"),
        ]
