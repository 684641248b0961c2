"""How long prefill rooms wait for a decode that is gone, with production settings.

A prefill rank and a decode rank, each in its own OS process (engine, control plane, fenced NIXL
over DRAM, ``ChannelConfig()`` defaults: 1 s heartbeat, lost after 2 s of silence). Decode
claims ``--rooms`` rooms; prefill has a sender for each, half of them with decode's page list
(WaitingForInput), half without (Bootstrapping: before claims, these waited out the 300 s
Bootstrapping deadline). Then decode is SIGKILLed (its sockets close at once) or SIGSTOPped
(silence: the liveness window). Reported: seconds from the signal until every prefill room is
terminal, and until every one is settled, against the bound ``2 * heartbeat_s + 1``.

Run: ``python benchmarks/peer_loss.py`` (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from _rank import start_rank  # benchmarks/ is the script's directory: on sys.path

from kvfsm._child import ChildProcess
from kvfsm.control import ChannelConfig
from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.states import TERMINAL, KVPoll
from kvfsm.workload.buffers import Shape

SHAPE = Shape(layers=2, num_pages=1024, page_bytes=1024, aux_rows=256, aux_row_bytes=64)
CHANNEL = ChannelConfig()


def _prefill(conn: Connection) -> None:
    rank = start_rank(SHAPE, CHANNEL, name="loss-prefill")
    engine, control = rank.engine, rank.control
    conn.send(control.port)
    senders: dict[int, SenderRoom] = {}
    while True:
        request: Any = conn.recv()
        if request[0] == "quit":
            break
        if request[0] == "create":
            for room in request[1]:
                senders[room] = engine.sender(room)
            conn.send(True)
        elif request[0] == "states":
            conn.send([int(s.poll()) for s in senders.values()])
        elif request[0] == "watch":  # the time every room was terminal, then settled
            give_up = time.monotonic() + request[1]
            terminal = settled = None
            while time.monotonic() < give_up and settled is None:
                now = time.monotonic()
                if terminal is None and all(s.poll() in TERMINAL for s in senders.values()):
                    terminal = now
                if terminal is not None and all(s.settled for s in senders.values()):
                    settled = now
                time.sleep(0.001)
            reasons = sorted(
                {
                    s.reason.split(":")[0] + ":" + s.reason.split(":")[1]
                    for s in senders.values()
                    if s.reason
                }
            )
            conn.send((terminal, settled, reasons))
    rank.close()


def _decode(conn: Connection, port: int) -> None:
    rank = start_rank(SHAPE, CHANNEL, name="loss-decode", port=port)
    engine = rank.engine
    conn.send(True)
    receivers: dict[int, ReceiverRoom] = {}
    while True:
        request: Any = conn.recv()
        if request[0] == "quit":
            break
        if request[0] == "claim":
            for room in request[1]:
                receivers[room] = receiver = engine.receiver(room)
                receiver.init(0)
            conn.send(True)
        elif request[0] == "metadata":
            for room in request[1]:
                receiver = receivers[room]
                while receiver.poll() is KVPoll.Bootstrapping:
                    time.sleep(0.001)
                receiver.send_metadata(np.arange(4 * room, 4 * room + 4), room)
            conn.send(True)
    rank.close()


def trial(rooms: int, how: str) -> dict[str, Any]:
    prefill = ChildProcess(_prefill, what="prefill")
    decode = ChildProcess(_decode, prefill.greeting, what="decode")
    try:
        ids = list(range(rooms))
        prefill.ask("create", ids)
        decode.ask("claim", ids)
        decode.ask("metadata", ids[: rooms // 2])
        give_up = time.monotonic() + 30
        while True:
            states = prefill.ask("states")
            waiting = states.count(int(KVPoll.WaitingForInput))
            if waiting == rooms // 2 or time.monotonic() > give_up:
                break
            time.sleep(0.01)
        before = {
            "bootstrapping": states.count(int(KVPoll.Bootstrapping)),
            "waiting_for_input": waiting,
        }
        time.sleep(CHANNEL.heartbeat_s)  # the claims are in, the link is quiet
        signalled = time.monotonic()
        os.kill(decode.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        terminal, settled, reasons = prefill.ask("watch", 60.0, timeout=90)
    finally:
        if how == "sigstop":
            os.kill(decode.pid, signal.SIGCONT)
        decode.kill()
        prefill.close()
    return {
        "signal": how,
        "rooms": before,
        "all_terminal_after_s": None if terminal is None else round(terminal - signalled, 3),
        "all_settled_after_s": None if settled is None else round(settled - signalled, 3),
        "bound_s": 2 * CHANNEL.heartbeat_s + 1.0,
        "reasons": reasons,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rooms", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = [trial(args.rooms, how) for how in ("sigkill", "sigstop")]
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(
                f"decode {r['signal']}: {r['rooms']} prefill rooms all terminal after "
                f"{r['all_terminal_after_s']} s, settled after {r['all_settled_after_s']} s "
                f"(bound {r['bound_s']} s); reasons {r['reasons']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
