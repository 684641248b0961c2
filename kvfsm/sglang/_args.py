"""From what SGLang hands a backend (``KVArgs``, its configuration) to what kvfsm needs: a
:class:`~kvfsm.transport.Layout`, the rank's place in the topology, and addresses.

SGLang 0.5.23 resolves its configuration once per process and publishes it in its runtime
context (``sglang.srt.runtime_context``: ``get_disagg()``, ``get_parallel()``, ...); its own
backends read it there, not from the ``ServerArgs`` object they are handed, whose attributes can
be raw or stale (SGLang's resolution hooks rewrite published leaves such as the bootstrap port,
and its test fixture ``override_server_args`` publishes a configuration the ``server_args``
argument knows nothing of). :class:`ServerConfig` reads the same leaves the same way, and falls
back to ``ServerArgs`` attributes only where no configuration is published (SGLang absent, or
kvfsm's own harnesses).

Everything here is a pure function of its arguments and raises :class:`UnsupportedError` (a
``ValueError``) naming the SGLang feature when a deployment asks for something kvfsm does not do
yet, so the scheduler fails at start-up with a clear message instead of moving wrong bytes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import operator
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfsm.control import Fingerprint
from kvfsm.sglang._errors import UnsupportedError
from kvfsm.sglang._states import StateMap
from kvfsm.transport import Layout, LayoutError, MemKind

__all__ = [
    "ServerConfig",
    "Topology",
    "UnsupportedError",
    "advertised_host",
    "bootstrap_url",
    "fingerprint_from_kv_args",
    "layout_from_kv_args",
    "mode_name",
]

#: Every kvfsm rank of one SGLang instance registers under this engine name in the instance's own
#: bootstrap server (one server per prefill instance, as in SGLang).
ENGINE = "sglang"


def mode_name(mode: Any) -> str:
    """``"prefill"``/``"decode"`` from SGLang's ``DisaggregationMode`` (or kvfsm's pinned copy)."""
    value = getattr(mode, "value", mode)
    if value not in ("prefill", "decode"):
        raise UnsupportedError(f"kvfsm serves disaggregation mode prefill or decode, not {mode!r}")
    return str(value)


#: The runtime-context getter of each leaf kvfsm reads: the ones SGLang's own backends use
#: (disaggregation/common/conn.py, nixl/conn.py).
_GETTERS: dict[str, str] = {
    "host": "get_serving",
    "port": "get_serving",
    "disaggregation_bootstrap_port": "get_disagg",
    "disaggregation_decode_allocation_policy": "get_disagg",
    "dist_init_addr": "get_parallel",
    "tp_size": "get_parallel",
    "dp_size": "get_parallel",
    "pp_size": "get_parallel",
    "enable_dp_attention": "get_parallel",
    "load_balance_method": "get_parallel",
    "device": "get_device",
}


def _published(getter: str, name: str) -> tuple[bool, object]:
    """``(True, value)`` of a leaf of SGLang's published configuration, or ``(False, None)``
    when SGLang is not importable or has published nothing in this process."""
    try:
        from sglang.srt import runtime_context  # noqa: PLC0415 - SGLang is optional
    except ImportError:
        return False, None
    try:
        bag = getattr(runtime_context, getter)()
        return True, getattr(bag, name)
    except (ValueError, RuntimeError, AttributeError):
        # ValueError: "config namespace ... not published"; RuntimeError: a parallel width
        # not written in this process; AttributeError: a release without this leaf.
        return False, None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The SGLang configuration kvfsm reads, resolved as SGLang's own backends see it."""

    host: str | None = "127.0.0.1"
    #: The server's HTTP port (``--port``): where a decode asks this prefill to recompute a
    #: retracted request (SGLang's re-bootstrap ``/generate``).
    port: int | None = None
    disaggregation_bootstrap_port: int = 8998
    dist_init_addr: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    enable_dp_attention: bool = False
    #: When decode reserves a request's pages (``--disaggregation-decode-allocation-policy``).
    disaggregation_decode_allocation_policy: str | None = "early"
    #: How SGLang's DP controller picks a request's DP rank (``--load-balance-method``).
    load_balance_method: str | None = "auto"
    #: SGLang's ``--device`` (``cuda``, ``cpu``, ...), None when unknown.
    device: str | None = None

    @classmethod
    def read(cls, server_args: Any) -> ServerConfig:
        """Each leaf from SGLang's runtime context when published, else the ``server_args``
        attribute, else SGLang's default."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            found, value = _published(_GETTERS[field.name], field.name)
            if not found:
                value = getattr(server_args, field.name, field.default)
            values[field.name] = value
        if values["device"] is not None:
            values["device"] = str(values["device"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Topology:
    """Where one scheduler rank sits. With equal attention TP, kvfsm pairs prefill rank r with
    decode rank r; otherwise the head plan says which ranks pair (``_slices.legs``). A
    request's prefill DP rank is chosen by SGLang (``bootstrap_room % dp_size`` or the router)
    and named in ``receiver.init``."""

    attn_tp_size: int
    tp_rank: int  # within the attention TP group
    dp_size: int
    dp_rank: int
    #: Pipeline stages, and this rank's (prefill only: decode refuses ``pp_size > 1``).
    pp_size: int = 1
    pp_rank: int = 0

    @property
    def rank(self) -> int:
        """The registry rank: unique per (dp_rank, pp_rank, tp_rank) within the instance."""
        return self.rank_of(self.dp_rank, self.pp_rank, self.tp_rank)

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The registry rank of the rank at those coordinates of this rank's instance (decode
        computes a prefill instance's with its sizes: :meth:`of_instance`)."""
        return (dp_rank * self.pp_size + pp_rank) * self.attn_tp_size + tp_rank

    @classmethod
    def of_instance(cls, dp_size: int, attn_tp_size: int, pp_size: int) -> Topology:
        """Rank 0 of an instance of these sizes (for :meth:`rank_of`)."""
        return cls(attn_tp_size, 0, dp_size, 0, pp_size, 0)

    @classmethod
    def of(cls, args: Any, server_args: Any) -> Topology:
        tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        dp_size = int(getattr(server_args, "dp_size", 1) or 1)
        pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        if not 0 <= pp_rank < pp_size:
            raise UnsupportedError(f"pp_rank {pp_rank} out of range (pp_size {pp_size})")
        dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
        if dp_attention and tp_size % dp_size:
            raise UnsupportedError(f"tp_size {tp_size} is not a multiple of dp_size {dp_size}")
        attn_tp = tp_size // dp_size if dp_attention else tp_size
        engine_rank = int(args.engine_rank)
        if dp_attention:
            # One scheduler per TP rank; DP groups are consecutive blocks of attention TP ranks.
            dp_rank = engine_rank // attn_tp
        else:
            # One scheduler group per DP rank, each with the full TP; the scheduler tells us which.
            dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        return cls(attn_tp, engine_rank % attn_tp, dp_size, dp_rank, pp_size, pp_rank)


