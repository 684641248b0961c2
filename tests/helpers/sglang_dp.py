"""The SGLang replay (:mod:`tests.helpers.sglang_replay`) with a data-parallel prefill instance:
SGLang's DP controller runs each request on one prefill DP rank, whose scheduler alone builds
its senders, and decode finds that rank the way SGLang 0.5.23's decode scheduler does, with
SGLang's own code: ``DecodePreallocQueue._resolve_prefill_dp_rank`` (the rank the router named,
``bootstrap_room % dp_size`` under ``follow_bootstrap_room``, else unknown) and, for the rooms it
cannot compute, ``CommonKVReceiver.query_prefill_dp_ranks`` against the instance's bootstrap
server (kvfsm's registry), as ``_resolve_pending_reqs`` does. A room the registry does not know
yet stays pending and is asked for again on the next step.

Each DP group's prefill bytes are a generation of their own
(:meth:`~tests.helpers.sglang_replay.Instance.dp_group`), so KV, aux and state rows from the
wrong DP rank fail the byte checks.

SGLang's decode scheduler is imported on first use (a few seconds of CPU).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvfsm.sglang import KvfsmKVManager
from tests.helpers.sglang_replay import Instance, Pair, PrefillScheduler, Request, verify_success


def _sglang() -> tuple[Any, Any]:
    # On a CPU, SGLang's quantization modules warn at import that they need CUDA (AWQ, GGUF):
    # SGLang's words about this machine, not about kvfsm; the suite turns warnings into errors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.disaggregation.common.conn import CommonKVReceiver
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

    return DecodePreallocQueue, CommonKVReceiver


class SGLangDpResolver:
    """Decode's ``_resolve_pending_reqs`` for one prefill instance, with SGLang's functions.
    ``queries`` counts the registry lookups, ``asked`` the rooms they asked about."""

    def __init__(self, manager: KvfsmKVManager, addr: str) -> None:
        self.queue, self.receiver = _sglang()
        self.mgr = manager
        self.addr = addr
        self.queries = 0
        self.asked: list[int] = []

    def _req(self, req: Request) -> SimpleNamespace:
        host, port = self.addr.rsplit(":", 1)
        return SimpleNamespace(
            bootstrap_host=host,
            bootstrap_port=int(port),
            bootstrap_room=req.room,
            disagg_prefill_dp_rank=req.prefill_dp if req.dp_named else None,
        )

    def __call__(self, reqs: Sequence[Request]) -> dict[int, int]:
        me = SimpleNamespace(kv_manager=self.mgr)
        found: dict[int, int] = {}
        need = []
        for req in reqs:
            rank = self.queue._resolve_prefill_dp_rank(me, self._req(req))
            if rank is None:
                need.append(req.room)
            else:
                found[req.room] = int(rank)
        if need:
            self.queries += 1
            self.asked.extend(need)
            answer = self.receiver.query_prefill_dp_ranks(self.addr, need)
            for room in need:
                if str(room) in answer:
                    found[room] = int(answer[str(room)])
        return found


class DpPair(Pair):
    """A DP prefill instance and a decode instance: each request's senders are built on its
    ``prefill_dp`` group only, and its bytes checked against that group's."""

    def __init__(self, prefill: Instance, decode: Instance, port: int) -> None:
        super().__init__(prefill, decode, port)
        self.groups = [prefill.dp_group(d) for d in range(prefill.dp)]
        self.ps = [PrefillScheduler(g, self.check, self.addr) for g in self.groups]
        self.resolver = SGLangDpResolver(decode.managers[0], self.addr)
        self.d.dp_ranks = self.resolver
        self.d.on_commit = lambda req: self.check.violations.extend(
            verify_success(req, self.groups[req.prefill_dp], decode, self.row_sources)
        )

    def submit(self, requests: Sequence[Request]) -> None:
        for req in requests:
            self.d.add(req)
            self.ps[req.prefill_dp].add(req)

    def step(self) -> None:
        for p in self.ps:
            p.step()
        self.d.step()
