"""Real SGLang 0.5.23 servers on this CPU machine, with kvfsm as their KV transfer backend.

A prefill server and a decode server (``KVFSM_SGLANG=1``: SGLang's ``nixl`` backend is served
by kvfsm), SGLang's router in PD mode in front of them, and one non-disaggregated reference
server with the same dummy weights (``servers.py``). The reference and prefill servers are the
e2e package's shared ones (``conftest.py``); the decode server and router are this module's.
Checks:

* greedy output ids through the PD pair equal the reference server's, for every one of 200
  concurrent requests of random prompt lengths;
* the comparison can fail: the prefill's next transfer, armed to be corrupted at the source
  (kvfsm's own NIXL interposition hook, ``shim/kvfsm_e2e_corrupt.py``), gives different output;
* client disconnects and SGLang's ``/abort_request`` leave no kvfsm room on either server;
* SGLang's transfer metrics are non-zero with kvfsm;
* decode retraction (``/pause_generation`` with ``mode: retract``): prefill recomputes every
  retracted request and each finishes with the reference's tokens;
* decode killed under load: prefill's rooms all end by peer loss (not by a deadline), and a
  restarted decode serves again through the router.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.servers import (
    DECODE_FLAGS,
    FAILED,
    LIVENESS_S,
    Server,
    SharedPrefill,
    body,
    get_json,
    get_text,
    keep_logs_if_failed,
    kvfsm_stats,
    metric_sum,
    post_json,
    router,
    sglang_server,
    stop_all,
)
from tests.helpers.waiting import wait_until_sync

pytestmark = pytest.mark.timeout(900)

#: What the corrupting proxy (``shim/kvfsm_e2e_corrupt.py``) logs for each transfer it corrupts.
CORRUPTED = "kvfsm-e2e: corrupted"

VOCAB = 512
MAX_NEW = 8
REQUESTS = 200
SEED = 13

FIGURES: dict[str, Any] = {}


def prompt(rng: random.Random, low: int = 4, high: int = 300) -> list[int]:
    # Token 0-2 are pad/bos/eos in the config: keep prompts to ordinary ids.
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))]


async def generate(
    session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int = MAX_NEW
) -> list[int]:
    async with session.post(url + "/generate", json=body(ids, max_new)) as resp:
        text = await resp.text()
        assert resp.status == 200, f"{url}: {resp.status} {text[:500]}"
        out: list[int] = (await resp.json())["output_ids"]
        return out


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    )


async def generate_all(url: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[Any]:
    async with session() as s:
        return await asyncio.gather(*(generate(s, url, p, max_new) for p in prompts))


def live_rooms(server: Server) -> int:
    rooms: dict[str, int] = kvfsm_stats(server)["rooms"]
    return rooms["live"]


# -- fixtures -----------------------------------------------------------------------------------


@dataclass
class Rig:
    log_dir: Path
    model: Path
    reference: Server
    prefill: Server
    decode: Server
    router: Server
    bootstrap_port: int
    #: Created to corrupt prefill's next KV transfer (the negative control); the transfer that
    #: corrupts takes it away.
    corrupt_next: Path
    started: list[Server] = field(default_factory=list)

    def reference_outputs(self, prompts: list[list[int]]) -> list[list[int]]:
        return asyncio.run(generate_all(self.reference.url, prompts))


def _router_serves(rig: Rig) -> bool:
    try:
        out = post_json(rig.router.url + "/generate", body([5, 6, 7, 8], 2), timeout=60)
    except OSError:
        return False
    return isinstance(out, dict) and len(out.get("output_ids", [])) == 2


@pytest.fixture(scope="module")
def rig(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    llama: SharedPrefill,
) -> Iterator[Rig]:
    """The worker's shared reference and prefill servers (``conftest.py``), with this
    module's own decode server and router."""
    log_dir = tmp_path_factory.mktemp("sglang-e2e")
    decode = sglang_server("decode", llama.model, log_dir, *DECODE_FLAGS, kvfsm=True)
    front = router(log_dir, llama.prefill, llama.bootstrap_port, decode)
    rig = Rig(
        log_dir,
        llama.model,
        llama.reference,
        llama.prefill,
        decode,
        front,
        llama.bootstrap_port,
        llama.corrupt_next,
    )
    began = time.monotonic()
    try:
        # Launched together with the shared servers' start (the first module) and each other:
        # the router checks its workers' health again every few seconds.
        for server in (decode, front):
            rig.started.append(server)
            server.start()
        llama.ready()
        decode.wait_ready()
        front.wait_ready()
        wait_until_sync(
            lambda: _router_serves(rig),
            timeout=120,
            interval=1.0,
            message="the router to route to the pair",
        )
        shared = (llama.reference, llama.prefill)
        FIGURES["startup_s"] = {s.name: round(s.startup_s[0], 1) for s in (*shared, *rig.started)}
        FIGURES["rig_ready_s"] = round(time.monotonic() - began, 1)
        yield rig
    finally:
        stop_all(list(reversed(rig.started)))
        FIGURES["module_s"] = round(time.monotonic() - began, 1)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\nsglang e2e figures: {FIGURES}")
        keep_logs_if_failed(request, log_dir, request.node.stash.get(FAILED, False))


