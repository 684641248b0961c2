"""``KVFSM_THREAD_CPUS``: kvfsm's threads on CPUs of their own, the engine's starter off them.

Checked on real threads with the kernel's own answer (``os.sched_getaffinity`` of each thread).
Every test runs its starter in a thread of its own, so pytest's main thread keeps its CPUs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kvfsm.rooms import RoomEngine, parse_cpu_list, set_thread_cpus, thread_cpus
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._placement import ENV, keep_this_thread_off, place_this_thread
from kvfsm.transport._poster import Poster

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread placement is Linux's sched_setaffinity"
)

T = TypeVar("T")
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV, raising=False)
    set_thread_cpus(None)
    yield
    set_thread_cpus(None)


def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a fresh thread (which inherits this one's CPUs); its result or its error."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return out[0]


def cpus_of(thread: threading.Thread) -> set[int]:
    assert thread.native_id is not None
    return os.sched_getaffinity(thread.native_id)


def test_cpu_lists_parse_as_taskset_writes_them() -> None:
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("2-4") == {2, 3, 4}
    assert parse_cpu_list("0, 6-7,9") == {0, 6, 7, 9}
    assert parse_cpu_list("5-5,5") == {5}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("1,,2", "not a CPU number"),
        ("a", "not a CPU number"),
        ("1-", "not a CPU number"),
        ("-1", "not a CPU number"),
        ("4-2", "backwards"),
        ("99999999", "out of range"),
    ],
)
def test_a_bad_cpu_list_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_cpu_list(text)


def test_the_setting_comes_from_code_first_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert thread_cpus() is None
    monkeypatch.setenv(ENV, "0-1")
    assert thread_cpus() == {0, 1}
    set_thread_cpus([1])
    assert thread_cpus() == {1}
    set_thread_cpus(None)
    assert thread_cpus() == {0, 1}
    monkeypatch.setenv(ENV, "  ")
    assert thread_cpus() is None
    with pytest.raises(ValueError, match="non-empty"):
        set_thread_cpus([])


def test_unset_touches_no_thread() -> None:
    def run() -> tuple[set[int], frozenset[int] | None, set[int]]:
        before = os.sched_getaffinity(0)
        moved = keep_this_thread_off()
        place_this_thread()
        return before, moved, os.sched_getaffinity(0)

    before, moved, after = in_thread(run)
    assert moved is None
    assert after == before == set(ALLOWED)


def test_a_kvfsm_thread_confines_itself_to_the_cpus() -> None:
    set_thread_cpus([ALLOWED[-1]])

    def run() -> set[int]:
        place_this_thread()
        return os.sched_getaffinity(0)

    assert in_thread(run) == {ALLOWED[-1]}


def test_cpus_the_process_may_not_use_leave_the_thread_where_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_thread_cpus([max(ALLOWED) + 1000])

    def run() -> set[int]:
        place_this_thread()  # never raises: the kernel refuses, the thread stays
        return os.sched_getaffinity(0)

    with caplog.at_level(logging.WARNING, logger="kvfsm.runtime"):
        assert in_thread(run) == set(ALLOWED)
    assert "not placed" in caplog.text
    assert ENV in caplog.text


def test_the_starter_is_left_alone_when_kvfsm_would_take_all_its_cpus(
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_thread_cpus(ALLOWED)
    with caplog.at_level(logging.WARNING, logger="kvfsm.runtime"):
        moved, after = in_thread(lambda: (keep_this_thread_off(), os.sched_getaffinity(0)))
    assert moved is None
    assert after == set(ALLOWED)
    assert "covers every CPU" in caplog.text


needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="placement apart needs two CPUs")


@needs_two
def test_an_engine_runs_on_its_cpus_and_its_starter_leaves_them() -> None:
    """The engine's loop thread on the CPU of the setting, the thread that started the engine
    (SGLang's scheduler) on the others, and a poster started by the loop on the loop's CPU."""
    kvfsm_cpu = ALLOWED[-1]
    set_thread_cpus([kvfsm_cpu])

    def run() -> tuple[set[int], set[int], set[int]]:
        with RoomEngine(LoopbackSink()) as engine:
            loop_thread = next(t for t in threading.enumerate() if t.name == "kvfsm-loop")
            poster: Poster[int] = Poster(lambda item: None, lambda batch: None)

            async def start_poster() -> None:
                poster.start(asyncio.get_running_loop())

            engine.call(start_poster())
            try:
                posted = cpus_of(poster._thread)
            finally:
                poster.close()
            return os.sched_getaffinity(0), cpus_of(loop_thread), posted

    starter, loop_cpus, poster_cpus = in_thread(run)
    assert loop_cpus == {kvfsm_cpu}
    assert poster_cpus == {kvfsm_cpu}
    assert starter == set(ALLOWED) - {kvfsm_cpu}


def test_a_setting_that_does_not_parse_stops_the_engine_from_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "two")
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match=f"{ENV}='two'"):
        in_thread(lambda: RoomEngine(LoopbackSink()).start())
    assert not [
        t for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvfsm")
    ]
