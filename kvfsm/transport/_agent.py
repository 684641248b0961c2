"""One NIXL agent per rank: its registered layout, its prepared descriptor lists, its peers.

Everything here blocks (registration, ``add_remote_agent`` takes milliseconds, ``prep_xfer_dlist``
walks every descriptor), so none of it runs on the event loop thread: :class:`NixlTransport`
calls it from its worker thread, and setup code from the caller's thread.

Memory is registered as a few large regions (whole per-layer K/V buffers, aux and state buffers),
never per page: registration cost and the backend's region lookups grow with the number of
regions. Descriptor lists are prepared once per side (local once, each remote once per peer
generation); a chunk is then just two int32 index arrays into them (``make_prepped_xfer``), which
is also the only path on which NIXL merges physically contiguous pages.

The agent runs with its progress thread off (on, it spins a core) and in NIXL's STRICT thread
mode, because two threads call it: the transport's worker thread (posts, peer setup) and the
loop thread (completion checks, releases).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.transport._layout import Layout, LayoutError, LayoutSummary, MemKind
from kvfsm.transport._nixl import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from kvfsm.transport._slices import NO_KV, KvPiece, check_slice, sliced_descs
from kvfsm.transport._state_slices import DESTINATION, SOURCE, StatePiece, check_state_piece

__all__ = ["FLUSH_BYTES", "Agent", "AgentConfig", "AgentFencedOutError", "Peer"]

_log = logging.getLogger("kvfsm.transport")
_LOCAL = "NIXL_INIT_AGENT"

#: What a flush reads from a peer (the data path's rule 2, ``_ledger``): a few bytes of the
#: start of its first registered region, into this agent's own scratch buffer. Reading writes
#: nothing of the peer's, and the READ's completion is what proves earlier WRITEs over.
FLUSH_BYTES: Final = 8

#: Raw NIXL agents that were fenced out: referenced until the process ends, so that no
#: destructor closes their endpoints (a flush-mode close would push their queued WRITEs).
_ABANDONED: list[Any] = []


class AgentFencedOutError(RuntimeError):
    """The agent was fenced out (``Leases.progress_allowed``): it is never called again."""


def _no_params() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """How the NIXL agent is created.

    ``backend_params`` are merged over the plugin's defaults (for UCX, e.g. ``device_list`` or
    ``ucx_error_handling_mode``); leave ``ucx_error_handling_mode`` at ``peer``, which is what
    turns a dead peer into an error instead of a silent stall. UCX's ``num_workers`` and
    ``num_threads`` must stay at their defaults (1 and unset) and are refused otherwise: with
    one worker every transfer to a peer, from any thread, goes on one UCX endpoint, which is
    what lets a flush prove earlier WRITEs over (the data path's rule 2, ``_ledger``); with
    more, WRITEs and the flush may go on different endpoints and the proof is void.
    """

    backend: str = "UCX"
    backend_params: Mapping[str, str] = field(default_factory=_no_params)
    progress_thread: bool = False
    #: Wraps the raw NIXL agent once it is created; the wrapper is what :attr:`Agent.nixl`
    #: holds, so every call the agent and the transport make goes through it. For fault
    #: injection (:mod:`kvfsm.chaos`) and tracing; None in production.
    interpose: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        params = self.backend_params
        if str(params.get("num_workers", "1")) != "1" or str(params.get("num_threads", "0")) != "0":
            raise ValueError(
                "AgentConfig: num_workers must be 1 and num_threads unset: a flush proves "
                "earlier WRITEs over only on the one endpoint they share"
            )


class Peer:
    """A remote agent as this agent knows it, for one generation.

    A peer that disconnects is removed; adding it again (same ``peer_id``, maybe new metadata)
    gives a new generation with freshly prepared descriptor lists. Transfers record the
    generation they were posted under, so errors from an old generation never condemn a new one.
    """

    __slots__ = (
        "aux",
        "flush",
        "generation",
        "kv",
        "local_kv",
        "name",
        "peer_id",
        "local_state",
        "piece",
        "state",
        "state_piece",
        "summary",
    )

    def __init__(
        self,
        peer_id: str,
        generation: int,
        *,
        name: str,
        summary: LayoutSummary,
        kv: Any,
        aux: Any | None,
        state: Any | None,
        piece: KvPiece | None = None,
        local_kv: Any = None,
        flush: tuple[Any, Any] | None = None,
        state_piece: StatePiece | None = None,
        local_state: Any = None,
    ) -> None:
        self.peer_id = peer_id
        self.generation = generation
        self.name = name
        self.summary = summary
        self.kv = kv
        self.aux = aux
        self.state = state
        #: The head slice this agent writes of each page into the peer (unequal attention TP);
        #: None: whole pages. With a piece, ``kv`` and ``local_kv`` list one descriptor per
        #: (buffer, page, row) (``_slices.sliced_descs``) instead of one per (buffer, page).
        self.piece = piece
        self.local_kv = local_kv
        #: The byte blocks of each state item this agent writes into the peer (unequal
        #: attention TP: ``_state_slices``); None: whole items. With a piece, ``state`` and
        #: ``local_state`` list one descriptor per (region, item, block), or are None when the
        #: piece moves nothing.
        self.state_piece = state_piece
        self.local_state = local_state
        #: (local scratch list, remote list) of one ``FLUSH_BYTES`` descriptor each: what a
        #: flush of this generation READs (``Pump``, the ledger's rule 2). None: this peer
        #: cannot be flushed (its held WRITEs then wait for their generation to go).
        self.flush = flush

    def __repr__(self) -> str:
        return f"<Peer {self.peer_id} gen {self.generation} agent {self.name}>"


class Agent:
    """A NIXL agent with ``layout`` registered and its local descriptor lists prepared."""

    def __init__(self, name: str, layout: Layout, config: AgentConfig | None = None) -> None:
        self.name = name
        self.layout = layout
        self.config = config if config is not None else AgentConfig()
        self._generations = itertools.count(1)
        self._registrations: list[Any] = []
        self._local: dict[str, Any] = {}
        #: The flush's landing place (``FLUSH_BYTES``, DRAM): never part of any page.
        self._flush_scratch = np.zeros(64, np.uint8)
        self._closed = False
        self._metadata: bytes | None = None
        #: Asked before a call that can progress the agent outside the transfer path (adding
        #: and removing peers, closing): the transport sets it to its stale-progress gate
        #: (``Leases.progress_allowed``). Once it says no, the agent is abandoned for good.
        self.gate: Callable[[float], bool] | None = None
        #: Why the agent was abandoned; None while it is usable.
        self.abandoned: str | None = None
        #: Prepared descriptor lists made and released, and remote agents added and removed:
        #: after close() each pair must match (tests check it).
        self.dlists_prepped = 0
        self.dlists_released = 0
        self.peers_added = 0
        self.peers_removed = 0
        self.nixl = self._create()
        try:
            self._register()
            self._prepare_local()
            self.metadata()
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------

    def _create(self) -> Any:
        cfg = self.config
        params = dict(cfg.backend_params)
        nixl_config = nixl_agent_config(
            enable_prog_thread=cfg.progress_thread,
            backends=[] if params else [cfg.backend],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        agent = nixl_agent(self.name, nixl_config)
        if params:
            # The only way to set plugin options: create the backend ourselves.
            defaults = agent.get_plugin_params(cfg.backend)
            agent.create_backend(cfg.backend, {**defaults, **params})
        return agent if cfg.interpose is None else cfg.interpose(agent)

    def _register(self) -> None:
        for region in self.layout.regions():
            reg = self.nixl.register_memory(
                [(region.addr, region.nbytes, region.device, "")], region.kind.value
            )
            self._registrations.append(reg)
        scratch = self._flush_scratch.ctypes.data
        reg = self.nixl.register_memory([(scratch, FLUSH_BYTES, 0, "")], MemKind.DRAM.value)
        self._registrations.append(reg)

    def _prepare_local(self) -> None:
        layout = self.layout
        self._local["kv"] = self._prep(_LOCAL, layout.kv_descs(), layout.kv[0].kind)
        if layout.aux:
            self._local["aux"] = self._prep(_LOCAL, layout.aux_descs(), layout.aux[0].kind)
        if layout.state:
            self._local["state"] = self._prep(_LOCAL, layout.state_descs(), layout.state[0].kind)
        scratch = np.asarray([[self._flush_scratch.ctypes.data, FLUSH_BYTES, 0]], np.uint64)
        self._local["flush"] = self._prep(_LOCAL, scratch, MemKind.DRAM)

    def _prep(self, agent: str, descs: npt.NDArray[np.uint64], kind: MemKind) -> Any:
        dlist = self.nixl.prep_xfer_dlist(agent, descs, kind.value)
        self.dlists_prepped += 1
        return dlist

    # -- reads ---------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`connect` (its registrations included).
        Read once: registrations never change after construction, and the loop thread asks."""
        if self._metadata is None:
            self._metadata = bytes(self.nixl.get_agent_metadata())
        return self._metadata

    def local(self, what: str) -> Any:
        """The local prepared list for ``"kv"``, ``"aux"`` or ``"state"``."""
        return self._local[what]

    # -- peers (blocking) ----------------------------------------------------------------------

    def _local_kv(self, piece: KvPiece) -> Any:
        """The local list of ``piece``'s slice of every page, prepared once per slice (every
        decode rank fed the same slice of this rank's heads shares it), released at close."""
        key = f"kv/{piece.rows}/{piece.src.offset}/{piece.src.length}"
        dlist = self._local.get(key)
        if dlist is None:
            descs = sliced_descs(self.layout.kv_specs(), piece.rows, piece.src)
            dlist = self._local[key] = self._prep(_LOCAL, descs, self.layout.kv[0].kind)
        return dlist

    def _local_state(self, piece: StatePiece | None) -> Any:
        """The local list of ``piece``'s blocks of every state item, prepared once per piece
        (decode ranks fed the same shard share it), released at close; None without a piece
        or when it moves nothing."""
        if piece is None or piece.moves_nothing:
            return None
        key = f"state/{piece.blocks!r}"
        dlist = self._local.get(key)
        if dlist is None:
            descs = piece.descs(self.layout.state_specs(), SOURCE)
            dlist = self._local[key] = self._prep(_LOCAL, descs, self.layout.state[0].kind)
        return dlist

    def connect(
        self,
        peer_id: str,
        metadata: bytes,
        summary: LayoutSummary,
        piece: KvPiece | None = None,
        state_piece: StatePiece | None = None,
    ) -> Peer:
        """Load a remote agent and prepare its lists. Raises ``ValueError`` if a WRITE from this
        layout into ``summary`` is not well-formed (the peer is then not added). With a
        ``piece`` (unequal attention TP) the KV lists address that head slice of every row
        of every page, and KV pages may differ in size; aux rows still must not. With a
        ``state_piece`` the state lists address its blocks of every state item, and state
        items may differ in size too."""
        problem = self.layout.compatible_with(
            summary, sliced=piece is not None, state_sliced=state_piece is not None
        )
        if problem is None and piece is not None and piece is not NO_KV:
            try:  # the geometry of both sides against the piece, before NIXL sees anything
                check_slice(self.layout.kv_specs(), piece.rows, piece.src)
                check_slice(summary.kv, piece.rows, piece.dst)
            except LayoutError as exc:
                problem = f"head slice {piece}: {exc}"
        if problem is None and state_piece is not None:
            try:
                check_state_piece(state_piece, self.layout.state_specs(), summary.state)
            except LayoutError as exc:
                problem = f"state slice: {exc}"
        if problem is not None:
            raise ValueError(f"peer {peer_id}: layouts are incompatible: {problem}")
        if not self._usable():
            raise AgentFencedOutError(f"peer {peer_id} not connected: {self.abandoned}")
        local_kv = None if piece is None or piece is NO_KV else self._local_kv(piece)
        local_state = self._local_state(state_piece)
        name = self.nixl.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        self.peers_added += 1
        lists: list[Any] = []
        try:
            if piece is None:
                kv = self._prep(name, summary.kv_descs(), MemKind(summary.kv_kind))
                lists.append(kv)
            elif piece is NO_KV:
                kv = None
            else:
                descs = sliced_descs(summary.kv, piece.rows, piece.dst)
                kv = self._prep(name, descs, MemKind(summary.kv_kind))
                lists.append(kv)
            aux = state = None
            if summary.aux:
                aux = self._prep(name, summary.aux_descs(), MemKind(summary.aux_kind))
                lists.append(aux)
            if summary.state and state_piece is None:
                state = self._prep(name, summary.state_descs(), MemKind(summary.state_kind))
                lists.append(state)
            elif local_state is not None and state_piece is not None:
                descs = state_piece.descs(summary.state, DESTINATION)
                state = self._prep(name, descs, MemKind(summary.state_kind))
                lists.append(state)
            flush = self._prep(name, *_flush_target(summary))
            lists.append(flush)
        except BaseException:
            for dlist in lists:
                self._release_dlist(dlist)
            self._remove_remote(name)
            raise
        return Peer(
            peer_id,
            next(self._generations),
            name=name,
            summary=summary,
            kv=kv,
            aux=aux,
            state=state,
            piece=piece,
            local_kv=local_kv,
            flush=(self._local["flush"], flush),
            state_piece=state_piece,
            local_state=local_state,
        )

    def abandon(self, reason: str) -> None:
        """Never call NIXL through this agent again (it was fenced out): later disconnects and
        close() do nothing, and the raw agent stays referenced until the process ends."""
        if self.abandoned is None:
            self.abandoned = reason
            _ABANDONED.append(self.nixl)

    def _usable(self) -> bool:
        if self.abandoned is None and self.gate is not None and not self.gate(time.monotonic()):
            self.abandon("the stale-progress gate refused (see kvfsm.transport._fence)")
        return self.abandoned is None

    def disconnect(self, peer: Peer) -> None:
        """Release a peer's lists and drop the remote agent. Handles made from those lists must
        have been released first. Never raises. An abandoned agent keeps them (a remote agent
        is removed in flush mode: its queued WRITEs would be pushed)."""
        if not self._usable():
            return
        remote_flush = None if peer.flush is None else peer.flush[1]
        for dlist in (peer.kv, peer.aux, peer.state, remote_flush):
            if dlist is not None:
                self._release_dlist(dlist)
        peer.kv = peer.aux = peer.state = peer.flush = None
        self._remove_remote(peer.name)

    def _release_dlist(self, dlist: Any) -> None:
        try:
            self.nixl.release_dlist_handle(dlist)
        except Exception:
            _log.exception("%s: release_dlist_handle failed", self.name)
        else:
            self.dlists_released += 1

    def _remove_remote(self, name: str) -> None:
        try:
            self.nixl.remove_remote_agent(name)
        except Exception:
            _log.exception("%s: remove_remote_agent(%s) failed", self.name, name)
        else:
            self.peers_removed += 1

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release local lists and deregister memory (after every handle and peer). Idempotent.
        An abandoned agent is left as it is."""
        if self._closed:
            return
        self._closed = True
        if not self._usable():
            _log.warning("%s: fenced out, left open until the process ends", self.name)
            return
        for dlist in self._local.values():
            self._release_dlist(dlist)
        self._local.clear()
        for reg in reversed(self._registrations):
            try:
                self.nixl.deregister_memory(reg)
            except Exception:
                _log.exception("%s: deregister_memory failed", self.name)
        self._registrations.clear()


def _flush_target(summary: LayoutSummary) -> tuple[npt.NDArray[np.uint64], MemKind]:
    """The descriptor a flush READs on a peer: the first ``FLUSH_BYTES`` of its first region
    (KV, else aux, else state: a summary always has KV), in that region's memory kind."""
    for specs, kind in (
        (summary.kv, summary.kv_kind),
        (summary.aux, summary.aux_kind),
        (summary.state, summary.state_kind),
    ):
        if specs:
            addr, _nbytes, _item, device = specs[0]
            return np.asarray([[addr, FLUSH_BYTES, device]], np.uint64), MemKind(kind)
    raise ValueError("a layout summary with no region")  # pragma: no cover - validated
