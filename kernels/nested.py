"""CPU kernels of the nested (progressive) ladder codec: a base and ternary refinements,
each tier its own interleaved rANS stream (numba).

Per group (layer, K/V, head) ``g`` and lane (channel) ``d``, with ``J = depth[-1]``
the number of splits of the finest tier and ``fine`` the step of that tier:

* the finest index ``nJ = clip(rint((x - mean) / fine), lo * 3**J - h, hi * 3**J + h)``
  (float32 arithmetic; ``h = (3**J - 1) / 2``, ``[lo, hi]`` the base table's range);
* tier ``r``'s index ``n_r = floor((nJ + u_r // 2) / u_r)``, ``u_r = 3**(J - depth[r])``;
* tier 0 codes ``n_0 - lo`` with the lane's base table of context ``1 + sign(p_0)``,
  ``p_0`` the previous token's ``n_0`` in the lane (0 before the chunk's first token);
  tier ``r > 0`` codes, for the lanes it splits (``depth[r] > depth[r - 1]``),
  ``c = n_r - 3 n_{r-1} + 1`` turned to count from the mean's side (``s = 2 - c``
  where ``n_{r-1} < 0``) with the table of context ``3 min(|n_{r-1}|, 2) + p_s``,
  ``p_s`` the previous token's ``s`` in the lane at this tier (1 before the first);
* a lane's tables of the contexts of one parent cell are consecutive: the kernels take
  the table of the first (``base_tid`` at ``p_0 < 0``; ``refine_tid`` at each parent
  context, ``p_s = 0``) and add ``stride`` times the context's rest (1; 0 for a
  profile whose tables do not depend on the previous token, made before they did);
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

from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from . import parallel
from .rans import PROB_BITS, RANS_L, RansError, cumulative

if TYPE_CHECKING:
    from .nested_simd import BlockSetup, VectorTables

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


@njit(cache=True, nogil=True, inline="always")
def _at_depth(nj, t, d, up):  # pragma: no cover - jitted
    """The index of token ``t``, lane ``d`` at a tier ``up = 3**(top - depth)`` below the
    finest."""
    return (nj[t, d] + (up - 1) // 2) // up


@njit(cache=True, nogil=True)
def _encode_tier(nj, r, depth, top, lo, base_tid, refine_tid, stride, freqs, starts, scratch,
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
                s = _at_depth(nj, t, d, up) - lo[d]
                prev = _at_depth(nj, t - 1, d, up) if t > 0 else 0
                tab = base_tid[d] + (0 if prev < 0 else (1 if prev == 0 else 2)) * stride
            else:
                if depth[r, d] == depth[r - 1, d]:
                    continue
                up = _pow3(top[d] - depth[r, d])
                s = _symbol(nj, t, d, up)
                ps = _symbol(nj, t - 1, d, up) if t > 0 else 1
                parent = _at_depth(nj, t, d, up * 3)
                tab = refine_tid[r - 1, min(abs(parent), 2), d] + ps * stride
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


@njit(cache=True, nogil=True, inline="always")
def _symbol(nj, t, d, up):  # pragma: no cover - jitted
    """Token ``t``'s refinement symbol in lane ``d`` at the tier ``up`` below the finest,
    counted from the mean's side."""
    child = _at_depth(nj, t, d, up)
    parent = _at_depth(nj, t, d, up * 3)
    c = child - 3 * parent + 1
    return 2 - c if parent < 0 else c


