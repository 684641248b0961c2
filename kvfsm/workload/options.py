"""The workload's knobs and their flags, defined once for ``kvfsm run`` and ``kvfsm demo``.

Both commands move the same kind of load (a KV layout, rooms of random pages cut into chunks,
random aborts) and take the same flags for it; only their defaults and their count flag
(``--rooms``, ``--requests``) differ.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Final

from kvfsm.control import Fingerprint
from kvfsm.workload.buffers import Shape, shape_of

__all__ = [
    "ABORT_REASON",
    "DTYPES",
    "DemoOptions",
    "RunOptions",
    "WorkloadOptions",
    "add_workload_flags",
    "workload_arguments",
]

#: Bytes per element of the KV dtypes ``--dtype`` accepts.
DTYPES: Final = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
#: The reason ``kvfsm run`` and ``kvfsm demo`` give the rooms they abort on purpose
#: (``--abort-rate``); a failure with another reason is unexpected.
ABORT_REASON: Final = "requested by --abort-rate"


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """The layout and the load, shared by ``kvfsm run`` and ``kvfsm demo``."""

    concurrency: int = 16
    #: Pages in each side's pool (decode's free pool, prefill's source pages).
    num_pages: int = 1024
    #: Each layer has a K and a V buffer; a page spans all of them.
    layers: int = 8
    page_tokens: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bf16"
    #: Bytes of one page in one K or V buffer; ``None``: tokens x heads x head_dim x dtype.
    page_bytes: int | None = None
    aux_rows: int = 256
    aux_row_bytes: int = 4096
    max_room_pages: int = 32
    max_chunks: int = 4
    #: Probability that a room is aborted at a random point of its life.
    abort_rate: float = 0.0
    #: A room not terminal this long after it started is counted wedged and aborted.
    room_timeout_s: float = 30.0
    #: Extra time a terminal room gets to settle before its pages are written off as unsettled.
    settle_grace_s: float = 30.0
    #: Scheduler nap when an iteration found nothing to do (0: just yield the GIL).
    idle_sleep_s: float = 0.0
    seed: int | None = None

    @property
    def buffer_page_bytes(self) -> int:
        """Bytes of one page in one K or V buffer."""
        if self.page_bytes is not None:
            return self.page_bytes
        return self.page_tokens * self.kv_heads * self.head_dim * DTYPES.get(self.dtype, 0)

    @property
    def total_page_bytes(self) -> int:
        """Bytes one page moves: its slice of every layer's K and V buffer."""
        return 2 * self.layers * self.buffer_page_bytes

    def fingerprint(self) -> Fingerprint:
        """What the ranks of this workload declare in their handshakes."""
        return Fingerprint(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_bytes=self.head_dim * DTYPES.get(self.dtype, 0),
            dtype=self.dtype,
            page_tokens=self.page_tokens,
        )

    def shape(self) -> Shape:
        """The buffers of one side."""
        return shape_of(self, page_bytes=self.buffer_page_bytes)

    def validate_workload(self, count_flag: str, count: int) -> None:
        """Raise ``ValueError`` naming the flag that is out of range."""
        if count < 0 or self.concurrency < 1:
            raise ValueError(f"{count_flag} must be >= 0 and --concurrency >= 1")
        for flag, value in (
            ("--layers", self.layers),
            ("--pages", self.num_pages),
            ("--page-tokens", self.page_tokens),
            ("--kv-heads", self.kv_heads),
            ("--head-dim", self.head_dim),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for flag, value in (
            ("--page-bytes", self.buffer_page_bytes),
            ("--aux-row-bytes", self.aux_row_bytes),
        ):
            if value < 8 or value % 8:
                raise ValueError(f"{flag} must be a positive multiple of 8, got {value}")
        if not 1 <= self.max_room_pages <= self.num_pages:
            raise ValueError("--max-room-pages must be in [1, --pages]")
        if self.max_chunks < 1:
            raise ValueError("--max-chunks must be >= 1")
        if self.aux_rows < self.concurrency:
            raise ValueError("--aux-rows must be >= --concurrency (one live row per room)")
        if not 0.0 <= self.abort_rate <= 1.0:
            raise ValueError(f"--abort-rate must be in [0, 1], got {self.abort_rate}")
        if not (self.room_timeout_s > 0 and self.settle_grace_s > 0 and self.idle_sleep_s >= 0):
            raise ValueError("--room-timeout must be > 0 and --idle-sleep >= 0")


@dataclass(frozen=True, slots=True)
class RunOptions(WorkloadOptions):
    """``kvfsm run``: ``rooms`` rooms from this process into a passive decode process."""

    rooms: int = 200

    def validate(self) -> None:
        self.validate_workload("--rooms", self.rooms)


@dataclass(frozen=True, slots=True)
class DemoOptions(WorkloadOptions):
    """``kvfsm run``'s workload knobs with the demo's defaults, plus its own."""

    num_pages: int = 512
    layers: int = 32
    kv_heads: int = 1
    aux_rows: int = 64
    aux_row_bytes: int = 1024
    room_timeout_s: float = 60.0
    idle_sleep_s: float = 0.0002
    requests: int = 300
    progress: bool = True

    def validate(self) -> None:
        self.validate_workload("--requests", self.requests)


def add_workload_flags(
    parser: argparse.ArgumentParser,
    defaults: WorkloadOptions,
    *,
    page_bytes: bool,
    abort_help: str,
    idle_help: str,
) -> None:
    """Add the workload's flags (``--concurrency`` to ``--seed``) with ``defaults``' values;
    ``page_bytes``: also ``--page-bytes`` (``kvfsm run`` only)."""
    d, a = defaults, parser.add_argument
    a("--concurrency", type=int, default=d.concurrency, help="rooms in flight (%(default)s)")
    a("--pages", type=int, default=d.num_pages, help="KV pages per side (%(default)s)")
    a("--layers", type=int, default=d.layers, help="layers, each a K and a V buffer (%(default)s)")
    a("--page-tokens", type=int, default=d.page_tokens, help="tokens per page (%(default)s)")
    a("--kv-heads", type=int, default=d.kv_heads, help="KV heads (%(default)s)")
    a("--head-dim", type=int, default=d.head_dim, help="head dim (%(default)s)")
    a("--dtype", choices=tuple(DTYPES), default=d.dtype, help="KV dtype (%(default)s)")
    if page_bytes:
        a(
            "--page-bytes",
            type=int,
            default=None,
            help="bytes of one page in one K or V buffer (default: tokens x heads x dim x dtype)",
        )
    a("--aux-rows", type=int, default=d.aux_rows, help="aux rows (%(default)s)")
    a("--aux-row-bytes", type=int, default=d.aux_row_bytes, help="bytes per aux row")
    a("--max-room-pages", type=int, default=d.max_room_pages, help="pages per room, at most")
    a("--max-chunks", type=int, default=d.max_chunks, help="chunks per room, at most")
    a("--abort-rate", type=float, default=d.abort_rate, help=abort_help)
    a(
        "--room-timeout",
        type=float,
        default=d.room_timeout_s,
        help="seconds after which a non-terminal room counts as wedged (%(default)s)",
    )
    a("--idle-sleep", type=float, default=d.idle_sleep_s, help=idle_help)
    a("--seed", type=int, default=None, help="random seed (default: random)")


def workload_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The ``WorkloadOptions`` fields from the flags of :func:`add_workload_flags`."""
    out = {
        "concurrency": args.concurrency,
        "num_pages": args.pages,
        "layers": args.layers,
        "page_tokens": args.page_tokens,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "aux_rows": args.aux_rows,
        "aux_row_bytes": args.aux_row_bytes,
        "max_room_pages": args.max_room_pages,
        "max_chunks": args.max_chunks,
        "abort_rate": args.abort_rate,
        "room_timeout_s": args.room_timeout,
        "idle_sleep_s": args.idle_sleep,
        "seed": args.seed,
    }
    if hasattr(args, "page_bytes"):
        out["page_bytes"] = args.page_bytes
    return out
