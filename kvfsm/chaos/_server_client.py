"""The clients of ``kvfsm chaos servers``: one coroutine per planned request, which sends it to
the router at its planned time (streamed or not), disconnects or aborts it when the plan says,
and records how it ended (:class:`~kvfsm.chaos._server_scoring.RequestOutcome`). A request that
has not ended when its client's patience (``hang_s``) runs out is recorded as hung and cancelled.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from kvfsm.chaos._server_plan import PlannedRequest
from kvfsm.chaos._server_scoring import RequestOutcome, classify_error

__all__ = ["send_request"]


def payload(req: PlannedRequest, rid: str) -> dict[str, Any]:
    """Greedy, exactly ``max_new`` tokens (EOS ignored), so outputs compare token by token."""
    return {
        "input_ids": list(req.prompt),
        "sampling_params": {"max_new_tokens": req.max_new, "temperature": 0, "ignore_eos": True},
        "rid": rid,
        "stream": req.stream,
    }


def _finish(answer: Any) -> str:
    if not isinstance(answer, dict):
        return ""
    reason = (answer.get("meta_info") or {}).get("finish_reason") or {}
    return str(reason.get("type", "")) if isinstance(reason, dict) else str(reason)


async def _stream(resp: aiohttp.ClientResponse, req: PlannedRequest, sent: float) -> Any:
    """The last ``data:`` object of a streamed answer; with ``disconnect_s``, None once the
    client left (it closes the connection mid-stream)."""
    last: Any = None
    pieces: list[int] = []
    while True:
        wait = None
        if req.disconnect_s is not None:
            wait = max(0.0, sent + req.disconnect_s - time.monotonic())
        try:
            line = await asyncio.wait_for(resp.content.readline(), wait)
        except TimeoutError:
            resp.close()
            return None
        if not line:
            break
        text = line.decode(errors="replace").strip()
        if not text.startswith("data:"):
            continue
        data = text[5:].strip()
        if data == "[DONE]":
            break
        last = json.loads(data)
        if isinstance(last, dict):
            pieces += list(last.get("output_ids") or [])
    # SGLang streams the whole output so far in each chunk by default, only the new tokens
    # with ``--incremental-streaming-output``: either way the answer is the full output.
    if isinstance(last, dict) and len(last.get("output_ids") or []) < len(pieces) == req.max_new:
        last = {**last, "output_ids": pieces}
    return last


async def _abort_later(s: aiohttp.ClientSession, urls: list[str], rid: str, after_s: float) -> None:
    await asyncio.sleep(after_s)
    for url in urls:
        try:
            async with s.post(url + "/abort_request", json={"rid": rid}) as resp:
                await resp.read()
        except (aiohttp.ClientError, OSError):
            pass  # that server is down: its half of the request is gone anyway


async def send_request(
    s: aiohttp.ClientSession,
    router_url: str,
    abort_urls: list[str],
    req: PlannedRequest,
    episode: int,
    *,
    epoch: float,
    start: float,
    hang_s: float,
    tag: str,
) -> RequestOutcome:
    """Send ``req`` at ``start + req.start_s`` (monotonic); times in the outcome are seconds
    since ``epoch``."""
    await asyncio.sleep(max(0.0, start + req.start_s - time.monotonic()))
    rid = f"kvfsm-chaos-{tag}-{req.index}"
    sent = time.monotonic()
    out = RequestOutcome(req.index, episode, "errored", sent - epoch, sent - epoch)
    aborter = None
    if req.abort_s is not None:
        aborter = asyncio.ensure_future(_abort_later(s, abort_urls, rid, req.abort_s))
    try:
        answer, status = await asyncio.wait_for(_ask(s, router_url, req, rid, sent), hang_s)
    except TimeoutError:
        out.status, out.reason = "hung", "no end"
    except (aiohttp.ClientError, OSError) as exc:
        out.reason, out.detail = classify_error(0, repr(exc)), repr(exc)[:300]
    else:
        if answer is None:
            out.status = "disconnected"
        elif status == 200 and _finish(answer) == "length" and "error" not in answer:
            # Greedy with EOS ignored: a whole answer ends by its length, nothing else.
            out.status = "completed"
            out.output_ids = list(answer.get("output_ids") or [])
        elif req.abort_s is not None and (status != 200 or _finish(answer) == "abort"):
            out.status = "aborted"
        else:
            out.detail = json.dumps(answer)[:300] if not isinstance(answer, str) else answer[:300]
            out.reason = classify_error(status, out.detail)
            if status == 200 and out.reason == "http 200":
                out.reason = "ended without a finish reason"
    finally:
        if aborter is not None:
            aborter.cancel()
    out.ended_s = time.monotonic() - epoch
    return out


async def _ask(
    s: aiohttp.ClientSession, url: str, req: PlannedRequest, rid: str, sent: float
) -> tuple[Any, int]:
    async with s.post(url + "/generate", json=payload(req, rid)) as resp:
        if req.stream and resp.status == 200:
            return await _stream(resp, req, sent), resp.status
        text = await resp.text()
        try:
            return json.loads(text), resp.status
        except ValueError:
            return text, resp.status
