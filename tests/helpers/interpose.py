"""``Interposer``: the base of the tests' NIXL proxies. ``AgentConfig(interpose=proxy)`` hands the
raw agent to ``proxy(inner)`` once it is created, and the ``Agent`` then calls NIXL only through
the proxy: a subclass overrides the calls it watches or bends, the rest go to ``inner``."""

from __future__ import annotations

from typing import Any, Self

__all__ = ["Interposer"]


class Interposer:
    def __init__(self) -> None:
        self.inner: Any = None

    def __call__(self, inner: Any) -> Self:
        self.inner = inner
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
