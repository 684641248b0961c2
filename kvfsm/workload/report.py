"""What the workload summaries share: latency percentiles, failure reasons counted by class,
byte sizes and the layout in words. ``kvfsm run``, ``kvfsm demo`` and ``kvfsm chaos`` count and
print them the same way."""

from __future__ import annotations

import re

import numpy as np

from kvfsm.workload.options import WorkloadOptions

__all__ = ["describe_layout", "percentile", "reason_class", "size"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values``; 0 when there are none."""
    return float(np.percentile(values, q)) if values else 0.0


def reason_class(
    reason: str, *, own_abort: str = "", own_name: str = "", width: int | None = None
) -> str:
    """A failure reason with its numbers (chunk ids, sizes, seconds) blanked, for counting.

    ``own_abort``: a reason that contains it is one of the run's own aborts; those are one class
    per side that aborted, ``"aborted (local|peer): <own_name>"``. ``width``: at most that many
    characters of a blanked reason."""
    if own_abort and own_abort in reason:
        return f"aborted ({'peer' if '(peer)' in reason else 'local'}): {own_name}"
    blanked = re.sub(r"\d+(\.\d+)?", "#", reason)
    return blanked if width is None else blanked[:width]


def size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that shows it to a sixteenth ("2 MiB", "1.5 KiB")."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % (scale // 16) == 0:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def describe_layout(opts: WorkloadOptions) -> str:
    """The layout in one line: buffers, page size, pool size, aux rows."""
    per_buffer = (
        f"{size(opts.buffer_page_bytes)}"
        if opts.page_bytes is not None
        else f"{opts.page_tokens} tokens x {opts.kv_heads} KV heads x {opts.head_dim} dims "
        f"{opts.dtype} = {size(opts.buffer_page_bytes)}"
    )
    pool = opts.num_pages * opts.total_page_bytes
    return (
        f"{opts.layers} layers x K,V; a page is {per_buffer} per buffer, "
        f"{size(opts.total_page_bytes)} in all; {opts.num_pages} pages "
        f"({size(pool)} of KV per side); aux {opts.aux_rows} x {size(opts.aux_row_bytes)}"
    )
