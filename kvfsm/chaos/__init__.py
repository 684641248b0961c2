"""Fault injection and reliability campaigns (docs/reliability.md).

* ``_plan``: seeded fault plans, one random stream per fault site (replayable from the seed).
* ``_transport_faults``: a proxy around the raw NIXL agent (``AgentConfig(interpose=...)``) that
  makes real transfers fail on post, fail on completion, never complete, or complete late.
* ``_control_proxy``: a TCP proxy between decode and prefill that drops, duplicates, reorders,
  delays, truncates or corrupts control frames, or cuts the connection.
* ``_hostile``: hostile clients for a prefill rank's control port.
* ``_campaign``, ``_rank``, ``_options``, ``_cli``: ``kvfsm chaos``, randomized episodes against a
  real prefill process and a real decode process (freezes of either rank past decode's settle
  bound, room ids reused at once and oversized calls among the faults), with the report and its
  checks. The campaign process's faults are ``_campaign_faults``, its scores and report
  ``_campaign_scoring``, its helpers inside network namespaces ``_netns_helpers``; what a rank
  answers over its pipe and counts is ``_rank_service``. ``add_chaos_parser`` and
  ``run_chaos`` are the subcommand, for ``kvfsm.cli``.
* ``_servers``, ``_server_*``, ``_decode_dropper``: ``kvfsm chaos servers``, the campaign against
  real SGLang servers (a reference, a kvfsm prefill and decode, the router): its seeded plan
  (``_server_plan``) and scores (``_server_scoring``), both pure; the servers and what is read of
  them (``_servers``, ``_server_rig``), the clients (``_server_client``), the proxy that drops
  the router's request to decode (``_decode_dropper``), the soak's samples (``_server_soak``),
  the report (``_server_report``) and the command (``_server_cli``).
* ``_netns``, ``_two_hosts``: two network namespaces joined by a veth pair, the demo and a
  link-cut scenario across them (``kvfsm demo --two-hosts``); ``kvfsm chaos --two-hosts`` runs
  the campaign across them, with link cuts as one more fault.
"""

from __future__ import annotations

from kvfsm.chaos._cli import add_parser as add_chaos_parser
from kvfsm.chaos._cli import run as run_chaos
from kvfsm.chaos._control_proxy import ProxyThread
from kvfsm.chaos._plan import ControlRates, FaultPlan, FrameFault, TransferFault, TransferRates
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.chaos._two_hosts import run_demo_two_hosts

__all__ = [
    "ControlRates",
    "FaultPlan",
    "FrameFault",
    "ProxyThread",
    "TransferFault",
    "TransferRates",
    "TransportFaults",
    "add_chaos_parser",
    "faulty_agent_config",
    "run_chaos",
    "run_demo_two_hosts",
]
