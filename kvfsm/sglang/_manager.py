"""``KvfsmKVManager``: one per scheduler rank, as SGLang builds it; owns a kvfsm
:class:`~kvfsm.manager.PrefillManager` or :class:`~kvfsm.manager.DecodeManager`.

What the scheduler reads beyond the ABC (SGLang's ``disaggregation/decode.py`` reads the
manager's ``prefill_info_table`` and calls ``try_ensure_parallel_info``) is here with kvfsm's
meaning:

* ``prefill_info_table`` / ``try_ensure_parallel_info``: decode learns a prefill instance's DP
  and TP sizes from its bootstrap server. SGLang's own backends do that with a blocking HTTP
  GET on the scheduler thread; here the lookup runs on kvfsm's loop and the call returns False
  until it has landed (the scheduler retries every second), so it never blocks.
* deferred decode page release (law 4): ``is_abort_release_safe(room, acks)`` is the room's
  ``settled`` flag: true once no write from any prefill rank can reach its pages, which kvfsm
  learns from prefill's settle acknowledgement or from the loss of the peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp

from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.registry import BootstrapClient
from kvfsm.sglang._args import (
    ENGINE,
    ServerConfig,
    Topology,
    UnsupportedError,
    advertised_host,
    bootstrap_url,
    fingerprint_from_kv_args,
    layout_from_kv_args,
    mode_name,
)
from kvfsm.sglang._bases import BaseKVManager, DisaggregationMode, KVArgs
from kvfsm.sglang._dp_ranks import dp_by_room, force_flag, force_query
from kvfsm.sglang._settings import manager_config
from kvfsm.sglang._staging import EmptyStagingRing, StagingContext
from kvfsm.sglang._states import StateMap
from kvfsm.states import KVPoll as RoomStatus
from kvfsm.states import Part
from kvfsm.transport import legs, state_legs

if TYPE_CHECKING:
    from kvfsm.control import PipelineStage
    from kvfsm.rooms import ReceiverRoom, SenderRoom
    from kvfsm.sglang._legs import Legs

__all__ = ["KvfsmKVManager", "PrefillInfo"]

_log = logging.getLogger("kvfsm.sglang")


#: How long a prefill rank retries registering a room's DP rank while the registry is
#: unreachable (SGLang's own registration gives up after one 5 s request).
DP_REGISTER_WAIT_S = 5.0


def _waiting_timeout_s() -> float:
    """SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (seconds, default 300): how long the
    recompute of a retracted request may take before its receiver fails."""
    raw = os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "").strip()
    return float(raw) if raw.isdigit() and int(raw) > 0 else 300.0


def _executor_threads() -> int:
    """SGLang's ``SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`` when set, else 4."""
    raw = os.environ.get("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return 4


class PrefillInfo(NamedTuple):
    """What decode's scheduler reads from ``prefill_info_table[addr]``."""

    dp_size: int
    tp_size: int  # attention TP of the prefill instance
    #: SGLang routes a request to prefill DP rank ``bootstrap_room % dp_size``.
    follow_bootstrap_room: bool = True
    #: Pipeline stages of the prefill instance: a request is read from every one.
    pp_size: int = 1
    #: The prefill server's HTTP port (SGLang's re-bootstrap ``/generate``); None: unknown.
    prefill_http_port: int | None = None


class Leg(NamedTuple):
    """One prefill rank a decode request hears from, and what it carries."""

    tp_rank: int  # attention-TP rank of the prefill instance
    pp_rank: int  # its pipeline stage
    part: Part

    def source(self, pp_size: int) -> str:
        if pp_size > 1:
            return f"prefill pipeline stage {self.pp_rank}, attention-TP rank {self.tp_rank}"
        return f"prefill attention-TP rank {self.tp_rank}"


class KvfsmKVManager(BaseKVManager):
    """kvfsm behind SGLang's ``BaseKVManager``. Built by the scheduler with
    ``(kv_args, disaggregation_mode, server_args, is_mla_backend)``."""

    supports_deferred_decode_kv_release = True
    enable_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False
    #: Context-parallel ranks all move their own KV; there are no dummy ranks.
    is_dummy_cp_rank = False
    enable_all_cp_ranks_for_transfer = False

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.mode = mode_name(disaggregation_mode)
        #: SGLang's configuration as its own backends read it (runtime context first).
        self.server_config = ServerConfig.read(server_args)
        self.topology = Topology.of(args, self.server_config)
        #: SGLang's staging buffers (``SGLANG_DISAGG_STAGING_BUFFER``): kvfsm never stages, but
        #: SGLang's decode builds its staging handler from these at start-up (``_staging``).
        self.enable_staging = force_flag("SGLANG_DISAGG_STAGING_BUFFER")
        self._staging_ctx = StagingContext(
            EmptyStagingRing() if self.enable_staging and self.mode == "decode" else None
        )
        self._staging_handler: Any = None  # SGLang's decode sets its handler here
        self.kv_buffer_tensors: dict[str, Any] | None = None
        policy = self.server_config.disaggregation_decode_allocation_policy or "early"
        if policy != "early":
            raise UnsupportedError(
                f"--disaggregation-decode-allocation-policy {policy} is not supported by kvfsm "
                "(decode reserves a request's pages when it bootstraps: policy early)"
            )
        if self.mode != "prefill" and self.topology.pp_size > 1:
            raise UnsupportedError(
                f"pipeline parallelism on decode (pp_size={self.topology.pp_size}) is not "
                "supported by kvfsm (prefill may use it)"
            )
        #: Whether this instance serves room r on DP rank r % dp_size (else each room's DP
        #: rank is registered for decode to ask: ``_dp_ranks``), and whether SGLang was told
        #: to ask always (``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK``).
        self.dp_by_room = dp_by_room(self.server_config.load_balance_method, self.mode)
        self.force_dp_query = force_query()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._http: aiohttp.ClientSession | None = None
        self.layout = layout_from_kv_args(args, self.server_config.device)
        #: Its state types, and which layout rows a request's ``state_indices`` name.
        states = StateMap.from_kv_args(args).placed(self.layout.state_type_rows())
        if self.mode == "prefill" and self.topology.pp_size > 1:
            states = dataclasses.replace(states, stage=True)
        self.states = states
        self.bootstrap_url = bootstrap_url(self.server_config)
        #: Prefill: rooms with transfer state on this rank. kvfsm keeps that state in the rooms
        #: themselves; SGLang reads this only for staging prefetch, which kvfsm does not do.
        self.transfer_infos: dict[int, Any] = {}
        #: Decode: prefill instances whose sizes are known, by bootstrap address.
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._fetching: set[str] = set()
        self._peer_ids: dict[tuple[str, int], int] = {}
        self._peers: dict[int, tuple[str, int]] = {}
        self._next_peer = itertools.count(1)
        self._groups = itertools.count(1)
        self._clients: dict[str, BootstrapClient] = {}
        self._clients_closed = False
        self._closed = False
        self._receivers: dict[int, Legs[ReceiverRoom]] = {}
        self._cleared: dict[int, Legs[ReceiverRoom]] = {}
        self._lock = threading.Lock()
        self.config = self._config()
        self.kvfsm: PrefillManager | DecodeManager
        if self.mode == "prefill":
            self.kvfsm = self._prefill()
        else:
            self.kvfsm = DecodeManager(
                self.layout,
                None,
                engine_id=ENGINE,
                rank=self.topology.rank,
                resolver=self._resolve,
                config=self.config,
            )
        _log.info(
            "kvfsm %s rank %d (dp %d/%d, attn tp %d/%d) ready: %d KV buffers of %d pages, "
            "%d aux rows, %d state rows",
            self.mode,
            self.topology.rank,
            self.topology.dp_rank,
            self.topology.dp_size,
            self.topology.tp_rank,
            self.topology.attn_tp_size,
            len(self.layout.kv),
            self.layout.num_pages,
            self.layout.aux_rows,
            self.layout.state_rows,
        )

    # -- construction ----------------------------------------------------------------------

    def _config(self) -> ManagerConfig:
        config = manager_config()
        host = os.environ.get("KVFSM_HOST") or str(self.server_config.host or "")
        if host and config.channel.host == ChannelConfig().host:
            channel = dataclasses.replace(config.channel, host=host)
            config = dataclasses.replace(config, channel=channel)
        status = os.environ.get("KVFSM_STATUS_PORT")
        if status and config.status_port is None:
            config = dataclasses.replace(config, status_port=int(status) + self.topology.rank)
        status_host = os.environ.get("KVFSM_STATUS_HOST")
        if status_host and config.status_host == ManagerConfig().status_host:
            config = dataclasses.replace(config, status_host=status_host)
        if config.fingerprint is None:
            fingerprint = fingerprint_from_kv_args(
                self.kv_args,
                is_mla=self.is_mla_backend,
                attn_tp_size=self.topology.attn_tp_size,
                pp_size=self.topology.pp_size,
                attn_rank=self.topology.tp_rank,
                pp_rank=self.topology.pp_rank,
            )
            config = dataclasses.replace(config, fingerprint=fingerprint)
        return config

    def _prefill(self) -> PrefillManager:
        topo = self.topology
        return PrefillManager(
            self.layout,
            self.bootstrap_url,
            engine_id=ENGINE,
            rank=topo.rank,
            tp_rank=topo.tp_rank,
            tp_size=topo.attn_tp_size,
            dp_rank=topo.dp_rank,
            dp_size=topo.dp_size,
            pp_rank=topo.pp_rank,
            pp_size=topo.pp_size,
            stage_root=topo.rank_of(topo.dp_rank, 0, topo.tp_rank),
            dp_by_room=self.dp_by_room,
            http_port=int(self.server_config.port or 0),
            host=advertised_host(self.config.channel.host, self.bootstrap_url),
            config=self.config,
        )

    def new_sender(self, room: int, *, leg: int = 0) -> SenderRoom:
        if not isinstance(self.kvfsm, PrefillManager):
            raise RuntimeError("a decode-mode kvfsm manager has no senders")
        return self.kvfsm.sender(room, leg=leg)

    # -- prefill pipeline stages (any thread; no-ops without pipeline parallelism) -------------

    def _stage(self) -> PipelineStage | None:
        kvfsm = self.kvfsm
        return kvfsm.pipeline if isinstance(kvfsm, PrefillManager) else None

    def stage_track(self, room: int, sender: SenderRoom) -> None:
        stage = self._stage()
        if stage is not None:
            stage.track(room, sender)

    def stage_release(self, room: int, sender: SenderRoom) -> None:
        stage = self._stage()
        if stage is not None:
            stage.release(room, sender)

    def stage_consensus(self, room: int, own: RoomStatus) -> tuple[RoomStatus, str]:
        stage = self._stage()
        return (own, "") if stage is None else stage.consensus(room, own)

    def stage_ready(self) -> bool:
        """Every stage of this rank's pipeline can be heard (True without a pipeline)."""
        stage = self._stage()
        return stage is None or stage.ready

    def stage_entries(self) -> int:
        stage = self._stage()
        return 0 if stage is None else stage.entries()

    def new_receiver(self, room: int, *, leg: int = 0, group: int | None = None) -> ReceiverRoom:
        if not isinstance(self.kvfsm, DecodeManager):
            raise RuntimeError("a prefill-mode kvfsm manager has no receivers")
        return self.kvfsm.receiver(room, leg=leg, group=group)

    def new_group(self) -> int:
        """A fresh id for the legs of one request (they share its pages)."""
        return next(self._groups)

    def legs_for(self, bootstrap_addr: str) -> list[Leg] | str:
        """The prefill ranks a request of this decode rank hears from, with what each carries
        (``_slices.legs``), or why this pair cannot be served. Equal TP: this rank's own,
        whole. Unequal TP: the ranks holding this rank's heads (the first also sends the aux
        and state rows) and the ranks this one tells they are dummies; with state sharded over
        attention TP, the ranks of this rank's state group instead of dummies
        (``_slices.state_legs``). The model's head count comes from ``KVArgs`` when the
        scheduler set it; SGLang's decode usually has not, and then any count the TPs split
        gives the same plan unless prefill replicates heads, which the handshake refuses
        without one.

        Prefill pipeline stages (equal TP only): this rank's counterpart in every stage, each
        writing its span of layers; the last stage, which samples the first output token, also
        sends the aux row (and is leg 0, which carries it by convention)."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None:
            return f"prefill instance {bootstrap_addr} is unknown (no parallel info yet)"
        mine, theirs = self.topology.attn_tp_size, info.tp_size
        rank = self.topology.tp_rank
        if info.pp_size > 1:
            if theirs != mine:
                return (
                    f"prefill {bootstrap_addr} has {info.pp_size} pipeline stages and attention "
                    f"TP {theirs}, this decode {mine}: pipeline parallelism needs equal "
                    "attention TP"
                )
            last = info.pp_size - 1
            return [Leg(rank, last, Part.WHOLE)] + [
                Leg(rank, stage, Part.KV) for stage in range(last)
            ]
        if theirs == mine:
            return [Leg(rank, 0, Part.WHOLE)]
        if theirs % mine and mine % theirs:
            return (
                f"unequal attention TP: prefill {bootstrap_addr} has attention TP {theirs}, this "
                f"decode {mine}; kvfsm needs one to be a multiple of the other"
            )
        heads = (
            1 if self.is_mla_backend else int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        )
        if heads <= 0:
            heads = theirs
        # A Mamba state (or DSA's indexer) comes from the prefill ranks SGLang pairs this rank
        # with, over a state-only leg where that rank writes no KV here (with heads replicated
        # on both sides, the KV may come from another rank than the state).
        grouped = not self.is_mla_backend and self.states.group_legs
        plan = state_legs if grouped else legs
        try:
            return [Leg(tp, 0, part) for tp, part in plan(heads, theirs, mine, rank)]
        except ValueError as exc:
            return f"unequal attention TP ({theirs} to {mine}): {exc}"

    def register_dp_rank(self, room: int) -> concurrent.futures.Future[None] | None:
        """Prefill: publish that ``room`` runs on this rank's DP rank, for decode's scheduler to
        find (``/query_dp_ranks``). Returns at once; the registration runs on kvfsm's loop
        (``PrefillManager.register_dp_rank``), for up to ``DP_REGISTER_WAIT_S``. Only the
        first attention-TP rank of the first stage registers (the others would say the same):
        the others return None."""
        if self.topology.tp_rank or self.topology.pp_rank:
            return None
        prefill, engine = self.kvfsm, self.kvfsm.engine
        assert isinstance(prefill, PrefillManager)
        assert engine is not None
        coro = prefill.register_dp_rank(room, wait_s=DP_REGISTER_WAIT_S)
        return asyncio.run_coroutine_threadsafe(coro, engine.loop)

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """Decode, PD retraction with re-bootstrap: ask the request's prefill server to compute
        its KV again (``POST /generate`` with SGLang's ``payload``: the prompt and the tokens
        decoded so far, the same ``bootstrap_room``), which it then sends into the pages this
        new receiver named. Returns at once: the request runs on kvfsm's loop. Only the first
        attention-TP rank asks (the prefill server sends every decode rank its share), as
        SGLang's common backend elects. An address without a published HTTP port, an error
        answer or no answer within ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` fail the
        receiver with the reason, unless its transfer already succeeded."""
        if self.topology.tp_rank or self.topology.pp_rank:
            return
        rid = payload.get("rid")
        info = self.prefill_info_table.get(kv_receiver.bootstrap_addr)
        port = None if info is None else info.prefill_http_port
        engine = self.kvfsm.engine
        if port is None or engine is None:
            kv_receiver.recompute_failure = (
                f"PD retract rebootstrap for rid={rid}: no /generate URL for prefill "
                f"{kv_receiver.bootstrap_addr} (it published no HTTP port)"
                if engine is not None
                else f"PD retract rebootstrap for rid={rid}: the kvfsm manager is closed"
            )
            return
        host = kv_receiver.bootstrap_addr.rsplit(":", 1)[0]
        url = f"http://{host}:{port}/generate"
        future = asyncio.run_coroutine_threadsafe(self._recompute(url, payload), engine.loop)

        def done(future: concurrent.futures.Future[str | None]) -> None:
            failure = (
                f"PD retract rebootstrap for rid={rid}: the kvfsm manager closed first"
                if future.cancelled()
                else future.result()
            )
            if failure is not None:
                kv_receiver.recompute_failure = failure

        future.add_done_callback(done)

    async def _recompute(self, url: str, payload: dict[str, Any]) -> str | None:
        """POST the recompute; None once the prefill server answered it, else why not."""
        rid = payload.get("rid")
        if self._clients_closed:
            return f"PD retract rebootstrap for rid={rid}: the kvfsm manager is closed"
        if self._http is None:
            self._http = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=_waiting_timeout_s())
        try:
            async with self._http.post(url, json=payload, timeout=timeout) as resp:
                if resp.status < 400:
                    return None
                body = (await resp.text())[:512]
                return (
                    f"PD retract rebootstrap /generate failed for rid={rid} "
                    f"(status={resp.status}): {body}"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return (
                f"PD retract rebootstrap /generate request errored for rid={rid}: "
                f"{type(exc).__name__}: {exc}"
            )

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads decode's scheduler runs its DP-rank lookups on (``/query_dp_ranks``,
        SGLang's ``prefetch_prefill_dp_rank_queries``): SGLang's common backend lends its own
        executor for them, so every backend must have one. Made on first use, shut down with
        the manager."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=_executor_threads(), thread_name_prefix="kvfsm-sglang-http"
                )
            return self._executor

    def register_to_bootstrap(self) -> None:
        """Prefill ranks register when built and keep refreshing; nothing to do on demand."""

    # -- decode: finding prefill ranks (loop thread) -------------------------------------------

    def _client(self, addr: str) -> BootstrapClient:
        # Loop thread only, like _close_clients: a lookup still in flight when close() begins
        # cannot open a client that nothing would close (its socket would hold up the loop's
        # shutdown).
        if self._clients_closed:
            raise RuntimeError("the kvfsm manager is closed")
        client = self._clients.get(addr)
        if client is None:
            client = self.config.registry_client(f"http://{addr}")
            self._clients[addr] = client
        return client

    @property
    def attn_tp_size(self) -> int:
        """This instance's attention TP (SGLang's staging handler reads it)."""
        return self.topology.attn_tp_size

    def set_kv_buffer_tensors(
        self,
        k_buffers: list[Any],
        v_buffers: list[Any],
        page_size: int,
        slot_layer_ids: list[int] | None = None,
    ) -> None:
        """SGLang hands its KV pool tensors over with staging enabled; kvfsm keeps them only
        for SGLang's staging handler to read (it moves KV through the registered layout)."""
        self.kv_buffer_tensors = {
            "k_buffers": k_buffers,
            "v_buffers": v_buffers,
            "page_size": page_size,
            "slot_layer_ids": slot_layer_ids,
        }

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """True once ``prefill_info_table`` knows ``bootstrap_addr``; otherwise start the lookup
        on kvfsm's loop (once at a time per address) and return False. Never blocks."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        with self._lock:
            if bootstrap_addr in self._fetching:
                return False
            self._fetching.add(bootstrap_addr)
        engine = self.kvfsm.engine
        assert engine is not None
        asyncio.run_coroutine_threadsafe(self._fetch_info(bootstrap_addr), engine.loop)
        return False

    async def _fetch_info(self, addr: str) -> None:
        try:
            info = await self._client(addr).rank(ENGINE, 0)
            self.prefill_info_table[addr] = PrefillInfo(
                info.dp_size,
                info.tp_size,
                follow_bootstrap_room=info.dp_by_room,
                pp_size=info.pp_size,
                prefill_http_port=info.http_port or None,
            )
        except Exception as exc:
            _log.warning("prefill instance %s: parallel info not available yet: %s", addr, exc)
        finally:
            with self._lock:
                self._fetching.discard(addr)

    def peer_for(
        self,
        bootstrap_addr: str,
        prefill_dp_rank: int,
        prefill_tp_rank: int | None = None,
        prefill_pp_rank: int = 0,
    ) -> int | str:
        """The peer id a receiver names for ``(instance, DP rank, attention-TP rank, pipeline
        stage)`` (by default its own attention-TP rank: equal TP), or a reason why there is
        none."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None:
            return f"prefill instance {bootstrap_addr} is unknown (no parallel info yet)"
        if prefill_tp_rank is None:
            prefill_tp_rank = self.topology.tp_rank
        if not 0 <= prefill_tp_rank < info.tp_size:
            return (
                f"prefill attention-TP rank {prefill_tp_rank} out of range (attention TP "
                f"{info.tp_size})"
            )
        if not 0 <= prefill_dp_rank < info.dp_size:
            return f"prefill DP rank {prefill_dp_rank} out of range (dp_size {info.dp_size})"
        if not 0 <= prefill_pp_rank < info.pp_size:
            return f"prefill pipeline stage {prefill_pp_rank} out of range (pp {info.pp_size})"
        shape = Topology.of_instance(info.dp_size, info.tp_size, info.pp_size)
        target = (bootstrap_addr, shape.rank_of(prefill_dp_rank, prefill_pp_rank, prefill_tp_rank))
        with self._lock:
            peer = self._peer_ids.get(target)
            if peer is None:
                peer = next(self._next_peer)
                self._peer_ids[target] = peer
                self._peers[peer] = target
        return peer

    async def _resolve(self, peer: int) -> tuple[str, int, int]:
        addr, rank = self._peers[peer]
        info = await self._client(addr).rank(ENGINE, rank)
        return info.host, info.port, info.rank

    # -- decode: deferred page release ---------------------------------------------------------

    # A failed receiver's entry outlives clear() until its room is settled: the scheduler asks
    # is_abort_release_safe() after failure_exception() has already cleared it.

    def track(self, room: int, receiver: Legs[ReceiverRoom]) -> None:
        with self._lock:
            self._sweep()
            held = self._receivers.get(room)
            # A duplicate room id (refused by the engine, settled at once) must not hide the
            # live room's pages: the scheduler asks by room id, so answer for the live one.
            if held is None or held.settled:
                self._receivers[room] = receiver

    def cleared(self, room: int, receiver: Legs[ReceiverRoom]) -> None:
        with self._lock:
            if self._receivers.get(room) is receiver:
                self._cleared[room] = receiver
            self._sweep()

    def _sweep(self) -> None:
        for room, receiver in list(self._cleared.items()):
            if receiver.settled:
                del self._cleared[room]
                if self._receivers.get(room) is receiver:
                    del self._receivers[room]

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """May decode reuse the pages of failed ``room``? Only once no write can reach them
        (kvfsm knows without counting acknowledgements: ``required_acks`` is not needed)."""
        receiver = self._receivers.get(room)
        return receiver is None or receiver.settled

    def clear_deferred_abort_state(self, room: int) -> None:
        with self._lock:
            self._sweep()

    def tracked_rooms(self) -> int:
        """Per-room entries the adapter still holds (leak checks): settled rooms are dropped."""
        with self._lock:
            self._sweep()
            return len(self._receivers)

    # -- everything else the scheduler may call ------------------------------------------------

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return True

    async def _close_clients(self) -> None:
        self._clients_closed = True
        http, self._http = self._http, None
        if http is not None:
            await http.close()
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                await client.close()
            except Exception:
                _log.exception("closing a bootstrap client failed")

    def close(self) -> None:
        """Stop the rank: abort live rooms, let them settle, release NIXL. Idempotent."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        engine = self.kvfsm.engine
        if engine is not None and not self._closed:
            self._closed = True
            try:
                engine.call(self._close_clients(), timeout=10)
            except Exception:
                _log.exception("closing the bootstrap clients failed")
        self.kvfsm.close()

    def teardown(self) -> None:
        self.close()
