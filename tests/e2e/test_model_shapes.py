"""Model families beyond Llama as PD pairs of real SGLang 0.5.23 servers on this CPU machine,
with kvfsm as the transfer backend: an MLA model (DeepSeek-V2-style latent KV) and a hybrid
sliding-window model (SGLang's SWA memory pool, whose rows move as the ``swa`` state type).

Per model (``shapes_probe``'s configs, dummy weights): a non-disaggregated reference server, a
prefill server and a decode server, started together. 20 requests of random prompt lengths (the
longest past the sliding window) go to the pair directly, as SGLang's router sends them, at
once; every greedy output must equal the reference server's, the outputs must differ between
prompts (so equality says something), and both kvfsm ranks must count the rooms as succeeded.
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
from tests.e2e.shapes_probe import MLA_CONFIG, SWA_CONFIG

pytestmark = pytest.mark.timeout(900)

MODELS: dict[str, dict[str, Any]] = {"mla": MLA_CONFIG, "swa": SWA_CONFIG}
REQUESTS, MAX_NEW, VOCAB = 20, 8, 512


@dataclass
class Pair:
    reference: Server
    prefill: Server
    decode: Server
    bootstrap_port: int


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    name = request.param
    log_dir = tmp_path_factory.mktemp(f"sglang-e2e-{name}")
    model = log_dir / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODELS[name]))
    bootstrap = free_port()
    servers = [
        sglang_server("reference", model, log_dir),
        sglang_server("prefill", model, log_dir, *prefill_flags(bootstrap), kvfsm=True),
        sglang_server("decode", model, log_dir, *DECODE_FLAGS, kvfsm=True),
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield Pair(*servers, bootstrap)
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
