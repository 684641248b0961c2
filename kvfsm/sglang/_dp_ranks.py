"""Which DP rank of a prefill instance serves a request, as SGLang 0.5.23 decides it
(``CommonKVSender.__init__`` and the decode scheduler's ``_resolve_prefill_dp_rank``,
``disaggregation/common/conn.py`` and ``disaggregation/decode.py``).

A prefill instance with several data-parallel ranks runs each request on one of them. With the
prefill's load balancing at ``follow_bootstrap_room`` (SGLang's default for prefill), that is
DP rank ``bootstrap_room % dp_size``, which decode computes itself. Otherwise (round robin, a
load-aware method) or with ``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`` set, the rank
that got the request registers it with the instance's bootstrap registry and decode's scheduler
asks the registry (``/query_dp_ranks``). A request whose DP rank the router named
(``disagg_prefill_dp_rank``) needs neither. A rank that got a request which
``follow_bootstrap_room`` sends elsewhere (an external DP dispatch) fails it, with SGLang's
reason: decode would look for its KV on the other rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

__all__ = [
    "FORCE_QUERY_ENV",
    "DpPlan",
    "dp_by_room",
    "force_flag",
    "force_query",
    "prefill_dp_plan",
]

FORCE_QUERY_ENV: Final = "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"
_FOLLOW: Final = "follow_bootstrap_room"
# SGLang's EnvBool spellings.
_TRUE: Final = frozenset({"true", "1", "yes", "y"})
_FALSE: Final = frozenset({"false", "0", "no", "n", ""})


def force_flag(variable: str) -> bool:
    """A boolean SGLang environment variable, read as SGLang reads them; a value SGLang would
    not read as one is refused, naming the variable."""
    raw = os.environ.get(variable, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{variable}={raw!r}: expected true/false, 1/0, yes/no")


def force_query() -> bool:
    """``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`` (:func:`force_flag`)."""
    return force_flag(FORCE_QUERY_ENV)


def dp_by_room(load_balance_method: str | None, mode: str) -> bool:
    """Whether an instance serves room ``r`` on DP rank ``r % dp_size``: its load balancing
    is ``follow_bootstrap_room``, which ``auto`` (SGLang's default) means on prefill."""
    method = (load_balance_method or "auto").lower()
    if method == "auto":
        return mode == "prefill"
    return method == _FOLLOW


@dataclass(frozen=True, slots=True)
class DpPlan:
    """What a prefill rank does for a new request: ``register`` its DP rank with the registry
    (decode will ask for it), or fail it with ``failure`` (or neither)."""

    register: bool = False
    failure: str | None = None


def prefill_dp_plan(
    *,
    room: int,
    dp_size: int,
    dp_rank: int,
    by_room: bool,
    force: bool,
    rank_named: bool,
) -> DpPlan:
    """SGLang's rule, for the request ``room`` on DP rank ``dp_rank`` of ``dp_size``.
    ``rank_named``: the router named the request's prefill DP rank (decode knows it too)."""
    if dp_size <= 1 or rank_named:
        return DpPlan()
    if not by_room or force:
        return DpPlan(register=True)
    if dp_rank != room % dp_size:
        return DpPlan(
            failure=(
                f"follow_bootstrap_room conflict: dispatched to dp_rank {dp_rank} but "
                f"bootstrap_room {room} implies dp_rank {room % dp_size}. Set "
                f"{FORCE_QUERY_ENV}=1 to allow mixed routing."
            )
        )
    return DpPlan()
