"""Which SGLang base classes the adapter builds on: the real ones when SGLang is importable (a
drop-in backend must be a subclass of SGLang's own ABCs), otherwise the pinned 0.5.23 copy.

Importing SGLang's ``base.conn`` runs ``sglang/__init__.py`` (torch, triton and some 1,800 modules,
about 2 s: docs/sglang-import.md), which is fine inside an SGLang process, where all of it is
loaded already. ``KVFSM_SGLANG_BASES=pinned`` forces the pinned copy (for comparing the two).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

__all__ = [
    "BASES",
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

BASES: Literal["sglang", "pinned"]

if TYPE_CHECKING:
    from kvfsm.sglang._pinned import (
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        DisaggregationMode,
        KVArgs,
        KVPoll,
        KVTransferDestination,
        KVTransferMetric,
    )
else:
    try:
        if os.environ.get("KVFSM_SGLANG_BASES") == "pinned":
            raise ImportError("KVFSM_SGLANG_BASES=pinned")
        from sglang.srt.disaggregation.base.conn import (
            BaseKVBootstrapServer,
            BaseKVManager,
            BaseKVReceiver,
            BaseKVSender,
            KVArgs,
            KVPoll,
            KVTransferDestination,
            KVTransferMetric,
        )
    except ImportError:
        from kvfsm.sglang._pinned import (
            BaseKVBootstrapServer,
            BaseKVManager,
            BaseKVReceiver,
            BaseKVSender,
            DisaggregationMode,
            KVArgs,
            KVPoll,
            KVTransferDestination,
            KVTransferMetric,
        )

        BASES = "pinned"
    else:
        # DisaggregationMode lives in disaggregation/utils.py, whose import needs the whole
        # model stack (docs/sglang-import.md, section 5). The adapter only compares its value, so it
        # keeps the pinned enum; SGLang's member compares equal by ``.value`` (see _manager.py).
        from kvfsm.sglang._pinned import DisaggregationMode

        BASES = "sglang"
