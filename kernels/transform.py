"""The nested codec's transform: each head's channels turned into coefficients that are
cheaper to code, and back (``docs/format.md``, "The transformed nested ladder").

A group (layer, K/V, head) holds values ``x [T, D]``. Its coefficients are
``y = A u`` where ``u`` is ``x`` with keys' rotary embedding taken back (position
``p``: each pair ``(i, i + D/2)`` turned by ``-p * inv_freq[i]``) and ``A`` the
inverse of the group's synthesis matrix ``M``. The encoder's side (:func:`analyse`)
is float64 and need not agree with anyone; the decoder's (:func:`synthesise`) is
specified to the bit, so that every decoder (this numba kernel, the Triton one, the
numpy reference) writes the same float32 values:

* ``z[d] = fma(M[d, D-1], y[D-1], ... fma(M[d, 1], y[1], fma(M[d, 0], y[0], 0)))``:
  ``D`` fused multiply-adds in increasing ``j``, each rounded once to float32 (an
  FMA is the instruction every CPU and GPU kvcdn decodes on runs at full rate: with
  a multiply and an add rounded apart, the CPU kernel took twice the instructions:
  2.45 against 1.6 ms a 256-token chunk of the embedded model on 2 cores);
* for keys with rotary frequencies, ``c = float32(cos(p f_i))``, ``s = float32(sin(p
  f_i))`` (``p f_i`` in float64, from :func:`rope_tables`, which every decoder takes
  from the host), and ``x[i] = c z[i] - s z[i + D/2]``, ``x[i + D/2] = s z[i] + c z[i
  + D/2]``, each product rounded, then the sum; values and other groups: ``x = z``.

The kernels take the synthesis matrices transposed (``mt[g, j, d] = M[g, d, j]``), so
that the inner loop runs over adjacent outputs and vectorises without reordering any
sum. numpy has no fused multiply-add: the reference (:func:`synthesise_reference`)
rounds each one exactly by way of float64 (:func:`fma_reference`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import parallel, simd

TOKENS = 4  # tokens a pass of the kernel computes at once
BLOCK = 4 * simd.W  # and outputs, where D is a multiple: 16 sums held in registers


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
    if y.dtype != np.float32 or out.dtype != np.float32:
        raise ValueError("the coefficients and values are float32")
    if np.any(rotate) and (cos.shape != (T, D // 2) or sin.shape != (T, D // 2)):
        raise ValueError("the rotary tables do not fit the tokens")
    parallel.run(_synthesise, G, y, np.ascontiguousarray(mt, dtype=np.float32),
                 np.ascontiguousarray(rotate, dtype=np.bool_),
                 np.ascontiguousarray(cos, dtype=np.float32).reshape(-1, D // 2),
                 np.ascontiguousarray(sin, dtype=np.float32).reshape(-1, D // 2), out)  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def _synthesise(start, end, y, mt, rotate, cos, sin, out):  # pragma: no cover - jitted
    G, T, D = y.shape
    z = np.empty((TOKENS, D), dtype=np.float32)  # the tokens' sums, before the rotary step
    # Where D is a multiple of BLOCK: four tokens and BLOCK outputs at a time, their 16
    # sums in registers, so each row of the matrix read serves four tokens and enough
    # independent FMAs are in flight to keep both FMA units busy (with 8 sums, the
    # FMA's latency left them idle: 1.6 against 1.4 ms a chunk's arrays). The terms are
    # added in the same order as one by one, which takes the tokens left (and every
    # token of other heads' sizes).
    blocked = D % BLOCK == 0
    # and the values written W at a time where rows are contiguous (a third of the
    # time was the rotary step and the copy, element by element)
    lanes = (blocked and out.strides[2] == 4 and out.strides[0] % 4 == 0
             and out.strides[1] % 4 == 0 and (D // 2) % simd.W == 0)  # fmt: skip
    flat = mt.reshape(-1)
    zs = z.reshape(-1)
    for g in range(start, end):
        rows = g * D * D
        t = 0
        while blocked and t + TOKENS <= T:
            for d in range(0, D, BLOCK):
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = simd.fsplat(0.0)
                c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = simd.fsplat(0.0)
                for j in range(D):
                    at = rows + j * D + d
                    m0, m1 = simd.fload(flat, at), simd.fload(flat, at + simd.W)
                    m2, m3 = simd.fload(flat, at + 2 * simd.W), simd.fload(flat, at + 3 * simd.W)
                    u = simd.fsplat(y[g, t, j])
                    a0, a1 = simd.ffma(m0, u, a0), simd.ffma(m1, u, a1)
                    a2, a3 = simd.ffma(m2, u, a2), simd.ffma(m3, u, a3)
                    u = simd.fsplat(y[g, t + 1, j])
                    b0, b1 = simd.ffma(m0, u, b0), simd.ffma(m1, u, b1)
                    b2, b3 = simd.ffma(m2, u, b2), simd.ffma(m3, u, b3)
                    u = simd.fsplat(y[g, t + 2, j])
                    c0, c1 = simd.ffma(m0, u, c0), simd.ffma(m1, u, c1)
                    c2, c3 = simd.ffma(m2, u, c2), simd.ffma(m3, u, c3)
                    u = simd.fsplat(y[g, t + 3, j])
                    e0, e1 = simd.ffma(m0, u, e0), simd.ffma(m1, u, e1)
                    e2, e3 = simd.ffma(m2, u, e2), simd.ffma(m3, u, e3)
                _store(zs, d, a0, a1, a2, a3)
                _store(zs, D + d, b0, b1, b2, b3)
                _store(zs, 2 * D + d, c0, c1, c2, c3)
                _store(zs, 3 * D + d, e0, e1, e2, e3)
            for q in range(TOKENS):
                if lanes:
                    _put_lanes(g, t + q, zs, q * D, rotate, cos, sin, out)
                else:
                    _put(g, t + q, z[q], rotate, cos, sin, out)
            t += TOKENS
        for left in range(t, T):
            _sums(y, mt, g, left, z[0])
            _put(g, left, z[0], rotate, cos, sin, out)


@njit(nogil=True, inline="always")
def _store(zs, at, s0, s1, s2, s3):  # pragma: no cover - jitted
    simd.fstore(zs, at, s0)
    simd.fstore(zs, at + simd.W, s1)
    simd.fstore(zs, at + 2 * simd.W, s2)
    simd.fstore(zs, at + 3 * simd.W, s3)


@njit(nogil=True, error_model="numpy")
def _sums(y, mt, g, t, z):  # pragma: no cover - jitted
    """``z[d] = fma(mt[g, j, d], y[g, t, j], z[d])`` from 0, in increasing ``j``."""
    D = z.shape[0]
    for d in range(D):
        z[d] = np.float32(0.0)
    for j in range(D):
        v = y[g, t, j]
        for d in range(D):
            z[d] = simd.fma32(mt[g, j, d], v, z[d])


@njit(nogil=True, error_model="numpy")
def _put_lanes(g, t, zs, at, rotate, cos, sin, out):  # pragma: no cover - jitted
    """:func:`_put` of the sums ``zs[at:at + D]``, ``W`` values at a time: the same
    products and sums, each rounded as there (never fused); ``out``'s rows contiguous,
    ``D / 2`` a multiple of ``W``."""
    D = out.shape[2]
    half = D // 2
    row = g * (out.strides[0] // 4) + t * (out.strides[1] // 4)  # out[g, t, 0]'s element
    if rotate[g]:
        for i in range(0, half, simd.W):
            c, s = simd.fload(cos, t * half + i), simd.fload(sin, t * half + i)
            a, b = simd.fload(zs, at + i), simd.fload(zs, at + half + i)
            simd.fstore(out, row + i, simd.fsub(simd.fmul(c, a), simd.fmul(s, b)))
            simd.fstore(out, row + half + i, simd.fadd(simd.fmul(s, a), simd.fmul(c, b)))
    else:
        for i in range(0, D, simd.W):
            simd.fstore(out, row + i, simd.fload(zs, at + i))


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
    for table in (cos, sin):  # as a profile's transform gives them (kept, read-only)
        table.flags.writeable = False
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
        acc = fma_reference(mt[:, None, j, :], y[:, :, j, None], acc)
    out = acc.copy()
    if np.any(rotate):
        a, b = acc[rotate][..., :half], acc[rotate][..., half:]
        turned = np.concatenate([cos * a - sin * b, sin * a + cos * b], axis=-1)
        out[rotate] = turned
    return out


def fma_reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` of float32 arrays (broadcast), each rounded once to float32, as an
    FMA rounds it. A float32 product is exact in float64, and TwoSum gives the float64
    sum's error exactly; the sum rounded to odd (moved to its odd neighbour where
    inexact and even) then rounds to float32 as the exact value does, float64 having
    more than 24 + 2 bits (Boldo and Melquiond, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd", 2008)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = np.broadcast_to(c, p.shape).astype(np.float64)
    s = p + c64
    bb = s - p
    error = (p - (s - bb)) + (c64 - bb)
    even = (s.view(np.int64) & 1) == 0
    toward = np.where(error > 0, np.inf, -np.inf)
    odd = np.where((error != 0) & even, np.nextafter(s, toward), s)
    return odd.astype(np.float32)
