"""Decode retraction with re-bootstrap (SGLang's ``pause_generation(mode="retract")``): decode
drops a running request's KV, bootstraps it again under the same ``bootstrap_room`` and asks
its prefill server to recompute it (``KvfsmKVManager.submit_prefill_recompute``: ``POST
/generate`` with SGLang's payload, to the HTTP port the prefill instance published).

Replayed over real NIXL (:mod:`tests.helpers.sglang_replay`): a request is served, then
retracted into fresh decode pages; a stand-in for the prefill server's HTTP frontend takes the
recompute and hands the request to the prefill scheduler again, which sends it under the same
room id. Every byte of the second delivery is checked. And the failures: a prefill instance
that published no HTTP port, a frontend answering an error, a late error after the transfer
succeeded, one recompute per request however many decode ranks ask.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from kvfsm.sglang import KvfsmKVBootstrapServer, KvfsmKVReceiver
from kvfsm.states import KVPoll
from tests.helpers.sglang_replay import PAGES, Instance, Outcome, Pair, Request, random_requests

TP = 2


class Frontend:
    """The prefill server's ``/generate``, as far as a recompute goes: it records each payload
    and answers ``status`` at once (the replay's prefill scheduler then runs the request)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.payloads: queue.Queue[dict[str, Any]] = queue.Queue()
        self.received: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.set()
        self.loop.run_forever()

    async def _generate(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.received.append(payload)
        self.payloads.put(payload)
        return web.json_response({"status": self.status}, status=self.status)

    def close(self) -> None:
        """Stop serving; idempotent."""
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class RetractPair(Pair):
    """A pair whose prefill scheduler also takes the requests the frontend received."""

    def __init__(self, prefill: Instance, decode: Instance, port: int, frontend: Frontend):
        super().__init__(prefill, decode, port)
        self.frontend = frontend
        self.retracted: dict[int, Request] = {}

    def step(self) -> None:
        while not self.frontend.payloads.empty():
            payload = self.frontend.payloads.get()
            req = self.retracted.get(payload["bootstrap_room"])
            if req is not None and self.frontend.status < 400:
                self.p.add(req)
        super().step()


def payload(req: Request) -> dict[str, Any]:
    """The part of SGLang's ``Req.build_rebootstrap_payload()`` kvfsm reads and forwards."""
    return {
        "input_ids": list(range(3, 3 + req.input_len)),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "rid": f"rid-{req.room}",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_room": req.room,
    }


def retracted(req: Request, rng: random.Random, used: set[int]) -> Request:
    """``req`` retracted by decode: the same room and prefill pages, fresh decode pages and
    metadata row (the old ones went back to decode's pools), and its re-bootstrap payload."""
    free = [p for p in range(PAGES) if p not in used]
    dst = rng.sample(free, len(req.dst_pages))
    used.update(dst)
    again = Request(
        room=req.room,
        src_pages=req.src_pages,
        dst_pages=dst,
        chunks=req.chunks,
        src_aux=req.src_aux,
        dst_aux=req.dst_aux,
        src_state=req.src_state,
        dst_state=req.dst_state,
    )
    again.rebootstrap = payload(again)
    return again


@pytest.fixture
def frontend() -> Iterator[Frontend]:
    f = Frontend()
    yield f
    f.close()


def start_pair(
    bootstrap: KvfsmKVBootstrapServer, frontend: Frontend, *, publish: bool = True
) -> RetractPair:
    prefill = Instance.start(
        "prefill", bootstrap.port, TP, http_port=frontend.port if publish else None
    )
    try:
        decode = Instance.start("decode", bootstrap.port, TP)
    except BaseException:
        prefill.close()
        raise
    return RetractPair(prefill, decode, bootstrap.port, frontend)


@pytest.fixture
def pair(bootstrap: KvfsmKVBootstrapServer, frontend: Frontend) -> Iterator[RetractPair]:
    p = start_pair(bootstrap, frontend)
    yield p
    p.decode.close()
    p.prefill.close()


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def serve_then_retract(
    pair: RetractPair, n: int, seed: int, *, recomputed: bool = True
) -> list[Request]:
    """Serve ``n`` requests, then retract them all into decode's queue. ``recomputed``: the
    prefill gets them again (False: the recompute fails, prefill never sees them)."""
    rng = random.Random(seed)
    first = random_requests(rng, n, max_pages=4)
    assert_clean(pair.run(first))
    assert all(r.decode_outcome == "Success" for r in first)
    used = {p for r in first for p in r.dst_pages}
    again = [retracted(r, rng, used) for r in first]
    for req in again:
        req.prefill_ignores = not recomputed
    pair.retracted = {r.room: r for r in again}
    for req in again:
        pair.d.add(req)
    return again


def test_a_retracted_request_is_recomputed_and_delivered_again(
    pair: RetractPair, frontend: Frontend
) -> None:
    again = serve_then_retract(pair, 6, seed=3)
    assert_clean(pair.drive(again))
    assert [r.decode_outcome for r in again] == ["Success"] * len(again)
    assert [r.prefill_outcome for r in again] == ["Success"] * len(again)
    # One recompute per request, from the first decode rank only, with SGLang's payload.
    assert sorted(p["bootstrap_room"] for p in frontend.received) == sorted(r.room for r in again)
    assert all(p["rid"] == f"rid-{p['bootstrap_room']}" for p in frontend.received)


def test_an_instance_without_an_http_port_fails_the_retracted_request_with_a_reason(
    bootstrap: KvfsmKVBootstrapServer, frontend: Frontend
) -> None:
    pair = start_pair(bootstrap, frontend, publish=False)
    try:
        again = serve_then_retract(pair, 2, seed=5, recomputed=False)
        out = pair.drive(again)
        assert out.violations == []
        assert out.leaks == []
        assert [r.decode_outcome for r in again] == ["Failed"] * 2
        for req in again:
            assert "no /generate URL" in req.decode_reasons[0]
            assert "published no HTTP port" in req.decode_reasons[0]
        assert frontend.received == []
    finally:
        pair.decode.close()
        pair.prefill.close()


def test_an_error_from_the_prefill_frontend_fails_the_retracted_request(
    pair: RetractPair, frontend: Frontend
) -> None:
    frontend.status = 503
    again = serve_then_retract(pair, 2, seed=7, recomputed=False)
    out = pair.drive(again)
    assert out.violations == []
    assert out.leaks == []
    assert [r.decode_outcome for r in again] == ["Failed"] * 2
    for req in again:
        assert f"/generate failed for rid=rid-{req.room} (status=503)" in req.decode_reasons[0]
    assert len(frontend.received) == 2


def test_an_unreachable_frontend_fails_the_retracted_request(
    pair: RetractPair, frontend: Frontend
) -> None:
    frontend.close()
    again = serve_then_retract(pair, 1, seed=9, recomputed=False)
    out = pair.drive(again)
    assert out.violations == []
    assert again[0].decode_outcome == "Failed"
    assert "/generate request errored for rid=" in again[0].decode_reasons[0]


def test_a_late_recompute_error_leaves_a_delivered_request_alone(pair: RetractPair) -> None:
    """The frontend's answer may come after the transfer ended (SGLang answers /generate when
    the prefill finished): an error then must not turn a Success into a failure."""
    first = random_requests(random.Random(11), 1, max_pages=3)
    assert_clean(pair.run(first))
    receiver: KvfsmKVReceiver = first[0].receivers[0]
    assert receiver.poll() == KVPoll.Success
    receiver.recompute_failure = "PD retract rebootstrap /generate failed (late)"
    assert receiver.poll() == KVPoll.Success
    assert receiver.recompute_failure is None  # taken, and the room stayed a Success
