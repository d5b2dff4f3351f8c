"""Interleaved rANS: static 12-bit tables, 32-bit state, 16-bit renormalisation.

This module is the reference: plain numpy, written for clarity, and the
specification the numba (:mod:`kvcdn.kernels.rans_numba`) and Triton
(:mod:`kvcdn.kernels.rans_triton`) kernels must match bit for bit.

Shapes. A chunk's symbols are ``sym [G, T, D]`` (uint8): ``G`` groups (one per
layer, K/V and head), ``T`` tokens, ``D`` lanes (one per head-dim channel).
Every (group, lane) is its own rANS stream with its own state and its own
table (``table_id [G, D]``); the ``D`` streams of a group are *interleaved*:
they share one buffer of 16-bit words, consumed in the order
``(t=0, d=0), (t=0, d=1), ..., (t=T-1, d=D-1)``. Groups are independent, so a
decoder runs groups in parallel and lanes in SIMD.

Coding (ryg_rans conventions): ``L = 2**16``; a state lives in ``[L, 2**32)``.
Decoding a symbol from state ``x``: ``slot = x & 4095``; the table gives the
symbol ``s`` whose range ``[start_s, start_s + freq_s)`` holds ``slot``;
``x = freq_s * (x >> 12) + slot - start_s``; if ``x < L``, ``x = (x << 16) |
next_word``. The encoder runs in exact reverse order, starting every state at
``L``, so a correct decode ends every state at ``L`` again: that is checked.

A packed decode table entry (uint32, one per slot) holds
``symbol | (freq - 1) << 8 | (slot - start) << 20``: one load per symbol.
"""

from __future__ import annotations

import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
MAX_SYMBOLS = 256  # symbols are uint8


class RansError(ValueError):
    """A table or stream that cannot be coded or decoded."""


def normalize_freqs(counts: np.ndarray) -> np.ndarray:
    """Counts of each symbol -> frequencies summing to ``PROB_SCALE``, each at least 1.

    Every symbol in the table's range keeps a non-zero frequency so that any
    symbol the quantiser can emit is encodable. Rounding is deterministic.
    """
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.shape[0]
    if not 1 <= n <= MAX_SYMBOLS:
        raise RansError(f"a table needs 1 to {MAX_SYMBOLS} symbols, got {n}")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise RansError("counts must be finite and non-negative")
    total = counts.sum()
    probs = counts / total if total > 0 else np.full(n, 1.0 / n)
    freqs = np.maximum(1, np.floor(probs * (PROB_SCALE - n)).astype(np.int64) + 1)
    # Hand out (or take back) the rounding remainder, largest frequencies first.
    diff = PROB_SCALE - int(freqs.sum())
    order = np.argsort(-freqs, kind="stable")
    i = 0
    while diff != 0:
        j = order[i % n]
        if diff > 0:
            freqs[j] += 1
            diff -= 1
        elif freqs[j] > 1:
            freqs[j] -= 1
            diff += 1
        i += 1
    return freqs.astype(np.uint32)


def check_freqs(freqs: np.ndarray) -> None:
    """Raise :class:`RansError` unless ``freqs [n_tables, n]`` is a valid table set."""
    freqs = np.asarray(freqs)
    if freqs.ndim != 2 or not 1 <= freqs.shape[1] <= MAX_SYMBOLS:
        raise RansError(f"frequency tables must be [n_tables, <= {MAX_SYMBOLS}]")
    if np.any(freqs.sum(axis=1, dtype=np.int64) != PROB_SCALE):
        raise RansError(f"every frequency table must sum to {PROB_SCALE}")
    if np.any(freqs > PROB_SCALE):
        raise RansError("frequency out of range")


def cumulative(freqs: np.ndarray) -> np.ndarray:
    """``freqs [n_tables, n]`` -> starts ``[n_tables, n]`` (exclusive prefix sums)."""
    freqs = np.asarray(freqs, dtype=np.uint32)
    starts = np.zeros_like(freqs)
    starts[:, 1:] = np.cumsum(freqs, axis=1)[:, :-1]
    return starts


