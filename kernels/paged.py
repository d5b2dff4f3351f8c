"""Tokens in and out of a paged KV cache whose blocks are token-major.

A layer's keys (or values) in FlashAttention's layout are ``[blocks, block_size,
heads, head_dim]``: token ``t`` of a request lives at slot ``block_ids[t //
block_size] * block_size + t % block_size``, a row of ``heads x head_dim``. Writing
and reading tokens is then one indexed copy of rows, exact in any dtype, on
the device the cache is on.
"""

from __future__ import annotations

import torch


def scatter_token_major(cache: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``tokens`` ``[T, H, D]`` into ``cache`` ``[blocks, block_size, H, D]`` at ``slots``."""
    rows = cache.view(-1, cache.shape[-2], cache.shape[-1])
    rows.index_copy_(0, slots, tokens.to(cache.dtype))


def gather_token_major(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The tokens ``[T, H, D]`` at ``slots`` of ``cache`` ``[blocks, block_size, H, D]``."""
    rows = cache.view(-1, cache.shape[-2], cache.shape[-1])
    return rows.index_select(0, slots)
