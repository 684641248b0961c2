"""What SGLang's decode asks of its backend under ``SGLANG_DISAGG_STAGING_BUFFER=1``, from a
backend that never stages.

SGLang's NIXL backend moves unequal-TP KV through staging buffers: prefill gathers its head
slices into a buffer on decode's device, and decode scatters them into its pages. kvfsm needs
none: it writes each head slice where it belongs with head-sliced descriptors, so every kvfsm
receiver reports ``require_staging = False``.

With the variable set, SGLang 0.5.23's decode still builds its staging handler once, at
start-up, from the backend (``DecodePreallocQueue.__init__`` and ``_init_kv_manager`` in
sglang/srt/disaggregation/decode.py, ``DecodeStagingHandler.create`` in
disaggregation/common/staging_handler.py): it hands the manager its KV pool tensors
(``set_kv_buffer_tensors``) and reads back ``kv_buffer_tensors``, ``attn_tp_size`` and the
staging allocator ``_staging_ctx.allocator``. Per request it uses the handler only for
receivers whose ``require_staging`` is true (``pop_preallocated`` registers them, and
``poll_and_all_reduce_with_staging`` in disaggregation/utils.py scatters and gates only them),
so with kvfsm it never touches a request. What kvfsm lends it is :class:`StagingContext`
with an empty ring (:class:`EmptyStagingRing`): SGLang's allocator of zero bytes, which
would refuse any allocation as one that does not fit, and reserves no device memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EmptyStagingRing", "StagingContext"]


class EmptyStagingRing:
    """SGLang's ``StagingAllocator`` (disaggregation/common/staging_buffer.py) of zero bytes:
    the same methods with the answers that allocator gives at size 0."""

    #: SGLang's marker for a chunk that can never fit.
    ALLOC_OVERSIZED = -2

    def __init__(self) -> None:
        self.total_size = 0
        self.base_ptr = 0
        #: SGLang's handler drains this stream before it frees a room's slots (none here).
        self._scatter_stream: Any = None

    def assign(self, required_bytes: int) -> tuple[int, int, int] | None:
        """None, as SGLang's allocator answers a request larger than its ring."""
        return None

    def free(self, alloc_id: int) -> None:
        """Nothing was allocated: a no-op, as SGLang's allocator is for an unknown id."""

    def get_watermark(self) -> tuple[int, int]:
        return (0, 0)

    def get_base_ptr(self) -> int:
        return self.base_ptr

    def get_total_size(self) -> int:
        return self.total_size


@dataclass(slots=True)
class StagingContext:
    """The fields of SGLang's ``DecodeStagingContext`` its staging handler reads: the
    allocator, and the per-room maps it clears when a staged room ends (never filled here)."""

    allocator: EmptyStagingRing | None = None
    room_receivers: dict[int, Any] = field(default_factory=dict)
    room_bootstrap: dict[int, Any] = field(default_factory=dict)
