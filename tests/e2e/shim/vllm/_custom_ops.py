"""``rotary_embedding``: vLLM's in-place rotary kernel, in plain torch (tests only).

The kernel's contract, as SGLang calls it: ``positions`` (tokens), ``query`` and ``key`` of
shape ``[tokens, heads * head_size]`` (or ``[tokens, heads, head_size]``), rotated in place over
their first ``rotary_dim`` features, where ``rotary_dim`` is the width of ``cos_sin_cache``
(``[max_positions, rotary_dim]``, cosines first, then sines).
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    if neox:
        # Neox style pairs feature i with feature i + rotary_dim / 2.
        x1, x2 = x.chunk(2, dim=-1)
    else:
        # GPT-J style pairs neighbouring features (2i, 2i + 1).
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _apply(
    x: torch.Tensor,
    *,
    head_size: int,
    rotary_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool,
) -> None:
    heads = x.view(x.shape[0], -1, head_size)
    rot = heads[..., :rotary_dim]
    # In the tensor's own dtype, as SGLang's forward_native computes it, so the two agree bit
    # for bit; in place, as the kernel's callers ignore any return value.
    rot.copy_(_rotate(rot, cos.to(x.dtype), sin.to(x.dtype), neox))


def rotary_embedding(  # noqa: PLR0917 - vLLM's positional signature is the contract
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    rotary_dim = cos_sin_cache.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.flatten().long())
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    for x in (query, key):
        if x is not None:
            _apply(x, head_size=head_size, rotary_dim=rotary_dim, cos=cos, sin=sin, neox=is_neox)