def _kind(name: str, value: object) -> MemKind:
    try:
        return MemKind(str(value).upper())
    except ValueError:
        raise UnsupportedError(
            f"{name}: memory kind {value!r} (kvfsm moves DRAM or VRAM)"
        ) from None


def _uniform_kind(name: str, kinds: Sequence[object], default: MemKind) -> MemKind:
    # One NIXL descriptor list per group, so one memory kind per group. SGLang's own NIXL
    # backend refuses mixed kinds as well (``_homogeneous_kv_mem_kind`` in
    # sglang/srt/disaggregation/nixl/conn.py).
    if not kinds:
        return default
    found = {_kind(name, k) for k in kinds}
    if len(found) > 1:
        raise UnsupportedError(
            f"{name}: mixed memory kinds {sorted(k.value for k in found)} in one KV pool"
        )
    return found.pop()


def fingerprint_from_kv_args(
    args: Any,
    *,
    is_mla: bool,
    attn_tp_size: int,
    pp_size: int,
    attn_rank: int = 0,
    pp_rank: int = 0,
) -> Fingerprint:
    """What this rank declares in its handshakes, from what SGLang's scheduler put in
    ``KVArgs`` *before* it built the manager: a peer whose pool has other layers, dtype, page
    size, MLA-ness, state types or parallel shape is refused at the handshake, naming the field,
    instead of landing wrong bytes.

    Head counts (``kv_heads``, ``head_bytes``) are declared where the scheduler has set them:
    SGLang 0.5.23's prefill sets ``kv_head_num``/``total_kv_head_num`` for MHA pools before the
    manager, its decode only afterwards (and only with heterogeneous-TP staging), so decode
    usually declares 0, which the rules accept (they compare head fields only where both sides
    declare them). Prefill needs them to plan the head slices it writes under unequal attention
    TP. MHA pools hold a K and a V buffer per layer, MLA pools one latent buffer per layer.
    A prefill pipeline stage declares its own layers, from ``prefill_start_layer``."""
    item_lens = list(getattr(args, "kv_item_lens", None) or [])
    states = StateMap.from_kv_args(args)
    page_tokens = int(getattr(args, "page_size", 0) or 0)
    kv_heads = head_bytes = 0
    local = int(getattr(args, "kv_head_num", 0) or 0)
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if not is_mla and local > 0 and total > 0 and item_lens and page_tokens > 0:
        row, rest = divmod(int(item_lens[0]), page_tokens)
        if not rest and row % local == 0:
            kv_heads, head_bytes = total, row // local
    return Fingerprint(
        layers=len(item_lens) // (1 if is_mla else 2),
        kv_heads=kv_heads,
        head_bytes=head_bytes,
        dtype=str(getattr(args, "kv_cache_dtype_str", "") or ""),
        page_tokens=page_tokens,
        mla=is_mla,
        state_types=states.names,
        state_dims=states.dims,
        state_conv=states.conv if any(states.conv) else (),
        state_outer=states.outer if any(o != 1 for o in states.outer) else (),
        state_layers=states.layers,
        attn_tp=attn_tp_size,
        pp=pp_size,
        attn_rank=attn_rank,
        pp_rank=pp_rank,
        first_layer=int(getattr(args, "prefill_start_layer", 0) or 0) if pp_size > 1 else 0,
    )


