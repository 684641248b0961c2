"""``PeerSet``: the decode peers a prefill data path writes into, by peer id, each a generation
of NIXL lists and a remote agent (``Agent.connect``).

Rules kept here:

* Connecting is blocking work (``add_remote_agent`` and list preparation take milliseconds), so
  it runs on the set's own worker thread, never on the loop, and never on the poster thread: a
  connecting peer does not delay another peer's chunks.
* Concurrent connects of one peer with the same metadata share one attempt; one with other
  metadata (a reload of a dead incarnation racing the restarted peer's registration) waits the
  other out, then makes its own.
* A connect with the metadata, layout and piece of the peer's current generation keeps that
  generation (a control link that came back to the same process): replacing it would remove
  the remote agent while WRITEs to it may still be queued, and with it the only endpoint
  whose flush can prove them over (the data path's rule 2, ``_ledger``). ``remove_remote_agent``
  returns at once and its queued bytes still land later, unproven.
* A reconnect, or a lost peer, hands the old generation to ``drop`` first, on the loop, before
  its remote agent goes: the data path holds its chunks (NIXL's word on a handle whose agent was
  removed says nothing about the WRITE) and keeps progressing what the old endpoint has queued.
* A lost peer is reloaded from the metadata it last connected with, rate-limited by
  ``reconnect_interval_s``, in case the disconnect was transient; a restarted peer comes back
  through :meth:`PeerSet.connect` instead.
* Every generation is disconnected exactly once: when it is replaced or lost (on the worker),
  or at :meth:`PeerSet.close` for what is left, including generations the worker held when the
  engine stopped (connected but not adopted yet, or queued for disconnection).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvfsm.rooms import name_this_thread
from kvfsm.transport._agent import Agent, Peer
from kvfsm.transport._layout import LayoutSummary
from kvfsm.transport._slices import KvPiece
from kvfsm.transport._state_slices import StatePiece

__all__ = ["PeerSet"]

_log = logging.getLogger("kvfsm.transport")


class PeerSet:
    """Connected peers by id. Loop thread only, except :meth:`close`, which runs after the
    engine's loop has stopped. ``drop(peer, reason)``: the data path's part when a generation
    goes (called on the loop before the generation is disconnected)."""

    def __init__(
        self,
        agent: Agent,
        *,
        reconnect_interval_s: float,
        drop: Callable[[Peer, str], None],
        counters: Callable[[str], None],
    ) -> None:
        self.agent = agent
        self.reconnect_interval_s = reconnect_interval_s
        self._drop = drop
        self._count = counters
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvfsm-peers", initializer=_name_worker
        )
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Future[Peer]] = {}
        self._attempts: dict[str, bytes] = {}  # metadata of each connection in progress
        self._lost_at: dict[str, float] = {}
        self._known: dict[str, tuple[bytes, LayoutSummary, KvPiece | None, StatePiece | None]] = {}
        # Generations in the worker's hands: an old one it is to disconnect, or a new one it
        # connected that the loop has not adopted yet. If the engine stops meanwhile (the loop
        # ends, connect's task is cancelled, a queued job is cancelled by close()), nobody else
        # knows them: close() disconnects what is left here, or their lists and remote agent
        # would leak.
        self._in_worker: list[Peer] = []
        self._closed = False

    def get(self, peer_id: str) -> Peer | None:
        return self._peers.get(peer_id)

    def __len__(self) -> int:
        return len(self._peers)

    async def connect(
        self,
        peer_id: str,
        metadata: bytes,
        summary: LayoutSummary,
        piece: KvPiece | None = None,
        state: StatePiece | None = None,
    ) -> Peer:
        """Connect (or reconnect, as a new generation) the peer ``peer_id``."""
        loop = asyncio.get_running_loop()
        current = self._peers.get(peer_id)
        if current is not None and self._known.get(peer_id) == (metadata, summary, piece, state):
            self._count("peers_kept")
            return current
        while (pending := self._connecting.get(peer_id)) is not None:
            same = self._attempts.get(peer_id) == metadata
            try:
                shared = await asyncio.shield(pending)
            except Exception:
                if same:
                    raise
                continue
            if same:
                return shared
        future: asyncio.Future[Peer] = loop.create_future()
        self._connecting[peer_id] = future
        self._attempts[peer_id] = metadata
        try:
            old = self._peers.pop(peer_id, None)
            if old is not None:
                self._drop(old, f"peer {peer_id} reconnected as a new generation")
                self._in_worker.append(old)
            peer = await loop.run_in_executor(
                self._worker,
                functools.partial(
                    self._reconnect_blocking, old, peer_id, metadata, summary, piece, state=state
                ),
            )
            self._in_worker.remove(peer)  # adopted: in _peers from here on
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            del self._connecting[peer_id]
            del self._attempts[peer_id]
        self._peers[peer_id] = peer
        self._known[peer_id] = (metadata, summary, piece, state)
        self._count("peers_connected")
        future.set_result(peer)
        _log.info("peer %s connected (generation %d)", peer_id, peer.generation)
        return peer

    def lost(self, peer: Peer, reason: str) -> None:
        """The peer's agent reported a remote disconnect: drop this generation (its chunks
        first), disconnect it on the worker, and reload it later."""
        if self._peers.get(peer.peer_id) is not peer:
            return  # an older generation; the current one is not condemned by it
        del self._peers[peer.peer_id]
        self._count("peers_lost")
        _log.warning("peer %s generation %d lost: %s", peer.peer_id, peer.generation, reason)
        self._drop(peer, reason)
        loop = asyncio.get_running_loop()
        self._in_worker.append(peer)
        loop.run_in_executor(self._worker, self._disconnect_blocking, peer)
        last = self._lost_at.get(peer.peer_id, -1e9)
        delay = max(0.0, last + self.reconnect_interval_s - loop.time())
        self._lost_at[peer.peer_id] = loop.time() + delay
        loop.call_later(delay, self._reload, peer.peer_id)

    def _reload(self, peer_id: str) -> None:
        if peer_id in self._peers or peer_id in self._connecting or self._closed:
            return
        known = self._known.get(peer_id)
        if known is None:
            return
        task = asyncio.get_running_loop().create_task(self.connect(peer_id, *known))
        task.add_done_callback(_log_reload_failure)

    def _reconnect_blocking(
        self,
        old: Peer | None,
        peer_id: str,
        metadata: bytes,
        summary: LayoutSummary,
        piece: KvPiece | None,
        *,
        state: StatePiece | None,
    ) -> Peer:
        if old is not None:
            self._disconnect_blocking(old)
        peer = self.agent.connect(peer_id, metadata, summary, piece, state)
        self._in_worker.append(peer)
        return peer

    def _disconnect_blocking(self, peer: Peer) -> None:
        self.agent.disconnect(peer)
        self._in_worker.remove(peer)

    def stop_worker(self) -> None:
        """Stop the worker (queued connects and disconnects are cancelled). First part of the
        data path's close, before its handles are released."""
        self._closed = True
        self._worker.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """After :meth:`stop_worker` and once every handle is released: disconnect every
        generation left, adopted or still in the worker's hands. Idempotent."""
        self.stop_worker()
        for peer in [*self._peers.values(), *self._in_worker]:
            self.agent.disconnect(peer)
        self._peers.clear()
        self._in_worker.clear()


def _name_worker() -> None:
    name_this_thread(threading.current_thread().name)


def _log_reload_failure(task: asyncio.Task[Peer]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.warning("reloading a lost peer failed: %s", task.exception())
