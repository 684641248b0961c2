"""The replay of SGLang 0.5.23's scheduler with pipeline parallelism on prefill (``--pp-size``).

What SGLang does (``disaggregation/utils.py`` and ``prefill.py``), and what this
replays on several pipeline stages in one process, each stage a TP group of real
``KvfsmKVManager`` ranks over real NIXL:

* Every stage's scheduler builds a sender for every request (the requests reach every stage
  in the same order) and holds only its own span of layers: stage ``s`` of a model of ``L``
  layers registers the K and V buffers of layers ``first_s .. first_s + n_s - 1`` and sets
  ``KVArgs.pp_rank`` and ``prefill_start_layer``.
* Bootstrap queue (``pop_bootstrapped``): only PP rank 0 polls, with ``poll_pp_consensus()``,
  MIN-reduced over its attention-TP ranks; the list travels down the chain and every stage acts
  on it: Failed fails the request on every stage, WaitingForInput runs ``finalize_bootstrap``
  (``init``) on every stage. The replay checks that a stage told WaitingForInput really is:
  its own senders' polls say so (what the consensus is for).
* Chunks: every stage sends the same pages of its own layers, the last chunk with the aux row
  (every stage calls ``set_buf``; the rows of the last stage, which samples, are the ones
  decode must hold).
* Inflight queue (``process_disagg_prefill_inflight_queue``): stage 0 MIN-polls its own
  senders; a later stage looks only at the requests the stage before it finished, and
  finishes one only when its own MIN poll is terminal too.

Decode is the ordinary replay (:class:`~tests.helpers.sglang_replay.DecodeScheduler`): one request,
one receiver per decode rank, which reads from every stage. Every KV byte is checked against
the whole model's fill (:attr:`Pipeline.view`: prefill's buffers of every layer, the very arrays
the stages registered), so a layer written into the wrong decode buffer, or not at all, shows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvfsm.sglang import KvfsmKVManager, KvfsmKVSender
from kvfsm.sglang._bases import DisaggregationMode, KVPoll
from tests.helpers.sglang_replay import (
    AUX_ROWS,
    PAGE_TOKENS,
    Checker,
    Instance,
    Pair,
    RankBuffers,
    Request,
    StateSpec,
    min_poll,
    rank_heads,
    server_args,
)
from tests.helpers.waiting import ConditionTimeoutError, wait_until_sync


def spans(layers: int, stages: int) -> list[tuple[int, int]]:
    """``(first layer, layers)`` of each stage, as SGLang splits them (``get_pp_indices``: an
    even split, the remainder to the last stages)."""
    base, extra = divmod(layers, stages)
    out, first = [], 0
    for s in range(stages):
        n = base + (1 if s >= stages - extra else 0)
        out.append((first, n))
        first += n
    return out


def stage_buffers(full: RankBuffers, first: int, n: int, layers: int) -> RankBuffers:
    """Stage view of ``full`` (a rank's buffers for the whole model): the K and V buffers of its
    layers, in SGLang's order (all its K, then all its V), and the state buffers of its layers
    (each state type's, by their layer ids), sharing ``full``'s arrays; aux rows of its own."""
    k = [full.kv[first + i] for i in range(n)]
    v = [full.kv[layers + first + i] for i in range(n)]
    specs, states = [], []
    for spec, group in zip(full.specs, full.states, strict=True):
        mine = [b for b, layer in enumerate(spec.layers) if first <= layer < first + n]
        specs.append(
            replace(
                spec,
                item_bytes=tuple(spec.item_bytes[b] for b in mine),
                layers=tuple(spec.layers[b] for b in mine),
            )
        )
        states.append([group[b] for b in mine])
    return replace(
        full,
        kv=k + v,
        output_ids=np.zeros((AUX_ROWS, 16), np.int32),
        rooms=np.zeros((AUX_ROWS, 8), np.int64),
        specs=tuple(specs),
        states=states,
        channels=[[None] * len(group) for group in states],
    )


@dataclass
class Pipeline:
    """A prefill instance with ``len(stages)`` pipeline stages of ``tp`` ranks each."""

    stages: list[Instance]
    #: The whole model's prefill buffers per TP rank (no managers): what decode must hold. Its
    #: aux rows are the last stage's.
    view: Instance

    @classmethod
    def start(
        cls,
        port: int,
        tp: int,
        pp: int,
        *,
        layers: int,
        generation: int = 0,
        heads: int = 0,
        state: tuple[StateSpec, ...] = (),
    ) -> Pipeline:
        """``state``: the model's state types, each buffer with its layer (``StateSpec.layers``),
        split over the stages by layer."""
        total = heads or tp
        full = [
            RankBuffers.make(
                generation,
                rank=r,
                heads=rank_heads(r, tp, total),
                total_heads=total,
                state=state,
                layers=layers,
            )
            for r in range(tp)
        ]
        stages: list[Instance] = []
        try:
            for s, (first, n) in enumerate(spans(layers, pp)):
                buffers = [stage_buffers(b, first, n, layers) for b in full]
                managers = []
                stages.append(Instance("prefill", buffers, managers, total, generation=generation))
                for r, b in enumerate(buffers):
                    args = b.kv_args(r)
                    args.pp_rank = s
                    args.prefill_start_layer = first
                    sargs = server_args(port, tp)
                    sargs.pp_size = pp
                    managers.append(
                        KvfsmKVManager(args, DisaggregationMode("prefill"), sargs, False)
                    )
        except BaseException:
            for stage in stages:
                stage.close()
            raise
        last = stages[-1].buffers
        view = [
            replace(b, output_ids=last[r].output_ids, rooms=last[r].rooms)
            for r, b in enumerate(full)
        ]
        return cls(stages, Instance("prefill", view, [], total, generation=generation))

    @property
    def managers(self) -> list[KvfsmKVManager]:
        return [m for stage in self.stages for m in stage.managers]

    def live_rooms(self) -> int:
        return sum(stage.live_rooms() for stage in self.stages)

    def leaks(self, timeout: float = 5.0) -> list[str]:
        # A later stage's last report and its forget travel on its status link after its
        # rooms are reaped: give them time to arrive before counting stage 0's entries.
        # What is still held after the timeout is reported below, not raised.
        with contextlib.suppress(ConditionTimeoutError):
            wait_until_sync(
                lambda: not any(m.stage_entries() for m in self.managers),
                timeout=timeout,
                interval=0.005,
            )
        found = []
        for s, stage in enumerate(self.stages):
            found += [f"stage {s}: {leak}" for leak in stage.leaks()]
            for r, m in enumerate(stage.managers):
                left = m.stage_entries()
                if left:
                    found.append(f"stage {s} rank {r}: {left} pipeline status entries")
        return found

    def transport_snapshots(self) -> list[list[dict[str, Any]]]:
        return [stage.transport_snapshots() for stage in self.stages]

    def close(self) -> None:
        # Later stages first: stage 0's hub is what they report to.
        for stage in reversed(self.stages):
            stage.close()


class PipelinePrefillScheduler:
    """SGLang's PP prefill queues on every stage, in lockstep (see the module docstring).
    ``req.senders`` holds every stage's senders, stage after stage (the rank numbers the
    :class:`Checker` and ``prefill_abort_rank`` use: ``stage * tp + tp_rank``)."""

    def __init__(self, pipeline: Pipeline, checker: Checker, bootstrap_addr: str) -> None:
        self.pipeline = pipeline
        self.check = checker
        self.addr = bootstrap_addr
        self.tp = pipeline.stages[0].tp
        self.bootstrap: list[Request] = []
        self.forward: list[Request] = []
        #: Per stage: the requests in its inflight queue, and those it finished.
        self.inflight: list[list[Request]] = [[] for _ in pipeline.stages]
        self.finished: list[set[int]] = [set() for _ in pipeline.stages]
        self._consensus: dict[int, Any] = {}
        self._outcomes: dict[int, list[str]] = {}

    def _stage(self, req: Request, s: int) -> list[KvfsmKVSender]:
        return req.senders[s * self.tp : (s + 1) * self.tp]

    def add(self, req: Request) -> None:
        if req.prefill_ignores:
            return
        req.senders = [
            self.check.call(
                "KvfsmKVSender()",
                KvfsmKVSender,
                mgr=m,
                bootstrap_addr=self.addr,
                bootstrap_room=req.room,
                req_has_disagg_prefill_dp_rank=False,
            )
            for m in self.pipeline.managers
        ]
        for s in req.senders[: self.tp]:
            # Checker.poll calls .poll(): a stable object per sender, so its history is kept.
            self._consensus[id(s)] = SimpleNamespace(poll=s.poll_pp_consensus)
        self._outcomes[req.room] = []
        self.bootstrap.append(req)

    def _fail_everywhere(self, req: Request) -> None:
        req.prefill_reasons = [
            self.check.failure("prefill", req, r, s) for r, s in enumerate(req.senders)
        ]
        req.prefill_outcome = "Failed"

    def step(self) -> None:
        self._bootstrap_queue()
        for req in list(self.forward):
            self._send_next_chunk(req)
        self._inflight_queues()

    def _bootstrap_queue(self) -> None:
        for req in list(self.bootstrap):
            if req.prefill_abort_early:
                for r, s in enumerate(req.senders):
                    self.check.abort("prefill", req, r, s)
            # PP rank 0 polls the consensus, MIN over its TP ranks; pp_sync_polls hands the
            # list to every later stage, which acts on it without polling.
            polls = [
                self.check.poll("prefill", req, r, self._consensus[id(s)], before_init=True)
                for r, s in enumerate(self._stage(req, 0))
            ]
            status = min_poll(polls)
            if status == KVPoll.Failed:
                self.bootstrap.remove(req)
                self._fail_everywhere(req)
            elif status == KVPoll.WaitingForInput:
                self.bootstrap.remove(req)
                req.popped, req.rank_chunks = [], []
                for r, s in enumerate(req.senders):
                    own = int(s.poll())
                    if own != KVPoll.WaitingForInput:
                        self.check.violations.append(
                            f"prefill room {req.room} rank {r}: the pipeline consensus said "
                            f"WaitingForInput, this stage's sender says {KVPoll(own).name}"
                        )
                    prefix = self.check.call("pop_decode_prefix_len", s.pop_decode_prefix_len)
                    req.popped.append(prefix)
                    req.rank_chunks.append(req.chunks_from(prefix))
                    num_pages = -(-(req.input_len - prefix) // PAGE_TOKENS)
                    self.check.call("sender init", s.init, num_pages, req.src_aux)
                self.forward.append(req)

    def _send_next_chunk(self, req: Request) -> None:
        i = req.chunks_sent
        if req.prefill_abort_after is not None and i >= req.prefill_abort_after:
            r = req.prefill_abort_rank
            self.check.abort("prefill", req, r, req.senders[r])
            self.forward.remove(req)
            self.inflight[0].append(req)
            return
        last = i == len(req.chunks) - 1
        buffers = [b for stage in self.pipeline.stages for b in stage.buffers]
        for r, (s, b) in enumerate(zip(req.senders, buffers, strict=True)):
            pages = np.asarray(req.rank_chunks[r][i], np.int32)
            if last:
                # Every stage's set_buf. The output ids name the TP rank, as the replay's
                # (verify_success expects the last stage's), plus 50 * (stage + 1) on the
                # other stages, whose rows must not reach decode.
                stage, tp_rank = divmod(r, self.tp)
                other = 0 if stage == len(self.pipeline.stages) - 1 else 50 * (stage + 1)
                ids = np.arange(16, dtype=np.int32) + req.room * 100 + tp_rank + other
                b.output_ids[req.src_aux] = ids
                b.rooms[req.src_aux] = req.room
            if self.check.call("should_send_kv_chunk", s.should_send_kv_chunk, len(pages), last):
                # Every stage sends its own state buffers' items with the last chunk.
                state = b.state_indices(req, "src") if last else None
                self.check.call(
                    "sender send", s.send, pages, state, num_kv_tokens=len(pages) * PAGE_TOKENS
                )
        req.chunks_sent += 1
        if last:
            self.forward.remove(req)
            self.inflight[0].append(req)

    def _inflight_queues(self) -> None:
        stages = len(self.pipeline.stages)
        for st in range(stages):
            for req in list(self.inflight[st]):
                if st and req.room not in self.finished[st - 1]:
                    continue  # rids_to_check: the stage before has not finished it yet
                polls = [
                    self.check.poll("prefill", req, st * self.tp + r, s, before_init=False)
                    for r, s in enumerate(self._stage(req, st))
                ]
                status = min_poll(polls)
                if status not in (KVPoll.Success, KVPoll.Failed):
                    continue
                self.inflight[st].remove(req)
                self.finished[st].add(req.room)
                outcomes = self._outcomes[req.room]
                outcomes.append("Success" if status == KVPoll.Success else "Failed")
                for r, s in enumerate(self._stage(req, st)):
                    if status == KVPoll.Success:
                        self.check.call("sender clear", s.clear)
                    else:
                        req.prefill_reasons.append(
                            self.check.failure("prefill", req, st * self.tp + r, s)
                        )
                if st + 1 < stages:
                    self.inflight[st + 1].append(req)
                else:
                    req.prefill_outcome = (
                        "Success" if all(o == "Success" for o in outcomes) else "Failed"
                    )


class PipelinePair(Pair):
    """A pipelined prefill instance and a decode instance, driven in lockstep; every Success
    checked byte for byte against the whole model's fill."""

    def __init__(self, prefill: Pipeline, decode: Instance, port: int) -> None:
        super().__init__(prefill.view, decode, port)
        self.pipeline = prefill
        self.prefill = prefill  # type: ignore[assignment]  # drain() and leaks: every stage
        self.p = PipelinePrefillScheduler(prefill, self.check, self.addr)  # type: ignore[assignment]

    def wait_for_stages(self, timeout: float = 20.0) -> None:
        """Until every later stage's status link reached stage 0 (start-up)."""
        wait_until_sync(
            lambda: all(m.stage_ready() for m in self.pipeline.managers),
            timeout=timeout,
            interval=0.005,
            message="the pipeline stages to connect to stage 0",
        )
