"""Model families beyond Llama as PD pairs of real SGLang 0.5.23 servers on this CPU machine,
with kvfsm as the transfer backend: an MLA model (DeepSeek-V2-style latent KV), a hybrid
sliding-window model (SGLang's SWA memory pool, whose rows move as the ``swa`` state type) and a
hybrid linear-state model (ZAYA1: its attention's convolution state lives in SGLang's Mamba
pool, one slot per request, and moves as the ``mamba`` state type).

Per model (``shapes_probe``'s configs, dummy weights): a non-disaggregated reference server, a
prefill server and a decode server, started together. 20 requests of random prompt lengths (the
longest past the sliding window) go to the pair directly, as SGLang's router sends them, at
once; every greedy output must equal the reference server's, the outputs must differ between
prompts (so equality says something), and both kvfsm ranks must count the rooms as succeeded.

Greedy equality alone cannot show that a state slot moved: with dummy weights a model's outputs
may not depend on it. So the ZAYA1 pair also runs SGLang's own KV checksum
(``--disaggregation-enable-kv-checksum``, digested on the CPU by the rig's shim): prefill
digests the KV pages and the Mamba-pool slot it sends, decode digests what landed in its own
page and slot before the request runs, and any difference fails the request with SGLang's "KV
checksum mismatch". The decode's log must show that its digest covered state buffers.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.e2e.servers import (
    DECODE_FLAGS,
    FAILED,
    Server,
    body,
    free_port,
    keep_logs_if_failed,
    kvfsm_stats,
    prefill_flags,
    sglang_server,
    stop_all,
)
from tests.e2e.shapes_probe import HYBRID_FLAGS, MLA_CONFIG, SWA_CONFIG, ZAYA_CONFIG
from tests.e2e.shim.kvfsm_e2e_cpu_checksum import COVERS, ENABLE_ENV

pytestmark = pytest.mark.timeout(900)

#: name -> (model config, extra flags every server of the model takes, whether the pair runs
#: SGLang's KV checksum)
MODELS: dict[str, tuple[dict[str, Any], list[str], bool]] = {
    "mla": (MLA_CONFIG, [], False),
    "swa": (SWA_CONFIG, [], False),
    "zaya": (ZAYA_CONFIG, HYBRID_FLAGS, True),
}
CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"
MISMATCH, SKIPPED = "KV checksum mismatch", "KV checksum skipped"
REQUESTS, MAX_NEW, VOCAB = 20, 8, 512


@dataclass
class Pair:
    reference: Server
    prefill: Server
    decode: Server
    bootstrap_port: int
    checksum: bool


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    name = request.param
    log_dir = tmp_path_factory.mktemp(f"sglang-e2e-{name}")
    model = log_dir / "model"
    model.mkdir()
    config, flags, checksum = MODELS[name]
    (model / "config.json").write_text(json.dumps(config))
    bootstrap = free_port()
    pd = [CHECKSUM_FLAG] if checksum else []
    # SGLang's CI mode turns a mismatch into a crash of the decode scheduler; the check wants a
    # decode that answers it.
    env = {ENABLE_ENV: "1", "SGLANG_IS_IN_CI": "false"} if checksum else {}
    servers = [
        sglang_server("reference", model, log_dir, *flags),
        sglang_server(
            "prefill", model, log_dir, *flags, *pd, *prefill_flags(bootstrap), kvfsm=True, env=env
        ),
        sglang_server("decode", model, log_dir, *flags, *pd, *DECODE_FLAGS, kvfsm=True, env=env),
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        reference, prefill, decode = servers
        yield Pair(reference, prefill, decode, bootstrap, checksum)
    finally:
        stop_all(list(reversed(servers)))
        keep_logs_if_failed(request, log_dir, request.node.stash.get(FAILED, False))


async def _both(pair: Pair, prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """Every prompt through the reference server and through the PD pair, all at once; the
    pair's as the router sends them: the same body, with a room id, to both servers."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def post(server: Server, payload: dict[str, Any]) -> list[int]:
            async with s.post(server.url + "/generate", json=payload) as resp:
                assert resp.status == 200, await resp.text()
                out: list[int] = (await resp.json())["output_ids"]
                return out

        async def pd(ids: list[int]) -> list[int]:
            extra = {
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": pair.bootstrap_port,
                "bootstrap_room": random.getrandbits(62),
            }
            payload = body(ids, MAX_NEW, **extra)
            _, out = await asyncio.gather(post(pair.prefill, payload), post(pair.decode, payload))
            return out

        ref = asyncio.gather(*(post(pair.reference, body(p, MAX_NEW)) for p in prompts))
        got = asyncio.gather(*(pd(p) for p in prompts))
        return await asyncio.gather(ref, got)


def test_pd_outputs_equal_the_reference_server(pair: Pair) -> None:
    rng = random.Random(17)
    prompts = [
        [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 200))] for _ in range(REQUESTS)
    ]
    before = {s.name: kvfsm_stats(s)["rooms"] for s in (pair.prefill, pair.decode)}
    want, got = asyncio.run(_both(pair, prompts))
    assert len({tuple(o) for o in want}) > 1, "outputs do not depend on the prompt"
    mismatched = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
    assert not mismatched, [(len(prompts[i]), want[i], got[i]) for i in mismatched[:3]]
    for server in (pair.prefill, pair.decode):
        rooms = kvfsm_stats(server)["rooms"]
        assert rooms["succeeded"] - before[server.name]["succeeded"] >= REQUESTS, rooms
        assert rooms["failed"] == before[server.name]["failed"], rooms
    if pair.checksum:
        log = pair.decode.log_path.read_text(errors="replace")
        assert MISMATCH not in log
        assert SKIPPED not in log  # (a digest decode did not compare)
        covers = [line for line in log.splitlines() if COVERS in line]
        assert covers, "decode's digest never covered a state item"
        assert " 0 state buffers" not in covers[0], covers
