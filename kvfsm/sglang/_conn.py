"""``KvfsmKVSender`` / ``KvfsmKVReceiver``: one per request and side, as SGLang's scheduler builds
them; each wraps one kvfsm room facade.

Every method runs on the scheduler thread and returns at once: ``poll()`` reads the value the
room's task published; the others post an event to kvfsm's loop (law 6). What SGLang expects,
and how it is met (SGLang's prefill and decode schedulers, ``disaggregation/prefill.py`` and
``disaggregation/decode.py``):

* before ``init``/``send_metadata`` a room reports only Failed, Bootstrapping or WaitingForInput
  (the room's own table: it cannot move further without them);
* the last chunk is the one that brings the pages sent to ``init``'s count, and may be empty
  (``should_send_kv_chunk`` lets a zero-page last chunk through);
* decode reports Success only after prefill confirmed every write, aux row included, so the
  scheduler's metadata gate sees ``bootstrap_room`` in the aux row by then;
* decode prefix caching: decode passes only the pages past its cached prefix, with
  ``decode_prefix_len``; it travels with them, and prefill's room reports WaitingForInput only
  once they arrived, so ``pop_decode_prefix_len()`` has it when the scheduler asks
  (docs/decode-prefix.md);
* ``abort()`` makes ``poll()`` Failed when it returns; ``failure_exception()`` always raises,
  with the reason, and clears; ``clear()`` is idempotent and aborts a room that is not finished.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any, Final, NoReturn

import numpy as np
import numpy.typing as npt

from kvfsm.rooms import KVTransferError
from kvfsm.sglang._bases import (
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from kvfsm.sglang._dp_ranks import prefill_dp_plan
from kvfsm.sglang._early_send import ChunkGate
from kvfsm.sglang._legs import Legs
from kvfsm.states import TERMINAL, Part
from kvfsm.states import KVPoll as RoomStatus

if TYPE_CHECKING:
    from kvfsm.rooms import ReceiverRoom, SenderRoom
    from kvfsm.sglang._manager import KvfsmKVManager

__all__ = ["KvfsmKVReceiver", "KvfsmKVSender", "SGLangTransferError"]

# Read on every poll: a module global, not ``RoomStatus.Success`` (Python 3.11's EnumType
# defines ``__getattr__``, which makes every attribute read on an enum class several times
# slower).
_SUCCESS: Final = RoomStatus.Success

#: The clock of the transfer metric (a module attribute, so a test can hand it a virtual one).
_now = time.monotonic


class SGLangTransferError(KVTransferError):
    """What ``failure_exception()`` raises. SGLang's scheduler reads ``failure_reason`` and
    ``is_from_another_rank`` (the request failed on a sibling rank: this room is not Failed
    itself, the MIN all-reduce made it so) off the exception."""

    def __init__(self, room: int, reason: str, *, is_from_another_rank: bool = False) -> None:
        super().__init__(room, reason)
        self.is_from_another_rank = is_from_another_rank


def prefix_problem(decode_prefix_len: int, page_tokens: int) -> str | None:
    """Why decode's ``decode_prefix_len`` cannot be served, or None. Pages move whole: a prefix
    that ends inside a page would have prefill overwrite that page's cached tokens (SGLang's
    radix match is page-aligned, so it never sends one: docs/decode-prefix.md)."""
    if decode_prefix_len < 0:
        return f"decode_prefix_len={decode_prefix_len} is negative"
    if page_tokens > 1 and decode_prefix_len % page_tokens:
        return (
            f"decode_prefix_len={decode_prefix_len} is not a multiple of the page size "
            f"({page_tokens} tokens): pages move whole"
        )
    return None


class _Conn:
    """What both sides share: the room, its failure report and its clearing."""

    _room: Legs[SenderRoom] | Legs[ReceiverRoom]

    def __init__(self, mgr: KvfsmKVManager, bootstrap_addr: str, bootstrap_room: int) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self._cleared = False

    def poll(self) -> int:
        return self._room.poll()

    @property
    def reason(self) -> str:
        return self._room.reason

    def abort(self) -> None:
        self._room.abort("aborted by the scheduler (AbortReq)")

    def failure_exception(self) -> NoReturn:
        status = self._room.poll()
        room = self.bootstrap_room
        if status is RoomStatus.Failed:
            error = SGLangTransferError(room, self._room.reason or "failed")
        else:
            # Failed only in the MIN over ranks: some sibling rank failed. End this rank's room
            # too (clear() below aborts it), so it does not wait out its deadline.
            error = SGLangTransferError(
                room,
                f"failed on another rank (this rank was {RoomStatus(status).name})",
                is_from_another_rank=True,
            )
        self.clear()
        raise error

    def clear(self) -> None:
        if self._cleared:
            return
        self._cleared = True
        if self._room.poll() not in TERMINAL:
            self._room.abort("cleared before completion")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} room={self.bootstrap_room} {self._room.poll().name}>"


class KvfsmKVSender(_Conn, BaseKVSender):
    """Prefill side of one request."""

    #: SGLang may hand Mooncake device-side page indices with a CUDA event; kvfsm takes host
    #: indices only, so the scheduler converts them first.
    supports_host_tensor_indices = False

    def __init__(
        self,
        mgr: KvfsmKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        _Conn.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self._early_send_wait_event: Any = None
        self._gate = ChunkGate(self._ended, self._legs_reject)
        self._num_pages = 0
        self._sent_pages = 0
        self._chunks = 0
        #: When the first bytes were handed over (SGLang's own senders time "first enqueue
        #: -> Success": the prefill forward before it is not transfer time).
        self._started: float | None = None
        self._finished: float | None = None
        #: What each leg carries of the request (unequal TP), known at init.
        self._parts: list[Part] = []
        #: Leg 0; with decode's attention TP larger, one more leg per further decode rank,
        #: spawned once leg 0's destination says how many (``poll``).
        self._sender = mgr.new_sender(bootstrap_room)
        self._legs: Legs[SenderRoom] = Legs(self._sender)
        self._room = self._legs
        self._spawned = False
        #: Set by ``_poll_legs`` once ``poll`` may read leg 0 alone (see ``poll``).
        self._one_leg = False
        self._prefix_popped = False
        # A later pipeline stage reports this room's status to stage 0, whose scheduler alone
        # polls (poll_pp_consensus). A pipeline pairs only with equal attention TP, so leg 0
        # is the whole request; its published status is read there, never polled for it.
        mgr.stage_track(bootstrap_room, self._sender)
        # Its DP rank: registered for decode to find when this instance does not pick DP ranks
        # by room id; a request sent to the wrong rank for the room fails (``_dp_ranks``).
        self._dp_registration: concurrent.futures.Future[None] | None = None
        topo = mgr.topology
        plan = prefill_dp_plan(
            room=bootstrap_room,
            dp_size=topo.dp_size,
            dp_rank=topo.dp_rank,
            by_room=mgr.dp_by_room,
            force=mgr.force_dp_query,
            rank_named=req_has_disagg_prefill_dp_rank,
        )
        if plan.failure is not None:
            self._legs.reject(plan.failure)
        elif plan.register:
            self._dp_registration = mgr.register_dp_rank(bootstrap_room)

    def pop_decode_prefix_len(self) -> int:
        """Prompt tokens decode already holds (its radix cache), which prefill must not send:
        SGLang's ``finalize_bootstrap`` calls this at the request's first WaitingForInput,
        starts sending at that token and passes ``init`` only the pages after it. As in
        SGLang's own backends it pops: the value once it is known, 0 before and after."""
        if self._prefix_popped:
            return 0
        prefix = self._sender.decode_prefix
        if prefix:
            self._prefix_popped = True
        return prefix

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._num_pages = int(num_kv_indices)
        aux = -1 if aux_index is None else int(aux_index)
        # What each leg carries is known by now: the scheduler calls init on WaitingForInput,
        # which follows every leg's destination (and a part is published before it).
        self._parts = [room.part for room in self._legs.rooms]
        for room, part in zip(self._legs.rooms, self._parts, strict=True):
            if part is Part.NONE or part is Part.STATE:
                # A dummy rank for this request (unequal TP): its heads reach decode through
                # another rank. It moves nothing (or only its shard of the state, with the last
                # chunk) and ends with its last send, like SGLang's.
                room.init(0, -1)
            else:
                room.init(self._num_pages, aux)

    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ) -> None:
        rows = self.kv_mgr.states.rows(state_indices)
        if isinstance(rows, str):
            self._legs.reject(rows)
            return
        if self._sent_pages >= self._num_pages and self._chunks and not len(kv_indices):
            # The page count was reached by an earlier chunk, which kvfsm sent as the last one
            # (with the aux row). A trailing zero-page "last" send adds nothing, unless it
            # brings state rows the last chunk lacked: those cannot be sent any more.
            if rows:
                self._legs.reject(
                    "state rows arrived after the last chunk (the page count was reached by an "
                    "earlier send without them)"
                )
            return
        if self._started is None and (len(kv_indices) or rows or not self._num_pages):
            self._started = _now()
        self._sent_pages += len(kv_indices)
        self._chunks += 1
        last = self._sent_pages >= self._num_pages
        # SGLang's early send of prefix pages comes with the event of the forward that may still
        # be writing them, for this chunk only (``_early_send``).
        event, self._early_send_wait_event = self._early_send_wait_event, None
        if event is None and not self._gate.holding:
            self._post(kv_indices, rows, last)
        else:
            self._gate.submit(event, lambda: self._post(kv_indices, rows, last))

    def _post(self, kv_indices: npt.NDArray[np.int32], rows: Any, last: bool) -> None:
        for room, part in zip(self._legs.rooms, self._parts or [Part.WHOLE], strict=False):
            if part is Part.WHOLE:
                room.send(kv_indices, rows)
            elif part is Part.KV:
                # Its shard of sharded state too (the link's state piece says which bytes;
                # none for state another leg writes whole).
                room.send(kv_indices, rows)
            elif last and part is Part.STATE:
                room.send(b"", rows)  # its shard of the state, and the leg ends
            elif last:
                room.send(b"")  # a dummy's last chunk: it ends, having moved nothing

    def _ended(self) -> bool:
        return self._sender.poll() in TERMINAL

    def _legs_reject(self, reason: str) -> None:
        self._legs.reject(reason)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A zero-page last chunk must still be sent: it carries the aux row and ends the room.
        return num_pages > 0 or last_chunk

    def poll(self) -> int:
        # The scheduler polls every live request every iteration. Once the legs are known and
        # no DP registration is pending, a one-leg request's status is leg 0's (Legs.poll's MIN
        # of one): read straight, it skips three calls a poll.
        status = self._sender.poll() if self._one_leg else self._poll_legs()
        if status is _SUCCESS and self._finished is None:
            self._finished = _now()
        return status

    def _poll_legs(self) -> RoomStatus:
        if self._dp_registration is not None and self._dp_registration.done():
            self._registered()
        if not self._spawned:
            self._spawn_legs()
        self._one_leg = (
            self._spawned and self._dp_registration is None and len(self._legs.rooms) == 1
        )
        return self._legs.poll()

    def poll_pp_consensus(self) -> int:
        """Pipeline stage 0 (SGLang's bootstrap queue with ``--pp-size > 1``): the MIN of this
        room's status on every stage, a stage that has not reported it yet counting as
        Bootstrapping, as SGLang's ``check_status_pp_consensus`` does. A failure on another
        stage (or the loss of a stage) fails this room too, so decode hears of it and every
        leg ends; the scheduler then fails the request on every stage. Without pipeline
        parallelism, ``poll()``."""
        own = self.poll()
        if own in TERMINAL:
            return own
        status, reason = self.kv_mgr.stage_consensus(self.bootstrap_room, RoomStatus(own))
        if status is RoomStatus.Failed:
            self._legs.abort(reason)
            return self.poll()
        return status

    def clear(self) -> None:
        already = self._cleared
        super().clear()
        if not already:
            self.kv_mgr.stage_release(self.bootstrap_room, self._sender)

    def _registered(self) -> None:
        """The DP-rank registration ended: if it failed, decode cannot find this request's
        prefill rank, so the request fails here at once, with the registry's answer."""
        registration, self._dp_registration = self._dp_registration, None
        assert registration is not None
        error = (
            concurrent.futures.CancelledError("the kvfsm manager is closing")
            if registration.cancelled()
            else registration.exception()
        )
        if error is not None:
            self._legs.reject(
                f"registering its prefill DP rank {self.kv_mgr.topology.dp_rank} failed, so "
                f"decode cannot find it: {type(error).__name__}: {error}"
            )

    def _spawn_legs(self) -> None:
        """Once leg 0's destination arrived it says how many decode ranks this request goes
        to; the other legs are spawned then, before the scheduler can see WaitingForInput
        (they are Bootstrapping until their own destinations arrive, and the MIN with them)."""
        first = self._sender.poll()
        if first is RoomStatus.Bootstrapping:
            return
        self._spawned = True
        if first is RoomStatus.Failed:
            return
        mgr = self.kv_mgr
        for leg in range(1, self._sender.legs):
            self._legs.add(mgr.new_sender(self.bootstrap_room, leg=leg))

    def get_transfer_metric(self) -> KVTransferMetric:
        # Bytes read from this rank's pool: each leg that moves KV reads the pages (a head
        # slice of them when decode's attention TP is larger), and a whole leg the aux row.
        layout = self.kv_mgr.layout
        total = 0
        for part in self._parts or [Part.WHOLE]:
            if part is Part.WHOLE or part is Part.KV:
                total += self._sent_pages * layout.page_bytes()
            if part is Part.WHOLE and layout.aux:
                total += layout.aux_row_bytes()
        latency = None
        if self._finished is not None and self._started is not None:
            latency = self._finished - self._started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=total)


