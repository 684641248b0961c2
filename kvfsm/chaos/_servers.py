"""Real SGLang 0.5.23 servers on this CPU: a process group per server, its log in a file, a
readiness wait that fails fast (with the log's tail) when the server dies, and a cleanup that
always runs (``atexit`` and the kernel's parent-death signal). ``kvfsm chaos servers`` runs its
campaign on them; the e2e suite (``tests/e2e/servers.py``) starts its rigs with them.

Everything runs on a CPU: a 2-layer Llama config with no weights (``--load-format dummy``:
deterministic weights), SGLang's CPU device and torch attention, and the repository's
``tests/e2e/shim`` on ``PYTHONPATH`` for the one vLLM op SGLang reaches off-CUDA (``SHIM``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COMMON_FLAGS",
    "DECODE_FLAGS",
    "HEARTBEAT_S",
    "KVFSM_ENV",
    "LIVENESS_FACTOR",
    "LIVENESS_S",
    "MODEL_CONFIG",
    "SGLANG_CPU_ENV",
    "SHIM",
    "START_TIMEOUT_S",
    "Server",
    "ServerStartError",
    "body",
    "free_port",
    "get_json",
    "get_text",
    "healthy",
    "kvfsm_stats",
    "pd_router",
    "post_json",
    "prefill_flags",
    "router_serves",
    "router_workers",
    "sglang_server",
    "stop_all",
    "write_model",
]

#: The shim SGLang needs on a CPU: in the repository beside the e2e suite (the package does not
#: ship it; ``kvfsm chaos servers --shim`` names another place).
SHIM = Path(__file__).resolve().parents[2] / "tests" / "e2e" / "shim"
BIN = Path(sys.executable).parent

#: The model: small enough that a server starts in ~30 s and serves 200 requests on 2 cores.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: Every server: CPU device, no CUDA graphs, a small pool, no radix cache (a prefill prefix hit
#: would make the comparison depend on arrival order; decode's radix cache is turned on in
#: test_decode_prefix.py only).
#:
#: The pool is sized by ``--max-total-tokens``; ``--mem-fraction-static`` is only the margin
#: SGLang's start-up check allows. On a CPU that check reads the machine's available memory
#: before and after the weights load and fails the scheduler when it fell by more than
#: ``1 - fraction`` of the first reading allows for ("Loaded weights leave no GPU memory for the
#: KV cache"): with 0.05, three servers starting together (each grows by about a GB while it
#: imports) failed it on this machine (a 6% drop). 0.5 tolerates their growth; the pool stays
#: 8192 tokens either way (the cap applies after the check).
#:
#: ``--sleep-on-idle``: without it an idle SGLang scheduler on a CPU spins, a whole core per
#: server (10.1 s of CPU in 10 s idle, 0.14 s with it: measured), starving whatever else runs
#: (the other pytest worker's timing-sensitive tests). SGLang sleeps only when every queue,
#: its disaggregation queues included, is empty, and wakes on the next request.
COMMON_FLAGS = [
    "--load-format", "dummy",
    "--skip-tokenizer-init",
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "8192",
    "--disable-radix-cache",
    "--host", "127.0.0.1",
    "--sleep-on-idle",
]  # fmt: skip

#: kvfsm's liveness bound in these servers: heartbeat 1 s x 10. kvfsm's default (2 s) takes a
#: peer whose loop thread went unscheduled for 2 s for dead, which happens here: three CPU-bound
#: servers (and whatever else runs) share two cores, and the prefill scheduler's forward passes
#: hold the GIL. Leases as long, for the same reason.
HEARTBEAT_S, LIVENESS_FACTOR = 1.0, 10.0
LIVENESS_S = HEARTBEAT_S * LIVENESS_FACTOR
KVFSM_ENV = {
    "KVFSM_SGLANG": "1",
    "KVFSM_HEARTBEAT_S": str(HEARTBEAT_S),
    "KVFSM_LIVENESS_FACTOR": str(LIVENESS_FACTOR),
    "KVFSM_LEASE_S": str(LIVENESS_S),
}

#: SGLang settings every server here needs because it runs on a CPU.
#:
#: ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX``: with overlap scheduling, a prefill that
#: sends a request's already computed prefix pages early (a chunked prompt whose first chunk
#: waited for decode's bootstrap, or a prefix-cache hit) records a CUDA event on the forward
#: stream first, so that the transfer waits for the previous forward's writes. On a CPU there is
#: no such stream, and SGLang's scheduler dies (``expected stream to be a torch.Stream``), with
#: any transfer backend, before the backend is called: seen under load with 2,000-token prompts.
#: Off, those pages go with the request's next chunk instead.
#:
#: ``SGLANG_PYSPY_DUMP_BEFORE_CRASH`` and ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH``: when one of its
#: schedulers dies, SGLang's launcher sleeps 5 s "to let GPU activity settle" before it dumps
#: the schedulers' stacks and CUDA cores, then ends the server. On a CPU there is no GPU work to
#: settle and no CUDA core to dump, and the scheduler is already gone: off, the server ends (and
#: its supervisor can start it again) at once.
SGLANG_CPU_ENV = {
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}
#: How long one server may take to come up on a loaded 2-core machine (~30 s when idle).
START_TIMEOUT_S = 300.0

_LIVE: set[Server] = set()


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return directory


#: Ports handed out by ``free_port``, never handed out twice in one test process.
_GIVEN: set[int] = set()
#: Below Linux's ephemeral range (32768-60999): a port the kernel picked for a ``bind(0)``
#: (``free_port`` itself, once, or any server's own listeners: kvfsm's control plane, NIXL,
#: SGLang's ZMQ sockets) can be handed to the next ``bind(0)`` before a server binds it, which
#: failed a clean-clone run with "address already in use" (decode then waited 300 s for nothing).
#: Nor in 22000-29999: there each SGLang server draws the port of its torch.distributed store
#: (``get_free_port_below_ephemeral``, bound later by its scheduler) and the router serves
#: Prometheus (29000). A run that started six servers at once lost a ``KVFSM_STATUS_PORT``
#: from that range before its server bound it ("address already in use").
_PORTS: list[int] = [*range(20000, 22000), *range(30000, 32000)]


def free_port() -> int:
    """A port nobody listens on now, outside the ephemeral range, not given out before."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.choice(_PORTS)
        if port in _GIVEN or port + 1 in _GIVEN or port - 1 in _GIVEN:
            continue  # (a server may use its port's neighbour: KVFSM_STATUS_PORT + rank)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _die_with_parent() -> None:
    # The server's launcher dies with the test process even when that one is killed hard;
    # SGLang's own children watch the launcher and end with it.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ServerStartError(RuntimeError):
    """A server exited or did not come up; the message has its log's tail."""


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