# -- the checks ---------------------------------------------------------------------------------


def test_pd_output_equals_the_reference_server_for_every_request(rig: Rig) -> None:
    rng = random.Random(SEED)
    prompts = [prompt(rng) for _ in range(REQUESTS)]
    before = kvfsm_stats(rig.prefill)["rooms"]

    async def both() -> tuple[list[Any], list[Any]]:
        ref, pd = await asyncio.gather(
            generate_all(rig.reference.url, prompts), generate_all(rig.router.url, prompts)
        )
        return ref, pd

    began = time.monotonic()
    ref, pd = asyncio.run(both())
    FIGURES["requests"] = len(prompts)
    FIGURES["equal_outputs"] = sum(a == b for a, b in zip(ref, pd, strict=True))
    FIGURES["requests_wall_s"] = round(time.monotonic() - began, 1)
    # How long the decode side took to claim a request under this load: what prefill's
    # unclaimed bound (KVFSM_UNCLAIMED_S, 60 s) must stay well above.
    FIGURES["claim_wait_max_ms"] = kvfsm_stats(rig.prefill)["control"]["claim_wait_max_ms"]
    assert all(len(out) == MAX_NEW for out in pd)
    mismatched = [i for i, (a, b) in enumerate(zip(ref, pd, strict=True)) if a != b]
    assert not mismatched, (
        f"{len(mismatched)} of {len(prompts)} differ, first: prompt length "
        f"{len(prompts[mismatched[0]])}, reference {ref[mismatched[0]]}, PD {pd[mismatched[0]]}"
    )
    # Every request moved its KV through kvfsm (not SGLang's fake warm-up backend).
    after = kvfsm_stats(rig.prefill)["rooms"]
    assert after["succeeded"] - before["succeeded"] >= REQUESTS
    assert after["failed"] == before["failed"]
    assert len({tuple(o) for o in ref}) > 1, "outputs do not depend on the prompt"


def test_sglang_transfer_metrics_are_non_zero_with_kvfsm(rig: Rig) -> None:
    rng = random.Random(SEED + 1)
    asyncio.run(generate_all(rig.router.url, [prompt(rng, 64, 256) for _ in range(8)]))
    text = get_text(rig.prefill.url + "/metrics")
    for name in ("sglang:kv_transfer_speed_gb_s", "sglang:kv_transfer_latency_ms"):
        assert metric_sum(text, name + "_count") > 0, name
        assert metric_sum(text, name + "_sum") > 0, name
    FIGURES["kv_transfer_speed_gb_s_mean"] = round(
        metric_sum(text, "sglang:kv_transfer_speed_gb_s_sum")
        / metric_sum(text, "sglang:kv_transfer_speed_gb_s_count"),
        4,
    )


async def _pd_direct(prefill: Server, bootstrap: int, decode: Server, ids: list[int]) -> Any:
    """One request to a PD pair without the router, as the router sends it: the same body,
    with the prefill's bootstrap address and a room id, to both servers at once."""
    room = random.getrandbits(62)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
    async with session() as s:

        async def post(server: Server) -> Any:
            async with s.post(server.url + "/generate", json=body(ids, **extra)) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        _, out = await asyncio.gather(post(prefill), post(decode))
        return out["output_ids"]


def test_negative_control_a_corrupted_transfer_changes_the_output(rig: Rig) -> None:
    rng = random.Random(SEED + 2)
    first, second = prompt(rng, 200, 250), prompt(rng, 200, 250)
    ref_first, ref_second = rig.reference_outputs([first, second])
    marks = rig.prefill.log_path.read_text(errors="replace").count(CORRUPTED)
    rig.corrupt_next.touch()
    got_first = asyncio.run(_pd_direct(rig.prefill, rig.bootstrap_port, rig.decode, first))
    # That request's transfer took the arming file and corrupted its own source pages.
    assert not rig.corrupt_next.exists(), "no transfer claimed the armed corruption"
    assert rig.prefill.log_path.read_text(errors="replace").count(CORRUPTED) == marks + 1
    assert got_first != ref_first, "corrupted KV gave the reference output: the check is blind"
    # Only that transfer was corrupted: the same pair is otherwise exact.
    got_second = asyncio.run(_pd_direct(rig.prefill, rig.bootstrap_port, rig.decode, second))
    assert got_second == ref_second