@njit(cache=True, nogil=True, error_model="numpy")
def _encode(g0, g1, x, mean, fine, top, depth, lo, size, base_tid, refine_tid, stride, freqs,
            starts, scratch, lengths, states):  # pragma: no cover - jitted  # fmt: skip
    G, T, D = x.shape
    R = depth.shape[0]
    nj = np.empty((T, D), dtype=np.int64)
    for g in range(g0, g1):
        _finest(x[g], mean[g], fine[g], top[g], lo[g], size[g], nj)
        for r in range(R):
            lengths[r, g] = _encode_tier(nj, r, depth[:, g], top[g], lo[g], base_tid[g],
                                         refine_tid[:, :, g], stride, freqs, starts,
                                         scratch[r, g], states[r, g])  # fmt: skip


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
    size: np.ndarray, base_tid: np.ndarray, refine_tid: np.ndarray, stride: int,
    freqs: np.ndarray,
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:  # fmt: skip
    """Quantise ``x [G, T, D]`` (float32, mean not removed) into every tier and code it.

    ``mean``, ``fine``, ``lo``, ``size``, ``base_tid``: ``[G, D]``; ``depth [R, G, D]``;
    ``refine_tid [R - 1, 3, G, D]``; ``stride`` 1 where the tables depend on the
    previous token, else 0 (the module's docstring). Returns ``states [R, G, STATES]``, each tier's
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
        np.ascontiguousarray(refine_tid, dtype=np.int64), check_stride(stride), freqs32,
        cumulative(freqs32),
        scratch, lengths, states,
    )  # fmt: skip
    word_start = np.zeros((R, G + 1), dtype=np.int64)
    np.cumsum(lengths, axis=1, out=word_start[:, 1:])
    flat = np.zeros((R, int(word_start[:, -1].max(initial=0))), dtype=np.uint16)
    parallel.run(_gather, G, scratch, lengths, word_start, flat)
    return states, [flat[r, : word_start[r, -1]].copy() for r in range(R)], word_start


def check_stride(stride: int) -> int:
    """``stride`` as the kernels take it: 1 where a context's tables follow the first's,
    0 where every context uses the first."""
    if stride not in (0, 1):
        raise ValueError("stride must be 0 or 1")
    return int(stride)


_U = np.uint64
_UMASK = _U(_MASK)
_UL = _U(RANS_L)


@njit(cache=True, nogil=True, inline="always")
def _base_row(rows, d, prev, stride):  # pragma: no cover - jitted
    """The first LUT entry of lane ``d``'s base table in the context of the previous
    token's base index ``prev`` (the table ``1 + sign(prev)`` after ``rows[d]``'s, times
    ``stride``), without a branch."""
    return rows[d] + ((_U(1) + _U(prev > 0) - _U(prev < 0)) * stride << _U(PROB_BITS))


@njit(cache=True, nogil=True, inline="always")
def _base_symbol(x, row, lut, words, p, last):  # pragma: no cover - jitted
    """A base symbol from state ``x``, ``row`` the first LUT entry of the lane's table:
    (symbol, new state, new position). Branch-free (a renormalisation is data, not a
    jump: which states renormalise is random), unsigned indices (no wraparound
    checks): the decoder is bound by instructions a symbol, not by latency."""
    e = _U(lut[row + (x & _UMASK)])
    v = (((e >> _U(8)) & _U(0xFFF)) + _U(1)) * (x >> _U(PROB_BITS)) + (e >> _U(20))
    b = (v - _UL) >> _U(63)  # 1 where v < L: take a word
    w = _U(words[min(p, last)])
    return e & _U(0xFF), (v << (b << _U(4))) | (w & (_U(0) - b)), p + b


@njit(cache=True, nogil=True, inline="always")
def _refinement(at, x, lanes, n, prev, cuts, words, p, last):  # pragma: no cover - jitted
    """Coded lane ``at``'s next refinement symbol, applied to its index ``n[lanes[at]]``
    (``prev[at]``: the lane's symbol at the previous token): (new state, new
    position). A ternary table needs no LUT: the symbol is the count of its two cut
    points at or below the slot (``cuts``: ``first | second << 16`` per lane and
    context), its start and end the cut points around it."""
    d = lanes[at]
    parent = n[d]
    a = _U(abs(parent))
    # context 3 min(|parent|, 2) + the previous symbol
    cc = _U(cuts[at * _U(9) + (_U(a != _U(0)) + _U(a > _U(1))) * _U(3) + prev[at]])
    first, second = cc & _U(0xFFFF), cc >> _U(16)
    slot = x & _UMASK
    above_first = (first - _U(1) - slot) >> _U(63)
    above_second = (second - _U(1) - slot) >> _U(63)
    start = second if above_second else (first if above_first else _U(0))
    end = _U(_MASK + 1) if above_second else (second if above_first else first)
    v = (end - start) * (x >> _U(PROB_BITS)) + slot - start
    b = (v - _UL) >> _U(63)
    w = _U(words[min(p, last)])
    s = above_first + above_second
    prev[at] = s
    n[d] = 3 * parent + (np.int64(s) - 1) * ((parent >> 63) | 1)  # from the mean's side
    return (v << (b << _U(4))) | (w & (_U(0) - b)), p + b


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
def _decode(g0, g1, k, words, wbeg, wend, states, lut, cum, mean, fine, top, depth, lo,
            base_tid, refine_tid, stride, out, status):  # pragma: no cover - jitted  # fmt: skip
    """Tiers ``0..k`` of groups ``[g0, g1)``, token by token: the base's symbols of every
    lane, then each refinement's symbols of its coded lanes (each tier its own four
    states, in registers while its row is decoded), then the token's values. A read
    is clamped to the group's words of its tier (a corrupt stream cannot read outside
    them), and the end check finds overruns."""
    G, T, D = out.shape
    R = k + 1
    S = 1 << PROB_BITS
    n = np.empty(D, dtype=np.int64)
    lanes = np.empty(R * D, dtype=np.uint64)  # tier r's coded lanes, from r * D
    m = np.empty(R, dtype=np.uint64)
    cuts = np.empty(R * D * 9, dtype=np.uint32)  # (coded lane, context): its 2 cut points
    prev = np.empty(R * D, dtype=np.uint64)  # (coded lane): the previous token's symbol
    rows = np.empty(D, dtype=np.uint64)  # its first context's table's first LUT entry
    base = np.empty(D, dtype=np.int64)  # the previous token's base indices
    low = np.empty(D, dtype=np.int64)
    xs = np.empty(R * STATES, dtype=np.uint64)
    pos = np.empty(R, dtype=np.uint64)
    last = np.empty(R, dtype=np.uint64)
    scale = np.empty(D, dtype=np.float32)
    mu = np.empty(D, dtype=np.float32)
    ust = _U(stride)
    for g in range(g0, g1):
        for d in range(D):
            rows[d] = _U(base_tid[g, d]) * _U(S)
            base[d] = 0
            low[d] = lo[g, d]
            mu[d] = mean[g, d]
            scale[d] = np.float32(_pow3(top[g, d] - depth[k, g, d])) * fine[g, d]
        for r in range(R):
            q = 0
            for d in range(D):
                if r == 0 or depth[r, g, d] != depth[r - 1, g, d]:
                    lanes[r * D + q] = d
                    if r > 0:
                        prev[r * D + q] = 1
                        for c in range(9):  # 3 (parent's context) + the previous symbol
                            tab = refine_tid[r - 1, c // 3, g, d] + (c % 3) * stride
                            cuts[(r * D + q) * 9 + c] = cum[tab, 1] | (cum[tab, 2] << 16)
                    q += 1
            m[r] = q
            for i in range(STATES):
                xs[r * STATES + i] = states[r, g, i]
            pos[r] = wbeg[r, g]
            last[r] = max(wend[r, g] - 1, wbeg[r, g])
        for t in range(T):
            x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
            p, lp = pos[0], last[0]
            j = 0
            while j + 4 <= D:
                row = _base_row(rows, j, base[j], ust)
                s, x0, p = _base_symbol(x0, row, lut, words, p, lp)
                n[j] = base[j] = np.int64(s) + low[j]
                row = _base_row(rows, j + 1, base[j + 1], ust)
                s, x1, p = _base_symbol(x1, row, lut, words, p, lp)
                n[j + 1] = base[j + 1] = np.int64(s) + low[j + 1]
                row = _base_row(rows, j + 2, base[j + 2], ust)
                s, x2, p = _base_symbol(x2, row, lut, words, p, lp)
                n[j + 2] = base[j + 2] = np.int64(s) + low[j + 2]
                row = _base_row(rows, j + 3, base[j + 3], ust)
                s, x3, p = _base_symbol(x3, row, lut, words, p, lp)
                n[j + 3] = base[j + 3] = np.int64(s) + low[j + 3]
                j += 4
            xs[0], xs[1], xs[2], xs[3] = x0, x1, x2, x3
            while j < D:
                i = j % STATES
                row = _base_row(rows, j, base[j], ust)
                s, xs[i], p = _base_symbol(xs[i], row, lut, words, p, lp)
                n[j] = base[j] = np.int64(s) + low[j]
                j += 1
            pos[0] = p
            for r in range(1, R):
                mr, p, lr, o = m[r], pos[r], last[r], r * STATES
                x0, x1, x2, x3 = xs[o], xs[o + 1], xs[o + 2], xs[o + 3]
                a = _U(r * D)
                e = a + mr
                while a + _U(4) <= e:
                    x0, p = _refinement(a, x0, lanes, n, prev, cuts, words, p, lr)
                    x1, p = _refinement(a + _U(1), x1, lanes, n, prev, cuts, words, p, lr)
                    x2, p = _refinement(a + _U(2), x2, lanes, n, prev, cuts, words, p, lr)
                    x3, p = _refinement(a + _U(3), x3, lanes, n, prev, cuts, words, p, lr)
                    a += _U(4)
                if a < e:
                    x0, p = _refinement(a, x0, lanes, n, prev, cuts, words, p, lr)
                if a + _U(1) < e:
                    x1, p = _refinement(a + _U(1), x1, lanes, n, prev, cuts, words, p, lr)
                if a + _U(2) < e:
                    x2, p = _refinement(a + _U(2), x2, lanes, n, prev, cuts, words, p, lr)
                xs[o], xs[o + 1], xs[o + 2], xs[o + 3] = x0, x1, x2, x3
                pos[r] = p
            for d in range(D):
                out[g, t, d] = mu[d] + np.float32(n[d]) * scale[d]
        ok = True
        for r in range(R):
            if pos[r] != _U(wend[r, g]):
                ok = False
            for i in range(STATES):
                if xs[r * STATES + i] != _UL:
                    ok = False
        status[g] = 0 if ok else 1


def decode(
    k: int, words: np.ndarray, wbeg: np.ndarray, wend: np.ndarray, states: np.ndarray,
    lut: np.ndarray, cum: np.ndarray, mean: np.ndarray, fine: np.ndarray, depth: np.ndarray,
    lo: np.ndarray, base_tid: np.ndarray, refine_tid: np.ndarray, stride: int,
    out: np.ndarray, vector: bool = True,
    vector_tables: VectorTables | None = None,
    block_setup: BlockSetup | None = None,
) -> None:  # fmt: skip
    """Tiers ``0..k`` of every group into ``out [G, T, D]`` (float32).

    ``words``: 16-bit words holding every stream (at least one word, so that an empty
    stream's clamped read stays inside); group ``g``'s stream of tier ``r`` is
    ``words[wbeg[r, g]:wend[r, g]]`` (``[R, G]`` each, within ``words``), its states
    ``states [R, G, STATES]``; ``lut`` the packed decode tables ``[n, 4096]``, ``cum``
    the tables' starts (:func:`~kvcdn.kernels.rans.cumulative`); the rest as
    :func:`encode` takes them. Raises :class:`RansError` naming the first group
    whose stream did not end where it should (values were written).

    Sixteen groups at a time in vector registers (:mod:`.nested_simd`) where the host
    has AVX-512 or AVX2 and the arrays allow, else (or with ``vector=False``) group by group;
    the two give the same values and errors. ``vector_tables``: the vector kernel's
    form of ``lut``, ``cum``, ``base_tid`` and ``stride``
    (:func:`.nested_simd.vector_tables`), and
    ``block_setup`` how its blocks take the groups and what each starts from
    (:func:`.nested_simd.block_setup` of :func:`.nested_simd.plan_blocks` and these
    arrays), which a caller decoding many chunks makes once; else made for this call."""
    from . import nested_simd  # it imports this module

    G = out.shape[0]
    R = k + 1
    # neither kernel checks its indices: the tiers, shapes and table ids are checked here
    bounds = (np.shape(wbeg), np.shape(wend), np.shape(states)[:2])
    if not 0 <= k < depth.shape[0] or any(len(b) != 2 or b[0] < R or b[1] != G for b in bounds):
        raise ValueError("the tiers asked for are not those of the streams")
    if np.shape(states)[2:] != (STATES,) or np.shape(refine_tid)[:1] != (depth.shape[0] - 1,):
        raise ValueError("the streams' states or tables do not fit their tiers")
    lanes = (G, out.shape[2])  # each group's lanes: every per-stream array's last two axes
    if any(np.shape(a)[-2:] != lanes for a in (mean, fine, depth, lo, base_tid, refine_tid)):
        raise ValueError("the streams' arrays do not fit the output's groups and lanes")
    if not len(words) or np.any(wbeg > wend) or np.any(wend > len(words)) or np.any(wbeg < 0):
        raise ValueError("stream bounds outside the words")
    if np.any(np.asarray(states) < RANS_L):  # as a container's parser refuses them
        raise ValueError("a stream's state is below the coder's range")
    tables_n = lut.size // (1 << PROB_BITS)
    for tid in (base_tid, refine_tid):
        if np.size(tid) and (int(np.min(tid)) < 0 or int(np.max(tid)) + 2 * stride >= tables_n):
            raise ValueError("a stream's table is not one of the decode tables")
    status = np.zeros(G, dtype=np.int64)
    wbeg = np.ascontiguousarray(wbeg, dtype=np.int64)
    wend = np.ascontiguousarray(wend, dtype=np.int64)
    args = (
        k, words, wbeg, wend, np.ascontiguousarray(states, dtype=np.uint32), lut.reshape(-1),
        np.ascontiguousarray(cum, dtype=np.uint32),
        np.ascontiguousarray(mean, dtype=np.float32), np.ascontiguousarray(fine, dtype=np.float32),
    )  # fmt: skip
    depth = np.ascontiguousarray(depth, dtype=np.int64)
    tables = (
        np.ascontiguousarray(lo, dtype=np.int64), np.ascontiguousarray(base_tid, dtype=np.int64),
        np.ascontiguousarray(refine_tid, dtype=np.int64), check_stride(stride),
    )  # fmt: skip
    if vector and nested_simd.usable(out, words, lut, wbeg, wend, lo):
        nested_simd.decode(*args, depth, *tables, out, status, vector_tables, block_setup)
    else:
        parallel.run(_decode, G, *args, np.ascontiguousarray(depth[-1]), depth, *tables, out,
                     status)  # fmt: skip
    bad = np.flatnonzero(status)
    if bad.size:
        raise RansError(f"group {int(bad[0])}: its rANS stream does not end where it should")


def warm_up() -> None:
    """Run the decoder once on a tiny stream, in the array types a reader passes (words
    read-only from a payload; a whole or a sliced output), so that a process's first
    real decode does not pay for loading the compiled kernel (about 0.2 s). Nothing is
    encoded (a reader never compiles the encoder): the stream is made up, and fails
    its end check, which is expected."""
    G, T, D = 2, 1, 16  # lanes enough for the vector kernel too
    freqs = np.zeros((2, 12), dtype=np.uint32)
    freqs[0, :4] = 1024  # a base table of 4 symbols
    freqs[1, :3] = (1366, 1365, 1365)  # a ternary refinement table
    from .rans import build_decode_table

    mean, fine = np.zeros((G, D), dtype=np.float32), np.ones((G, D), dtype=np.float32)
    depth = np.zeros((2, G, D), dtype=np.int64)
    depth[1] = 1
    lo, base_tid = np.zeros((G, D), dtype=np.int64), np.zeros((G, D), dtype=np.int64)
    refine_tid = np.ones((1, 3, G, D), dtype=np.int64)
    words = np.frombuffer(bytes(8), dtype="<u2")  # read-only, as a payload's
    bounds = np.zeros((2, G), dtype=np.int64)
    states = np.full((2, G, STATES), RANS_L, dtype=np.uint32)
    lut, starts = build_decode_table(freqs), cumulative(freqs)
    for out in (np.empty((G, T, D), dtype=np.float32),
                np.empty((G, T + 1, D), dtype=np.float32)[:, 1:]):  # fmt: skip
        for vector in (False, True):
            try:
                decode(1, words, bounds, bounds, states, lut, starts, mean, fine, depth, lo,
                       base_tid, refine_tid, 0, out, vector)  # fmt: skip
            except RansError:
                pass  # the made-up stream does not end where it should
