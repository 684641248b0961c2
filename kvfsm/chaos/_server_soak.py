"""The soak's samples: prefill's and decode's RSS and open file descriptors (their whole
process groups), read every ``every_s`` beside the count of requests ended so far, and their
growth per 1,000 requests (:func:`growth`, pure).

A server the campaign restarted starts from nothing again, so growth is read per incarnation
(``start``: the server's start number) and reported for each server's longest-lived one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Sample", "Sampler", "growth"]


@dataclass(frozen=True)
class Sample:
    t_s: float
    server: str
    start: int
    requests: int
    rss: int
    fds: int


def growth(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Per server: RSS (bytes) and fds grown per 1,000 requests over its longest incarnation
    with at least two samples and some requests between them (absent if none has)."""
    out: dict[str, dict[str, Any]] = {}
    by: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        by.setdefault((s.server, s.start), []).append(s)
    best: dict[str, list[Sample]] = {}
    for (server, _), run in by.items():
        run.sort(key=lambda s: s.t_s)
        served = run[-1].requests - run[0].requests
        if len(run) < 2 or served <= 0:
            continue
        kept = best.get(server)
        if kept is None or served > kept[-1].requests - kept[0].requests:
            best[server] = run
    for server, run in best.items():
        first, last = run[0], run[-1]
        served = last.requests - first.requests
        out[server] = {
            "requests": served,
            "minutes": round((last.t_s - first.t_s) / 60, 1),
            "samples": len(run),
            "rss_mib_first": round(first.rss / 2**20, 1),
            "rss_mib_last": round(last.rss / 2**20, 1),
            "rss_kib_per_1000_requests": round((last.rss - first.rss) / 1024 / served * 1000, 1),
            "fds_first": first.fds,
            "fds_last": last.fds,
            "fds_per_1000_requests": round((last.fds - first.fds) / served * 1000, 2),
        }
    return out


class Sampler:
    """Calls ``read()`` (a list of (server, start, rss, fds)) every ``every_s`` in a daemon
    thread, with ``done()`` (requests ended so far), until :meth:`stop`."""

    def __init__(
        self,
        read: Callable[[], list[tuple[str, int, int, int]]],
        done: Callable[[], int],
        epoch: float,
        every_s: float = 60.0,
    ) -> None:
        self.samples: list[Sample] = []
        self._read, self._done, self._epoch, self._every = read, done, epoch, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._take()

    def _take(self) -> None:
        now, done = time.monotonic() - self._epoch, self._done()
        for server, start, rss, fds in self._read():
            self.samples.append(Sample(round(now, 1), server, start, done, rss, fds))

    def _run(self) -> None:
        self._take()
        while not self._stop.wait(self._every):
            self._take()
