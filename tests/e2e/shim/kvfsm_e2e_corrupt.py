"""The e2e suite's negative control (tests only): corrupt the KV of the first transfer a
prefill rank posts, through kvfsm's own interposition point (``AgentConfig.interpose``, the
hook kvfsm's chaos proxy uses), so the suite can show that its output comparison fails when
transferred bytes are wrong.

``install()`` runs in every process of a server started with ``KVFSM_E2E_CORRUPT_FIRST=1``
(``sitecustomize`` beside this file calls it); only the scheduler builds a kvfsm manager.
The proxy overwrites the *source* pages of the first KV WRITE just before it is posted: they
belong to that request alone (the prefill radix cache is off), so no other request sees them.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

#: bf16 0x4040 (3.0) in every K and V element: far from what the dummy weights produce.
_BYTE = 0x40
_LOCAL = "NIXL_INIT_AGENT"  # the agent name NIXL gives a local descriptor list


class CorruptFirstKV:
    """Wraps a raw ``nixl_agent``; everything but two calls passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._kv_list: Any = None  # the first local list kvfsm preps is its KV list
        self._kv_descs: Any = None
        self._done = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prep_xfer_dlist(self, agent: str, descs: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._inner.prep_xfer_dlist(agent, descs, *args, **kwargs)
        with self._lock:
            if agent == _LOCAL and self._kv_list is None:
                self._kv_list, self._kv_descs = handle, descs
        return handle

    def make_prepped_xfer(
        self, op: str, local: Any, local_idx: Any, remote: Any, remote_idx: Any, *a: Any, **k: Any
    ) -> Any:
        with self._lock:
            hit = not self._done and local is self._kv_list and len(local_idx) > 0
            self._done = self._done or hit
        if hit:
            for row in local_idx:
                addr, nbytes = int(self._kv_descs[row][0]), int(self._kv_descs[row][1])
                ctypes.memset(addr, _BYTE, nbytes)
            print(
                f"kvfsm-e2e: corrupted {len(local_idx)} KV descriptors of the first transfer",
                file=sys.stderr,
                flush=True,
            )
        return self._inner.make_prepped_xfer(op, local, local_idx, remote, remote_idx, *a, **k)


def install() -> None:
    import dataclasses

    from kvfsm.sglang import configure
    from kvfsm.sglang._settings import manager_config

    base = manager_config()
    agent = dataclasses.replace(base.agent, interpose=CorruptFirstKV)
    configure(dataclasses.replace(base, agent=agent))