class KvfsmKVReceiver(_Conn, BaseKVReceiver):
    """Decode side of one request."""

    require_staging = False

    def __init__(
        self,
        mgr: KvfsmKVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
    ):
        room = -1 if bootstrap_room is None else int(bootstrap_room)
        _Conn.__init__(self, mgr, bootstrap_addr, room)
        #: One entry per prefill rank this request reads from (SGLang counts abort acks by it).
        self.bootstrap_infos: list[tuple[str, int]] = []
        self._group = mgr.new_group()
        self._legs: Legs[ReceiverRoom] = Legs(mgr.new_receiver(room, group=self._group))
        #: What each leg carries (``Part``), in leg order; known once ``init`` ran.
        self._parts: list[Part] = []
        self._room = self._legs
        mgr.track(room, self._legs)
        if bootstrap_room is None:
            self._legs.reject("no bootstrap_room: the request cannot be matched to a prefill")
        #: Set from kvfsm's loop when the prefill recompute of a re-bootstrapped request
        #: failed (``kv_mgr.submit_prefill_recompute``); applied on the scheduler thread.
        self.recompute_failure: str | None = None

    def poll(self) -> int:
        failure = self.recompute_failure
        if failure is not None:
            self.recompute_failure = None
            self._legs.reject(failure)  # a no-op once the room ended (a late answer)
        return self._room.poll()

    @property
    def conclude_state(self) -> int | None:
        """Failed once the room failed, else None (SGLang checks it right after ``init``)."""
        return KVPoll.Failed if self._room.poll() is RoomStatus.Failed else None

    @property
    def abort_notified(self) -> bool:
        """True once the room failed after naming its prefill rank: kvfsm has then told that rank
        and will learn when its writes are over (``kv_mgr.is_abort_release_safe``)."""
        return bool(self.bootstrap_infos) and self._room.poll() is RoomStatus.Failed

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        if self._room.poll() not in TERMINAL:
            self._room.abort("aborted by the scheduler (deferred release)")

    def is_abort_release_safe(self) -> bool:
        return self._room.settled

    def init(self, prefill_dp_rank: int) -> None:
        mgr, addr, dp_rank = self.kv_mgr, self.bootstrap_addr, int(prefill_dp_rank)
        plan = mgr.legs_for(addr)
        if isinstance(plan, str):
            self._legs.reject(plan)
            return
        peers = [mgr.peer_for(addr, dp_rank, leg.tp_rank, leg.pp_rank) for leg in plan]
        problem = next((peer for peer in peers if isinstance(peer, str)), None)
        if problem is not None:
            self._legs.reject(problem)
            return
        if self._legs.poll() is RoomStatus.Failed:
            return  # refused already (a duplicate room id): no more legs for it
        for leg in range(1, len(plan)):
            self._legs.add(mgr.new_receiver(self.bootstrap_room, leg=leg, group=self._group))
        self._parts = [leg.part for leg in plan]
        pp_size = mgr.prefill_info_table[addr].pp_size
        self._legs.sources = [leg.source(pp_size) for leg in plan]
        self.bootstrap_infos = [(addr, dp_rank)] * len(plan)
        for room, peer in zip(self._legs.rooms, peers, strict=True):
            assert isinstance(peer, int)
            room.init(peer)

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        if destination != KVTransferDestination.DEVICE:
            self._legs.reject(f"destination {destination!r}: kvfsm writes device KV only")
            return
        # kv_indices are the pages past the prefix only (SGLang slices them so, decode.py:1642).
        prefix = int(decode_prefix_len or 0)
        problem = prefix_problem(prefix, int(getattr(self.kv_mgr.kv_args, "page_size", 0) or 0))
        if problem is not None:
            self._legs.reject(problem)
            return
        rows = self.kv_mgr.states.rows(state_indices)
        if isinstance(rows, str):
            self._legs.reject(rows)
            return
        aux = -1 if aux_index is None else int(aux_index)
        parts = self._parts or [Part.WHOLE]
        for room, part in zip(self._legs.rooms, parts, strict=True):
            # Every leg names the prefix: each prefill rank skips the same pages.
            if part is Part.WHOLE:
                room.send_metadata(kv_indices, aux, rows, prefix=prefix)
            elif part is Part.KV:  # another leg carries the aux row; state is sharded by link
                room.send_metadata(kv_indices, -1, rows, Part.KV, prefix)
            elif part is Part.STATE:  # that prefill rank writes its state shard, no KV
                room.send_metadata(b"", -1, rows, Part.STATE, prefix)
            else:  # a dummy: that prefill rank holds none of this rank's heads
                room.send_metadata(b"", -1, None, Part.NONE, prefix)

    def clear(self) -> None:
        already = self._cleared
        super().clear()
        if not already:
            self.kv_mgr.cleared(self.bootstrap_room, self._legs)
