"""The nested codec's transform: each head's channels turned into coefficients that are
cheaper to code, and back (``docs/format.md``, "The transformed nested ladder").

A group (layer, K/V, head) holds values ``x [T, D]``. Its coefficients are
``y = A u`` where ``u`` is ``x`` with keys' rotary embedding taken back (position
``p``: each pair ``(i, i + D/2)`` turned by ``-p * inv_freq[i]``) and ``A`` the
inverse of the group's synthesis matrix ``M``. The encoder's side (:func:`analyse`)
is float64 and need not agree with anyone; the decoder's (:func:`synthesise`) is
specified to the bit, so that every decoder (this numba kernel, the Triton one, the
numpy reference) writes the same float32 values:

* ``z[d] = (((0 + M[d, 0] y[0]) + M[d, 1] y[1]) + ...) + M[d, D-1] y[D-1]``, every
  product and every sum rounded to float32 (no fused multiply-add);
* for keys with rotary frequencies, ``c = float32(cos(p f_i))``, ``s = float32(sin(p
  f_i))`` (``p f_i`` in float64, from :func:`rope_tables`, which every decoder takes
  from the host), and ``x[i] = c z[i] - s z[i + D/2]``, ``x[i + D/2] = s z[i] + c z[i
  + D/2]``, each product rounded, then the sum; values and other groups: ``x = z``.

The kernels take the synthesis matrices transposed (``mt[g, j, d] = M[g, d, j]``), so
that the inner loop runs over adjacent outputs and vectorises without reordering any
sum.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import parallel, simd

BLOCK = 2 * simd.W  # outputs a token's sums are computed in at once, where D is a multiple


def rope_tables(inv_freq: np.ndarray, first: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` ``[tokens, D/2]`` (float32) of positions ``first, first + 1,
    ...``: the angle ``p * inv_freq[i]`` in float64, its cosine and sine rounded once."""
    positions = np.arange(first, first + tokens, dtype=np.float64)
    angle = positions[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def analyse(x: np.ndarray, analysis: np.ndarray, rotate: np.ndarray, cos: np.ndarray,
            sin: np.ndarray) -> np.ndarray:  # fmt: skip
    """The coefficients ``[G, T, D]`` (float32) of values ``x [G, T, D]``: keys of the
    groups where ``rotate`` turned back by ``cos``/``sin`` (``[T, D/2]``), then each
    group's ``analysis [G, D, D]`` (float64, the synthesis matrices' inverses)."""
    u = np.asarray(x, dtype=np.float64).copy()
    half = u.shape[-1] // 2
    if np.any(rotate):
        c, s = cos.astype(np.float64), sin.astype(np.float64)
        k = u[rotate]
        a, b = k[..., :half].copy(), k[..., half:].copy()
        k[..., :half] = c * a + s * b
        k[..., half:] = c * b - s * a
        u[rotate] = k
    return np.einsum("gde,gte->gtd", analysis, u).astype(np.float32)


def synthesise(y: np.ndarray, mt: np.ndarray, rotate: np.ndarray, cos: np.ndarray,
               sin: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
    """Values ``out [G, T, D]`` (float32) of coefficients ``y [G, T, D]``, to the bit as
    the module specifies; ``mt [G, D, D]`` the synthesis matrices transposed,
    ``rotate [G]`` the groups whose rotary embedding is put back with ``cos``/``sin``
    ``[T, D/2]``. ``out`` may be ``y`` itself (each token is read whole before its
    values are written)."""
    G, T, D = y.shape
    if out.shape != y.shape or mt.shape != (G, D, D) or rotate.shape != (G,) or D % 2:
        raise ValueError("the coefficients, matrices and output do not fit together")
    if np.any(rotate) and (cos.shape != (T, D // 2) or sin.shape != (T, D // 2)):
        raise ValueError("the rotary tables do not fit the tokens")
    parallel.run(_synthesise, G, y, np.ascontiguousarray(mt, dtype=np.float32),
                 np.ascontiguousarray(rotate, dtype=np.bool_),
                 np.ascontiguousarray(cos, dtype=np.float32).reshape(-1, D // 2),
                 np.ascontiguousarray(sin, dtype=np.float32).reshape(-1, D // 2), out)  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def _synthesise(start, end, y, mt, rotate, cos, sin, out):  # pragma: no cover - jitted
    G, T, D = y.shape
    z = np.empty((2, D), dtype=np.float32)  # two tokens' sums, before the rotary step
    # Where D is a multiple of BLOCK: two tokens and BLOCK outputs at a time, their
    # sums held in registers, so each row of the matrix read is used twice and no sum
    # goes to memory between two terms. The terms are added in the same order as one
    # by one, which takes the tokens left (and every token of other heads' sizes).
    blocked = D % BLOCK == 0
    flat = mt.reshape(-1)
    zs = z.reshape(-1)
    for g in range(start, end):
        rows = g * D * D
        t = 0
        while blocked and t + 1 < T:
            for d in range(0, D, BLOCK):
                a0 = a1 = b0 = b1 = simd.fsplat(0.0)
                for j in range(D):
                    m0 = simd.fload(flat, rows + j * D + d)
                    m1 = simd.fload(flat, rows + j * D + d + simd.W)
                    u = simd.fsplat(y[g, t, j])
                    v = simd.fsplat(y[g, t + 1, j])
                    a0 = simd.fadd(a0, simd.fmul(m0, u))
                    a1 = simd.fadd(a1, simd.fmul(m1, u))
                    b0 = simd.fadd(b0, simd.fmul(m0, v))
                    b1 = simd.fadd(b1, simd.fmul(m1, v))
                simd.fstore(zs, d, a0)
                simd.fstore(zs, d + simd.W, a1)
                simd.fstore(zs, D + d, b0)
                simd.fstore(zs, D + d + simd.W, b1)
            _put(g, t, z[0], rotate, cos, sin, out)
            _put(g, t + 1, z[1], rotate, cos, sin, out)
            t += 2
        for left in range(t, T):
            _sums(y, mt, g, left, z[0])
            _put(g, left, z[0], rotate, cos, sin, out)


@njit(nogil=True, error_model="numpy")
def _sums(y, mt, g, t, z):  # pragma: no cover - jitted
    """``z[d] = sum_j mt[g, j, d] y[g, t, j]``, the terms added in increasing ``j``."""
    D = z.shape[0]
    for d in range(D):
        z[d] = np.float32(0.0)
    for j in range(D):
        v = y[g, t, j]
        for d in range(D):
            z[d] = z[d] + mt[g, j, d] * v


@njit(nogil=True, error_model="numpy")
def _put(g, t, z, rotate, cos, sin, out):  # pragma: no cover - jitted
    """Token ``t``'s values from its sums ``z``: the rotary embedding put back where
    ``rotate[g]``, else ``z`` as it is."""
    D = z.shape[0]
    half = D // 2
    if rotate[g]:
        for i in range(half):
            c, s = cos[t, i], sin[t, i]
            a, b = z[i], z[i + half]
            out[g, t, i] = c * a - s * b
            out[g, t, i + half] = s * a + c * b
    else:
        for d in range(D):
            out[g, t, d] = z[d]


def warm_up() -> None:
    """Run the inverse once on tiny arrays, in the layouts a reader passes (a whole
    staging buffer, and a window of one after its sinks), so that a process's first
    transformed decode does not pay for loading the compiled kernel: about 4.7 s the
    first time on a machine (compiled, then kept in numba's cache), 30 ms after."""
    G, T, D = 2, 3, 4  # two groups: a window of tokens is then not contiguous
    mt = np.zeros((G, D, D), dtype=np.float32)
    rotate = np.array([True, False])
    cos, sin = np.ones((T, D // 2), dtype=np.float32), np.zeros((T, D // 2), dtype=np.float32)
    whole = np.zeros((G, T, D), dtype=np.float32)
    synthesise(whole, mt, rotate, cos, sin, whole)
    window = whole[:, 1:]
    synthesise(window, mt, rotate, cos[1:], sin[1:], window)


def synthesise_reference(y: np.ndarray, mt: np.ndarray, rotate: np.ndarray, cos: np.ndarray,
                         sin: np.ndarray) -> np.ndarray:  # fmt: skip
    """:func:`synthesise` in numpy, step by step as specified (for tests)."""
    G, T, D = y.shape
    half = D // 2
    acc = np.zeros((G, T, D), dtype=np.float32)
    for j in range(D):
        acc = acc + mt[:, None, j, :] * y[:, :, j, None]
    out = acc.copy()
    if np.any(rotate):
        a, b = acc[rotate][..., :half], acc[rotate][..., half:]
        turned = np.concatenate([cos * a - sin * b, sin * a + cos * b], axis=-1)
        out[rotate] = turned
    return out
