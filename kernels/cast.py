"""Decoded float32 values into a bfloat16 tensor's memory, in one parallel pass (numba
kernels on :mod:`.parallel`'s threads).

A decoder's float32 output is cast here rather than by PyTorch: each torch operation
on the CPU wakes PyTorch's OpenMP team, whose threads then spin for a while and take
the cores from the decode kernels' threads of the next chunk. Decoding a document
chunk by chunk into a bfloat16 tensor that way took 1.5-2.1x as long as into a
float32 one, though the cast itself is about a millisecond a chunk. Values are rounded as PyTorch
rounds them (to nearest even, :func:`.paged_cpu.bf16_bits`), bit for bit, but for
the payload of a NaN.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import parallel
from .paged_cpu import bf16_bits


# One signature for every layout (a whole tensor, a window of a larger one), compiled
# or loaded from numba's cache when this module is imported: what a warm-up does.
@njit("void(int64, int64, float32[:, :, :], uint16[:, :, :])", cache=True, nogil=True,
      boundscheck=False)  # fmt: skip
def _write_bf16(g0, g1, values, bits):  # pragma: no cover - jitted
    for g in range(g0, g1):
        for t in range(values.shape[1]):
            for d in range(values.shape[2]):
                bits[g, t, d] = bf16_bits(values[g, t, d])


def write_bf16(values: np.ndarray, bits: np.ndarray) -> None:
    """``values`` (float32 ``[N, T, D]``, any strides) rounded to bfloat16 into ``bits``
    (uint16, the same shape, any strides: a bfloat16 tensor's memory)."""
    if values.dtype != np.float32 or bits.dtype != np.uint16 or values.ndim != 3:
        raise ValueError(f"float32 [N, T, D] into uint16, not {values.dtype} {values.shape} "
                         f"into {bits.dtype}")  # fmt: skip
    if values.shape != bits.shape:
        raise ValueError(f"shapes differ: {values.shape} into {bits.shape}")
    parallel.run(_write_bf16, values.shape[0], values, bits)