def build_decode_table(freqs: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """``freqs [n_tables, n]`` -> packed decode entries ``[n_tables, 4096]`` (uint32);
    with ``rows``, only those tables' entries (the others stay 0, and untouched pages
    of the zeroed array take no memory): for profiles whose ternary tables are never
    decoded through the LUT."""
    check_freqs(freqs)
    freqs = np.asarray(freqs, dtype=np.uint32)
    starts = cumulative(freqs)
    n_tables, n = freqs.shape
    lut = np.zeros((n_tables, PROB_SCALE), dtype=np.uint32)
    slots = np.arange(PROB_SCALE, dtype=np.uint32)
    for t in range(n_tables) if rows is None else np.unique(rows):
        sym = np.repeat(np.arange(n, dtype=np.uint32), freqs[t])  # zero-frequency symbols vanish
        start = starts[t][sym]
        lut[t] = sym | ((freqs[t][sym] - 1) << 8) | ((slots - start) << 20)
    return lut


def encode_ref(
    sym: np.ndarray, table_id: np.ndarray, freqs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode ``sym [G, T, D]`` -> (``states [G, D]``, ``words``, ``word_start [G+1]``).

    States are uint32, words uint16.

    ``words[word_start[g]:word_start[g+1]]`` is group ``g``'s buffer, in the
    order the decoder reads it.
    """
    sym = np.asarray(sym, dtype=np.uint8)
    G, T, D = sym.shape
    freqs = np.asarray(freqs, dtype=np.uint64)
    starts = cumulative(freqs).astype(np.uint64)
    table_id = np.asarray(table_id, dtype=np.int64)
    f = freqs[table_id[:, None, :], sym]  # [G, T, D]
    if np.any(f == 0):
        raise RansError("a symbol has zero frequency in its table")
    s = starts[table_id[:, None, :], sym]
    states = np.full((G, D), RANS_L, dtype=np.uint64)
    out: list[list[int]] = [[] for _ in range(G)]
    for t in range(T - 1, -1, -1):
        for d in range(D - 1, -1, -1):
            x = states[:, d]
            fd = f[:, t, d]
            x_max = ((RANS_L >> PROB_BITS) << 16) * fd
            emit = x >= x_max
            for g in np.nonzero(emit)[0]:
                out[g].append(int(x[g] & 0xFFFF))
            x = np.where(emit, x >> 16, x)
            states[:, d] = ((x // fd) << PROB_BITS) + (x % fd) + s[:, t, d]
    word_start = np.zeros(G + 1, dtype=np.int64)
    word_start[1:] = np.cumsum([len(w) for w in out])
    words = np.array([w for g in range(G) for w in reversed(out[g])], dtype=np.uint16)
    return states.astype(np.uint32), words, word_start


def decode_ref(
    words: np.ndarray,
    word_start: np.ndarray,
    states: np.ndarray,
    lut: np.ndarray,
    table_id: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    out: np.ndarray,
) -> None:
    """Decode into ``out [G, T, D]`` (float32, may be a strided view): ``sym * scale + offset``.

    Raises :class:`RansError` when a group reads past its buffer, leaves
    words unread, or does not end every state at ``L``.
    """
    G, T, D = out.shape
    x = np.asarray(states, dtype=np.uint64).copy()
    pos = np.asarray(word_start[:-1], dtype=np.int64).copy()
    end = np.asarray(word_start[1:], dtype=np.int64)
    words = np.asarray(words, dtype=np.uint64)
    lut = np.asarray(lut)
    tid = np.asarray(table_id, dtype=np.int64)
    for t in range(T):
        for d in range(D):
            e = lut[tid[:, d], x[:, d] & (PROB_SCALE - 1)].astype(np.uint64)
            s = e & 0xFF
            xd = (((e >> 8) & 0xFFF) + 1) * (x[:, d] >> PROB_BITS) + (e >> 20)
            need = xd < RANS_L
            if np.any(pos[need] >= end[need]):
                raise RansError("rANS stream overrun")
            w = words[np.where(need, pos, 0)] if words.size else np.zeros(G, np.uint64)
            x[:, d] = np.where(need, (xd << 16) | w, xd)
            pos += need
            out[:, t, d] = s.astype(np.float32) * scale[:, d] + offset[:, d]
    if np.any(pos != end) or np.any(x != RANS_L):
        raise RansError("rANS stream does not end where it should (corrupt payload)")
