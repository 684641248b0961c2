"""Shapes SGLang 0.5.23 itself cannot run on this CPU machine, and its own errors for them.

``shapes_probe`` found four shapes that do not start here: ``--tp 2``, ``--pp-size 2`` and
``--tp 2 --dp 2 --enable-dp-attention`` (SGLang sets up PyNccl for every process group of more
than one rank, and PyNccl wants a CUDA device), and a Mamba model (SGLang has no implementation
of it that runs here). ``docs/sglang.md`` says so and names the errors; this module keeps that
statement true. Each shape is launched as a plain server (``KVFSM_SGLANG=0``: kvfsm registers
no hook), all of them at once, and each must:

* exit with a non-zero status without ever answering ``/health``;
* leave SGLang's error text in its log;
* have raised it from SGLang's own code: in the traceback that ends with the error, the
  deepest frame inside the ``sglang`` package is the expected SGLang file, every frame below
  it is torch's (the PyNccl error is raised by ``torch.cuda.device``, called from SGLang's
  ``pynccl.py``), and no frame is kvfsm's.

Not run here: the same shapes as kvfsm prefill servers (``--disaggregation-mode prefill``, the
``nixl`` backend served by kvfsm). Tried while this module was written, ``--tp 2`` that way
passed the same checks, and ``--tp 2 --dp 2 --enable-dp-attention`` and Mamba logged the same
errors; but each costs more than it tells: ``--tp 2`` alone as a kvfsm prefill made the module
take 80 s instead of 66 s (measured back to back on an otherwise idle 2-core machine), and all
four as well took 141 s against 62 s (outside pytest). A case with ``True`` in ``CASES`` runs a
shape that way, with the same checks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.servers import (
    FAILED,
    START_TIMEOUT_S,
    Server,
    assert_raised_in_sglang,
    free_port,
    healthy,
    keep_logs_if_failed,
    prefill_flags,
    sglang_server,
    stop_all,
)
from tests.e2e.shapes_probe import SHAPES
from tests.helpers.waiting import wait_until_sync

pytestmark = pytest.mark.timeout(600)

#: SGLang's error for a group of more than one rank on a CPU, and the SGLang file that calls
#: the torch function raising it.
PYNCCL = (
    "ValueError: Expected a cuda device, but got: cpu",
    "srt/distributed/device_communicators/pynccl.py",
)
#: SGLang's error for a model class it cannot run, and the SGLang file raising it.
NO_IMPL = (
    "ValueError: MambaForCausalLM has no SGlang implementation and the Transformers "
    "implementation is not compatible with SGLang",
    "srt/model_loader/utils.py",
)

#: case -> (``shapes_probe`` shape, as a kvfsm prefill server, the expected error)
CASES: dict[str, tuple[str, bool, tuple[str, str]]] = {
    "tp2": ("tp2", False, PYNCCL),
    "pp2": ("pp2", False, PYNCCL),
    "dp2-dp-attention": ("dp2", False, PYNCCL),
    "mamba": ("mamba", False, NO_IMPL),
}


@dataclass
class Outcome:
    server: Server
    #: The process's exit status; None if it was still running at the deadline.
    returncode: int | None
    #: Whether ``/health`` ever answered 200 while it ran.
    served: bool
    #: Seconds from launch to exit.
    exited_after_s: float


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Outcome]]:
    """Every case launched at once (each fails in its schedulers' start-up, so they only share
    the cores for their imports), then watched until each has exited: its ``/health`` polled
    meanwhile, so a server that came up, however briefly, is seen."""
    log_dir = tmp_path_factory.mktemp("sglang-e2e-unservable")
    servers: dict[str, Server] = {}
    for case, (shape, as_prefill, _) in CASES.items():
        config, flags, env = SHAPES[shape]
        model = log_dir / f"model-{shape}"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(config))
        extra = [*flags, *prefill_flags(free_port())] if as_prefill else flags
        servers[case] = sglang_server(case, model, log_dir, *extra, kvfsm=as_prefill, env=env)
    began = time.monotonic()
    exits: dict[str, float] = {}
    served: set[str] = set()

    def all_exited() -> bool:
        for case, server in servers.items():
            assert server.proc is not None
            if case in exits:
                continue
            if server.proc.poll() is not None:
                exits[case] = time.monotonic() - began
            elif healthy(server):
                served.add(case)
        return len(exits) == len(servers)

    try:
        for server in servers.values():
            server.start()
        wait_until_sync(
            all_exited,
            timeout=START_TIMEOUT_S,
            interval=0.5,
            message="every unservable shape's server to exit",
        )
        yield {
            case: Outcome(server, server.proc.returncode, case in served, exits[case])
            for case, server in servers.items()
            if server.proc is not None
        }
    finally:
        stop_all(list(servers.values()))
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            figures = {case: round(s, 1) for case, s in sorted(exits.items())}
            reporter.write_line(f"\nunservable shapes, exited after s: {figures}")
        keep_logs_if_failed(request, log_dir, request.node.stash.get(FAILED, False))


@pytest.mark.parametrize("case", sorted(CASES))
def test_sglang_refuses_the_shape_with_its_own_error(
    outcomes: dict[str, Outcome], case: str
) -> None:
    outcome = outcomes[case]
    error, origin = CASES[case][2]
    log = outcome.server.log_path.read_text(errors="replace")
    tail = "\n".join(log.splitlines()[-30:])
    # (a) It exited, non-zero, and never served. SGLang's launcher ends its own process group
    # when a scheduler fails ("Received sigquit from a child process"): status -9.
    assert outcome.returncode not in (None, 0), (case, outcome.returncode, tail)
    assert not outcome.served, f"{case} answered /health before it exited"
    # (b) SGLang's error text is in its log.
    assert error in log, f"{case}: {error!r} not in the log:\n{tail}"
    # (c) Raised from SGLang's code, with no kvfsm frame on the way.
    assert_raised_in_sglang(log, error, origin)
