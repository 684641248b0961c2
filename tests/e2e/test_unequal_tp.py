"""Unequal attention TP with real SGLang 0.5.23 servers on this CPU machine: a prefill server
with ``--tp 2`` (two scheduler processes, one KV head each of the test model's two), a decode
server with ``--tp 1`` (both heads), SGLang's router, and a non-disaggregated reference server.

Each decode request hears from both prefill ranks, each writing its head into its half of every
row of decode's pages (``docs/heterogeneous-tp.md``). The greedy outputs must equal the
reference server's: a head slice written in the wrong place, or not at all, changes them. Both
prefill ranks must have moved KV, and decode must have received every room from both.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.servers import (
    DECODE_FLAGS,
    FAILED,
    Server,
    free_port,
    get_json,
    post_json,
    prefill_flags,
    router,
    sglang_server,
    write_model,
)
from tests.e2e.test_sglang_servers import body

pytestmark = pytest.mark.timeout(900)

VOCAB = 512
MAX_NEW = 8


@dataclass
class Rig:
    reference: Server
    prefill: Server
    decode: Server
    router: Server


@pytest.fixture(scope="module")
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    log_dir = tmp_path_factory.mktemp("sglang-e2e-tp")
    model = write_model(log_dir / "model")
    bootstrap = free_port()
    reference = sglang_server("reference", model, log_dir)
    # SGLang's CPU backend binds each TP rank's OpenMP threads to cores; without a binding it
    # wants a NUMA node per rank, and this machine has one.
    prefill = sglang_server(
        "prefill",
        model,
        log_dir,
        *prefill_flags(bootstrap),
        "--tp",
        "2",
        kvfsm=True,
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
    )
    decode = sglang_server("decode", model, log_dir, *DECODE_FLAGS, kvfsm=True)
    front = router(log_dir, prefill, bootstrap, decode)
    started: list[Server] = []
    try:
        for group in ([reference, prefill, decode], [front]):
            for server in group:
                server.start()
                started.append(server)
            for server in group:
                server.wait_ready()
        deadline = time.monotonic() + 120
        while not _serves(front):
            assert time.monotonic() < deadline, "the router never routed to the pair"
            time.sleep(1.0)
        yield Rig(reference, prefill, decode, front)
    finally:
        for server in reversed(started):
            server.stop()
        if request.node.stash.get(FAILED, False):
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"sglang e2e logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)


def _serves(front: Server) -> bool:
    try:
        out = post_json(front.url + "/generate", body([5, 6, 7, 8], 2), timeout=60)
    except OSError:
        return False
    return isinstance(out, dict) and len(out.get("output_ids", [])) == 2


def _generate(url: str, ids: list[int]) -> list[int]:
    out = post_json(url + "/generate", body(ids, MAX_NEW), timeout=300)
    return list(out["output_ids"])


def _succeeded(status_url: str) -> int:
    stats = get_json(status_url + "/stats")
    return int(stats["rooms"]["succeeded"])


def test_two_prefill_ranks_feed_one_decode_rank_and_outputs_equal_the_reference(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each prefill rank serves its status on KVFSM_STATUS_PORT + its rank.
    assert rig.prefill.status_port is not None
    assert rig.decode.status_port is not None
    ranks = [f"http://127.0.0.1:{rig.prefill.status_port + r}" for r in (0, 1)]
    decode = rig.decode.status_url
    before = [_succeeded(url) for url in ranks]
    decode_before = _succeeded(decode)
    rng = random.Random(41)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (17, 64, 130, 200, 33)]
    for ids in prompts:
        want = _generate(rig.reference.url, ids)
        got = _generate(rig.router.url, ids)
        assert got == want, (len(ids), got, want)
    served = [_succeeded(url) - b for url, b in zip(ranks, before, strict=True)]
    legs = _succeeded(decode) - decode_before
    with capsys.disabled():
        print(f"\nunequal TP e2e: rooms per prefill rank {served}, decode legs {legs}")
    # Every request was one room on each prefill rank and two legs on decode, one per rank.
    assert served == [len(prompts), len(prompts)], served
    assert legs == 2 * len(prompts), legs
