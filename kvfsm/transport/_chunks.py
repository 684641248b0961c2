"""Chunks: a room's ``PostChunk`` made into a record of NIXL WRITEs, and posted.

Two steps, on two threads:

* :func:`prepare` (loop thread, inside the room's command) does the O(1) checks against the
  peer and both layouts and sizes the chunk: a record for the ledger, or the chunk's end to
  deliver after the current callback. Sans-IO: it calls no NIXL and reads no clock.
  :func:`merge` makes the records of small chunks that arrive together one record (the
  ledger's rule 8): one NIXL request instead of one each. The transport hands the records to
  the ledger at the end of the batch of room steps that posted them.
* :func:`post_xfer` (poster thread, :mod:`kvfsm.transport._poster`) does the O(pages) work,
  page-range checks and the destination-order sort, then makes and posts one prepped transfer
  per part (kv, aux, state) and checks each once. ``transfer()`` copies synchronously on
  shared-memory paths, so it must not run on the loop.

Bad input (a page or row out of range, mismatched lengths, pages for a peer this rank writes
no KV into) raises ``LayoutError`` before anything reaches NIXL: it fails that chunk, never the
engine (law 7).

The fence (law 4, :mod:`kvfsm.transport._fence`). With leases, a chunk is accepted only under a
valid lease on its ``PostChunk.fence`` (the ledger's rule 3), and :func:`post_xfer` checks the
lease again right before each part's ``transfer()``, after its handle is made, with a fresh
``time.monotonic()``: a writer frozen for any length of time with chunks queued checks on
waking, and the window between check and post is a few bytecodes. A part stopped there raises
``FenceError``; the parts before it stay in the record for the ledger to judge.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvfsm.rooms import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed, PostChunk
from kvfsm.transport._agent import Agent, Peer
from kvfsm.transport._config import TransportStats
from kvfsm.transport._fence import FenceError, Leases
from kvfsm.transport._geometry import state_groups
from kvfsm.transport._layout import Layout, LayoutError
from kvfsm.transport._ledger import Action, Deliver, LedgerStats, Record
from kvfsm.transport._rings import RingBlocks, ring_blocks
from kvfsm.transport._slices import NO_KV, sliced_index
from kvfsm.transport._state_slices import DESTINATION, SOURCE

__all__ = ["Xfer", "merge", "post_xfer", "prepare"]

Indices = npt.NDArray[np.int32]
_NONE: Indices = np.zeros(0, dtype=np.int32)
_NONE.flags.writeable = False
#: One prepped transfer: (local list, local indices, remote list, remote indices).
_Part = tuple[Any, Indices, Any, Indices]


class _Raw(NamedTuple):
    """One transfer of descriptors made for it alone (NIXL's ``initialize_xfer``): the
    remapped ring slots of one request (``_rings``), whose blocks no prepared list holds."""

    local: npt.NDArray[np.uint64]
    remote: npt.NDArray[np.uint64]
    local_kind: str
    remote_kind: str


class Xfer(Record):
    """A record plus what the poster needs to post it (the ledger never reads these)."""

    __slots__ = (
        "checked",
        "dst",
        "dst_aux",
        "dst_state",
        "mergeable",
        "rings",
        "src",
        "src_aux",
        "src_state",
    )

    def __init__(
        self,
        key: RoomKey,
        chunk: int,
        *,
        peer: Peer,
        fence: int,
        src: Indices,
        dst: Indices,
        src_aux: Indices | None,
        dst_aux: Indices | None,
        src_state: Indices,
        dst_state: Indices,
        nbytes: int,
        rings: RingBlocks | None = None,
    ) -> None:
        super().__init__(key, chunk, peer, nbytes, fence)
        self.src = src
        self.dst = dst
        self.src_aux = src_aux
        self.dst_aux = dst_aux
        self.src_state = src_state
        self.dst_state = dst_state
        #: The live slots of remapped tail rings (``_rings``), posted as descriptors.
        self.rings = rings
        #: May share a NIXL request with other records (:func:`prepare`).
        self.mergeable = False
        #: Every page proven in range on both sides (:func:`merge`): the poster skips that.
        self.checked = False


# -- accepting (loop thread) ----------------------------------------------------------------------


def prepare(
    stats: LedgerStats,
    key: RoomKey,
    command: PostChunk,
    *,
    layout: Layout,
    peer: Peer | None,
    merge_bytes: int = 0,
) -> Xfer | list[Action]:
    """``command`` as a record for the ledger, or its end (a ``Deliver`` to execute after the
    current callback): bad input fails the chunk here. A record of at most ``merge_bytes``
    without state rows (whose per-row checks run on the poster) is marked ``mergeable``."""
    try:
        if peer is None:
            raise LayoutError(f"no connected peer {command.peer!r}")
        record = _record(key, command, layout, peer)
        if (
            record is not None
            and record.nbytes <= merge_bytes
            and not record.src_state.size
            and peer.piece is not NO_KV  # (its pages fail on the poster: alone)
        ):
            record.mergeable = True
    except LayoutError as exc:
        stats.chunks_rejected += 1
        stats.chunks_failed += 1
        return [Deliver(key, ChunkFailed(command.chunk, str(exc)))]
    if record is None:  # nothing to move: an empty chunk without an aux row or state
        stats.chunks_done += 1
        return [Deliver(key, ChunkDone(command.chunk))]
    return record


def merge(
    records: Sequence[Xfer], layout: Layout
) -> tuple[Xfer | None, list[tuple[Xfer, LayoutError]]]:
    """One record for the chunks of ``records`` (the ledger's rule 8): mergeable records (see
    :func:`prepare`) to one peer generation under one fence, their pages and aux rows posted
    as one NIXL request; each chunk still ends with its own event. Returns it (None if no
    record is left) and the records left out for a page out of range, with why.

    Pages are range-checked here, for the whole request at once (one reduction per side), and
    the poster skips its own check. Once chunks share a request a bad page found on the poster
    would fail every room in it, not just its own (law 7): when the request's check fails,
    each record is checked alone and only the bad ones are left out."""
    merged = _joined(records)
    try:
        _check_pages(merged, layout)
    except LayoutError:
        good: list[Xfer] = []
        bad: list[tuple[Xfer, LayoutError]] = []
        for record in records:
            try:
                _check_pages(record, layout)
            except LayoutError as exc:
                bad.append((record, exc))
            else:
                good.append(record)
        if not good:
            return None, bad
        merged = good[0] if len(good) == 1 else _joined(good)
        merged.checked = True
        return merged, bad
    merged.checked = True
    return merged, []


def _check_pages(record: Xfer, layout: Layout) -> None:
    if record.src.size:
        layout.check_pages(record.src, "source page")
        record.peer.summary.check_pages(record.dst, "destination page")


def _joined(records: Sequence[Xfer]) -> Xfer:
    first = records[0]
    if any(not r.mergeable or r.peer is not first.peer or r.fence != first.fence for r in records):
        raise ValueError("only mergeable records of one peer generation and fence merge")
    aux = [r for r in records if r.src_aux is not None and r.dst_aux is not None]
    merged = Xfer(
        first.key,
        first.chunk,
        peer=first.peer,
        fence=first.fence,
        src=np.concatenate([r.src for r in records]),
        dst=np.concatenate([r.dst for r in records]),
        src_aux=np.concatenate([r.src_aux for r in aux]) if aux else None,
        dst_aux=np.concatenate([r.dst_aux for r in aux]) if aux else None,
        src_state=_NONE,
        dst_state=_NONE,
        nbytes=sum(r.nbytes for r in records),
    )
    merged.members = tuple(member for r in records for member in r.members)
    merged.mergeable = True
    return merged


def _record(key: RoomKey, command: PostChunk, local: Layout, peer: Peer) -> Xfer | None:
    """The chunk as a record, after the O(1) checks; raise ``LayoutError`` on bad input.
    Page ranges are checked (and pages sorted) on the poster thread: for a chunk of
    thousands of pages that is a millisecond the loop thread should not spend."""
    remote = peer.summary
    src = np.frombuffer(command.src, dtype=np.int32)
    dst = np.frombuffer(command.dst, dtype=np.int32)
    if src.size != dst.size:
        raise LayoutError(f"{src.size} source pages but {dst.size} destination pages")
    src_aux = dst_aux = None
    aux_bytes = 0
    if command.is_last and command.src_aux >= 0 and command.dst_aux >= 0:
        local.check_row(command.src_aux, "source aux row")
        remote.check_row(command.dst_aux, "destination aux row")
        src_aux = local.aux_index(command.src_aux)
        dst_aux = remote.aux_index(command.dst_aux)
        aux_bytes = local.aux_row_bytes()
    # Most chunks carry no state rows: share one empty array rather than wrap b"" twice.
    src_state = np.frombuffer(command.src_state, dtype=np.int32) if command.src_state else _NONE
    dst_state = np.frombuffer(command.dst_state, dtype=np.int32) if command.dst_state else _NONE
    if src_state.size != dst_state.size:
        raise LayoutError(f"{src_state.size} source state rows but {dst_state.size} destination")
    for s_row, d_row in zip(src_state.tolist(), dst_state.tolist(), strict=True):
        # Each row is checked here, so a bad one fails this chunk before anything is posted;
        # a row of one state type must land in a row of the same type (other items, bytes).
        mine = local.state_type_of(s_row, "source state row")
        theirs = remote.state_type_of(d_row, "destination state row")
        if mine != theirs:
            raise LayoutError(
                f"source state row {s_row} is of state type {mine} but destination row "
                f"{d_row} is of state type {theirs}"
            )
    if src.size == 0 and src_aux is None and src_state.size == 0:
        return None
    rings = None
    if src_state.size and peer.state_piece is not None and peer.state_piece.rings:
        rings = ring_blocks(
            rings=peer.state_piece.rings,
            local=local.state_specs(),
            local_groups=local.state_groups,
            remote=tuple(remote.state),
            remote_groups=state_groups(remote.state_groups, len(remote.state)),
            src_rows=src_state,
            dst_rows=dst_state,
            src_rings=command.src_rings,
            dst_rings=command.dst_rings,
        )
    piece = peer.piece
    page_bytes = local.page_bytes() if piece is None else piece.page_bytes(len(local.kv))
    nbytes = src.size * page_bytes + aux_bytes + (_state_bytes(local, peer, src_state))
    nbytes += 0 if rings is None else rings.nbytes
    return Xfer(
        key,
        command.chunk,
        peer=peer,
        fence=command.fence,
        src=src,
        dst=dst,
        src_aux=src_aux,
        dst_aux=dst_aux,
        src_state=src_state,
        dst_state=dst_state,
        nbytes=nbytes,
        rings=rings,
    )


# -- posting (poster thread) ----------------------------------------------------------------------


def post_xfer(agent: Agent, leases: Leases | None, stats: TransportStats, record: Xfer) -> None:
    """Make and post the record's transfers; check each once. Appends each posted part's
    handle to ``record.handles`` and its state to ``record.states``, and releases them here if
    every part is over inside ``transfer()``. Raises what NIXL raised, ``LayoutError`` for bad
    input (nothing posted), ``FenceError`` when the lease is not valid before a part (that part
    and the later ones not posted). A dropped record (its room failed first) is skipped."""
    if record.dropped:
        return
    fence = record.fence
    if leases is not None and leases.fenced_out is not None:  # (queued before it happened)
        raise FenceError(_fenced_reason(leases, fence, 0, 1))
    nixl = agent.nixl
    parts = _parts(agent, record)
    for part, spec in enumerate(parts):
        if isinstance(spec, _Raw):  # remapped ring slots: descriptors of this request only
            handle = nixl.initialize_xfer(
                "WRITE",
                nixl.get_xfer_descs(spec.local, spec.local_kind),
                nixl.get_xfer_descs(spec.remote, spec.remote_kind),
                record.peer.name,
            )
        else:
            local_list, local_idx, remote_list, remote_idx = spec
            handle = nixl.make_prepped_xfer("WRITE", local_list, local_idx, remote_list, remote_idx)
        record.handles.append(handle)
        stats.handles_created += 1
        # The fence: checked here, after the handle is made and right before the post, so
        # the window between the check and transfer() is a few bytecodes. A writer that
        # was frozen with this chunk queued gets here first after waking, with a fresh
        # clock.
        if leases is not None:
            now = time.monotonic()
            if not leases.valid(fence, now):
                raise FenceError(_fenced_reason(leases, fence, part, len(parts)))
            # transfer() progresses the whole agent: bytes another record left queued
            # across a freeze would move too (the stale-progress gate, _fence).
            if not leases.progress_allowed(now):
                raise FenceError(_fenced_reason(leases, fence, part, len(parts)))
            if not record.opened:
                record.opened = True
                leases.opened(fence)
        state = nixl.transfer(handle)
        if state == "PROC":
            state = nixl.check_xfer_state(handle)
        record.states.append(state)
    if leases is not None and record.opened and "PROC" not in record.states:
        # Every part is over inside transfer() (the copy on shared memory): nothing of it can
        # be queued, so a freeze from here on has nothing of it to push.
        record.opened = False
        leases.closed(fence)
    if all(state == "DONE" for state in record.states):
        # The common case on shared memory: the copy finished inside transfer(). Release
        # here: release_xfer_handle holds the GIL, and freeing a large handle's
        # descriptors is work the loop thread should not do.
        while record.handles:
            nixl.release_xfer_handle(record.handles[-1])  # if it raises, the loop retries
            record.handles.pop()
            stats.handles_released_at_post += 1


def _parts(agent: Agent, record: Xfer) -> list[_Part | _Raw]:
    """The record's prepped transfers, kv then aux then state; raise ``LayoutError`` for a
    page out of range on either side, or pages for a peer this rank writes no KV into."""
    peer = record.peer
    layout, remote = agent.layout, peer.summary
    parts: list[_Part | _Raw] = []
    src, dst = record.src, record.dst
    if src.size:
        piece = peer.piece
        # Bad input fails this chunk (LayoutError) before anything reaches NIXL. Whole pages:
        # page_index below checks the range itself (one reduction per side per chunk).
        checked = record.checked  # (merge proved every page of a merged record in range)
        if piece is not None and not checked:
            layout.check_pages(src, "source page")
            remote.check_pages(dst, "destination page")
        if src.size > 1:
            # Destination order makes contiguous runs consecutive, and NIXL merges them.
            order = dst.argsort(kind="stable")
            src, dst = src[order], dst[order]
        if piece is NO_KV:
            raise LayoutError(
                f"{src.size} pages for peer {peer.peer_id}, which this rank writes no KV "
                "into (its heads come from another rank: a dummy link)"
            )
        if piece is None:
            local_idx = layout.page_index(src, "source page", checked=checked)
            remote_idx = remote.page_index(dst, "destination page", checked=checked)
            parts.append((agent.local("kv"), local_idx, peer.kv, remote_idx))
        else:  # a head slice: one descriptor per row of each page (pages checked above)
            rows = piece.rows
            local_idx = sliced_index(len(layout.kv), layout.num_pages, rows, src)
            remote_idx = sliced_index(len(remote.kv), remote.num_pages, rows, dst)
            parts.append((peer.local_kv, local_idx, peer.kv, remote_idx))
    if record.src_aux is not None and record.dst_aux is not None:
        parts.append((agent.local("aux"), record.src_aux, peer.aux, record.dst_aux))
    if record.src_state.size and peer.state_piece is None:
        local_rows = [layout.state_index(int(r)) for r in record.src_state]
        remote_rows = [remote.state_index(int(r)) for r in record.dst_state]
        parts.append(
            (
                agent.local("state"),
                np.concatenate(local_rows).astype(np.int32),
                peer.state,
                np.concatenate(remote_rows).astype(np.int32),
            )
        )
    elif record.src_state.size and peer.local_state is not None:
        # This link's blocks of each state item (unequal attention TP, ``_state_slices``).
        state_piece = peer.state_piece
        assert state_piece is not None
        specs, groups = layout.state_specs(), layout.state_groups
        theirs = tuple(remote.state), state_groups(remote.state_groups, len(remote.state))
        local_idx = np.concatenate(
            [state_piece.index(specs, groups, SOURCE, int(r)) for r in record.src_state]
        )
        remote_idx = np.concatenate(
            [state_piece.index(*theirs, DESTINATION, int(r)) for r in record.dst_state]
        )
        if local_idx.size:
            parts.append((peer.local_state, local_idx, peer.state, remote_idx))
    if record.rings is not None:
        rings = record.rings
        parts.append(
            _Raw(rings.local, rings.remote, layout.state_kind.value, remote.state_kind.value)
        )
    return parts


def _state_bytes(local: Layout, peer: Peer, rows: Indices) -> int:
    """Bytes the state ``rows`` move to ``peer`` (its blocks of them, with a state piece)."""
    if not rows.size:
        return 0
    piece = peer.state_piece
    if piece is None:
        return local.state_bytes(rows)
    groups = local.state_groups
    return sum(piece.row_bytes(groups, local.state_type_of(int(r))) for r in rows)


def _fenced_reason(leases: Leases, fence: int, part: int, parts: int) -> str:
    why = leases.describe(fence, time.monotonic())
    if part == 0:
        return f"write lease of fence {fence} {why}: not posted"
    return f"write lease of fence {fence} {why} before part {part + 1} of {parts}"