@dataclass(eq=False)
class Server:
    """One server process (and its process group)."""

    name: str
    argv: list[str]
    port: int
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    #: kvfsm's status server of rank 0 (``KVFSM_STATUS_PORT``), for kvfsm servers.
    status_port: int | None = None
    ready_path: str = "/health"
    #: Put first on the server's ``PYTHONPATH`` (SGLang servers: the CPU shim, ``SHIM``).
    pythonpath: list[str] = field(default_factory=list)
    #: The address it listens on (its status server too): another network namespace's
    #: address when it runs in one (:class:`~kvfsm.chaos._server_hosts.ServerHosts`).
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    #: Seconds from launch to ready, per start.
    startup_s: list[float] = field(default_factory=list)
    _launched: float = 0.0
    _starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def status_url(self) -> str:
        assert self.status_port is not None
        return f"http://{self.host}:{self.status_port}"

    @property
    def starts(self) -> int:
        """How many times it was started (its log's number)."""
        return self._starts

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.{self._starts}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        self._starts += 1
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (*self.pythonpath, os.environ.get("PYTHONPATH", "")) if p
        )
        env["PATH"] = os.pathsep.join((str(BIN), os.environ.get("PATH", "")))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killed as one
                # Only prctl() runs between fork and exec: safe with the test's threads.
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        self._launched = time.monotonic()
        _LIVE.add(self)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until ``ready_path`` answers 200; raises ``ServerStartError`` at once if the process
        exits, or when ``timeout`` passes (the server is then stopped)."""
        proc = self.proc
        assert proc is not None

        def ready() -> bool:
            code = proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with {code} before it was ready; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=10) as resp:
                    return bool(resp.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        give_up = self._launched + timeout
        while not ready():
            if time.monotonic() >= give_up:
                self.stop()
                raise ServerStartError(
                    f"{self.name} did not answer {self.ready_path} within {timeout:g}s; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)
        self.startup_s.append(time.monotonic() - self._launched)

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would."""
        self._signal(signal.SIGKILL)
        self._reap(10.0)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after a grace period. Idempotent."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        if not self._reap(15.0):
            self._signal(signal.SIGKILL)
            self._reap(10.0)
        # Children that outlived their launcher (same group) go too.
        self._signal(signal.SIGKILL)
        _LIVE.discard(self)

    def terminate(self) -> None:
        """SIGTERM the group, without waiting (:func:`stop_all` waits for several at once)."""
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def _reap(self, timeout: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def stop_all(servers: list[Server]) -> None:
    """Stop ``servers``, in that order: every one is told (SIGTERM) first, so that they shut
    down together, not one grace period after another."""
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop()


@atexit.register
def _stop_all() -> None:
    stop_all(list(_LIVE))


def sglang_server(
    name: str,
    model: Path,
    log_dir: Path,
    *extra: str,
    kvfsm: bool = False,
    env: dict[str, str] | None = None,
    shim: Path = SHIM,
    host: str = "127.0.0.1",
    prefix: list[str] | None = None,
) -> Server:
    """An SGLang server on ``model`` listening on ``host``; ``prefix`` goes before its command
    (``ip netns exec NAME``: it runs in that namespace)."""
    port = free_port()
    status = free_port() if kvfsm else None
    server_env = {**SGLANG_CPU_ENV, **(env or {})}
    if kvfsm:
        server_env.update(KVFSM_ENV)
        server_env["KVFSM_STATUS_PORT"] = str(status)
        server_env["KVFSM_STATUS_HOST"] = host
    else:
        server_env["KVFSM_SGLANG"] = "0"
    flags = list(COMMON_FLAGS)
    flags[flags.index("--host") + 1] = host
    argv = [
        *(prefix or ()),
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--port", str(port),
        *flags,
        *extra,
    ]  # fmt: skip
    shims = [str(shim)] if shim.is_dir() else []
    return Server(name, argv, port, log_dir, server_env, status, pythonpath=shims, host=host)


def prefill_flags(bootstrap_port: int) -> list[str]:
    return [
        "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", "nixl",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
    ]  # fmt: skip


#: The default decode host pool pins memory through CUDA: no retraction backup on a CPU.
DECODE_FLAGS = [
    "--disaggregation-mode", "decode",
    "--disaggregation-transfer-backend", "nixl",
    "--disaggregation-decode-retraction-backup", "none",
]  # fmt: skip


def pd_router(
    log_dir: Path,
    prefills: list[tuple[Server, int]],
    decodes: list[Server],
    *extra: str,
    retries: bool,
) -> Server:
    """SGLang's router in PD mode in front of ``prefills`` (each with its bootstrap port) and
    ``decodes``; its circuit breaker off (a worker's failures caused by its peer would open
    the circuit to it); ``retries`` as the caller says."""
    port = free_port()
    argv = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--pd-disaggregation",
        *(a for p, bootstrap in prefills for a in ("--prefill", p.url, str(bootstrap))),
        *(a for d in decodes for a in ("--decode", d.url)),
        "--host", "127.0.0.1",
        "--port", str(port),
        *([] if retries else ["--disable-retries"]),
        "--disable-circuit-breaker",
        # Health checks every second (default 60 s): the router routes to a restarted worker
        # again after two checks in a row pass, so within seconds of its start. SGLang's
        # /health answers without running the model (unless SGLANG_ENABLE_HEALTH_ENDPOINT_
        # GENERATION is set), so a check costs a loaded server little. A long timeout, as a
        # loaded CPU server answers slowly.
        "--health-check-interval-secs", "1",
        "--health-check-timeout-secs", "60",
        *extra,
    ]  # fmt: skip
    return Server("router", argv, port, log_dir, ready_path="/health")


def router_serves(front: Server) -> bool:
    """Whether the router answers a short greedy request with its tokens (it routes only to
    workers its health checks have seen)."""
    try:
        out = post_json(front.url + "/generate", body([5, 6, 7, 8], 2), timeout=60)
    except OSError:
        return False
    return isinstance(out, dict) and len(out.get("output_ids", [])) == 2


def healthy(server: Server) -> bool:
    """Whether ``server`` answers ``/health`` with 200 now."""
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def router_workers(front: Server) -> list[dict[str, Any]]:
    """The router's workers as it sees them (``/workers``: each one's ``url``,
    ``worker_type`` and ``is_healthy``). It adds the workers it was started with only once
    their first health check passed, so the list grows after the router is up."""
    workers: list[dict[str, Any]] = get_json(front.url + "/workers")["workers"]
    return workers


def kvfsm_stats(server: Server) -> dict[str, Any]:
    stats: dict[str, Any] = get_json(server.status_url + "/stats")
    return stats


def body(ids: list[int], max_new: int = 8, **extra: Any) -> dict[str, Any]:
    """A ``/generate`` request: greedy, exactly ``max_new`` tokens (EOS ignored)."""
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        **extra,
    }
