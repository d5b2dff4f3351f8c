"""Tokens into a paged KV cache whose blocks hold each head's tokens in a permuted order
(vLLM's CPU attention layouts), in one parallel pass (numba kernels on
:mod:`.parallel`'s threads).

A layer's cache is viewed as ``[blocks, heads, 2, block_size * head_dim]`` (K then V
of each head), the layers' caches as one array ``[layers, ...]`` (strided). The
element ``e = t * head_dim + d`` of a block's K (token ``t`` of the block, lane ``d``)
lives at position ``k_pos[e]`` of its row, and V's at ``v_pos[e]``: the layout's
permutation, learned by the caller. Values are written from float32 (or from float16,
exactly widened) and rounded to the cache's dtype as PyTorch rounds them (bfloat16:
to nearest even), bit-identical to casting with torch first, but for the payload of
a NaN (any NaN stays a NaN).

One call writes a whole chunk of every layer, split over layers, heads and tokens.
Keeping the cast and the scatter in one kernel matters on CPUs: a chain of small
torch ops each wakes PyTorch's OpenMP team, and those wake-ups cost more than the
copy. Decoders that produce values
one by one (:func:`kvcdn.kernels.rans_numba.decode_permuted`) write through the
same :class:`PermutedBlocks` and :func:`bf16_bits`, with no staging copy at all.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import parallel
from .permuted import PermutedBlocks


@njit(cache=True, nogil=True, inline="always")
def bf16_bits(x):  # pragma: no cover - jitted
    """float32 -> bfloat16 bits, rounded to nearest even (a NaN stays a quiet NaN)."""
    u = np.uint32(np.float32(x).view(np.uint32))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16((u + rounding) >> np.uint32(16))


@njit(cache=True, nogil=True, inline="always")
def _half_value(h):  # pragma: no cover - jitted
    """float16 bits -> the float32 of the same value (exact)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0:  # zero or subnormal: man * 2**-24, exact in float32
        value = np.float32(man) * np.float32(5.9604644775390625e-08)
        return -value if sign else value
    if exp == 31:  # infinity or NaN
        return np.uint32(sign | np.uint32(0x7F800000) | (man << np.uint32(13))).view(np.float32)
    bits = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))
    return np.uint32(bits).view(np.float32)


@njit(cache=True, nogil=True)
def _write(i0, i1, kv, half, cache, blocks, first, lo, hi, k_pos, v_pos,
           to_bf16):  # pragma: no cover  # fmt: skip
    # half / to_bf16 are run-time flags (a function argument numba cannot cache)
    layers, _, heads, _, dim = kv.shape
    tokens = hi - lo
    block_size = cache.shape[4] // dim
    for i in range(i0, i1):
        layer = i // (heads * tokens)
        h = i // tokens % heads
        t = lo + i % tokens
        p = first + t
        b = blocks[p // block_size]
        e = (p % block_size) * dim
        for kv_i in range(2):
            pos = k_pos if kv_i == 0 else v_pos
            for d in range(dim):
                value = _half_value(kv[layer, kv_i, h, t, d]) if half else kv[layer, kv_i, h, t, d]
                if to_bf16:
                    cache[layer, b, h, kv_i, pos[e + d]] = bf16_bits(value)
                else:
                    cache[layer, b, h, kv_i, pos[e + d]] = value


def write_permuted(kv: np.ndarray, into: PermutedBlocks) -> None:
    """Write tokens ``into.lo .. into.hi`` of ``kv`` (``[layers, 2, heads, T, head_dim]``:
    float32, or uint16 holding float16 bits) where ``into`` says."""
    if kv.dtype not in (np.float32, np.uint16) or kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be float32 or float16 bits [L, 2, H, T, D], not "
                         f"{kv.dtype} {kv.shape}")  # fmt: skip
    layers, _, heads, tokens, dim = kv.shape
    if into.cache.ndim != 5 or into.cache.shape[0] != layers or into.cache.shape[2] != heads:
        raise ValueError(f"cache {into.cache.shape} does not hold {layers} layers of {heads} heads")
    into.check(tokens, dim)
    kv = np.ascontiguousarray(kv)  # one compiled variant per dtype (a slice is copied)
    parallel.run(_write, layers * heads * (into.hi - into.lo), kv, kv.dtype == np.uint16,
                 into.cache, into.blocks, into.first, into.lo, into.hi, into.k_pos, into.v_pos,
                 into.cache.dtype == np.uint16)  # fmt: skip
