"""The two-host tests' precondition: network namespaces can be made here (root, iproute2), or
the test fails saying why. They are skipped only when ``KVFSM_NO_NETNS=1`` asks for it."""

from __future__ import annotations

import os

import pytest

from kvfsm.chaos._netns import NetnsError, check_environment

__all__ = ["require_netns"]


def require_netns() -> None:
    if os.environ.get("KVFSM_NO_NETNS") == "1":
        pytest.skip("KVFSM_NO_NETNS=1: two-host (network namespace) tests skipped on request")
    try:
        check_environment()
    except NetnsError as exc:
        pytest.fail(f"two-host tests cannot run: {exc}", pytrace=False)
