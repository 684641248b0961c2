"""``kvfsm.transport._agent``: one NIXL agent per rank, with its layout registered, its local lists
prepared, and peers connected as generations. Real NIXL (UCX), two agents in this process."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.transport._agent import Agent, AgentConfig
from kvfsm.transport._layout import Layout, Region
from kvfsm.workload.buffers import Shape, make_buffers, make_layout
from tests.helpers.interpose import Interposer

SHAPE = Shape(layers=2, num_pages=8, page_bytes=512, aux_rows=4, aux_row_bytes=64)
_NAMES = itertools.count()


def _name(role: str) -> str:
    return f"agent-test-{role}-{os.getpid()}-{next(_NAMES)}"


class Counting(Interposer):
    """Wraps the raw NIXL agent (``AgentConfig.interpose``) and counts what passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if callable(attr) and name in {
            "register_memory",
            "deregister_memory",
            "prep_xfer_dlist",
            "release_dlist_handle",
            "add_remote_agent",
            "remove_remote_agent",
        }:

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return attr(*args, **kwargs)

            return counted
        return attr


@pytest.fixture
def pair() -> Iterator[tuple[Agent, Agent, Counting]]:
    kv, aux = make_buffers(SHAPE)
    dkv, daux = make_buffers(SHAPE)
    counting = Counting()
    mine = Agent(_name("p"), make_layout(kv, aux), AgentConfig(interpose=counting))
    theirs = Agent(_name("d"), make_layout(dkv, daux))
    yield mine, theirs, counting
    mine.close()
    theirs.close()


def test_regions_are_registered_once_each_and_local_lists_prepared(
    pair: tuple[Agent, Agent, Counting],
) -> None:
    mine, _, counting = pair
    # Two K and two V buffers and one aux buffer: five registrations, never per page, and the
    # flush's 8-byte scratch buffer (what a flush READs into: never part of a page).
    assert len(mine.layout.regions()) == 5
    assert counting.calls.count("register_memory") == 5 + 1
    assert mine.dlists_prepped == 3  # kv, aux and the flush scratch, for this agent's own side
    assert mine.local("kv") is not None
    assert mine.local("aux") is not None
    assert mine.local("flush") is not None
    with pytest.raises(KeyError):
        mine.local("state")  # no state regions in this layout
    assert mine.metadata() is mine.metadata()  # read once


def test_each_connect_is_a_new_generation_and_disconnect_undoes_it(
    pair: tuple[Agent, Agent, Counting],
) -> None:
    mine, theirs, counting = pair
    first = mine.connect("decode-0", theirs.metadata(), theirs.layout.summary())
    second = mine.connect("decode-0", theirs.metadata(), theirs.layout.summary())
    assert second.generation > first.generation
    assert (first.peer_id, first.name) == ("decode-0", theirs.name)
    assert mine.peers_added == 2
    # Each generation prepares its kv and aux lists and the one-descriptor list a flush reads.
    assert mine.dlists_prepped == 3 + 2 * 3
    assert first.flush is not None
    assert first.flush[0] is mine.local("flush")  # the local side is the agent's scratch
    mine.disconnect(first)
    mine.disconnect(second)
    assert first.kv is None
    assert first.aux is None
    assert first.flush is None
    assert mine.peers_removed == 2
    assert mine.dlists_released == 6
    # Lists before the agent: a handle-free peer goes in that order.
    calls = counting.calls[counting.calls.index("release_dlist_handle") :]
    assert calls[:4] == ["release_dlist_handle"] * 3 + ["remove_remote_agent"]


def test_an_incompatible_layout_is_refused_before_nixl_hears_of_it(
    pair: tuple[Agent, Agent, Counting],
) -> None:
    mine, _, counting = pair
    # A decode layout whose pages are half the size: a page would not land on a page.
    small = [np.zeros((SHAPE.num_pages, SHAPE.page_bytes // 2), np.uint8) for _ in range(4)]
    regions = [
        Region(f"kv{i}", buf.ctypes.data, buf.nbytes, SHAPE.page_bytes // 2)
        for i, buf in enumerate(small)
    ]
    other = Layout(kv=tuple(regions), keepalive=tuple(small))
    before = list(counting.calls)
    with pytest.raises(ValueError, match="layouts are incompatible: kv region 0 item_bytes"):
        mine.connect("decode-9", b"not even metadata", other.summary())
    assert counting.calls == before  # no add_remote_agent, no list
    assert mine.peers_added == 0


def test_close_is_idempotent_and_balances_every_count(pair: tuple[Agent, Agent, Counting]) -> None:
    mine, theirs, counting = pair
    peer = mine.connect("decode-1", theirs.metadata(), theirs.layout.summary())
    mine.disconnect(peer)
    mine.close()
    mine.close()
    assert mine.dlists_prepped == mine.dlists_released
    assert mine.peers_added == mine.peers_removed
    assert counting.calls.count("deregister_memory") == counting.calls.count("register_memory")


@pytest.mark.parametrize("params", [{"num_workers": "2"}, {"num_threads": "4"}])
def test_more_than_one_ucx_worker_is_refused(params: dict[str, str]) -> None:
    """A flush proves earlier WRITEs over only on the endpoint they share: one worker."""
    with pytest.raises(ValueError, match="num_workers must be 1"):
        AgentConfig(backend_params=params)
    AgentConfig(backend_params={"num_workers": "1"})  # the default, said out loud