def layout_from_kv_args(args: Any, sglang_device: str | None = None) -> Layout:
    """The rank's layout: KV buffers (per layer, K and V apart, draft buffers included), aux
    rows (SGLang's metadata buffers, host memory) and the buffers of every state type, one
    state group each (:class:`~kvfsm.sglang._states.StateMap`).

    KV memory kind: DRAM when SGLang runs on ``sglang_device="cpu"`` (``--device cpu``),
    whose pool is host memory whatever the scheduler labels it (SGLang 0.5.23's decode sets
    ``kv_data_mem_kinds`` to VRAM for every NIXL rank, and prefill sets nothing, which means
    VRAM; registered as VRAM, a host pool fails NIXL registration). Otherwise
    ``kv_data_mem_kinds`` when the scheduler sets it, else VRAM on ``gpu_id``, which is where
    SGLang keeps the pool. State lives with the pool;
    aux rows are host memory.
    """
    if getattr(args, "host_kv_data_ptrs", None):
        raise UnsupportedError("host KV destinations (decode host receive) are not supported")
    if sglang_device == "cpu":
        kind = MemKind.DRAM
    else:
        kind = _uniform_kind(
            "kv_data_mem_kinds",
            list(getattr(args, "kv_data_mem_kinds", None) or []),
            MemKind.VRAM,
        )
    device = int(getattr(args, "gpu_id", 0) or 0) if kind is MemKind.VRAM else 0
    states = StateMap.from_kv_args(args)
    try:
        return Layout.from_pointers(
            args.kv_data_ptrs,
            args.kv_data_lens,
            args.kv_item_lens,
            getattr(args, "aux_data_ptrs", None) or (),
            getattr(args, "aux_data_lens", None) or (),
            getattr(args, "aux_item_lens", None) or (),
            states.ptrs,
            states.lens,
            states.items,
            kind=kind,
            device=device,
            state_groups=states.groups,
        )
    except LayoutError as exc:
        raise LayoutError(f"KVArgs does not describe a usable layout: {exc}") from exc


def _host_of(address: str) -> str:
    host, _, _port = address.rpartition(":")
    return host.strip("[]") or address


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def bootstrap_url(server_args: Any) -> str:
    """Where this instance's bootstrap server listens, as its own ranks reach it.

    SGLang starts it on ``--host`` at ``--disaggregation-bootstrap-port`` in the node-0 process;
    ranks on other nodes of a multi-node instance reach it through ``--dist-init-addr``'s host.
    """
    port = operator.index(getattr(server_args, "disaggregation_bootstrap_port", 8998))
    host = str(getattr(server_args, "host", "127.0.0.1") or "127.0.0.1")
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        host = _host_of(str(dist))
    if _is_wildcard(host):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def advertised_host(bind_host: str, toward: str) -> str:
    """The address peers should use for a socket bound to ``bind_host``: itself, unless it is a
    wildcard, then the local address of the route toward ``toward`` (no packet is sent)."""
    if not _is_wildcard(bind_host):
        return bind_host
    target = _host_of(toward.split("//", 1)[-1].split("/", 1)[0])
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(target).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
