"""Counting kernels of the nested ladder's calibration (numba): per-stream symbol counts
and the reconstruction the calibration measures, one pass over the data each.

The numpy definitions are :mod:`kvcdn.progressive`'s (``_row_entropy``,
``refinement_symbols``, ``indices``, ``reconstruct``, ``values_of``); these kernels
give the same integers and the same float bits (each value goes through the same
float64 operations, in the same order, without contraction), without the numpy
version's temporaries: a calibration plans on tens of millions of values, dozens of
times.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import parallel

SPLIT = 3
CONTEXTS = 3


@njit(cache=True, nogil=True)
def _row_counts(r0, r1, sym, bins, counts, bad):  # pragma: no cover - jitted
    N, T = sym.shape
    for i in range(r0, r1):
        for t in range(T):
            s = sym[i, t]
            if s < 0 or s >= bins:
                bad[i] = 1
            else:
                counts[i, s] += 1


def row_counts(sym: np.ndarray, bins: int) -> np.ndarray:
    """``counts [N, bins]`` (int64) of each row of ``sym [N, T]`` (integers in
    ``[0, bins)``; ValueError for any other)."""
    sym = np.ascontiguousarray(sym, dtype=np.int64)
    counts = np.zeros((sym.shape[0], bins), dtype=np.int64)
    bad = np.zeros(sym.shape[0], dtype=np.int64)
    parallel.run(_row_counts, sym.shape[0], sym, bins, counts, bad)
    if bad.any():
        raise ValueError(f"a symbol outside [0, {bins})")
    return counts


@njit(cache=True, nogil=True, error_model="numpy")
def _base_counts(r0, r1, x, divisor, limit, counts):  # pragma: no cover - jitted
    N, T = x.shape
    for i in range(r0, r1):
        for t in range(T):
            q = np.rint(x[i, t] / divisor[i])
            if q < -limit:
                q = -limit
            elif q > limit:
                q = limit
            elif q != q:  # NaN
                q = 0.0
            counts[i, np.int64(q) + np.int64(limit)] += 1


def base_counts(x: np.ndarray, divisor: np.ndarray, limit: int) -> np.ndarray:
    """Per row of ``x [N, T]`` (float64): the counts of its base indices
    ``clip(rint(x / divisor), -limit, limit)`` (NaN read as 0), ``[N, 2 * limit + 1]``
    from ``-limit``."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    counts = np.zeros((x.shape[0], 2 * limit + 1), dtype=np.int64)
    parallel.run(_base_counts, x.shape[0], x, np.ascontiguousarray(divisor, dtype=np.float64),
                 float(limit), counts)  # fmt: skip
    return counts


@njit(cache=True, nogil=True)
def _refinement_counts(r0, r1, parent, child, split, counts, bad):  # pragma: no cover
    N, T = parent.shape
    for i in range(r0, r1):
        for t in range(T):
            if child[i, t] != parent[i, t]:
                split[i] = 1
                break
        if not split[i]:
            continue
        for t in range(T):
            p = parent[i, t]
            c = child[i, t] - SPLIT * p + 1
            if c < 0 or c >= SPLIT:
                bad[i] = 1
                break
            s = SPLIT - 1 - c if p < 0 else c
            ctx = min(abs(p), CONTEXTS - 1)
            counts[i, ctx * SPLIT + s] += 1


def refinement_counts(parent: np.ndarray, child: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``parent`` and ``child`` (``[N, T]`` indices of a level and the next):
    whether the row is split (some child differs from its parent), and the split
    rows' counts of (context, symbol) as ``[N, CONTEXTS * SPLIT]`` (zero for the
    others); ValueError where a split row's children do not nest in their parents."""
    parent = np.ascontiguousarray(parent, dtype=np.int64)
    child = np.ascontiguousarray(child, dtype=np.int64)
    if parent.shape != child.shape or parent.ndim != 2:
        raise ValueError("parent and child indices must be [streams, tokens] alike")
    n = parent.shape[0]
    split = np.zeros(n, dtype=np.int64)
    counts = np.zeros((n, CONTEXTS * SPLIT), dtype=np.int64)
    bad = np.zeros(n, dtype=np.int64)
    parallel.run(_refinement_counts, n, parent, child, split, counts, bad)
    if bad.any():
        raise ValueError("child indices do not nest in their parents")
    return split.astype(bool), counts


@njit(cache=True, nogil=True, error_model="numpy")
def _level_values(r0, r1, kv, mean, sinks, divisor, limit, half, up, step, out):  # pragma: no cover
    L, K, H, T, D = kv.shape
    for r in range(r0, r1):  # r: (layer, K/V, head)
        h = r % H
        k = (r // H) % K
        layer = r // (H * K)
        for d in range(D):
            i = r * D + d
            m = np.float64(mean[layer, k, h, d])
            for t in range(T):
                v = kv[layer, k, h, t, d]
                if t < sinks:
                    out[layer, k, h, t, d] = v
                    continue
                q = np.rint((np.float64(v) - m) / divisor[i])
                if q < -limit[i]:
                    q = -limit[i]
                elif q > limit[i]:
                    q = limit[i]
                elif q != q:  # NaN
                    q = 0.0
                if up[i] > 1.0:
                    q = np.floor((q + half[i]) / up[i])
                out[layer, k, h, t, d] = np.float32(np.float64(np.int64(q)) * step[i] + m)


def level_values(
    kv: np.ndarray, mean: np.ndarray, sinks: int, divisor: np.ndarray, limit: np.ndarray,
    up: np.ndarray, step: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """``kv [L, 2, H, T, D]`` (float32) reconstructed at one level of a nested plan: the
    first ``sinks`` tokens as they are, the others quantised at the plan's finest
    step and coarsened to the level. Per stream (``[L * 2 * H * D]``, the streams'
    order): ``divisor`` the finest step, ``limit`` the finest index's reach, ``up``
    the finest cells a cell of the level holds, ``step`` the level's step."""
    kv = np.ascontiguousarray(kv, dtype=np.float32)
    L, K, H, _, _ = kv.shape
    divisor, limit, up, step = (np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
                                for a in (divisor, limit, up, step))  # fmt: skip
    half = (up - 1) / 2  # as _coarsen computes it
    out = np.empty_like(kv)
    parallel.run(_level_values, L * K * H, kv, np.ascontiguousarray(mean, dtype=np.float32),
                 sinks, divisor, limit, half, up, step, out)  # fmt: skip
    return out
