"""The e2e suite's negative control (tests only): corrupt the KV of one transfer a prefill rank
posts, through kvfsm's own interposition point (``AgentConfig.interpose``, the hook kvfsm's
chaos proxy uses), so the suite can show that its output comparison fails when transferred bytes
are wrong.

It lives in the rig's own prefill server, disarmed. ``KVFSM_E2E_CORRUPT_ARM`` names a file; the
test creates it, and the next KV WRITE that prefill posts claims it (``unlink``, so exactly one
transfer is corrupted even with several posting threads) and has its *source* pages overwritten
just before it is posted: they belong to that request alone (the prefill radix cache is off), so
no other request sees them. An armed file is the only thing that changes a byte: with no file
the proxy passes every call through.

Why not a second prefill server started with the proxy armed: that server was the only one the
suite started while four others ran, and in three clean-clone CI runs it did not come up within
300 s, which failed the module. Arming the rig's prefill at run time needs no extra server.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

#: The variable naming the arming file; set on the rig's prefill server only.
ARM_ENV = "KVFSM_E2E_CORRUPT_ARM"
#: bf16 0x4040 (3.0) in every K and V element: far from what the dummy weights produce.
_BYTE = 0x40
_LOCAL = "NIXL_INIT_AGENT"  # the agent name NIXL gives a local descriptor list


class CorruptArmedKV:
    """Wraps a raw ``nixl_agent``; everything but two calls passes through."""

    def __init__(self, inner: Any, arm_path: str) -> None:
        self._inner = inner
        self._arm_path = arm_path
        self._lock = threading.Lock()
        self._kv_list: Any = None  # the first local list kvfsm preps is its KV list
        self._kv_descs: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prep_xfer_dlist(self, agent: str, descs: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._inner.prep_xfer_dlist(agent, descs, *args, **kwargs)
        with self._lock:
            if agent == _LOCAL and self._kv_list is None:
                self._kv_list, self._kv_descs = handle, descs
        return handle

    def _claim(self) -> bool:
        """True for the one transfer that takes the armed file."""
        try:
            os.unlink(self._arm_path)
        except FileNotFoundError:
            return False
        return True

    def make_prepped_xfer(
        self, op: str, local: Any, local_idx: Any, remote: Any, remote_idx: Any, *a: Any, **k: Any
    ) -> Any:
        if local is self._kv_list and len(local_idx) > 0 and self._claim():
            for row in local_idx:
                addr, nbytes = int(self._kv_descs[row][0]), int(self._kv_descs[row][1])
                ctypes.memset(addr, _BYTE, nbytes)
            print(
                f"kvfsm-e2e: corrupted {len(local_idx)} KV descriptors of an armed transfer",
                file=sys.stderr,
                flush=True,
            )
        return self._inner.make_prepped_xfer(op, local, local_idx, remote, remote_idx, *a, **k)


def install() -> None:
    import dataclasses

    from kvfsm.sglang import configure
    from kvfsm.sglang._settings import manager_config

    arm_path = os.environ[ARM_ENV]
    base = manager_config()
    agent = dataclasses.replace(base.agent, interpose=lambda raw: CorruptArmedKV(raw, arm_path))
    configure(dataclasses.replace(base, agent=agent))
