"""The listener's books (``kvfsm.control._admission``), driven directly: handshakes shed per host
before they are shed for everyone, link places taken only by authenticated peers, within the
bounds per host and in all, given back when a handshake ends or a link is lost."""

from __future__ import annotations

import logging

import pytest

from kvfsm.control._admission import Admission, Throttled


def books(**bounds: int) -> Admission:
    defaults = {
        "max_unauthenticated": 8,
        "max_unauthenticated_per_host": 3,
        "max_links": 5,
        "max_links_per_host": 3,
    }
    return Admission(**{**defaults, **bounds})


def test_a_hosts_flood_of_handshakes_sheds_its_own_oldest() -> None:
    admission = books()
    assert admission.arrived("legit", "10.0.0.1") == []
    shed = []
    for i in range(100):
        shed += admission.arrived(("flood", i), "10.0.0.66")
    assert shed == [("flood", i) for i in range(97)]  # its own, oldest first
    assert admission.waiting("10.0.0.66") == 3
    assert admission.waiting("10.0.0.1") == 1  # never shed by another host's flood
    assert admission.waiting() == 4


def test_over_the_total_the_oldest_of_all_is_shed() -> None:
    admission = books(max_unauthenticated=4, max_unauthenticated_per_host=4)
    for host in range(4):
        assert admission.arrived(host, f"10.0.0.{host}") == []
    assert admission.arrived("late", "10.0.0.9") == [0]
    assert admission.waiting() == 4


def test_link_places_are_bounded_per_host_and_in_all() -> None:
    admission = books()
    for i in range(3):
        admission.arrived(("a", i), "A")
        admission.authenticated(("a", i))
        assert admission.take_slot(("a", i), "A") is None
        admission.opened(("a", i), i)
    refusal = admission.take_slot(("a", 3), "A")
    assert refusal == "3 control links from A already (ChannelConfig.max_links_per_host 3)"
    assert admission.take_slot("b1", "B") is None  # a slot taken, its link not open yet
    assert admission.take_slot("b2", "B") is None
    assert admission.take_slot("c", "C") == ("5 control links already (ChannelConfig.max_links 5)")
    admission.released("b2")  # its handshake failed after taking the place: given back
    assert admission.links == 4
    assert admission.take_slot("c", "C") is None
    admission.opened("c", 10)
    admission.closed(0)  # a link of A lost: A may open one again
    assert admission.links_from("A") == 2
    assert admission.take_slot(("a", 4), "A") is None


def test_a_link_that_replaces_one_of_its_host_is_not_counted_twice() -> None:
    admission = books(max_links_per_host=1)
    assert admission.take_slot("first", "A") is None
    admission.opened("first", 7)
    assert admission.take_slot("again", "A", replaces=7) is None
    admission.opened("again", 8)
    admission.closed(7)  # the replaced link goes
    assert admission.links_from("A") == 1
    # A link of another host is not one it can replace.
    assert admission.take_slot("other", "B", replaces=8) is None
    assert admission.take_slot("third", "A", replaces=99) is not None


def test_everything_is_given_back() -> None:
    admission = books()
    admission.arrived("x", "A")
    admission.authenticated("x")
    admission.take_slot("x", "A")
    admission.opened("x", 1)
    admission.released("x")  # its handshake is over: the link keeps its place
    assert admission.links == 1
    admission.closed(1)
    admission.arrived("y", "B")
    admission.released("y")
    assert (admission.links, admission.waiting(), admission._hosts) == (0, 0, {})


def test_a_flood_of_refusals_is_logged_once_per_period(caplog: pytest.LogCaptureFixture) -> None:
    log = Throttled(logging.getLogger("tests.admission"), every_s=10.0)
    with caplog.at_level(logging.WARNING, logger="tests.admission"):
        for i in range(900):
            log.warning(i * 0.01, "control link refused: x")  # 9 s of refusals
        log.warning(10.5, "control link refused: y")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "control link refused: x",
        "control link refused: y (899 more like it since the last line; one per 10 s)",
    ]
