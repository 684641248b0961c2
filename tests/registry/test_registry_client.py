"""The registry's client (``kvfsm/registry/_client.py``) on its own: an unreachable
registry, a closed client, a bad base URL. (The client against a real server is in
``test_registry_server.py``.)"""

from __future__ import annotations

import socket

import pytest

from kvfsm.registry import BootstrapClient, BootstrapError, UnreachableError


@pytest.mark.asyncio
async def test_client_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        async with BootstrapClient(f"http://127.0.0.1:{port}", timeout_s=1.0) as client:
            with pytest.raises(UnreachableError, match="unreachable"):
                await client.health()
    client = BootstrapClient("http://127.0.0.1:1")
    await client.close()
    with pytest.raises(BootstrapError, match="closed"):
        await client.health()
    with pytest.raises(ValueError, match="base_url"):
        BootstrapClient("127.0.0.1:8998")