class _Drained:
    """True once ``polls`` consecutive calls (``wait_until_sync``'s interval apart) read no
    live room on any server: requests still on their way would show up as new rooms between
    two reads."""

    def __init__(self, servers: list[Server], polls: int = 3) -> None:
        self.servers = servers
        self.polls = polls
        self.quiet = 0

    def __call__(self) -> bool:
        self.quiet = 0 if any(live_rooms(s) for s in self.servers) else self.quiet + 1
        return self.quiet >= self.polls


def test_disconnects_and_abort_requests_leave_no_kvfsm_room(rig: Rig) -> None:
    rng = random.Random(SEED + 3)
    pair = [rig.prefill, rig.decode]
    failed_before = kvfsm_stats(rig.decode)["rooms"]["failed"]

    async def disconnects() -> None:
        # The client gives up after a short, varied time: the router sees the connection go.
        async def one(i: int) -> None:
            timeout = aiohttp.ClientTimeout(total=0.05 + 0.1 * (i % 10))
            async with aiohttp.ClientSession(timeout=timeout) as s:
                try:
                    async with s.post(
                        rig.router.url + "/generate", json=body(prompt(rng, 100, 300), 100)
                    ) as resp:
                        await resp.read()
                except TimeoutError:
                    pass

        await asyncio.gather(*(one(i) for i in range(20)))

    async def aborts() -> int:
        rids = [f"kvfsm-e2e-abort-{i}" for i in range(16)]
        async with session() as s:

            async def one(rid: str) -> Any:
                payload = body(prompt(rng, 100, 300), 100, rid=rid)
                async with s.post(rig.router.url + "/generate", json=payload) as resp:
                    return resp.status, await resp.read()

            tasks = [asyncio.ensure_future(one(rid)) for rid in rids]
            for i, rid in enumerate(rids):
                # Aborts land at different stages: queued, bootstrapping, in transfer, decoding.
                # Real time on purpose: the spread sends them there; real servers mark no stage.
                await asyncio.sleep(0.03 * i)
                for server in pair:
                    async with s.post(server.url + "/abort_request", json={"rid": rid}) as resp:
                        assert resp.status == 200, await resp.text()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        return sum(1 for r in results if isinstance(r, tuple) and r[0] == 200)

    asyncio.run(disconnects())
    asyncio.run(aborts())
    wait_until_sync(_Drained(pair), timeout=300, interval=1.0, message="both servers to drain")
    for server in pair:
        stats = kvfsm_stats(server)["rooms"]
        assert stats["live"] == 0, (server.name, stats)
        assert stats["held_pages"] == 0, (server.name, stats)
    # Some rooms did end as aborted, so the check above saw aborts, not only completions.
    aborted = kvfsm_stats(rig.decode)["rooms"]["failed"] - failed_before
    FIGURES["decode_rooms_aborted"] = aborted
    assert aborted > 0
    # And the pair still serves exactly.
    wait_until_sync(
        lambda: _router_serves(rig),
        timeout=120,
        interval=1.0,
        message="the router to route to the pair",
    )
    check = [prompt(rng) for _ in range(4)]
    assert asyncio.run(generate_all(rig.router.url, check)) == rig.reference_outputs(check)


#: Requests decoding when decode is paused with retraction, and the tokens each generates.
RETRACTED, RETRACT_MAX_NEW = 6, 64


async def _stream(
    s: aiohttp.ClientSession, url: str, ids: list[int], decoding: asyncio.Event, seen: set[int]
) -> list[int]:
    """One streamed request; adds ``id(ids)`` to ``seen`` once decode produced a token for it
    (its second: the first is prefill's), and sets ``decoding`` when every request did."""
    out: list[int] = []
    async with s.post(
        url + "/generate", json={**body(ids, RETRACT_MAX_NEW), "stream": True}
    ) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            out = json.loads(line[len("data:") :])["output_ids"]  # the tokens so far
            if len(out) >= 2:
                seen.add(id(ids))
                if len(seen) == RETRACTED:
                    decoding.set()
    return out


