"""SGLang's KV checksum (``--disaggregation-enable-kv-checksum``) with kvfsm moving the KV, on
real SGLang 0.5.23 servers on this CPU machine.

How SGLang checks (``sglang/srt/disaggregation/``): prefill digests the pages it sends when it
sends a request's last chunk (``send_kv_chunk``, before handing them to the backend) and writes
the digest, with a signature of its KV layout, into the request's metadata row, an extra aux
buffer that the backend moves with the last chunk. Decode, before the request's first decode
step (``_verify_kv_checksums``), digests what landed in its own pages; on a mismatch it drops
the request with "KV checksum mismatch" (HTTP 500) and keeps serving (in CI mode,
``SGLANG_IS_IN_CI``, it raises instead).

SGLang's digest is a CUDA kernel, and ``KvChecksumComputer.compute`` asserts CUDA page indices:
on this CPU a prefill with the flag dies at its first digest, its own PD warm-up request (the
first check below, SGLang's own error). The second runs SGLang's check with one substitution:
the digest computed on the CPU by the rig (``shim/kvfsm_e2e_cpu_checksum.py``, the same bytes
with ``zlib.adler32``) on both servers. What is compared, when, and what happens on a mismatch
are SGLang's.

The corrupted transfer comes from the e2e suite's corrupting NIXL proxy (``ARM_ENV``), armed in
this module's own prefill. It overwrites the source pages of the next KV WRITE kvfsm posts,
which happens after ``send_kv_chunk`` took the digest of the request's only chunk (prompts here
are far shorter than a chunk): decode receives bytes that no longer match prefill's digest, as
after a corruption in flight. The request must fail with SGLang's checksum error instead of
returning tokens, while kvfsm itself counts the room's transfer as a success (the check is
SGLang's, not kvfsm's); requests before and after it must equal the reference server's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.servers import (
    ARM_ENV,
    DECODE_FLAGS,
    FAILED,
    START_TIMEOUT_S,
    Server,
    SharedPrefill,
    assert_raised_in_sglang,
    body,
    free_port,
    healthy,
    keep_logs_if_failed,
    kvfsm_stats,
    prefill_flags,
    router,
    router_serves,
    sglang_server,
    stop_all,
)
from tests.helpers.waiting import wait_until_sync

pytestmark = pytest.mark.timeout(900)

CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"
#: Installs the rig's CPU digest (``shim/kvfsm_e2e_cpu_checksum.py``, via ``sitecustomize``).
CPU_DIGEST_ENV = "KVFSM_E2E_CPU_KV_CHECKSUM"
#: What SGLang's decode answers and logs for a request whose KV does not match its digest.
MISMATCH = "KV checksum mismatch"
#: What the corrupting proxy logs for each transfer it corrupts.
CORRUPTED = "kvfsm-e2e: corrupted"

VOCAB, MAX_NEW, SEED = 512, 8, 29
#: Requests before the corrupted one, and after it (20 in all with it).
BEFORE, AFTER = 4, 15

FIGURES: dict[str, Any] = {}


@dataclass
class Rig:
    reference: Server
    #: A prefill with the flag and SGLang's own (CUDA) digest: it cannot run here.
    cuda_digest_prefill: Server
    prefill: Server
    decode: Server
    router: Server
    #: Created to corrupt ``prefill``'s next KV transfer; that transfer takes it away.
    corrupt_next: Path


@pytest.fixture(scope="module")
def rig(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    llama: SharedPrefill,
) -> Iterator[Rig]:
    """The package's shared reference server; this module's own prefill and decode with the
    flag and the CPU digest, and a prefill with the flag alone. All launched together."""
    log_dir = tmp_path_factory.mktemp("sglang-e2e-checksum")
    corrupt_next = log_dir / "corrupt-next-transfer"
    bootstrap = free_port()
    cuda_digest = sglang_server(
        "prefill-cuda-digest",
        llama.model,
        log_dir,
        *prefill_flags(free_port()),
        CHECKSUM_FLAG,
        kvfsm=True,
    )
    prefill = sglang_server(
        "prefill",
        llama.model,
        log_dir,
        *prefill_flags(bootstrap),
        CHECKSUM_FLAG,
        kvfsm=True,
        env={CPU_DIGEST_ENV: "1", ARM_ENV: str(corrupt_next)},
    )
    # SGLang's CI mode turns a mismatch into a crash of the decode scheduler; this check is
    # about a serving decode, whatever the environment the suite runs in says.
    decode = sglang_server(
        "decode",
        llama.model,
        log_dir,
        *DECODE_FLAGS,
        CHECKSUM_FLAG,
        kvfsm=True,
        env={CPU_DIGEST_ENV: "1", "SGLANG_IS_IN_CI": "false"},
    )
    front = router(log_dir, prefill, bootstrap, decode)
    started: list[Server] = []
    began = time.monotonic()
    try:
        for server in (cuda_digest, prefill, decode, front):
            started.append(server)
            server.start()
        llama.ready()
        for server in (prefill, decode, front):
            server.wait_ready()
        wait_until_sync(
            lambda: router_serves(front),
            timeout=120,
            interval=1.0,
            message="the router to route to the pair",
        )
        FIGURES["rig_ready_s"] = round(time.monotonic() - began, 1)
        yield Rig(llama.reference, cuda_digest, prefill, decode, front, corrupt_next)
    finally:
        stop_all(list(reversed(started)))
        FIGURES["module_s"] = round(time.monotonic() - began, 1)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\nsglang kv checksum figures: {FIGURES}")
        keep_logs_if_failed(request, log_dir, request.node.stash.get(FAILED, False))


def test_sglangs_own_digest_cannot_run_on_this_cpu(rig: Rig) -> None:
    """Without the rig's CPU digest, a prefill with the flag dies at its PD warm-up request
    (SGLang's fake backend: kvfsm moves nothing for it), on SGLang's assertion that the page
    indices are on a CUDA device."""
    server = rig.cuda_digest_prefill
    proc = server.proc
    assert proc is not None
    served: list[bool] = []

    def exited() -> bool:
        if proc.poll() is not None:
            return True
        served.append(healthy(server))
        return False

    wait_until_sync(exited, timeout=START_TIMEOUT_S, interval=0.5, message="it to exit")
    log = server.log_path.read_text(errors="replace")
    assert proc.returncode != 0
    assert not any(served), "it answered /health"
    assert "Start of pd disaggregation warmup" in log
    assert_raised_in_sglang(log, "AssertionError", "srt/disaggregation/checksum.py")


async def _post(s: aiohttp.ClientSession, url: str, ids: list[int]) -> tuple[int, Any]:
    async with s.post(url + "/generate", json=body(ids, MAX_NEW)) as resp:
        return resp.status, await resp.json(content_type=None)


async def _outputs(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        answers = await asyncio.gather(*(_post(s, url, p) for p in prompts))
    assert all(status == 200 for status, _ in answers), answers
    return [out["output_ids"] for _, out in answers]


async def _one(url: str, ids: list[int]) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        return await _post(s, url, ids)


def test_a_corrupted_transfer_fails_with_sglangs_checksum_error_and_the_rest_are_exact(
    rig: Rig,
) -> None:
    rng = random.Random(SEED)
    prompts = [
        [rng.randrange(3, VOCAB) for _ in range(rng.randint(100, 250))]
        for _ in range(BEFORE + 1 + AFTER)
    ]
    before, armed, after = prompts[:BEFORE], prompts[BEFORE], prompts[BEFORE + 1 :]
    want = asyncio.run(_outputs(rig.reference.url, prompts))
    assert len({tuple(o) for o in want}) > 1, "outputs do not depend on the prompt"
    rooms = {s.name: kvfsm_stats(s)["rooms"] for s in (rig.prefill, rig.decode)}

    # Checked and equal before the corruption.
    assert asyncio.run(_outputs(rig.router.url, before)) == want[:BEFORE]

    marks = rig.prefill.log_path.read_text(errors="replace").count(CORRUPTED)
    rig.corrupt_next.touch()
    status, answer = asyncio.run(_one(rig.router.url, armed))
    # That request's transfer took the arming file and corrupted its own source pages.
    assert not rig.corrupt_next.exists(), "no transfer claimed the armed corruption"
    assert rig.prefill.log_path.read_text(errors="replace").count(CORRUPTED) == marks + 1
    FIGURES["corrupted_request"] = {"status": status, "answer": answer}
    # SGLang's decode refused the request with its reason, instead of returning tokens.
    assert status != 200, f"the corrupted request was answered: {answer}"
    assert "output_ids" not in answer, answer
    assert MISMATCH in str(answer), answer
    decode_log = rig.decode.log_path.read_text(errors="replace")
    assert decode_log.count(f"{MISMATCH} req=") == 1, "decode did not log exactly one mismatch"

    # Checked and equal after it: the pair serves on.
    assert asyncio.run(_outputs(rig.router.url, after)) == want[BEFORE + 1 :]

    # kvfsm delivered every room, the corrupted one too: the refusal was SGLang's check.
    for server in (rig.prefill, rig.decode):
        now = kvfsm_stats(server)["rooms"]
        was = rooms[server.name]
        assert now["succeeded"] - was["succeeded"] == len(prompts), (server.name, now)
        assert now["failed"] == was["failed"], (server.name, now)
