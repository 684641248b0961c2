"""The test rig's stand-in for ``vllm._custom_ops.rotary_embedding`` (``shim/vllm``) computes
what SGLang's own ``RotaryEmbedding.forward_native`` computes, for both rotary styles, a partial
rotary dimension, flat and per-head layouts, and bf16 as the servers run it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.e2e.servers import SHIM

base = pytest.importorskip("sglang.srt.layers.rotary_embedding.base")


@pytest.fixture
def shim(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``vllm._custom_ops`` from the shim, on ``sys.path`` as the servers have it."""
    monkeypatch.syspath_prepend(str(SHIM))
    module = importlib.import_module("vllm._custom_ops")
    assert module.__file__ is not None
    assert module.__file__.startswith(str(SHIM))
    yield module
    for name in ("vllm._custom_ops", "vllm"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_shim_equals_forward_native(
    shim: ModuleType, neox: bool, rotary_dim: int, dtype: torch.dtype, per_head: bool
) -> None:
    head, q_heads, kv_heads, tokens = 32, 4, 2, 37
    rope = base.RotaryEmbedding(head, rotary_dim, 2048, 10000, neox, dtype)
    gen = torch.Generator().manual_seed(rotary_dim + neox)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    query = torch.randn(tokens, q_heads * head, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads * head, generator=gen).to(dtype)
    # This rig's torch (a CUDA build on a CPU machine) makes SGLang pick the vLLM fallback.
    assert rope.use_fallback_kernel
    assert rope.fallback_rotary_embedding is shim.rotary_embedding
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())

    q, k = query.clone(), key.clone()
    if per_head:
        q, k = q.view(tokens, q_heads, head), k.view(tokens, kv_heads, head)
    cache = rope.cos_sin_cache.to(dtype)  # as forward_cuda hands it to the kernel
    assert shim.rotary_embedding(positions, q, k, head, cache, neox) is None  # in place
    assert torch.equal(q.reshape(want_q.shape), want_q)
    assert torch.equal(k.reshape(want_k.shape), want_k)
    # The rotation did something (the comparison is not between two untouched copies).
    assert not torch.equal(q.reshape(query.shape), query)
