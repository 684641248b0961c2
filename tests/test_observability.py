"""What an operator sees of a running pair: live rooms with their deadlines, counters, Prometheus
metrics, structured log records, and ``kvfsm rooms``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm import KVPoll
from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.metrics import reason_kind
from kvfsm.states import TERMINAL
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.registry import running_registry
from tests.helpers.waiting import wait_until_sync

CONFIG = ManagerConfig(
    channel=ChannelConfig(heartbeat_s=0.25), register_interval_s=0.5, status_port=0, metrics=True
)


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    """A real bootstrap registry in its own process."""
    with running_registry(ttl_s=3) as url:
        yield url


@pytest.fixture
def pair(registry: str) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    src_kv, src_aux = make_buffers(SHAPE)
    fill_sources(src_kv, src_aux)
    dst_kv, dst_aux = make_buffers(SHAPE)
    prefill = PrefillManager(make_layout(src_kv, src_aux), registry, engine_id="t", config=CONFIG)
    decode = DecodeManager(make_layout(dst_kv, dst_aux), registry, engine_id="t", config=CONFIG)
    yield prefill, decode
    decode.close()
    prefill.close()


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def test_live_rooms_metrics_and_the_rooms_command(
    pair: tuple[PrefillManager, DecodeManager], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = pair
    assert prefill.status is not None
    assert decode.status is not None
    # One room completes; one is left waiting on decode's side; one fails.
    done_r, done_s = decode.receiver(1), prefill.sender(1)
    done_r.init(0)
    wait_until_sync(lambda: done_r.poll() is KVPoll.WaitingForInput, timeout=10)
    done_r.send_metadata(np.asarray([5, 6], np.int32), 0)
    wait_until_sync(lambda: done_s.poll() is KVPoll.WaitingForInput, timeout=10)
    done_s.init(2, 1)
    done_s.send([1, 2])
    wait_until_sync(lambda: done_r.poll() in TERMINAL, timeout=10)
    assert done_r.poll() is KVPoll.Success
    waiting = decode.receiver(2)
    waiting.init(0)
    with caplog.at_level(logging.INFO, logger="kvfsm.rooms"):
        failing = prefill.sender(3)
        failing.abort("operator test")
        wait_until_sync(lambda: prefill.stats()["rooms"]["failed"] >= 1, timeout=10)
    wait_until_sync(lambda: waiting.poll() is KVPoll.WaitingForInput, timeout=10)

    rows = json.loads(get(decode.status.url + "/rooms"))
    live = [r for r in rows if r["room"] == 2]
    assert live
    assert live[0]["state"] == "WaitingForInput"
    assert live[0]["role"] == "receiver"
    assert 0 < live[0]["deadline_in_s"] <= 300

    text = get(prefill.status.url + "/metrics").decode()
    assert (
        'kvfsm_transitions_total{from_state="Transferring",role="sender",to_state="Success"}'
        in text
    )
    assert 'kvfsm_failures_total{kind="aborted (local)",role="sender"}' in text
    assert "kvfsm_bytes_total" in text
    assert "kvfsm_chunk_seconds_bucket" in text
    stats = json.loads(get(prefill.status.url + "/stats"))
    assert stats["rooms"]["succeeded"] >= 1
    assert "control" in stats
    # Prefill's data path, and whether its agent was fenced out (None: it was not).
    assert stats["transport"]["chunks_done"] >= 1
    assert stats["transport"]["fenced_out"] == 0
    assert stats["fenced_out"] is None
    # Every kvfsm thread is named, in the OS too (what top -H and py-spy show).
    threads = {row["name"]: row for row in stats["threads"]}
    assert any(name.startswith("kvfsm-loop-p") for name in threads), threads
    assert any(name.startswith("kvfsm-loop-d") for name in threads), threads
    assert "kvfsm-poster" in threads
    for name, row in threads.items():
        with open(f"/proc/self/task/{row['native_id']}/comm") as comm:
            assert comm.read().strip() == name[:15]

    record = next(r for r in caplog.records if getattr(r, "room", None) == 3)
    assert record.to_state == "Failed"
    assert record.role == "sender"
    assert "operator test" in record.reason  # type: ignore[attr-defined]

    shown = subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "rooms", "--url", decode.status.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "WaitingForInput" in shown
    assert "live rooms" in shown


def test_reason_kinds_strip_numbers() -> None:
    assert reason_kind("chunk 12 stalled: no progress") == "chunk # stalled"
    assert reason_kind("deadline expired: Bootstrapping for more than 300s") == "deadline expired"
    assert reason_kind("") == "unknown"
