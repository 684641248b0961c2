"""Hybrid state under unequal attention TP, replayed over real NIXL with every byte checked.

SGLang shards a hybrid model's state over attention TP as it shards the KV heads: Mamba's conv
and SSM tensors along their channels (GDN's conv state per ``q | k | v`` sub-block, Kimi's
conv state in several rows of channels), an SWA page along its heads; some tensors are
replicated (``state_dim_per_tensor`` 0), and DSA's indexer cache is per token. SGLang 0.5.23's
NIXL backend moves each prefill rank's shard into its place in each decode rank's item
(``_send_mamba_state_slice``, ``_send_swa_state_slice``); kvfsm's state plan does the same
(``kvfsm.control._state_plan``).

The rig fills prefill's state by whole-model channel (:class:`~tests.helpers.sglang_replay.Shard`),
so every decode rank's check knows what each byte of its shard must hold whichever prefill rank
wrote it: a shard written at the wrong offset, from the wrong rank or not at all shows. MLA
models' state is whole on every rank and moves from the one prefill rank that writes the decode
rank's latent cache.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator

import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer
from tests.helpers.sglang_replay import (
    HYBRID,
    PAGE_TOKENS,
    PAGES,
    Instance,
    Outcome,
    Pair,
    Request,
    Shard,
    StateSpec,
    moved_bytes,
    random_requests,
)

HEADS, HEAD_BYTES = 4, 16


def sharded_model(heads: int) -> tuple[StateSpec, ...]:
    """A Qwen3-Next-style hybrid of ``heads`` KV heads: a Mamba state of four tensors per
    request (a GDN conv state whose q, k and v sub-blocks are sharded apart, a temporal state, a
    Kimi-style conv state of three rows of channels, and a tensor replicated over attention
    TP), an SWA window of K and V pages (head-sliced as KV), and a DSA indexer cache (per
    token, whole)."""
    return (
        StateSpec(
            "mamba",
            (),
            shards=(
                Shard("channels", 16, 8, conv=(4, 4, 8)),
                Shard("channels", 8, 32),
                Shard("channels", 8, 8, outer=3),
                Shard("replicated", 4, 8),
            ),
        ),
        StateSpec(
            "swa",
            (),
            items=PAGES,
            names="window",
            shards=(Shard("heads", heads, HEAD_BYTES), Shard("heads", heads, HEAD_BYTES)),
        ),
        StateSpec(
            "dsa",
            (),
            items=PAGES,
            names="window",
            window=PAGES,
            shards=(Shard("replicated", PAGE_TOKENS, 8),),
        ),
    )


#: (prefill attention TP, decode attention TP, the model's KV heads): several prefill ranks
#: into one decode rank, one prefill rank into several decode ranks, and prefill ranks that
#: replicate the KV heads (2 heads over 4 ranks), some of which write a decode rank its state
#: shard but no KV (a state-only leg). One head replicated on both sides: over prefill TP 4
#: and decode TP 2, prefill rank 1 writes decode rank 1's KV and its Mamba shard into decode
#: rank 0 (where SGLang's backend sends it), a KV leg and a state-only leg for one request;
#: over prefill TP 2 and decode TP 4, decode rank 1 takes its KV from prefill rank 1 and its
#: state from prefill rank 0, decode rank 2 the other way round.
SHAPES = [
    (2, 1, 4),
    (4, 2, 4),
    (1, 2, 4),
    (2, 4, 4),
    (4, 2, 2),
    (4, 1, 2),
    (4, 2, 1),
    (2, 4, 1),
]


@pytest.fixture
def port(bootstrap: KvfsmKVBootstrapServer) -> int:
    return bootstrap.port


def start(port: int, prefill_tp: int, decode_tp: int, **kw: object) -> Pair:
    prefill = Instance.start("prefill", port, prefill_tp, **kw)  # type: ignore[arg-type]
    try:
        decode = Instance.start("decode", port, decode_tp, **kw)  # type: ignore[arg-type]
    except BaseException:
        prefill.close()
        raise
    return Pair(prefill, decode, port)


@pytest.fixture(params=SHAPES, ids=[f"p{p}-d{d}-h{h}" for p, d, h in SHAPES])
def sharded(request: pytest.FixtureRequest, port: int) -> Iterator[Pair]:
    prefill_tp, decode_tp, heads = request.param
    pair = start(
        port,
        prefill_tp,
        decode_tp,
        heads=heads,
        head_bytes=HEAD_BYTES,
        state=sharded_model(heads),
    )
    yield pair
    pair.d.instance.close()
    pair.p.instance.close()


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def outcomes(requests: list[Request]) -> list[tuple[str | None, str | None]]:
    return [(r.prefill_outcome, r.decode_outcome) for r in requests]


def test_every_shard_of_every_state_item_lands_in_its_place(sharded: Pair) -> None:
    prefill, decode = sharded.p.instance, sharded.d.instance
    requests = random_requests(random.Random(prefill.tp * 10 + decode.tp), 10)
    out = sharded.run(requests)
    assert_clean(out)
    assert outcomes(requests) == [("Success", "Success")] * 10, [
        (r.room, r.prefill_reasons, r.decode_reasons) for r in requests
    ]
    # Each decode byte was written exactly once: prefill's transports moved exactly what decode
    # holds for the requests (KV slices, aux rows, and each state shard once).
    done = sum(snap["bytes_done"] for snap in prefill.transport_snapshots())
    assert done == moved_bytes(requests, decode)


def test_an_abort_mid_transfer_fails_a_sharded_request_on_every_rank(sharded: Pair) -> None:
    requests = random_requests(random.Random(7), 8, max_pages=8)
    aborted = []
    for i, req in enumerate(requests):
        if len(req.src_pages) >= 3:
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
            if i % 2:
                req.prefill_abort_after, req.prefill_abort_rank = 1, 0
            else:
                req.decode_abort_after, req.decode_abort_rank = 1, 0
            aborted.append(req)
    assert aborted
    out = sharded.run(requests)
    assert_clean(out)
    for req in requests:
        if req not in aborted:
            assert (req.prefill_outcome, req.decode_outcome) == ("Success", "Success"), req.room
        else:
            assert req.decode_outcome == "Failed", req.room


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_mla_state_moves_whole_from_the_rank_that_writes_the_latent_cache(
    port: int, prefill_tp: int, decode_tp: int
) -> None:
    pair = start(port, prefill_tp, decode_tp, mla=True, state=HYBRID)
    try:
        requests = random_requests(random.Random(zlib.crc32(b"mla") + prefill_tp), 8)
        out = pair.run(requests)
        done = sum(snap["bytes_done"] for snap in pair.p.instance.transport_snapshots())
        assert done == moved_bytes(requests, pair.d.instance)
    finally:
        pair.d.instance.close()
        pair.p.instance.close()
    assert_clean(out)
    assert outcomes(requests) == [("Success", "Success")] * 8


def test_mamba_state_without_its_shard_description_is_refused_at_the_handshake(
    port: int,
) -> None:
    # A Mamba state whose tensors SGLang describes without state_dim_per_tensor: SGLang's own
    # backend would copy whole items between different shards; kvfsm refuses the pair instead.
    plain = (StateSpec("mamba", (96, 160)),)
    pair = start(port, 2, 1, heads=HEADS, head_bytes=HEAD_BYTES, state=plain)
    try:
        requests = random_requests(random.Random(3), 2)
        out = pair.run(requests)
    finally:
        pair.d.instance.close()
        pair.p.instance.close()
    assert out.leaks == []
    for req in requests:
        assert req.decode_outcome == "Failed"
        assert any("state_dim_per_tensor" in why for why in req.decode_reasons), req.decode_reasons
