"""CPU kernels for the interleaved rANS of :mod:`kvcdn.kernels.rans` (numba).

Same inputs, outputs and bit-exact results as the numpy reference; groups
run in parallel (each kernel takes a range of groups, :mod:`.parallel` runs one
range per thread), and dequantisation is fused into the decode loop, writing
each value straight into the output view.

Bit-exactness of the fused dequantisation: ``sym * scale`` is exact in
float32 because codec profiles keep every scale to 4 significant bits
(``sym`` has 8), so each value is rounded exactly once, at the addition,
whatever the hardware does with a multiply-add.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numba import njit

from . import parallel
from .paged_cpu import bf16_bits
from .permuted import PermutedBlocks
from .rans import PROB_BITS, RANS_L, RansError

_MASK = (1 << PROB_BITS) - 1
_X_MAX_UNIT = (RANS_L >> PROB_BITS) << 16


@njit(cache=True, nogil=True)
def _encode_group(sym, table_id, freqs, starts, scratch, states):  # pragma: no cover - jitted
    """Encode one group's symbols ``[T, D]``; returns how many words went to ``scratch``."""
    T, D = sym.shape
    x = np.full(D, RANS_L, dtype=np.uint64)
    n = 0
    for t in range(T - 1, -1, -1):
        for d in range(D - 1, -1, -1):
            tab = table_id[d]
            s = sym[t, d]
            f = np.uint64(freqs[tab, s])
            xd = x[d]
            if xd >= np.uint64(_X_MAX_UNIT) * f:
                scratch[n] = np.uint16(xd & np.uint64(0xFFFF))
                n += 1
                xd >>= np.uint64(16)
            x[d] = ((xd // f) << np.uint64(PROB_BITS)) + (xd % f) + np.uint64(starts[tab, s])
    for d in range(D):
        states[d] = np.uint32(x[d])
    return n


@njit(cache=True, nogil=True)
def _encode(g0, g1, sym, table_id, freqs, starts, scratch, lengths, states):  # pragma: no cover
    for g in range(g0, g1):
        lengths[g] = _encode_group(sym[g], table_id[g], freqs, starts, scratch[g], states[g])


@njit(cache=True, nogil=True)
def _gather_words(g0, g1, scratch, lengths, word_start, words):  # pragma: no cover - jitted
    for g in range(g0, g1):
        n = lengths[g]
        base = word_start[g]
        for i in range(n):
            words[base + i] = scratch[g, n - 1 - i]


def _concatenate(scratch: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-group scratch words (in encoder order) -> (``words``, ``word_start``)."""
    word_start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=word_start[1:])
    words = np.empty(int(word_start[-1]), dtype=np.uint16)
    parallel.run(_gather_words, len(lengths), scratch, lengths, word_start, words)
    return words, word_start


def encode(
    sym: np.ndarray, table_id: np.ndarray, freqs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Same contract as :func:`kvcdn.kernels.rans.encode_ref`."""
    from .rans import cumulative

    sym = np.ascontiguousarray(sym, dtype=np.uint8)
    G, T, D = sym.shape
    freqs32 = np.ascontiguousarray(freqs, dtype=np.uint32)
    tid = np.ascontiguousarray(table_id, dtype=np.int32)
    check = freqs32[tid[:, None, :], sym]
    if check.size and check.min() == 0:
        raise RansError("a symbol has zero frequency in its table")
    scratch = np.empty((G, T * D), dtype=np.uint16)  # at most one word per symbol
    lengths = np.zeros(G, dtype=np.int64)
    states = np.empty((G, D), dtype=np.uint32)
    parallel.run(_encode, G, sym, tid, freqs32, cumulative(freqs32), scratch, lengths, states)
    return (states, *_concatenate(scratch, lengths))


@njit(cache=True, nogil=True, error_model="numpy")
def _quantise_encode(
    g0, g1, x, mean, step, lo, size, table_id, freqs, starts, scratch, lengths, states
):  # pragma: no cover
    G, T, D = x.shape
    for g in range(g0, g1):
        sym = np.empty((T, D), dtype=np.uint8)
        for t in range(T):
            for d in range(D):
                q = np.rint((x[g, t, d] - mean[g, d]) / step[g, d]) - np.float32(lo[g, d])
                top = np.float32(size[g, d] - 1)
                if q < np.float32(0.0):
                    q = np.float32(0.0)
                elif q > top:
                    q = top
                elif not q >= np.float32(0.0):  # NaN: fails every comparison
                    q = np.float32(0.0)
                sym[t, d] = np.uint8(q)
        lengths[g] = _encode_group(sym, table_id[g], freqs, starts, scratch[g], states[g])


def quantise_encode(
    x: np.ndarray,
    mean: np.ndarray,
    step: np.ndarray,
    lo: np.ndarray,
    size: np.ndarray,
    table_id: np.ndarray,
    freqs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantise ``x [G, T, D]`` (float32) and encode it in one pass.

    Symbol index = ``clip(rint((x - mean) / step) - lo, 0, size - 1)`` per
    stream (all ``[G, D]``); the result equals :func:`encode` of those indices.
    """
    from .rans import cumulative

    G, T, D = x.shape
    freqs32 = np.ascontiguousarray(freqs, dtype=np.uint32)
    scratch = np.empty((G, T * D), dtype=np.uint16)
    lengths = np.zeros(G, dtype=np.int64)
    states = np.empty((G, D), dtype=np.uint32)
    parallel.run(
        _quantise_encode,
        G,
        x.astype(np.float32, copy=False),
        np.ascontiguousarray(mean, dtype=np.float32),
        np.ascontiguousarray(step, dtype=np.float32),
        np.ascontiguousarray(lo, dtype=np.int32),
        np.ascontiguousarray(size, dtype=np.int32),
        np.ascontiguousarray(table_id, dtype=np.int32),
        freqs32,
        cumulative(freqs32),
        scratch,
        lengths,
        states,
    )
    return (states, *_concatenate(scratch, lengths))


@njit(cache=True, nogil=True, inline="always")
def _lanes(states, table_id, scale, offset, g):  # pragma: no cover - jitted
    """Group ``g``'s lane state and tables, as contiguous per-lane arrays."""
    D = states.shape[1]
    x = np.empty(D, dtype=np.uint32)
    tab = np.empty(D, dtype=np.int64)
    sc = np.empty(D, dtype=np.float32)
    of = np.empty(D, dtype=np.float32)
    for d in range(D):
        x[d] = states[g, d]
        tab[d] = table_id[g, d]
        sc[d] = scale[g, d]
        of[d] = offset[g, d]
    return x, tab, sc, of


@njit(cache=True, nogil=True, inline="always")
def _next_token(
    x, tab, lut, words, pos, last, value, sc, of, nx, need, at
):  # pragma: no cover - jitted
    """One token of a group: every lane's next symbol, dequantised into ``value``,
    each state advanced; returns the group's new word position.

    Three passes over the lanes instead of one: the decode-table lookups of all
    lanes first (independent: vectorised, with gathers), then where each
    renormalising lane's word is (a running sum, the only serial part), then the
    reads (independent again). One pass (:func:`_next_symbol`) carries the word
    position from lane to lane: 1.35x slower into an array (2,120 tokens, 2 CPUs:
    0.060 s against 0.043 s; one CPU 0.113 s against 0.082 s). The read index is
    clamped to the group's words (a corrupt stream cannot read outside them);
    overruns show as pos > end.
    """
    D = x.size
    for d in range(D):
        xd = x[d]
        e = lut[tab[d], xd & np.uint32(_MASK)]
        v = (((e >> np.uint32(8)) & np.uint32(0xFFF)) + np.uint32(1)) * (
            xd >> np.uint32(PROB_BITS)
        ) + (e >> np.uint32(20))
        nx[d] = v
        need[d] = np.uint32(1) if v < np.uint32(RANS_L) else np.uint32(0)
        value[d] = np.float32(e & np.uint32(0xFF)) * sc[d] + of[d]
    for d in range(D):
        at[d] = pos
        pos += need[d]
    for d in range(D):
        w = np.uint32(words[min(at[d], last)]) if words.size else np.uint32(0)
        x[d] = (nx[d] << np.uint32(16)) | w if need[d] else nx[d]
    return pos


@njit(cache=True, nogil=True)
def _next_symbol(x, d, lut, tab, words, pos, last):  # pragma: no cover - jitted
    """Lane ``d``'s next symbol (the decode-table entry's low byte), advancing its state
    ``x[d]`` and, when it renormalises, the group's word position; returns both.

    :func:`_next_token` in one pass, lane by lane: slower for a plain output (1.3x),
    but 1.1x faster where each value is scattered into paged blocks as it comes
    (the scattered stores overlap the serial decode; measured on 2,120 tokens, 2
    CPUs: 0.058 s against 0.064-0.067 s for three passes plus the scatter, and
    0.064 s for three passes into a staging array plus :mod:`.paged_cpu`'s write).
    Branch-free renormalisation: whether a lane needs a word is data-dependent and
    unpredictable, so select instead of branch; the read index is clamped as in
    :func:`_next_token`.

    Not ``inline="always"``: with numba's own (IR-level) inlining of this call, the
    decode into paged blocks compiled without ``parallel=True`` ran 5.5x slower (the
    embedded model's 256-token ``default`` chunk, one thread: 66 ms against 12 ms);
    numba's parallel pipeline, used before :mod:`.parallel`, had hidden that. Left to
    LLVM, the call is inlined at no such cost.
    """
    xd = x[d]
    e = lut[tab[d], xd & np.uint32(_MASK)]
    xd = ((e >> np.uint32(8)) & np.uint32(0xFFF)) + np.uint32(1)
    xd = xd * (x[d] >> np.uint32(PROB_BITS)) + (e >> np.uint32(20))
    w = np.uint32(words[min(pos, last)]) if words.size else np.uint32(0)
    need = xd < np.uint32(RANS_L)
    x[d] = (xd << np.uint32(16)) | w if need else xd
    return e & np.uint32(0xFF), pos + (1 if need else 0)


@njit(cache=True, nogil=True, inline="always")
def _stream_ok(x, pos, end):  # pragma: no cover - jitted
    """Whether a group's stream ended where it should: every word read, every state back
    at its initial value."""
    if pos != end:
        return False
    for d in range(x.size):
        if x[d] != np.uint32(RANS_L):
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def _decode(
    g0, g1, words, word_start, states, lut, table_id, scale, offset, out, status
):  # pragma: no cover
    G, T, D = out.shape
    for g in range(g0, g1):
        x, tab, sc, of = _lanes(states, table_id, scale, offset, g)
        nx = np.empty(D, dtype=np.uint32)
        need = np.empty(D, dtype=np.uint32)
        at = np.empty(D, dtype=np.int64)
        value = np.empty(D, dtype=np.float32)
        pos = word_start[g]
        end = word_start[g + 1]
        last = max(end - 1, 0)
        for t in range(T):
            pos = _next_token(x, tab, lut, words, pos, last, value, sc, of, nx, need, at)
            for d in range(D):
                out[g, t, d] = value[d]
        status[g] = 0 if _stream_ok(x, pos, end) else 1


@njit(cache=True, nogil=True, error_model="numpy")
def _decode_permuted(
    g0,
    g1,
    words,
    word_start,
    states,
    lut,
    table_id,
    scale,
    offset,
    tokens,
    heads,
    cache,
    blocks,
    first,
    lo,
    hi,
    k_pos,
    v_pos,
    to_bf16,
    status,
):  # pragma: no cover
    # group g is (layer, K|V, head) = divmod as the codec orders them: [L, 2, H]
    G, D = states.shape
    block_size = cache.shape[4] // D
    for g in range(g0, g1):
        layer = g // (2 * heads)
        kv = g // heads % 2
        h = g % heads
        pos_of = k_pos if kv == 0 else v_pos
        x, tab, sc, of = _lanes(states, table_id, scale, offset, g)
        pos = word_start[g]
        end = word_start[g + 1]
        last = max(end - 1, 0)
        for t in range(tokens):
            write = lo <= t < hi
            p = first + t
            b = blocks[p // block_size] if write else 0
            e = (p % block_size) * D
            for d in range(D):
                sym, pos = _next_symbol(x, d, lut, tab, words, pos, last)
                if write:
                    value = np.float32(sym) * sc[d] + of[d]
                    if to_bf16:
                        cache[layer, b, h, kv, pos_of[e + d]] = bf16_bits(value)
                    else:
                        cache[layer, b, h, kv, pos_of[e + d]] = value
        status[g] = 0 if _stream_ok(x, pos, end) else 1


def decode(
    words: np.ndarray,
    word_start: np.ndarray,
    states: np.ndarray,
    lut: np.ndarray,
    table_id: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    out: np.ndarray,
) -> None:
    """Same contract as :func:`kvcdn.kernels.rans.decode_ref`; ``out`` may be a strided view."""
    status = np.zeros(out.shape[0], dtype=np.uint8)
    parallel.run(_decode, out.shape[0], words, word_start, states, lut, table_id, scale, offset,
                 out, status)  # fmt: skip
    if status.any():
        raise RansError("rANS stream does not end where it should (corrupt payload)")


def decode_permuted(
    words: np.ndarray,
    word_start: np.ndarray,
    states: np.ndarray,
    lut: np.ndarray,
    table_id: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    tokens: int,
    into: PermutedBlocks,
) -> None:
    """:func:`decode` of ``tokens`` tokens of groups ``[L, 2, H]``, written into paged
    blocks instead of an array (:class:`~kvcdn.kernels.permuted.PermutedBlocks`:
    its tokens ``lo .. hi`` of these, rounded as it says). Values are written as they
    are decoded: a stream found corrupt at its end has written some."""
    G, D = states.shape
    heads = into.cache.shape[2]
    if G != into.cache.shape[0] * 2 * heads or into.cache.shape[4] % D:
        raise ValueError(f"{G} groups of {D} lanes do not fit cache {into.cache.shape}")
    into.check(tokens, D)
    status = np.zeros(G, dtype=np.uint8)
    parallel.run(
        _decode_permuted, G, words, word_start, states, lut, table_id, scale, offset, tokens, heads,
        into.cache, into.blocks, into.first, into.lo, into.hi, into.k_pos, into.v_pos,
        into.cache.dtype == np.uint16, status,
    )  # fmt: skip
    if status.any():
        raise RansError("rANS stream does not end where it should (corrupt payload)")


def warm_up() -> None:
    """Run the decoder once on a tiny stream, in the array layouts a reader passes
    (read-only words and states from a payload; a whole or sliced output), so
    that a process's first real decode does not pay for loading the compiled
    kernels from numba's cache (or compiling them)."""
    from .rans import build_decode_table, encode_ref, normalize_freqs

    G, T, D = 2, 4, 4
    freqs = normalize_freqs(np.arange(1, 13, dtype=np.float64))[None, :]
    sym = np.zeros((G, T, D), dtype=np.uint8)
    table_id = np.zeros((G, D), dtype=np.int32)
    states, words, word_start = encode_ref(sym, table_id, freqs)  # readers never encode
    payload = states.astype("<u4").tobytes() + words.astype("<u2").tobytes()
    states_ro = np.frombuffer(payload, dtype="<u4", count=G * D).reshape(G, D)
    words_ro = np.frombuffer(payload, dtype="<u2", offset=4 * G * D)
    lut = build_decode_table(freqs)
    scale = np.ones((G, D), dtype=np.float32)
    offset = np.zeros((G, D), dtype=np.float32)
    whole = np.empty((G, T, D), dtype=np.float32)
    sliced = np.empty((G, T + 1, D), dtype=np.float32)[:, 1:]  # after sink tokens
    for out in (whole, sliced):
        decode(words_ro, word_start, states_ro, lut, table_id, scale, offset, out)


def warm_up_permuted(into: PermutedBlocks) -> None:
    """:func:`warm_up` for :func:`decode_permuted` into ``into``'s cache (its array
    type: dtype and strides), and :func:`~kvcdn.kernels.paged_cpu.write_permuted` of
    float16 bits into it: zero tokens, nothing written."""
    from .paged_cpu import write_permuted

    layers, _, heads, _, _ = into.cache.shape
    groups, dim = layers * 2 * heads, into.dim
    empty = replace(into, lo=0, hi=0, tokens=0)
    payload = np.full(groups * dim, RANS_L, dtype="<u4").tobytes()  # streams that ended
    states = np.frombuffer(payload, dtype="<u4").reshape(groups, dim)
    words = np.frombuffer(b"", dtype="<u2")
    lut = np.zeros((1, 1 << PROB_BITS), dtype=np.uint32)
    table_id = np.zeros((groups, dim), dtype=np.int32)
    scale = np.ones((groups, dim), dtype=np.float32)
    decode_permuted(words, np.zeros(groups + 1, dtype=np.int64), states, lut, table_id, scale,
                    scale, 0, empty)  # fmt: skip
    # read-only, as payloads are
    write_permuted(np.frombuffer(b"", dtype="<u2").reshape(layers, 2, heads, 0, dim), empty)
