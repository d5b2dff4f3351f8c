"""Decoded values into a tensor's memory in one parallel pass (numba kernels on
:mod:`.parallel`'s threads): float32 into bfloat16, and float16 bits into float32.

A decoder's float32 output is cast here rather than by PyTorch: each torch operation
on the CPU wakes PyTorch's OpenMP team, whose threads then spin for a while and take
the cores from the decode kernels' threads of the next chunk. Decoding a document
chunk by chunk into a bfloat16 tensor that way took 1.5-2.1x as long as into a
float32 one, though the cast itself is about a millisecond a chunk. Values are rounded as PyTorch
rounds them (to nearest even, :func:`.paged_cpu.bf16_bits`), bit for bit, but for
the payload of a NaN. Float16 values are widened exactly (:func:`.paged_cpu._half_value`):
numpy's widening took 5.8 ms a 256-token chunk of the embedded model, this one 3.1 ms on
one thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from . import parallel
from .paged_cpu import _half_value, bf16_bits


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
    _check(values, np.float32, bits, np.uint16)
    parallel.run(_write_bf16, values.shape[0], values, bits)


# Read-only bits (an object's bytes) and writable ones alike, in one signature.
@njit(types.void(types.int64, types.int64, types.Array(types.uint16, 3, "A", readonly=True),
                 types.float32[:, :, :]), cache=True, nogil=True, boundscheck=False)  # fmt: skip
def _widen_half(g0, g1, bits, values):  # pragma: no cover - jitted
    for g in range(g0, g1):
        for t in range(bits.shape[1]):
            for d in range(bits.shape[2]):
                values[g, t, d] = _half_value(bits[g, t, d])


def widen_half(bits: np.ndarray, values: np.ndarray) -> None:
    """Float16 values given as their bits (uint16 ``[N, T, D]``, any strides, possibly
    read-only) into ``values`` (float32, the same shape, any strides), exactly."""
    _check(bits, np.uint16, values, np.float32)
    parallel.run(_widen_half, bits.shape[0], bits, values)


def _check(src: np.ndarray, src_dtype: type, dst: np.ndarray, dst_dtype: type) -> None:
    if src.dtype != src_dtype or dst.dtype != dst_dtype or src.ndim != 3:
        raise ValueError(f"{np.dtype(src_dtype)} [N, T, D] into {np.dtype(dst_dtype)}, not "
                         f"{src.dtype} {src.shape} into {dst.dtype}")  # fmt: skip
    if src.shape != dst.shape:
        raise ValueError(f"shapes differ: {src.shape} into {dst.shape}")
