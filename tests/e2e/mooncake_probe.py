"""Whether SGLang 0.5.23's own Mooncake backend runs a prefill-decode pair on this CPU machine:
its TCP transport (``MOONCAKE_PROTOCOL=tcp``), the e2e suite's model, flags and dummy weights,
kvfsm out of the way (``KVFSM_SGLANG=0``), a router in front, then greedy requests compared with
a plain SGLang server's. It prints what each server did: up or not, the answers, or the last
error lines of SGLang's own log.

    .venv/bin/pip install mooncake-transfer-engine-non-cuda
    .venv/bin/python -m tests.e2e.mooncake_probe

(``mooncake-transfer-engine`` itself, the CUDA build, does not import on a machine without an
NVIDIA driver: its engine links ``libcudart.so.12`` and ``libcuda.so.1``; the non-CUDA build
of the same release does, and also needs ``libibverbs1`` and ``librdmacm1`` from apt. Remove
those after probing: with them installed and no RDMA device, UCX loads its verbs transport, and
on this machine a process that had used NIXL then died of SIGSEGV at interpreter exit, which
fails tests that check a child's exit status.)

SGLang's NIXL backend cannot serve a CPU pool (it registers the KV pool as VRAM), so Mooncake is
the SGLang backend that kvfsm's fault campaigns could be compared with on this machine. What the
probe found is in ``docs/reliability.md``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.servers import (
    Server,
    ServerStartError,
    body,
    free_port,
    pd_router,
    post_json,
    router_serves,
    sglang_server,
    stop_all,
    write_model,
)

#: SGLang's Mooncake flags for a CPU pool: the TCP transport (RDMA is its default), and the
#: decode host pool off as in the e2e suite (it pins memory through CUDA).
MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp", "KVFSM_SGLANG": "0"}
PROMPTS = [[5 + i, 17, 33 + i, 9] * (1 + i % 4) for i in range(8)]


def _tail(server: Server, lines: int = 25) -> str:
    return "\n".join("    " + line for line in server.log_tail(lines).splitlines())


def main() -> int:
    try:
        import mooncake.engine  # noqa: F401 - the package under test
    except ImportError as exc:
        print(f"mooncake-transfer-engine is not installed: {exc}")
        return 2
    with tempfile.TemporaryDirectory(prefix="kvfsm-mooncake-") as tmp:
        logs = Path(tmp)
        model = write_model(logs / "model")
        bootstrap = free_port()
        prefill = sglang_server(
            "prefill",
            model,
            logs,
            "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(bootstrap),
            env=MOONCAKE_ENV,
        )  # fmt: skip
        decode = sglang_server(
            "decode",
            model,
            logs,
            "--disaggregation-mode", "decode",
            "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-decode-retraction-backup", "none",
            env=MOONCAKE_ENV,
        )  # fmt: skip
        reference = sglang_server("reference", model, logs, env={"KVFSM_SGLANG": "0"})
        servers = [prefill, decode, reference]
        try:
            for server in servers:
                server.start()
            for server in servers:
                try:
                    server.wait_ready()
                    print(f"{server.name}: up in {server.startup_s[-1]:.0f} s")
                except ServerStartError as exc:
                    print(f"{server.name}: did not come up: {str(exc).splitlines()[0]}")
                    print(_tail(server))
                    return 1
            front = pd_router(logs, [(prefill, bootstrap)], [decode], retries=False)
            servers.append(front)
            front.start()
            front.wait_ready()
            # It routes only to workers its health checks have seen: until then, 503.
            deadline = time.monotonic() + 180
            while not router_serves(front):
                if time.monotonic() > deadline:
                    print("the router never served a request; the end of prefill's log:")
                    print(_tail(prefill))
                    return 1
                time.sleep(2)
            equal = 0
            for ids in PROMPTS:
                want = post_json(f"{reference.url}/generate", body(ids))["output_ids"]
                started = time.monotonic()
                try:
                    got = post_json(f"{front.url}/generate", body(ids), timeout=120)
                except OSError as exc:
                    print(f"request of {len(ids)} tokens: error {exc}")
                    continue
                took = time.monotonic() - started
                same = got.get("output_ids") == want
                equal += same
                print(f"request of {len(ids)} tokens: {took:.2f} s, equal to reference: {same}")
            print(f"{equal} of {len(PROMPTS)} equal to the reference server")
            for server in (prefill, decode):
                print(f"-- the end of {server.name}'s log:")
                print(_tail(server, 15))
            return 0 if equal == len(PROMPTS) else 1
        finally:
            stop_all(servers)


if __name__ == "__main__":
    sys.exit(main())
