"""Decode prefix caching with real SGLang 0.5.23 servers on this CPU machine: a prefill server, a
decode server with ``--disaggregation-decode-enable-radix-cache`` (both served by kvfsm), SGLang's
router, and a non-disaggregated reference server with the same dummy weights (the reference and
prefill servers are the e2e package's shared ones, ``conftest.py``).

Requests go one at a time, so decode's radix cache holds the earlier prompts when the later ones
come: a prompt that extends an earlier one (decode holds its first part), the same prompt again
(a full hit: no KV page moves, only the aux row), and one that shares only a short prefix. Each
one's greedy output must equal the reference server's, and prefill's own transfer metric
(``sglang:kv_transfer_total_mb``, from kvfsm's ``get_transfer_metric``) must show that only the
tokens past decode's prefix moved.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.servers import (
    COMMON_FLAGS,
    DECODE_FLAGS,
    FAILED,
    Server,
    SharedPrefill,
    body,
    get_text,
    keep_logs_if_failed,
    metric_sum,
    post_json,
    router,
    sglang_server,
    stop_all,
)
from tests.helpers.waiting import wait_until_sync

pytestmark = pytest.mark.timeout(900)

VOCAB = 512
MAX_NEW = 8


@dataclass
class Rig:
    reference: Server
    prefill: Server
    decode: Server
    router: Server


def _decode_with_radix_cache(model: Path, log_dir: Path) -> Server:
    """The decode server, its radix cache on (``COMMON_FLAGS`` turn it off for the others)."""
    server = sglang_server(
        "decode", model, log_dir, *DECODE_FLAGS, "--disaggregation-decode-enable-radix-cache",
        kvfsm=True,
    )  # fmt: skip
    assert "--disable-radix-cache" in COMMON_FLAGS
    server.argv.remove("--disable-radix-cache")
    return server


@pytest.fixture(scope="module")
def rig(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    llama: SharedPrefill,
) -> Iterator[Rig]:
    """The worker's shared reference and prefill servers (``conftest.py``), with this
    module's own decode server (radix cache on) and router."""
    log_dir = tmp_path_factory.mktemp("sglang-e2e-prefix")
    decode = _decode_with_radix_cache(llama.model, log_dir)
    front = router(log_dir, llama.prefill, llama.bootstrap_port, decode)
    started: list[Server] = []
    try:
        # Launched together with the shared servers' start (the first module) and each other:
        # the router checks its workers' health again every few seconds.
        for server in (decode, front):
            started.append(server)
            server.start()
        llama.ready()
        decode.wait_ready()
        front.wait_ready()
        wait_until_sync(
            lambda: _serves(front),
            timeout=120,
            interval=1.0,
            message="the router to route to the pair",
        )
        yield Rig(llama.reference, llama.prefill, decode, front)
    finally:
        stop_all(list(reversed(started)))
        keep_logs_if_failed(request, log_dir, request.node.stash.get(FAILED, False))


def _serves(front: Server) -> bool:
    try:
        out = post_json(front.url + "/generate", body([5, 6, 7, 8], 2), timeout=60)
    except OSError:
        return False
    return isinstance(out, dict) and len(out.get("output_ids", [])) == 2


def _generate(url: str, ids: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = post_json(url + "/generate", body(ids, MAX_NEW), timeout=300)
    return out


def _transferred_mb(rig: Rig) -> tuple[float, float]:
    text = get_text(rig.prefill.url + "/metrics")
    return (
        metric_sum(text, "sglang:kv_transfer_total_mb_sum"),
        metric_sum(text, "sglang:kv_transfer_total_mb_count"),
    )


def _moved_mb(rig: Rig, ids: list[int]) -> tuple[list[int], float]:
    """Send ``ids`` through the PD pair; its output, and the MB prefill sent for it."""
    mb, count = _transferred_mb(rig)
    out = _generate(rig.router.url, ids)
    # Prefill records the metric when its room succeeded, after the response may have come.
    wait_until_sync(
        lambda: _transferred_mb(rig)[1] > count,
        timeout=60,
        interval=0.05,
        message="prefill to record a transfer for the request",
    )
    mb_after, count_after = _transferred_mb(rig)
    assert count_after == count + 1
    return list(out["output_ids"]), mb_after - mb


def test_only_the_tokens_past_decodes_prefix_move_and_outputs_equal_the_reference(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(29)
    base = [rng.randrange(3, VOCAB) for _ in range(240)]
    prompts = {
        "first": base,
        "extends it": base + [rng.randrange(3, VOCAB) for _ in range(48)],
        "full hit": list(base),
        "short shared prefix": base[:32] + [rng.randrange(3, VOCAB) for _ in range(160)],
    }
    moved: dict[str, float] = {}
    for name, ids in prompts.items():
        want = list(_generate(rig.reference.url, ids)["output_ids"])
        got, moved[name] = _moved_mb(rig, ids)
        assert got == want, (name, got, want)
    # A full hit moves the aux row only; every other request moves the aux row plus the KV of
    # the tokens decode's cache lacks: all 240 of the first prompt, then 48, then 160.
    aux = moved["full hit"]
    per_token = (moved["first"] - aux) / 240
    with capsys.disabled():
        sent = {k: round(v * 2**20) for k, v in moved.items()}
        print(f"\ndecode prefix e2e: bytes prefill sent per request: {sent}")
    assert per_token > 0, moved
    assert aux < per_token * 64, moved  # an aux row, not a prompt's KV
    assert (moved["extends it"] - aux) / per_token == pytest.approx(48, abs=0.5), moved
    assert (moved["short shared prefix"] - aux) / per_token == pytest.approx(160, abs=0.5), moved
