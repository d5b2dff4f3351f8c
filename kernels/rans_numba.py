"""CPU kernels for the interleaved rANS of :mod:`kvcdn.kernels.rans` (numba).

Same inputs, outputs and bit-exact results as the numpy reference; groups
run in parallel (``prange``), and dequantisation is fused into the decode
loop, writing each value straight into the output view.

Bit-exactness of the fused dequantisation: ``sym * scale`` is exact in
float32 because codec profiles keep every scale to 4 significant bits
(``sym`` has 8), so each value is rounded exactly once, at the addition,
whatever the hardware does with a multiply-add.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

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


@njit(parallel=True, cache=True, nogil=True)
def _encode(sym, table_id, freqs, starts, scratch, lengths):  # pragma: no cover - jitted
    G, T, D = sym.shape
    states = np.empty((G, D), dtype=np.uint32)
    for g in prange(G):
        lengths[g] = _encode_group(sym[g], table_id[g], freqs, starts, scratch[g], states[g])
    return states


@njit(parallel=True, cache=True, nogil=True)
def _gather_words(scratch, lengths, word_start, words):  # pragma: no cover - jitted
    for g in prange(scratch.shape[0]):
        n = lengths[g]
        base = word_start[g]
        for i in range(n):
            words[base + i] = scratch[g, n - 1 - i]


def _concatenate(scratch: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-group scratch words (in encoder order) -> (``words``, ``word_start``)."""
    word_start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=word_start[1:])
    words = np.empty(int(word_start[-1]), dtype=np.uint16)
    _gather_words(scratch, lengths, word_start, words)
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
    states = _encode(sym, tid, freqs32, cumulative(freqs32), scratch, lengths)
    return (states, *_concatenate(scratch, lengths))


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _quantise_encode(
    x, mean, step, lo, size, table_id, freqs, starts, scratch, lengths
):  # pragma: no cover
    G, T, D = x.shape
    states = np.empty((G, D), dtype=np.uint32)
    for g in prange(G):
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
    return states


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
    states = _quantise_encode(
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
    )
    return (states, *_concatenate(scratch, lengths))


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _decode(
    words, word_start, states, lut, table_id, scale, offset, out, status
):  # pragma: no cover
    G, T, D = out.shape
    for g in prange(G):
        x = np.empty(D, dtype=np.uint32)
        for d in range(D):
            x[d] = states[g, d]
        pos = word_start[g]
        end = word_start[g + 1]
        last = max(end - 1, 0)
        bad = False
        for t in range(T):
            for d in range(D):
                xd = x[d]
                e = lut[table_id[g, d], xd & np.uint32(_MASK)]
                xd = ((e >> np.uint32(8)) & np.uint32(0xFFF)) + np.uint32(1)
                xd = xd * (x[d] >> np.uint32(PROB_BITS)) + (e >> np.uint32(20))
                # Branch-free renormalisation: whether a lane needs a word is
                # data-dependent and unpredictable, so select instead of branch.
                # The read index is clamped to the group's words (a corrupt
                # stream cannot read outside them); overruns show as pos > end.
                w = np.uint32(words[min(pos, last)]) if words.size else np.uint32(0)
                need = xd < np.uint32(RANS_L)
                x[d] = (xd << np.uint32(16)) | w if need else xd
                pos += 1 if need else 0
                out[g, t, d] = np.float32(e & np.uint32(0xFF)) * scale[g, d] + offset[g, d]
        if pos != end:
            bad = True
        for d in range(D):
            if x[d] != np.uint32(RANS_L):
                bad = True
        status[g] = 1 if bad else 0


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
    _decode(words, word_start, states, lut, table_id, scale, offset, out, status)
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
