"""``kvfsm demo``: a real prefill-decode pair on this machine, both sides with rooms.

Three kinds of process take part: **this process** runs the bootstrap registry embedded in a
thread of its own (:class:`~kvfsm.registry.RegistryThread`), starts the two ranks,
hands them the plan, collects what they report, prints a live progress line on stderr and the
summary on stdout; **the prefill process** and **the decode process** each run a manager and a
scheduler-shaped loop over their rooms (:mod:`kvfsm.workload.ranks`).

Every chunk is a real NIXL WRITE (UCX, DRAM to DRAM) from the prefill process into the decode
process's pages, started by the prefill room after decode's page list came over the control
channel. Both ranks walk the same plan, made from the seed (:mod:`kvfsm.workload.plan`), so
nothing per room crosses a pipe; decode checks every byte against the sources, which it computes
from the seed too. What counts as succeeded, failed, wedged or unsettled, and when the exit
status is 1: :mod:`kvfsm.workload.demo_report`.

This module is the orchestration only: the plan, the ranks, the registry, the progress line and
the summary live in :mod:`kvfsm.workload`, the flags in :mod:`kvfsm.cli`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvfsm.states import KVPoll
from kvfsm.workload.demo_report import summarize
from kvfsm.workload.options import DemoOptions
from kvfsm.workload.pair import Site, collect, running_ranks
from kvfsm.workload.progress import Progress
from kvfsm.workload.ranks import Outcome

__all__ = ["run_demo"]


def run_demo(opts: DemoOptions, site: Site | None = None) -> dict[str, Any]:
    """Run the demo and return its summary as a JSON-able dict (see the module docstring).
    Stops both ranks (prefill first) and the registry whatever happens, Ctrl-C included."""
    opts.validate()
    site = site if site is not None else Site()
    seed = (
        opts.seed if opts.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    )
    progress = Progress(opts.requests, opts.progress)
    pre: dict[int, Outcome] = {}
    dec: dict[int, Outcome] = {}
    t_setup = time.perf_counter()
    with running_ranks(site, opts, seed) as (prefill, decode):
        try:
            setup_s = time.perf_counter() - t_setup
            t0 = time.perf_counter()
            # Prefill first, and it answers once its first rooms exist: from then on its rooms
            # are there before decode's page lists or aborts for them arrive (its window is
            # larger).
            prefill.ask("run")
            decode.ask("run")
            ok = 0
            starved = False  # decode gave up on the rest: prefill's rooms for it never finish
            while len(dec) < opts.requests or (len(pre) < opts.requests and not starved):
                time.sleep(0.05)
                collect(prefill, pre, "prefill")
                starved |= collect(decode, dec, "decode")
                ok = sum(o.status == KVPoll.Success and not o.mismatched for o in dec.values())
                progress.show(len(dec), ok, len(dec) - ok)
            seconds = time.perf_counter() - t0
            progress.show(len(dec), ok, len(dec) - ok, force=True)
            pids = {"prefill": prefill.pid, "decode": decode.pid}
            stats = {"prefill": prefill.ask("stats"), "decode": decode.ask("stats")}
            late = decode.ask("late")
            extra = site.report()
        finally:
            progress.end()
    summary = summarize(opts, seed, pre=pre, dec=dec, seconds=seconds, setup_s=setup_s, pids=pids)
    summary["engines"] = stats
    summary["late_writes"] = late["late_writes"]
    summary["failures"] += late["notes"][: max(0, 10 - len(summary["failures"]))]
    summary.update(extra)
    return summary
