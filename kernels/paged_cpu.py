"""Tokens into a paged KV cache whose blocks hold each head's tokens in a permuted order
(vLLM's CPU attention layouts), in one parallel pass (numba).

A layer's cache is viewed as ``[blocks, heads, 2, block_size * head_dim]`` (K then V
of each head), the layers' caches as one array ``[layers, ...]`` (strided). The
element ``e = t * head_dim + d`` of a block's K (token ``t`` of the block, lane ``d``)
lives at position ``k_pos[e]`` of its row, and V's at ``v_pos[e]``: the layout's
permutation, learned by the caller. Values are written from float32 and rounded to
the cache's dtype as PyTorch rounds them (bfloat16: to nearest even), bit-identical
to casting with torch first, but for the payload of a NaN (any NaN stays a NaN).

One call writes a whole chunk of every layer, split over layers, heads and tokens.
Keeping the cast and the scatter in one kernel matters on CPUs: a chain of small
torch ops each wakes PyTorch's OpenMP team, and beside numba's own team (the
decoder's) those wake-ups cost more than the copy.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, inline="always")
def _bf16_bits(x):  # pragma: no cover - jitted
    u = np.uint32(np.float32(x).view(np.uint32))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep it a quiet NaN
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16((u + rounding) >> np.uint32(16))


@njit(parallel=True, cache=True, nogil=True)
def _write(kv, cache, blocks, start, k_pos, v_pos, to_bf16):  # pragma: no cover - jitted
    # to_bf16 is a run-time flag (not a function argument, which numba cannot cache)
    layers, _, heads, tokens, dim = kv.shape
    block_size = cache.shape[4] // dim
    for i in prange(layers * heads * tokens):
        layer = i // (heads * tokens)
        h = i // tokens % heads
        t = i % tokens
        p = start + t
        b = blocks[p // block_size]
        e = (p % block_size) * dim
        for d in range(dim):
            k, v = kv[layer, 0, h, t, d], kv[layer, 1, h, t, d]
            if to_bf16:
                cache[layer, b, h, 0, k_pos[e + d]] = _bf16_bits(k)
                cache[layer, b, h, 1, v_pos[e + d]] = _bf16_bits(v)
            else:
                cache[layer, b, h, 0, k_pos[e + d]] = k
                cache[layer, b, h, 1, v_pos[e + d]] = v


def write_permuted(
    kv: np.ndarray,
    cache: np.ndarray,
    blocks: np.ndarray,
    start: int,
    k_pos: np.ndarray,
    v_pos: np.ndarray,
) -> None:
    """Write ``kv`` (float32 ``[layers, 2, heads, T, head_dim]``, the request's tokens
    ``start .. start + T``) into ``cache`` (``[layers, blocks, heads, 2, block_size *
    head_dim]``, any strides: ``uint16`` holding bfloat16 bits, or ``float32``) at the
    request's ``blocks`` (int64, its blocks from token 0)."""
    if kv.dtype != np.float32 or kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be float32 [L, 2, H, T, D], not {kv.dtype} {kv.shape}")
    layers, _, heads, tokens, dim = kv.shape
    if cache.ndim != 5 or cache.shape[0] != layers or cache.shape[2:4] != (heads, 2):
        raise ValueError(f"cache {cache.shape} does not hold {layers} layers of {heads} heads")
    if cache.shape[4] % dim or k_pos.shape != (cache.shape[4],) or v_pos.shape != k_pos.shape:
        raise ValueError("the permutations do not match the cache's blocks")
    block_size = cache.shape[4] // dim
    end = start + tokens
    if start < 0 or -(-end // block_size) > len(blocks):
        raise ValueError(f"tokens {start}..{end} do not fit {len(blocks)} blocks")
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= cache.shape[1]):
        raise ValueError("a block id is outside the cache")
    kv = np.ascontiguousarray(kv)  # one compiled variant (a chunk's slice is a copy)
    if cache.dtype not in (np.uint16, np.float32):
        raise ValueError(f"cache dtype {cache.dtype} is neither bfloat16 bits nor float32")
    _write(kv, cache, blocks, start, k_pos, v_pos, cache.dtype == np.uint16)
