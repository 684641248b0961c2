"""Runs the adapter under SGLang's published configuration in a process of its own, for
``test_runtime_context.py``; prints one JSON object and leaves with ``os._exit(0)``.

Why a child: publishing a configuration (``override_server_args``) imports SGLang's
quantization modules and with them ``tvm_ffi`` and ``sentencepiece``, whose teardown segfaults
the interpreter at exit on this CPU machine (no Python frame: C extension teardown). In the
test runner's process that crash would come at the very end of the suite and fail the run
whatever the tests said; here the child reports, then exits without running that teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace

from sglang.srt.runtime_context import get_context

from kvfsm.registry import BootstrapClient
from kvfsm.sglang import KvfsmKVManager
from kvfsm.sglang._args import ENGINE, ServerConfig
from kvfsm.sglang._bases import DisaggregationMode
from tests.helpers.sglang_replay import RankBuffers


async def _registered_port(url: str) -> int:
    async with BootstrapClient(url) as client:
        info = await client.rank(ENGINE, 0)
    return info.port


def manager_under_override(port: int) -> dict[str, object]:
    buffers = RankBuffers.make(1)
    args = buffers.kv_args(0)
    # SGLang 0.5.23's decode labels every NIXL rank's pool VRAM, even on --device cpu.
    args.kv_data_mem_kinds = ["VRAM"] * len(buffers.kv)
    stale = SimpleNamespace()  # what a test hands the backend: nothing configured on it
    overrides = {"disaggregation_bootstrap_port": port, "host": "127.0.0.1", "device": "cpu"}
    with get_context().override_server_args(**overrides):
        config = ServerConfig.read(stale)
        manager = KvfsmKVManager(args, DisaggregationMode.PREFILL, stale, False)
    try:
        return {
            "port": config.disaggregation_bootstrap_port,
            "device": config.device,
            "url": manager.bootstrap_url,
            "kind": manager.layout.kv[0].kind.value,
            "registered_port": asyncio.run(_registered_port(manager.bootstrap_url)),
        }
    finally:
        manager.close()


def published_wins() -> dict[str, object]:
    stale = SimpleNamespace(disaggregation_bootstrap_port=1, host="10.0.0.9", device="cuda")
    with get_context().override_server_args(disaggregation_bootstrap_port=4567, device="cpu"):
        seen = ServerConfig.read(stale)
    return {"port": seen.disaggregation_bootstrap_port, "device": seen.device, "host": seen.host}


if __name__ == "__main__":
    what = sys.argv[1]
    out = manager_under_override(int(sys.argv[2])) if what == "manager" else published_wins()
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)
