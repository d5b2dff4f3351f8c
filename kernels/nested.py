"""CPU kernels of the nested (progressive) ladder codec: a base and ternary refinements,
each tier its own interleaved rANS stream (numba).

Per group (layer, K/V, head) ``g`` and lane (channel) ``d``, with ``J = depth[-1]``
the number of splits of the finest tier and ``fine`` the step of that tier:

* the finest index ``nJ = clip(rint((x - mean) / fine), lo * 3**J - h, hi * 3**J + h)``
  (float32 arithmetic; ``h = (3**J - 1) / 2``, ``[lo, hi]`` the base table's range);
* tier ``r``'s index ``n_r = floor((nJ + u_r // 2) / u_r)``, ``u_r = 3**(J - depth[r])``;
* tier 0 codes ``n_0 - lo`` with the lane's base table; tier ``r > 0`` codes, for the
  lanes it splits (``depth[r] > depth[r - 1]``), ``c = n_r - 3 n_{r-1} + 1`` turned to
  count from the mean's side (``2 - c`` where ``n_{r-1} < 0``) with the table of
  context ``min(|n_{r-1}|, 2)``;
* decoding tiers ``0..k`` gives ``n_k``, and the value
  ``mean + float32(n_k * 3**(J - depth[k])) * fine``: the product is exact (``fine``
  has 4 significant bits, the integer fewer than 16), so a value is rounded once,
  at the addition, in every implementation.

Each tier of a group is one stream of 16-bit words shared by ``STATES`` interleaved
rANS states, over the lanes the tier codes (all for the base, the split ones for a
refinement) in order ``(t, j)``: the ``j``-th coded lane uses state ``j % STATES``; coded as
:mod:`kvcdn.kernels.rans` specifies (tables, renormalisation, end check): fewer
states than lanes, because every tier pays its final states again (4 bytes each).
Specified with the container in ``docs/format.md``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import parallel
from .rans import PROB_BITS, RANS_L, RansError, cumulative

STATES = 4
_MASK = (1 << PROB_BITS) - 1
_X_MAX_UNIT = (RANS_L >> PROB_BITS) << 16


@njit(cache=True, nogil=True, inline="always")
def _pow3(n):  # pragma: no cover - jitted
    out = np.int64(1)
    for _ in range(n):
        out *= 3
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def _finest(x, mean, fine, top, lo, size, out):  # pragma: no cover - jitted
    """The finest index of every value of one group ``x [T, D]``."""
    T, D = x.shape
    for d in range(D):
        up = _pow3(top[d])
        half = (up - 1) // 2
        first = np.int64(lo[d]) * up - half
        last = np.int64(lo[d] + size[d] - 1) * up + half
        for t in range(T):
            q = np.rint((x[t, d] - mean[d]) / fine[d])
            if not q >= np.float32(first):  # also NaN
                q = np.float32(first)
            elif q > np.float32(last):
                q = np.float32(last)
            out[t, d] = np.int64(q)


@njit(cache=True, nogil=True)
def _encode_tier(nj, r, depth, top, lo, base_tid, refine_tid, freqs, starts, scratch,
                 states):  # pragma: no cover - jitted  # fmt: skip
    """Tier ``r`` of one group: its symbols rANS-coded in reverse order into
    ``scratch``; returns the number of words."""
    T, D = nj.shape
    x = np.full(STATES, RANS_L, dtype=np.uint64)
    coded = np.empty(D, dtype=np.int64)  # each lane's place among the tier's coded lanes
    m = 0
    for d in range(D):
        if r == 0 or depth[r, d] != depth[r - 1, d]:
            coded[d] = m
            m += 1
    n = 0
    for t in range(T - 1, -1, -1):
        for d in range(D - 1, -1, -1):
            if r == 0:
                up = _pow3(top[d] - depth[0, d])
                s = (nj[t, d] + (up - 1) // 2) // up - lo[d]
                tab = base_tid[d]
            else:
                if depth[r, d] == depth[r - 1, d]:
                    continue
                up = _pow3(top[d] - depth[r, d])
                child = (nj[t, d] + (up - 1) // 2) // up
                upp = up * 3
                parent = (nj[t, d] + (upp - 1) // 2) // upp
                c = child - 3 * parent + 1
                s = 2 - c if parent < 0 else c
                ctx = min(abs(parent), 2)
                tab = refine_tid[r - 1, ctx, d]
            f = np.uint64(freqs[tab, s])
            i = coded[d] % STATES
            xd = x[i]
            if xd >= np.uint64(_X_MAX_UNIT) * f:
                scratch[n] = np.uint16(xd & np.uint64(0xFFFF))
                n += 1
                xd >>= np.uint64(16)
            x[i] = ((xd // f) << np.uint64(PROB_BITS)) + (xd % f) + np.uint64(starts[tab, s])
    for i in range(STATES):
        states[i] = np.uint32(x[i])
    return n


@njit(cache=True, nogil=True, error_model="numpy")
def _encode(g0, g1, x, mean, fine, top, depth, lo, size, base_tid, refine_tid, freqs, starts,
            scratch, lengths, states):  # pragma: no cover - jitted  # fmt: skip
    G, T, D = x.shape
    R = depth.shape[0]
    nj = np.empty((T, D), dtype=np.int64)
    for g in range(g0, g1):
        _finest(x[g], mean[g], fine[g], top[g], lo[g], size[g], nj)
        for r in range(R):
            lengths[r, g] = _encode_tier(nj, r, depth[:, g], top[g], lo[g], base_tid[g],
                                         refine_tid[:, :, g], freqs, starts, scratch[r, g],
                                         states[r, g])  # fmt: skip


@njit(cache=True, nogil=True)
def _gather(g0, g1, scratch, lengths, word_start, words):  # pragma: no cover - jitted
    R = lengths.shape[0]
    for r in range(R):
        for g in range(g0, g1):
            n = lengths[r, g]
            base = word_start[r, g]
            for i in range(n):
                words[r, base + i] = scratch[r, g, n - 1 - i]


def encode(
    x: np.ndarray, mean: np.ndarray, fine: np.ndarray, depth: np.ndarray, lo: np.ndarray,
    size: np.ndarray, base_tid: np.ndarray, refine_tid: np.ndarray, freqs: np.ndarray,
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:  # fmt: skip
    """Quantise ``x [G, T, D]`` (float32, mean not removed) into every tier and code it.

    ``mean``, ``fine``, ``lo``, ``size``, ``base_tid``: ``[G, D]``; ``depth [R, G, D]``;
    ``refine_tid [R - 1, 3, G, D]``. Returns ``states [R, G, STATES]``, each tier's
    words, and ``word_start [R, G + 1]`` (group ``g`` of tier ``r`` is
    ``words[r][word_start[r, g]:word_start[r, g + 1]]``).
    """
    G, T, D = x.shape
    R = depth.shape[0]
    freqs32 = np.ascontiguousarray(freqs, dtype=np.uint32)
    depth = np.ascontiguousarray(depth, dtype=np.int64)
    top = np.ascontiguousarray(depth[-1])
    scratch = np.empty((R, G, T * D), dtype=np.uint16)
    lengths = np.zeros((R, G), dtype=np.int64)
    states = np.empty((R, G, STATES), dtype=np.uint32)
    parallel.run(
        _encode, G, np.ascontiguousarray(x, dtype=np.float32),
        np.ascontiguousarray(mean, dtype=np.float32), np.ascontiguousarray(fine, dtype=np.float32),
        top, depth, np.ascontiguousarray(lo, dtype=np.int64),
        np.ascontiguousarray(size, dtype=np.int64), np.ascontiguousarray(base_tid, dtype=np.int64),
        np.ascontiguousarray(refine_tid, dtype=np.int64), freqs32, cumulative(freqs32),
        scratch, lengths, states,
    )  # fmt: skip
    word_start = np.zeros((R, G + 1), dtype=np.int64)
    np.cumsum(lengths, axis=1, out=word_start[:, 1:])
    flat = np.zeros((R, int(word_start[:, -1].max(initial=0))), dtype=np.uint16)
    parallel.run(_gather, G, scratch, lengths, word_start, flat)
    return states, [flat[r, : word_start[r, -1]].copy() for r in range(R)], word_start


@njit(cache=True, nogil=True, inline="always")
def _dec(x, tab, lut, words, r, pos, last):  # pragma: no cover - jitted
    """One symbol from state ``x`` with table ``tab``: (symbol, new state, new position)."""
    e = lut[tab, x & np.uint32(_MASK)]
    v = (((e >> np.uint32(8)) & np.uint32(0xFFF)) + np.uint32(1)) * (x >> np.uint32(PROB_BITS))
    v += e >> np.uint32(20)
    w = np.uint32(words[r, min(pos, last)])
    if v < np.uint32(RANS_L):
        return np.int64(e & np.uint32(0xFF)), (v << np.uint32(16)) | w, pos + 1
    return np.int64(e & np.uint32(0xFF)), v, pos


@njit(cache=True, nogil=True, error_model="numpy")
def _decode(g0, g1, k, words, word_start, states, lut, mean, fine, top, depth, lo, base_tid,
            refine_tid, out, status):  # pragma: no cover - jitted  # fmt: skip
    """Tiers ``0..k`` of groups ``[g0, g1)``, a tier at a time: the base's indices into a
    buffer, each refinement's symbols into it (its coded lanes only), then the values.
    The four states of a tier are locals (registers); a read is clamped to the tier's
    words of the group (a corrupt stream cannot read outside them), and the end
    check finds overruns."""
    G, T, D = out.shape
    n = np.empty((T, D), dtype=np.int64)
    lanes = np.empty(D, dtype=np.int64)
    tabs = np.empty((3, D), dtype=np.int64)
    scale = np.empty(D, dtype=np.float32)
    for g in range(g0, g1):
        ok = True
        for r in range(k + 1):
            m = 0
            for d in range(D):
                if r == 0:
                    lanes[m] = d
                    tabs[0, m] = base_tid[g, d]
                    m += 1
                elif depth[r, g, d] != depth[r - 1, g, d]:
                    lanes[m] = d
                    for c in range(3):
                        tabs[c, m] = refine_tid[r - 1, c, g, d]
                    m += 1
            x0, x1, x2, x3 = states[r, g, 0], states[r, g, 1], states[r, g, 2], states[r, g, 3]
            pos = word_start[r, g]
            end = word_start[r, g + 1]
            last = max(end - 1, pos)
            for t in range(T):
                for j in range(m):
                    d = lanes[j]
                    i = j % STATES
                    xi = x0 if i == 0 else (x1 if i == 1 else (x2 if i == 2 else x3))
                    if r == 0:
                        s, xi, pos = _dec(xi, tabs[0, j], lut, words, r, pos, last)
                        n[t, d] = s + lo[g, d]
                    else:
                        p = n[t, d]
                        c = 2 if p > 1 else (p if p >= 0 else (-p if p > -2 else 2))
                        s, xi, pos = _dec(xi, tabs[c, j], lut, words, r, pos, last)
                        n[t, d] = 3 * p + (1 - s if p < 0 else s - 1)
                    if i == 0:
                        x0 = xi
                    elif i == 1:
                        x1 = xi
                    elif i == 2:
                        x2 = xi
                    else:
                        x3 = xi
            rl = np.uint32(RANS_L)
            if pos != end or x0 != rl or x1 != rl or x2 != rl or x3 != rl:
                ok = False
        for d in range(D):
            scale[d] = np.float32(_pow3(top[g, d] - depth[k, g, d])) * fine[g, d]
        for t in range(T):
            for d in range(D):
                out[g, t, d] = mean[g, d] + np.float32(n[t, d]) * scale[d]
        status[g] = 0 if ok else 1


def decode(
    k: int, words: list[np.ndarray], word_start: np.ndarray, states: np.ndarray, lut: np.ndarray,
    mean: np.ndarray, fine: np.ndarray, depth: np.ndarray, lo: np.ndarray,
    base_tid: np.ndarray, refine_tid: np.ndarray, out: np.ndarray,
) -> None:  # fmt: skip
    """Tiers ``0..k`` of every group into ``out [G, T, D]`` (float32); the arguments as
    :func:`encode` takes and returns them, ``lut`` the packed decode tables. Raises
    :class:`RansError` naming the first group whose stream did not end where it should
    (values were written)."""
    G = out.shape[0]
    R = k + 1
    width = max(1, max(len(w) for w in words[:R]))
    stacked = np.zeros((R, width), dtype=np.uint16)
    for r in range(R):
        stacked[r, : len(words[r])] = words[r]
    depth = np.ascontiguousarray(depth, dtype=np.int64)
    status = np.zeros(G, dtype=np.int64)
    parallel.run(
        _decode, G, k, stacked, np.ascontiguousarray(word_start, dtype=np.int64),
        np.ascontiguousarray(states, dtype=np.uint32), lut,
        np.ascontiguousarray(mean, dtype=np.float32), np.ascontiguousarray(fine, dtype=np.float32),
        np.ascontiguousarray(depth[-1]), depth, np.ascontiguousarray(lo, dtype=np.int64),
        np.ascontiguousarray(base_tid, dtype=np.int64),
        np.ascontiguousarray(refine_tid, dtype=np.int64), out, status,
    )  # fmt: skip
    bad = np.flatnonzero(status)
    if bad.size:
        raise RansError(f"group {int(bad[0])}: its rANS stream does not end where it should")
