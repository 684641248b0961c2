"""A prefill-decode pair with status servers, under traffic, watched by ``kvfsm top``.

What an operator runs against their own ranks, shown on a pair this script runs itself:

* a bootstrap registry, a ``PrefillManager`` and a ``DecodeManager`` in this process, each with
  a status server (``ManagerConfig.status_port=0``: a free port) and metrics;
* traffic on a thread: rooms that move 32 pages (4 MiB) each and succeed, one in 7 aborted by
  prefill's caller, one in 11 aborted by decode's caller after it sent its page list, every 2 s
  a prefill room that no decode rank asks for (its Bootstrapping deadline is cut to 8 s here,
  so these expire while you watch), and two decode rooms whose prefill side never comes (they
  wait in Transferring throughout);
* after ``--seconds`` of it, ``kvfsm top --once`` on both status servers, printed here.

``--live`` runs ``kvfsm top`` live instead, until Ctrl-C. ``--svg FILE`` writes the frame as an
SVG; the screenshot in docs/operations.md is made with

    python examples/top_pair.py --svg docs/images/kvfsm-top.svg

No GPU needed: NIXL's UCX backend moves DRAM. Ends with ``top_pair: OK`` (exit status 0), or
says what went wrong and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np

from kvfsm import KVPoll
from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.registry import BootstrapServer
from kvfsm.rooms import RoomConfig
from kvfsm.states import TERMINAL, Role
from kvfsm.workload.buffers import Shape, make_buffers, make_layout

ENGINE = "top-pair"
SHAPE = Shape(layers=4, num_pages=1024, page_bytes=16384, aux_rows=64, aux_row_bytes=128)
PAGES_PER_ROOM = 32
#: Destination page slots for moving rooms; the last pages are the waiting rooms'.
SLOTS = 30
CONFIG = ManagerConfig(
    status_port=0,
    metrics=True,
    # Heartbeats measure each link's round trip, and go out only on a link idle for this long:
    # short, so that the links have a round trip before the traffic keeps them busy.
    channel=ChannelConfig(heartbeat_s=0.25),
    # Short, so that a room nobody asks for expires in a few seconds, not five minutes.
    rooms=RoomConfig(deadlines={Role.SENDER: {KVPoll.Bootstrapping: 8.0}}),
)


@contextlib.contextmanager
def registry() -> Iterator[str]:
    """The bootstrap registry on its own event loop thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server.url
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


class Traffic:
    """Rooms one after another, some of them failing, until stopped."""

    def __init__(self, prefill: PrefillManager, decode: DecodeManager) -> None:
        self.prefill, self.decode = prefill, decode
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.rooms = 0
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def open(self) -> None:
        """Two decode rooms that wait for prefill all along (the oldest rooms in kvfsm top); the
        first opens the control link."""
        for room, first in ((1, SLOTS * PAGES_PER_ROOM), (2, SLOTS * PAGES_PER_ROOM + 4)):
            receiver = self.decode.receiver(room)
            receiver.init(0)
            if wait(lambda r=receiver: r.poll() is KVPoll.WaitingForInput):
                receiver.send_metadata(np.arange(first, first + 4, dtype=np.int32), 60 + room)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        room = 100
        orphan_at = 0.0
        while not self.stop.is_set():
            room += 1
            if time.monotonic() >= orphan_at:  # a prefill room no decode rank asks for
                self.prefill.sender(room)
                orphan_at = time.monotonic() + 2.0
                continue
            try:
                self._one(room)
            except Exception as exc:  # keep going: the view is what this script is for
                self.problems.append(f"room {room}: {exc!r}")
            self.rooms += 1

    def _one(self, room: int) -> None:
        slot = room % SLOTS
        pages = np.arange(slot * PAGES_PER_ROOM, (slot + 1) * PAGES_PER_ROOM, dtype=np.int32)
        receiver, sender = self.decode.receiver(room), self.prefill.sender(room)
        receiver.init(0)
        if not wait(lambda: receiver.poll() is KVPoll.WaitingForInput):
            self.problems.append(f"room {room}: decode stayed {receiver.poll().name}")
        receiver.send_metadata(pages, slot)
        wait(lambda: sender.poll() is not KVPoll.Bootstrapping)
        if room % 7 == 0:
            sender.abort("client went away")
        elif room % 11 == 0:
            receiver.abort("client went away")
        else:
            sender.init(PAGES_PER_ROOM, slot)
            half = PAGES_PER_ROOM // 2
            sender.send(pages[:half])
            sender.send(pages[half:])
        if not wait(lambda: receiver.poll() in TERMINAL and sender.poll() in TERMINAL):
            self.problems.append(f"room {room}: {sender.poll().name}/{receiver.poll().name}")
        sender.clear()
        receiver.clear()


def links_timed(urls: list[str]) -> bool:
    """Whether every control link of these status servers has a round trip (``rtt_ms``)."""
    for url in urls:
        with urllib.request.urlopen(f"{url}/links", timeout=5) as response:
            links = json.loads(response.read())
        if not links or any(link.get("rtt_ms") is None for link in links):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="traffic before the frame")
    parser.add_argument("--svg", help="also write the frame as an SVG")
    parser.add_argument("--live", action="store_true", help="run kvfsm top live until Ctrl-C")
    args = parser.parse_args(argv)
    # Rooms fail here on purpose, hundreds a second: their JSON lines (one per failed room, for
    # an operator's logs) would bury the frame.
    logging.getLogger("kvfsm.rooms.failed").setLevel(logging.ERROR)
    kv, aux = make_buffers(SHAPE)
    dst_kv, dst_aux = make_buffers(SHAPE)
    with registry() as url:
        prefill = PrefillManager(make_layout(kv, aux), url, engine_id=ENGINE, config=CONFIG)
        decode = DecodeManager(make_layout(dst_kv, dst_aux), url, engine_id=ENGINE, config=CONFIG)
        traffic = Traffic(prefill, decode)
        status = 1
        try:
            assert prefill.status is not None
            assert decode.status is not None
            urls = [prefill.status.url, decode.status.url]
            print(f"status servers: prefill {urls[0]}, decode {urls[1]}", flush=True)
            traffic.open()
            # Each link has a round trip once both sides heard a heartbeat echoed (a second or
            # two); until then kvfsm top shows a dash for it.
            measured_by = time.monotonic() + 10
            while not links_timed(urls) and time.monotonic() < measured_by:
                time.sleep(0.05)
            traffic.start()
            top = [sys.executable, "-m", "kvfsm", "top", *urls]
            if args.svg:
                top += ["--svg", args.svg]
            if args.live:
                try:
                    status = subprocess.run(top, check=False).returncode
                except KeyboardInterrupt:
                    status = 0  # Ctrl-C reached kvfsm top too: how a live view is left
            else:
                time.sleep(args.seconds)  # traffic for the rates and some expired rooms
                once = [*top, "--once", "--interval", "2", "--width", "118"]
                status = subprocess.run(once, check=False).returncode
        finally:
            traffic.join()
            decode.close()
            prefill.close()
    print(f"{traffic.rooms} rooms run", flush=True)
    problems = traffic.problems + ([] if status == 0 else [f"kvfsm top exited {status}"])
    for problem in problems[:10]:
        print(f"PROBLEM: {problem}")
    print("top_pair: OK" if not problems else "top_pair: FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
