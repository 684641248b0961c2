"""The adapter reads SGLang's configuration where SGLang's own backends read it: the runtime
context (``get_disagg()``, ``get_parallel()``, ``get_serving()``, ``get_device()``), not only the
``server_args`` object it is handed. Under SGLang's own test fixture ``override_server_args``
(a published configuration the ``server_args`` argument knows nothing of), the adapter used to
connect to the default bootstrap port (8998) instead of the configured one; and on SGLang's CPU
device it registered the pool as VRAM, as SGLang labels it, which NIXL refuses on a CPU."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from kvfsm.bootstrap import BootstrapClient
from kvfsm.sglang import KvfsmKVBootstrapServer, KvfsmKVManager
from kvfsm.sglang._args import ENGINE, ServerConfig
from kvfsm.sglang._bases import DisaggregationMode
from kvfsm.transport import MemKind
from tests.sglang.scheduler import RankBuffers

if os.environ.get("KVFSM_NO_SGLANG") == "1":
    pytest.skip("KVFSM_NO_SGLANG=1", allow_module_level=True)

from sglang.srt.runtime_context import get_context

# Publishing a configuration imports SGLang's quantization modules, which warn on a CPU
# machine that AWQ and GGUF need CUDA: true, and beside the point here.
pytestmark = pytest.mark.filterwarnings("ignore:Only CUDA:UserWarning")


async def registered_port(url: str) -> int:
    async with BootstrapClient(url) as client:
        info = await client.rank(ENGINE, 0)
    return info.port


def test_under_override_server_args_the_manager_uses_the_published_configuration(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    buffers = RankBuffers.make(1)
    args = buffers.kv_args(0)
    # SGLang 0.5.23's decode labels every NIXL rank's pool VRAM, even on --device cpu.
    args.kv_data_mem_kinds = ["VRAM"] * len(buffers.kv)
    stale = SimpleNamespace()  # what a test hands the backend: nothing configured on it
    overrides = {
        "disaggregation_bootstrap_port": bootstrap.port,
        "host": "127.0.0.1",
        "device": "cpu",
    }
    with get_context().override_server_args(**overrides):
        config = ServerConfig.read(stale)
        manager = KvfsmKVManager(args, DisaggregationMode.PREFILL, stale, False)
    try:
        assert config.disaggregation_bootstrap_port == bootstrap.port
        assert config.device == "cpu"
        assert manager.bootstrap_url == f"http://127.0.0.1:{bootstrap.port}"
        assert manager.layout.kv[0].kind is MemKind.DRAM
        # It registered (NIXL took the pool as DRAM) in the configured bootstrap server.
        assert asyncio.run(registered_port(bootstrap.url)) > 0
    finally:
        manager.close()


def test_without_a_published_configuration_server_args_attributes_are_read() -> None:
    seen = ServerConfig.read(
        SimpleNamespace(host="10.0.0.9", disaggregation_bootstrap_port=9100, tp_size=4)
    )
    assert (seen.host, seen.disaggregation_bootstrap_port, seen.tp_size) == ("10.0.0.9", 9100, 4)
    assert ServerConfig.read(SimpleNamespace()) == ServerConfig()


def test_the_published_configuration_wins_over_server_args_attributes() -> None:
    stale = SimpleNamespace(disaggregation_bootstrap_port=1, host="10.0.0.9", device="cuda")
    with get_context().override_server_args(disaggregation_bootstrap_port=4567, device="cpu"):
        seen = ServerConfig.read(stale)
    assert seen.disaggregation_bootstrap_port == 4567
    assert seen.device == "cpu"
    assert seen.host == "127.0.0.1"  # SGLang's resolved default, not the stale attribute
