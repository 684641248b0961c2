"""SGLang 0.5.23's backend interface, pinned: what ``kvfsm.sglang`` builds on when SGLang itself is
not installed (unit tests, type checking, machines without a GPU stack).

Only the interface is here: the names, parameter lists, defaults, class attributes and abstract
methods of ``sglang/srt/disaggregation/base/conn.py`` in the 0.5.23 wheel, as recorded in
``docs/sglang-import.md``, section 6. ``tests/sglang/test_real_interface.py`` compares every
class here with the real one whenever SGLang is importable, so a version bump that changes the
interface fails loudly instead of drifting. When SGLang is installed, ``kvfsm.sglang``
subclasses the real classes and this module is not used at all (``kvfsm.sglang.BASES``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "SGLANG_VERSION",
    "BaseKVBootstrapServer",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "DisaggregationMode",
    "KVArgs",
    "KVPoll",
    "KVTransferDestination",
    "KVTransferMetric",
]

#: The release this snapshot was taken from (the signatures move between SGLang releases, so
#: the adapter pins one).
SGLANG_VERSION = "0.5.23"


class KVPoll:
    """Plain ints, ordered: the scheduler MIN-reduces them across ranks (``poll_and_all_reduce``
    in ``sglang/srt/disaggregation/utils.py``)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(enum.Enum):
    """``sglang.srt.disaggregation.utils.DisaggregationMode``."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferDestination(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass
class KVTransferMetric:
    transfer_latency_s: float | None = None
    alloc_latency_s: float | None = None
    transfer_total_bytes: int | None = None


class KVArgs:
    """A bag of attributes the scheduler fills in one by one (not a dataclass upstream either).

    Declared here are the fields the adapter reads; the scheduler sets some 40 more.
    """

    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    state_types: list[Any]
    state_data_ptrs: list[list[int]]
    state_data_lens: list[list[int]]
    state_item_lens: list[list[int]]
    gpu_id: int
    page_size: int
    system_dp_rank: int
    pp_rank: int
    kv_layout: str | None = None
    host_kv_data_ptrs: list[int] | None = None
    num_draft_entries: int = 0


class BaseKVManager(ABC):
    """Base class for managing transfer states"""

    enable_deferred_decode_kv_release = False
    supports_host_destination = False

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return True

    @abstractmethod
    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ): ...

    @abstractmethod
    def register_to_bootstrap(self):  # type: ignore[no-untyped-def]  # mirrors upstream
        ...

    supports_role_switch = False
    supports_deferred_decode_kv_release = False

    def teardown(self) -> None:
        raise NotImplementedError


class BaseKVSender(ABC):
    @abstractmethod
    def __init__(
        self,
        mgr: BaseKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ): ...

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: int | None = None):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def send(  # type: ignore[no-untyped-def]
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ): ...

    def mark_prefill_complete(self) -> None:
        raise NotImplementedError

    def pop_decode_prefix_len(self) -> int:
        return 0

    def get_max_transfer_tokens(self) -> int | None:
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0

    @abstractmethod
    def get_transfer_metric(self) -> KVTransferMetric: ...

    @abstractmethod
    def poll(self) -> Any: ...

    @abstractmethod
    def failure_exception(self):  # type: ignore[no-untyped-def]
        ...

    def clear(self):  # type: ignore[no-untyped-def]
        pass

    def abort(self):  # type: ignore[no-untyped-def]
        pass


class BaseKVReceiver(ABC):
    @property
    def supports_host_destination(self) -> bool:
        return False

    def is_abort_release_safe(self) -> bool:
        raise NotImplementedError

    @abstractmethod
    def __init__(
        self,
        mgr: BaseKVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
    ): ...

    @abstractmethod
    def init(self, prefill_dp_rank: int):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def send_metadata(  # type: ignore[no-untyped-def]
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ): ...

    @abstractmethod
    def poll(self) -> Any: ...

    @abstractmethod
    def failure_exception(self):  # type: ignore[no-untyped-def]
        ...

    def clear(self):  # type: ignore[no-untyped-def]
        pass

    def abort(self):  # type: ignore[no-untyped-def]
        pass


class BaseKVBootstrapServer(ABC):
    @abstractmethod
    def __init__(self, host: str, port: int): ...
