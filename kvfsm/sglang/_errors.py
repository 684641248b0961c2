"""The one error the adapter raises for a deployment it does not serve."""

from __future__ import annotations

__all__ = ["UnsupportedError"]


class UnsupportedError(ValueError):
    """The deployment uses an SGLang feature kvfsm does not support (see docs/sglang.md)."""
