"""``Interposer``: the base of the tests' NIXL proxies. ``AgentConfig(interpose=proxy)`` hands the
raw agent to ``proxy(inner)`` once it is created, and the ``Agent`` then calls NIXL only through
the proxy: a subclass overrides the calls it watches or bends, the rest go to ``inner``.

Handles made for a READ are the data path's flushes (the proof that a held WRITE is over):
``is_flush(handle)`` tells them apart, so a proxy that bends WRITEs can leave them alone."""

from __future__ import annotations

from typing import Any, Self

__all__ = ["Interposer"]


class Interposer:
    def __init__(self) -> None:
        self.inner: Any = None
        self._flushes: dict[int, Any] = {}  # id -> handle (kept: ids are not reused meanwhile)

    def __call__(self, inner: Any) -> Self:
        self.inner = inner
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.inner.make_prepped_xfer(*args, **kwargs)
        if args and args[0] == "READ":
            self._flushes[id(handle)] = handle
        return handle

    def is_flush(self, handle: Any) -> bool:
        return id(handle) in self._flushes
