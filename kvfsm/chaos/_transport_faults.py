"""NIXL-level faults in real transfers: a proxy around the raw NIXL agent.

Install it with :func:`faulty_agent_config` (an ``AgentConfig`` whose ``interpose`` hook wraps
the agent as soon as NIXL creates it), so ``Agent.nixl`` is the proxy and every call the agent
and :class:`~kvfsm.transport.NixlTransport` make goes through it. Six calls are intercepted;
everything else passes through untouched:

* ``make_prepped_xfer`` (poster thread): the real handle is made, then the plan decides this
  handle's fault once (:class:`~kvfsm.chaos._plan.TransferFault`). Deciding at creation, in
  the poster's submission order, keeps the decisions reproducible from the seed. A READ is a
  flush (the pump's proof that a held WRITE is over) and is never faulted, nor does it take a
  decision: flushes come when chunks are held, at times the machine decides, so drawing for
  them would shift every later decision; and a flush the proxy kept reporting ``"PROC"``
  after its real transfer ended would hold its rooms unsettled for good, a lie the proxy
  would be telling, not a fault of the transport.
* ``initialize_xfer`` (poster thread): a transfer of descriptors made for one request (the
  remapped slots of DSA tail rings of different sizes) is a handle like a prepared one, so it
  takes its decision the same way, in the same order among the poster's handles; without it
  those transfers would post untouched and no injected fault could reach them.
* ``transfer`` (poster thread): post errors do not post at all (``"ERR"``, an exception, or a
  remote-disconnect exception); for the completion faults the real transfer is posted but
  reported ``"PROC"`` even if it finished inside the call.
* ``check_xfer_state`` (poster thread once, then the pump on the loop thread): a completion
  error is reported only once the real transfer is over, because a real ``"ERR"`` means nothing
  more will be written; reporting it earlier would make the proxy, not kvfsm, break law 4.
  A never-completing handle says ``"PROC"`` forever: the transport's chunk deadline, release
  and quarantine must deal with it. A delayed one says ``"PROC"`` until its delay has passed.
* ``release_xfer_handle`` (either thread): released for real; the proxy forgets the handle.
* ``get_new_notifs``: passes through (counted).

The proxy keeps per-kind counters and the number of handles made and released, which a report
compares with the transport's own counters.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Final

from kvfsm.chaos._plan import FaultPlan, TransferFault
from kvfsm.transport import AgentConfig

__all__ = [
    "FaultyNixl",
    "InjectedTransferError",
    "TransportFaults",
    "faulty_agent_config",
    "nixlRemoteDisconnectError",
]

_DONE: Final = "DONE"
_PROC: Final = "PROC"
_ERR: Final = "ERR"
_COMPLETION_FAULTS: Final = frozenset(
    {TransferFault.COMPLETION_ERROR, TransferFault.NEVER_COMPLETE, TransferFault.DELAY}
)


class InjectedTransferError(RuntimeError):
    """What an injected ``post_raise`` fault raises from ``transfer()``."""


class nixlRemoteDisconnectError(RuntimeError):  # noqa: N801 - NIXL's name is the contract
    """Named like NIXL's own exception, which is how kvfsm recognises a remote disconnect
    (``kvfsm.transport._nixl.is_remote_disconnect``)."""


class _Handle:
    __slots__ = ("delay_s", "fault", "handle", "posted_at", "real")

    def __init__(self, handle: Any, fault: TransferFault, delay_s: float) -> None:
        self.handle = handle  # kept so its id() cannot be reused while we track it
        self.fault = fault
        self.delay_s = delay_s
        self.posted_at = 0.0
        self.real = ""  # the last real state seen


class FaultyNixl:
    """Wraps a raw ``nixl_agent``; see the module docstring for what it changes."""

    def __init__(self, inner: Any, plan: FaultPlan, *, site: str = "xfer") -> None:
        self._inner = inner
        self._plan = plan
        self._site = site
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self.counters: dict[str, int] = {
            "handles_made": 0,
            "handles_released": 0,
            "notif_calls": 0,
            **{f"injected_{kind.value}": 0 for kind in TransferFault if kind is not kind.NONE},
        }

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here: everything else is NIXL's own.
        return getattr(self._inner, name)

    # -- intercepted calls ---------------------------------------------------------------------

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        return self._track(self._inner.make_prepped_xfer(*args, **kwargs), args, kwargs)

    def initialize_xfer(self, *args: Any, **kwargs: Any) -> Any:
        return self._track(self._inner.initialize_xfer(*args, **kwargs), args, kwargs)

    def _track(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Decide a new handle's fault once and track it (both calls name the operation
        first, or as ``operation``)."""
        operation = args[0] if args else kwargs.get("operation")
        if operation == "READ":  # a flush: see the module docstring
            fault, delay = TransferFault.NONE, 0.0
        else:
            fault, param = self._plan.transfer_fault(self._site)
            delay = param * self._plan.transfer_rates.delay_max_s
        with self._lock:
            self._handles[id(handle)] = _Handle(handle, fault, delay)
            self.counters["handles_made"] += 1
            if fault is not TransferFault.NONE:
                self.counters[f"injected_{fault.value}"] += 1
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> str:
        entry = self._entry(handle)
        fault = entry.fault if entry is not None else TransferFault.NONE
        if fault is TransferFault.POST_ERROR:
            return _ERR
        if fault is TransferFault.POST_RAISE:
            raise InjectedTransferError("injected fault: transfer() failed to post")
        if fault is TransferFault.POST_DISCONNECT:
            raise nixlRemoteDisconnectError("injected fault: remote disconnect at post")
        state: str = self._inner.transfer(handle, *args, **kwargs)
        if entry is None:
            return state
        entry.posted_at = time.monotonic()
        entry.real = state
        if fault in _COMPLETION_FAULTS and state != _ERR:
            return _PROC
        return state

    def check_xfer_state(self, handle: Any) -> str:
        entry = self._entry(handle)
        if entry is None:
            state: str = self._inner.check_xfer_state(handle)
            return state
        if entry.fault is TransferFault.POST_ERROR:
            return _ERR  # never posted: the handle stays errored
        if entry.real != _DONE:  # NIXL's answer for a finished handle does not change
            entry.real = self._inner.check_xfer_state(handle)
        real, fault = entry.real, entry.fault
        if fault is TransferFault.NONE or real == _ERR:
            return real
        if fault is TransferFault.NEVER_COMPLETE:
            return _PROC
        if real == _PROC:
            return _PROC
        if fault is TransferFault.COMPLETION_ERROR:
            return _ERR
        # DELAY: done for real; report it once the delay since the post has passed.
        return _DONE if time.monotonic() - entry.posted_at >= entry.delay_s else _PROC

    def release_xfer_handle(self, handle: Any) -> None:
        self._inner.release_xfer_handle(handle)  # if NIXL refuses, we keep tracking it
        with self._lock:
            if self._handles.pop(id(handle), None) is not None:
                self.counters["handles_released"] += 1

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> Any:
        self.counters["notif_calls"] += 1  # one writer: whichever thread progresses the agent
        return self._inner.get_new_notifs(*args, **kwargs)

    # -- reads ---------------------------------------------------------------------------------

    def _entry(self, handle: Any) -> _Handle | None:
        with self._lock:
            return self._handles.get(id(handle))

    @property
    def outstanding(self) -> int:
        """Handles made through the proxy and not released yet."""
        with self._lock:
            return len(self._handles)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "outstanding": len(self._handles)}


class TransportFaults:
    """The ``AgentConfig.interpose`` hook: wraps each agent it is given in a
    :class:`FaultyNixl` driven by ``plan`` and remembers the proxies for reports."""

    def __init__(self, plan: FaultPlan, *, site: str = "xfer") -> None:
        self.plan = plan
        self.site = site
        self.proxies: list[FaultyNixl] = []

    def __call__(self, raw: Any) -> FaultyNixl:
        proxy = FaultyNixl(raw, self.plan, site=self.site)
        self.proxies.append(proxy)
        return proxy

    def snapshot(self) -> dict[str, int]:
        """The proxies' counters, summed."""
        out: dict[str, int] = {}
        for proxy in self.proxies:
            for name, value in proxy.snapshot().items():
                out[name] = out.get(name, 0) + value
        return out


def faulty_agent_config(faults: TransportFaults, base: AgentConfig | None = None) -> AgentConfig:
    """``base`` (default: ``AgentConfig()``) with ``faults`` installed as its interpose hook."""
    return dataclasses.replace(base if base is not None else AgentConfig(), interpose=faults)
