"""``NixlTransport``: the rooms' data path over NIXL, as a ``CommandSink``.

Prefill rooms emit ``PostChunk`` and ``ReleaseHandles``; this module turns them into NIXL WRITEs
from the local layout into a peer's pages and answers with ``ChunkDone``, ``ChunkFailed``,
``ChunkStalled`` and ``PeerLost``. Every other command is the control channel's: a rank's
router (``kvfsm.manager.CommandRouter``) sends it there, never here; used alone, as the engine's
only sink, this transport drops them (outcomes go nowhere).

The rules (which chunk ends how, quarantines, lost peers, fences) live in one place, the
sans-IO :class:`~kvfsm.transport._ledger.ChunkLedger`; the other modules execute its actions,
each on its own thread, and this one only wires them:

* :mod:`kvfsm.transport._chunks`: a ``PostChunk`` checked and made into a record (loop
  thread), and its transfers made, fenced and posted (the poster thread,
  :mod:`kvfsm.transport._poster`): ``transfer()`` copies synchronously on shared-memory paths.
  The records of one batch of room steps (the chunks that rooms post while handling, say, one
  scheduler iteration's calls) are handed to the ledger together at its end, small ones to
  the same peer and fence merged into one request (``TransferConfig.merge_max_bytes``; the
  ledger's rule 8): one ``make_prepped_xfer``, ``transfer()`` and handle instead of one per
  chunk. Chunks are grouped per peer generation and fence, in posting order within each
  (:func:`group_staged`), so a batch whose rooms alternate between decode peers still
  merges. A full request does not wait for the batch's end: it is handed over between two
  room steps (``Inbox.rooms_ran_soon``), the group that may still grow staying staged.
* :mod:`kvfsm.transport._pump`: the ledger's actions and the completion pump (loop thread);
  it owns every posted handle until it is released, and keeps progressing the agent after a
  hold.
* :mod:`kvfsm.transport._peers`: peers and their generations, connected on the peer set's own
  thread (``add_remote_agent`` takes milliseconds), so a connecting peer never delays another
  peer's chunks.

Handles belong to the pump, not to rooms. A room that fails still has its posted handles
drained; a chunk not yet posted when its room asks to release is dropped. Each chunk has a
deadline, ``deadline_base_s + bytes / floor_bandwidth``. A handle past it is released and
reported ``ChunkStalled`` (the room fails at once), and ``ChunkFailed`` follows only after
``quarantine_s``: bytes of a cancelled WRITE may still land, so its pages stay unsettled that
long (law 4). Every handle is released explicitly, on every path.

Write fencing (law 4, :mod:`kvfsm.transport._fence`). With ``leases`` set, every chunk names
a fence (``PostChunk.fence``) and is written only under a valid lease on it: checked when the
chunk is accepted, again on the poster thread immediately before each ``transfer()``, and by
the pump before each progress of the agent (an in-flight chunk whose lease went away is
released and held). Fence 0 on a fenced transport is refused. Without ``leases`` nothing is
fenced (direct users, benchmarks). Why the pump keeps progressing after a lease is gone:
:mod:`kvfsm.transport._pump`; what stays unfenced: ``docs/reliability.md``, Write fencing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict
from typing import cast

from kvfsm.rooms import CommandSink, Inbox, RoomKey
from kvfsm.states import ChunkFailed, Command, PostChunk, ReleaseHandles
from kvfsm.transport._agent import Agent, Peer
from kvfsm.transport._chunks import Xfer, merge, post_xfer, prepare
from kvfsm.transport._config import ChunkObserver, TransferConfig, TransportStats
from kvfsm.transport._fence import Leases
from kvfsm.transport._layout import LayoutSummary
from kvfsm.transport._ledger import DROPPED, Action, ChunkLedger, Deliver, Post, Record
from kvfsm.transport._peers import PeerSet
from kvfsm.transport._poster import Poster
from kvfsm.transport._pump import Pump
from kvfsm.transport._slices import KvPiece
from kvfsm.transport._state_slices import StatePiece

# TransferConfig, TransportStats and ChunkObserver live in _config; re-exported here, where
# callers have always imported them from.
__all__ = ["ChunkObserver", "NixlTransport", "TransferConfig", "TransportStats"]

_log = logging.getLogger("kvfsm.transport")
_NO_PEER: object = object()
#: What one NIXL request's own calls (make, transfer, check, release) cost the poster, counted
#: as bytes copied in that time, so that a run of tiny requests is handed back in bounded
#: time too (TransferConfig.hand_back_bytes).
_REQUEST_BYTES = 32 << 10


def _posting_weight(record: Xfer) -> int:
    return record.nbytes + _REQUEST_BYTES


def group_staged(
    staged: list[Xfer], max_chunks: int, max_bytes: int
) -> tuple[list[list[Xfer]], int]:
    """``staged`` (a batch's records in posting order) in the groups ``_hand_over`` takes, and
    the index of the group that may still grow, or -1.

    The mergeable records of each (peer generation, fence) form groups of their own, each in
    posting order and within ``max_chunks`` records and ``max_bytes`` bytes: a batch spreads
    its rooms over several decode peers, and runs of one peer in posting order would leave
    every chunk alone as soon as two peers alternate. Records of two generations of a peer,
    or under two fences, never share a group (law 4: a request is posted under one lease, to
    the generation whose lists it names). A group that cannot take the next record of its key
    is closed and a new one begins. Every other record is a group alone: a dropped one
    (never posted; it closes nothing) and one that is not mergeable, which closes its key's
    open group, so that each key's records reach the poster in posting order. Groups are in
    the order of their first records.

    The group that may still grow is the one holding the last staged record, when that one
    is mergeable and not dropped: the open group of the peer a room posted to last, which is
    the peer its next chunk goes to."""
    groups: list[list[Xfer]] = []
    sizes: list[int] = []  # bytes of each group (those alone included, unread)
    open_at: dict[tuple[Hashable, int], int] = {}  # a key's open group, by index
    # The previous record's key and group, so that a run to one peer (the batch of a
    # prefill with one decode peer) costs no dict look-up.
    last_peer: object = _NO_PEER
    last_fence = 0
    at = -1
    for record in staged:
        if record.dropped or not record.mergeable:
            if not record.dropped:
                open_at.pop((record.peer, record.fence), None)
                if record.peer is last_peer and record.fence == last_fence:
                    last_peer = _NO_PEER
            groups.append([record])
            sizes.append(record.nbytes)
            continue
        peer, fence = record.peer, record.fence
        if not (peer is last_peer and fence == last_fence):
            at = open_at.get((peer, fence), -1)
            last_peer, last_fence = peer, fence
        if at >= 0 and len(groups[at]) < max_chunks and sizes[at] + record.nbytes <= max_bytes:
            groups[at].append(record)
            sizes[at] += record.nbytes
            continue
        at = open_at[peer, fence] = len(groups)
        groups.append([record])
        sizes.append(record.nbytes)
    last = staged[-1] if staged else None
    growing = at if last is not None and last.mergeable and not last.dropped else -1
    return groups, growing


class NixlTransport(CommandSink):
    """A ``CommandSink`` for a prefill engine: chunks become NIXL WRITEs into peers' pages.

    Lifecycle: build an :class:`Agent` (blocking), wrap it here, hand this (or a router in
    front of it and a control channel) to a ``RoomEngine`` (``attach`` starts the pump),
    connect peers with :meth:`connect_peer`, run rooms;
    ``engine.close()``, then :meth:`close` (releases anything left, then the agent's peers).
    With ``leases`` (granted and revoked by the control plane on the loop thread) every chunk
    is fenced by its ``PostChunk.fence``; without, nothing is.
    """

    def __init__(
        self,
        agent: Agent,
        config: TransferConfig | None = None,
        observer: ChunkObserver | None = None,
        leases: Leases | None = None,
        on_fenced_out: Callable[[str], None] | None = None,
    ) -> None:
        self.agent = agent
        #: Called (loop thread) once the stale-progress gate fenced the agent out, after its
        #: chunks failed; the process's policy (``ManagerConfig.exit_on_fenced_out``).
        self.on_fenced_out = on_fenced_out
        self.config = config if config is not None else TransferConfig()
        self.stats = TransportStats()
        #: Write leases every chunk is fenced by; None: nothing is fenced.
        self.leases = leases
        self._ledger = ChunkLedger(
            deadline_s=self.config.deadline_s,
            quarantine_s=self.config.quarantine_s,
            leases=leases,
            stats=self.stats,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        # Peer set-up (milliseconds per add_remote_agent) and chunk posting (copies on shared
        # memory) are both blocking; each gets its own thread (the peer set's, the poster) so a
        # connecting peer never delays another peer's chunks.
        self._peers = PeerSet(
            agent,
            reconnect_interval_s=self.config.reconnect_interval_s,
            drop=self._drop_generation,
            counters=self._count,
        )
        self._pump = Pump(
            agent.nixl,
            self._ledger,
            self.config,
            self.stats,
            leases=leases,
            post=self._post,
            disconnected=self._peers.lost,
            observer=observer,
            fenced_out=self._fenced_out,
        )
        if leases is not None:
            agent.gate = leases.progress_allowed
        self._poster: Poster[Xfer] = Poster(
            functools.partial(post_xfer, agent, leases, self.stats),
            self._pump.posted,
            weight=_posting_weight,
            hand_back_weight=self.config.hand_back_bytes,
        )
        #: Records of this batch of room steps, handed to the ledger at its end (``_flush``).
        self._staged: list[Xfer] = []
        self._staged_bytes = 0
        #: A full request is staged and the inbox was asked for ``rooms_ran`` between steps:
        #: that call hands over all but the last group (which may still grow).
        self._cut = False
        self._inbox: Inbox | None = None
        self._closed = False

    @property
    def observer(self) -> ChunkObserver | None:
        """Told about every finished chunk (metrics); loop thread."""
        return self._pump.observer

    @observer.setter
    def observer(self, observer: ChunkObserver | None) -> None:
        self._pump.observer = observer

    # -- CommandSink (loop thread) -------------------------------------------------------------

    def attach(self, inbox: Inbox) -> None:
        if self._loop is not None or self._closed:
            raise RuntimeError("a NixlTransport serves one engine, once")
        self._loop = loop = asyncio.get_running_loop()
        self._inbox = inbox
        self._poster.start(loop)
        self._pump.start(loop, inbox)

    def submit(self, key: RoomKey, command: Command) -> None:
        if isinstance(command, PostChunk):
            loop = self._running_loop()
            self.stats.chunks_posted += 1
            config = self.config
            merging = config.merge_max_chunks > 1
            prepared = prepare(
                self.stats,
                key,
                command,
                layout=self.agent.layout,
                peer=self._peers.get(command.peer),
                merge_bytes=config.merge_max_bytes if merging else 0,
            )
            if isinstance(prepared, list):
                # Its end: told after this callback, the room is in the middle of a command.
                loop.call_soon(self._pump.execute, prepared)
            elif merging:
                # Every record waits for the batch's end (``rooms_ran``; sooner once a full
                # request is staged, below), merged or not, so that the chunks to each peer
                # and fence reach the poster in the order their rooms posted them. The
                # call_soon is a backstop for a command outside a batch of steps.
                if not self._staged:
                    loop.call_soon(self._flush)
                self._staged.append(prepared)
                self._staged_bytes += prepared.nbytes
                if self._staged_bytes >= config.merge_max_bytes and not self._cut:
                    # A full request is staged: the poster should not idle while the rest of
                    # a batch of up to 256 rooms runs (milliseconds). Hand it over between
                    # this step and the next; order is kept (a prefix of the staged list).
                    self._cut = True
                    inbox = self._inbox
                    if inbox is not None:
                        inbox.rooms_ran_soon()
            else:
                self._accept(prepared, time.monotonic(), later=True)
        elif isinstance(command, ReleaseHandles):
            self._ledger.release_requested(key)  # marks only: no actions
            for record in self._staged:  # not the ledger's yet: never posted (rule 7)
                if record.key == key:
                    record.dropped = True
        # Anything else is the control channel's (see the module docstring): dropped here.

    def rooms_ran(self) -> None:
        if self._staged:
            self._flush(keep_last=self._cut)

    def _accept(self, record: Xfer, now: float, *, later: bool = False) -> None:
        actions = self._ledger.accepted(record, now)
        if len(actions) == 1 and type(actions[0]) is Post:
            self._post(record)
        elif later:  # inside a room's command: its end is told after this callback
            self._running_loop().call_soon(self._pump.execute, actions)
        else:
            self._pump.execute(actions)

    def _flush(self, *, keep_last: bool = False) -> None:
        """The records of the batch of room steps that just ended, to the ledger and the poster
        in the groups :func:`group_staged` makes: the mergeable ones of each peer generation and
        fence as one record per group, the rest alone. ``keep_last``: all but the group that
        may still grow (the open group of the last staged record's peer and fence), which
        stays staged (called between two steps of a batch once a full request was staged).

        No exception leaves a staged chunk without an end: the records were taken off
        ``_staged`` already, so a chunk the ledger never got would be in no one's hands, its
        room failed at its deadline and never settled. A group whose hand-over raised fails
        the chunks the ledger does not have, and the other groups go on."""
        staged, self._staged = self._staged, []
        self._staged_bytes, self._cut = 0, False
        now = time.monotonic()
        config = self.config
        try:
            groups, growing = group_staged(staged, config.merge_max_chunks, config.merge_max_bytes)
        except Exception:  # a bug, or memory: each record alone, so that every one still ends
            _log.exception("could not group %d staged chunk(s); posting each alone", len(staged))
            groups, growing = [[record] for record in staged], -1
        if keep_last and len(groups) > 1 and growing >= 0:
            # Between two steps of a batch (``rooms_ran_soon``): the group of the record
            # staged last may still grow with the next steps' chunks (a room's next chunk goes
            # to the same peer), so it stays staged, ahead of them. Every other group goes:
            # its peer's later records start a group behind it, so each peer's order holds.
            self._staged = groups.pop(growing)
            self._staged_bytes = sum(record.nbytes for record in self._staged)
        for records in groups:
            try:
                self._hand_over(records, now)
            except Exception as exc:  # a bug, or memory: these chunks must still end
                self._not_handed_over(records, exc)
        if keep_last:
            # The poster was just woken with a full request, but it needs the GIL for the
            # microseconds it takes to enter transfer() (which releases it for the copy), and
            # this thread holds it for the rest of the batch: without a yield the poster waits
            # for the batch's end or CPython's forced switch (5 ms). Measured in rooms_256:
            # the first post 8.9 ms after the rooms start with the cut alone, 5.1 with this.
            time.sleep(0)
        self._pump.run_woken()

    def _hand_over(self, records: list[Xfer], now: float) -> None:
        first = records[0]
        if first.dropped:  # (alone) its room failed in the same batch: as the ledger's rule 7
            self.stats.chunks_dropped += 1
            self._fail(records, DROPPED)
            return
        peer = first.peer
        if self._peers.get(peer.peer_id) is not peer:
            # Its generation went while they waited for the batch's end: as if the poster had
            # dropped them (what a queued record of a lost generation gets).
            self._fail(records, f"peer {peer.peer_id} lost before posting")
            return
        if len(records) == 1:
            self._accept(first, now)
            return
        try:
            merged, bad = merge(records, self.agent.layout)
        except Exception as exc:  # (memory, joining the pages) each was fine alone: so post it
            self.stats.merge_errors += 1
            _log.warning("could not merge %d chunks, posting each alone: %r", len(records), exc)
            for record in records:
                self._accept(record, now)
            return
        for record, error in bad:
            self.stats.chunks_rejected += 1
            self._fail([record], str(error))
        if merged is not None:
            self._accept(merged, now)

    def _not_handed_over(self, records: list[Xfer], exc: Exception) -> None:
        """``_hand_over(records)`` raised: fail the chunks the ledger did not take (it keeps
        and ends those it took, as it does any record). Logs; never raises."""
        self.stats.hand_over_errors += 1
        _log.error("could not hand %d chunk(s) to the ledger", len(records), exc_info=exc)
        reason = f"could not post the chunk: {type(exc).__name__}: {exc}"
        ledger = self._ledger
        left = [r for r in records if not any(ledger.tracks(k, c) for k, c, _ in r.members)]
        try:
            self._fail(left, reason)
        except Exception:
            _log.exception("could not fail %d chunk(s) after that", len(left))

    def _fail(self, records: list[Xfer], reason: str) -> None:
        """Fail records the ledger never saw (outside any room's command)."""
        actions: list[Action] = [
            Deliver(key, ChunkFailed(chunk, reason))
            for record in records
            for key, chunk, _ in record.members
        ]
        self.stats.chunks_failed += len(actions)
        self._pump.execute(actions)

    def _post(self, record: Record) -> None:
        self._poster.submit(cast("Xfer", record))

    # -- peers ---------------------------------------------------------------------------------

    async def connect_peer(
        self,
        peer_id: str,
        metadata: bytes,
        summary: LayoutSummary,
        piece: KvPiece | None = None,
        state: StatePiece | None = None,
    ) -> Peer:
        """Connect (or reconnect, as a new generation) the peer ``peer_id``. Loop thread; the
        blocking work runs on the peer set's worker. Concurrent calls for one peer share one
        attempt. ``piece``: the head slice of each KV page this rank writes into the peer
        (unequal attention TP), None for whole pages; ``state``: the blocks of each state item
        it writes there, None for whole items."""
        self._running_loop()
        return await self._peers.connect(peer_id, metadata, summary, piece, state)

    def peer(self, peer_id: str) -> Peer | None:
        return self._peers.get(peer_id)

    def _drop_generation(self, peer: Peer, reason: str) -> None:
        """A peer generation goes (replaced, or lost): hold its chunks first, before its remote
        agent goes (NIXL's word on a handle whose agent was removed says nothing about the
        WRITE; Agent.disconnect wants its handles released), and keep progressing what its
        endpoint still has queued (it closes in flush mode)."""
        self._pump.execute(self._ledger.peer_lost(peer, reason, time.monotonic()))
        self._pump.linger()

    def _fenced_out(self, reason: str) -> None:
        """The stale-progress gate fenced the agent out (the pump failed its chunks)."""
        self.agent.abandon(reason)
        if self.on_fenced_out is not None:
            self.on_fenced_out(reason)

    @property
    def fenced_out(self) -> str | None:
        """Why the agent was fenced out (restart the process), or None."""
        return None if self.leases is None else self.leases.fenced_out

    def _count(self, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("NixlTransport is not attached to an engine")
        return self._loop

    # -- reads and teardown --------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Chunks accepted and not yet reported final (quarantined ones included)."""
        return self._ledger.in_flight

    def snapshot(self) -> dict[str, int]:
        out = asdict(self.stats)
        out["handles_released"] += out.pop("handles_released_at_post")
        out["handles_created"] += out.pop("flush_handles_created")
        out["in_flight"] = self.in_flight
        out["held"] = self._ledger.held
        out["awaiting_flush"] = self._ledger.awaiting_flush
        out["peers"] = len(self._peers)
        # Results the poster handed back to the loop (each a loop wake-up at most): with many
        # small requests, fewer than handles_created (kvfsm.transport._poster).
        out["poster_hand_backs"] = self._poster.hand_backs
        if self.leases is not None:
            out["leases_live"] = self.leases.live
            # 1: the agent was fenced out (the reason is logged, and in ``fenced_out``).
            out["fenced_out"] = int(self.leases.fenced_out is not None)
            out["progress_refused"] = self.leases.stats.progress_refused
        return out

    async def aclose(self) -> None:
        """Engine shutdown hook (loop thread): stop the pump; handles are released in close()."""
        if self._staged:  # (their flush is scheduled, but the loop may stop before it runs)
            self._flush()
        await self._pump.aclose()

    def close(self) -> None:
        """After ``engine.close()``: release what is left, drop peers, stop the worker.
        The agent itself is the caller's to close. Idempotent."""
        if self._closed:
            return
        loop = self._loop
        if loop is not None and loop.is_running():
            raise RuntimeError("close the RoomEngine before its NixlTransport")
        self._closed = True
        self._poster.close()
        self._peers.stop_worker()
        self._pump.close()
        # Handles first, then the peers' lists and remote agents (Agent.disconnect wants that).
        self._peers.close()