def test_retracted_requests_are_recomputed_by_prefill_and_finish_exact(rig: Rig) -> None:
    """SGLang's ``/pause_generation`` with ``mode: retract`` on decode drops the KV of every
    running request; ``/continue_generation`` bootstraps each again under its room and kvfsm
    asks prefill to recompute it (``submit_prefill_recompute``: ``/generate`` on the HTTP port
    prefill published). The pause comes once every request is decoding (streamed: decode sent
    a token for each), so all are retracted. Every request must still finish with the
    reference's tokens, and both servers must show a second room per request."""
    rng = random.Random(SEED + 5)
    prompts = [prompt(rng, 40, 120) for _ in range(RETRACTED)]
    want = asyncio.run(generate_all(rig.reference.url, prompts, RETRACT_MAX_NEW))
    before = {s.name: kvfsm_stats(s)["rooms"] for s in (rig.prefill, rig.decode)}

    async def run() -> list[list[int]]:
        decoding, seen = asyncio.Event(), set[int]()
        async with session() as s:
            tasks = [
                asyncio.ensure_future(_stream(s, rig.router.url, p, decoding, seen))
                for p in prompts
            ]
            await asyncio.wait_for(decoding.wait(), timeout=120)
            for path, payload in (
                ("/pause_generation", {"mode": "retract"}),
                ("/continue_generation", {}),
            ):
                async with s.post(rig.decode.url + path, json=payload) as resp:
                    assert resp.status == 200, (path, resp.status, await resp.text())
            return await asyncio.gather(*tasks)

    got = asyncio.run(run())
    after = {s.name: kvfsm_stats(s)["rooms"] for s in (rig.prefill, rig.decode)}
    spawned = {n: after[n]["spawned"] - before[n]["spawned"] for n in after}
    FIGURES["retraction_rooms_spawned"] = spawned
    # A second room per request on each side: the retraction really happened and was served.
    assert spawned == {"prefill": 2 * RETRACTED, "decode": 2 * RETRACTED}, spawned
    assert got == want


#: Requests in flight when decode is killed: they fit decode's pool at once (12 x 500 tokens <
#: 8192), so decode claims them all on arrival.
LOAD = 12


def test_decode_killed_under_load_prefill_rooms_end_and_a_restarted_decode_serves(
    rig: Rig,
) -> None:
    rng = random.Random(SEED + 4)
    before = kvfsm_stats(rig.prefill)["rooms"]

    def claimed_load() -> bool:
        """Every request of the load has its prefill room, some are live, and decode has
        claimed every live one (its receiver named the prefill rank: a decode room past
        Bootstrapping). An unclaimed prefill room cannot know which decode it waits for, so
        only its deadline can end it (by design); the liveness bound is about rooms whose peer
        is known. A request whose prefill room did not exist yet at the kill would be such a
        room (a run here killed decode with 2 of the 12 rooms made, and the other 10 waited
        out their 300 s deadline)."""
        if kvfsm_stats(rig.prefill)["rooms"]["spawned"] < before["spawned"] + LOAD:
            return False
        done = {"Success", "Failed"}
        rows = get_json(rig.prefill.status_url + "/rooms")
        live = {r["room"] for r in rows if r["state"] not in done}
        claimed = {
            r["room"]
            for r in get_json(rig.decode.status_url + "/rooms")
            if r["state"] not in done and r["state"] != "Bootstrapping"
        }
        return bool(live) and live <= claimed

    async def load_then_kill() -> tuple[list[Any], float]:
        async with session() as s:
            # Long prompts keep prefill busy for a while.
            tasks = [
                asyncio.ensure_future(generate(s, rig.router.url, prompt(rng, 250, 300), 200))
                for _ in range(LOAD)
            ]
            await asyncio.to_thread(
                wait_until_sync,
                claimed_load,
                timeout=120,
                interval=0.05,
                message="claimed prefill rooms",
            )
            rig.decode.kill()
            killed = time.monotonic()
            # Under every state deadline (>= 120 s), so rooms that waited for one would time
            # this wait out; what shows they ended on peer loss is the deadline count below.
            # Far above the liveness bound, as a second pytest worker may load both cores
            # (the figure records how long they took).
            idle = lambda: live_rooms(rig.prefill) == 0  # noqa: E731
            await asyncio.to_thread(
                wait_until_sync,
                idle,
                timeout=10 * LIVENESS_S,
                interval=0.1,
                message="prefill's rooms to end",
            )
            ended = time.monotonic() - killed
            results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, ended

    results, ended = asyncio.run(load_then_kill())
    FIGURES["prefill_rooms_ended_after_decode_kill_s"] = round(ended, 2)
    FIGURES["liveness_bound_s"] = LIVENESS_S
    after = kvfsm_stats(rig.prefill)["rooms"]
    assert after["failed"] > before["failed"], "no prefill room was in flight at the kill"
    # They ended on peer loss (the liveness bound), not by waiting out a state deadline.
    assert after["deadline_expiries"] == before["deadline_expiries"], after
    # The load's requests failed or finished; none is left hanging (gather returned).
    assert len(results) == LOAD

    rig.decode.start()
    rig.decode.wait_ready()
    FIGURES["decode_restart_s"] = round(rig.decode.startup_s[-1], 1)
    wait_until_sync(
        lambda: _router_serves(rig),
        timeout=180,
        interval=1,
        message="the router to route to the restarted decode",
    )
    check = [prompt(rng) for _ in range(20)]
    assert asyncio.run(generate_all(rig.router.url, check)) == rig.reference_outputs(check)
    assert get_json(rig.decode.status_url + "/stats")["rooms"]["succeeded"] >= len(check)
