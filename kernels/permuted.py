"""Where a chunk's tokens go in a paged KV cache whose blocks hold each head's tokens
in a permuted order (vLLM's CPU attention layouts): the destination that kvcdn's CPU
write and decode kernels (:mod:`kvcdn.kernels.paged_cpu`,
:func:`kvcdn.kernels.rans_numba.decode_permuted`) take. Plain numpy, so that naming
it loads no compiler (vLLM's worker start-up must not meet numba's modules).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class PermutedBlocks:
    """Where a chunk of ``tokens`` tokens of ``dim`` lanes goes: its tokens ``lo .. hi``
    to the request's positions ``first + lo .. first + hi``, in ``cache`` (``[layers,
    blocks, heads, 2, block_size * dim]``, any strides: ``uint16`` holding bfloat16
    bits, or ``float32``) at the request's ``blocks`` (int64, its blocks from token
    0). The layout's permutation puts element ``t * dim + d`` of a block's K (V) at
    ``k_pos`` (``v_pos``) of its row."""

    cache: np.ndarray
    blocks: np.ndarray
    first: int
    lo: int
    hi: int
    k_pos: np.ndarray
    v_pos: np.ndarray
    tokens: int
    dim: int

    def after(self, n: int) -> PermutedBlocks:
        """The same destination for the chunk's tokens from ``n`` on (as token 0)."""
        return replace(self, first=self.first + n, lo=max(self.lo - n, 0),
                       hi=max(self.hi - n, 0), tokens=max(self.tokens - n, 0))  # fmt: skip

    def check(self, tokens: int, dim: int) -> None:
        """Refuse, before any write, values that are not the chunk this destination is
        for (``tokens`` of ``dim`` lanes: a payload's own shape, which decides the
        block size the kernels compute), and what would land outside the cache (the
        kernels do not check their indices)."""
        cache = self.cache
        if (tokens, dim) != (self.tokens, self.dim):
            raise ValueError(f"{tokens} tokens of {dim} lanes given for {self.tokens} of "
                             f"{self.dim}")  # fmt: skip
        if cache.ndim != 5 or cache.shape[3] != 2:
            raise ValueError(f"cache {cache.shape} is not [layers, blocks, heads, 2, row]")
        if cache.dtype not in (np.uint16, np.float32):
            raise ValueError(f"cache dtype {cache.dtype} is neither bfloat16 bits nor float32")
        if dim < 1 or cache.shape[4] % dim:
            raise ValueError(f"cache rows of {cache.shape[4]} do not hold lanes of {dim}")
        if self.k_pos.shape != (cache.shape[4],) or self.v_pos.shape != self.k_pos.shape:
            raise ValueError("the permutations do not match the cache's blocks")
        if not 0 <= self.lo <= self.hi <= tokens or self.first < 0:
            raise ValueError(f"tokens {self.lo}..{self.hi} of {tokens} at {self.first}")
        block_size = cache.shape[4] // dim
        if self.hi > self.lo:
            last = (self.first + self.hi - 1) // block_size
            if last >= len(self.blocks):
                raise ValueError(
                    f"tokens {self.first + self.lo}..{self.first + self.hi} do not fit "
                    f"{len(self.blocks)} blocks"
                )
            used = self.blocks[(self.first + self.lo) // block_size : last + 1]
            if used.min() < 0 or used.max() >= cache.shape[1]:
                raise ValueError("a block id is outside the cache")
