"""GPU decoder of the nested ladder's tiers (Triton): the contract and the bits of
:func:`kvcdn.kernels.nested.decode`, into a torch tensor on the device.

Design. One program decodes ``BLOCK_G`` groups; a group's ``STATES`` interleaved
rANS states are one row of a ``[BLOCK_G, STATES]`` block, so a step decodes the next
``STATES`` coded lanes of each group at once. Renormalising states take their words in
lane order (an exclusive prefix sum along the row), as :mod:`kvcdn.kernels.rans_triton`
does for its lanes.

Each tier runs in a program of its own, all of a chunk's tiers at once, token by
token: a tier's states stay in registers for the whole tier, and a refinement reads
its parent index from a scratch ``[G, T, D]`` of int32 that the tier below wrote. A
tier's program publishes how many tokens it has finished (a release store, after a
barrier of its threads), and the tier above waits for token ``t`` before it reads
token ``t``'s parents (an acquire load, then volatile reads). A chunk's decode is a
chain of dependent loads four states wide (the format's), so one chunk takes the time
of its longest tier, not the sum of its tiers. The CPU kernel goes token-major
instead (its indices stay in cache); the symbols, and so the values, are the same.

The top tier's program writes each token's values once it is decoded, ``mean +
float32(n) * scale`` with ``scale =
float32(3 ** (top - depth[k])) * fine`` computed on the host as the CPU kernel does
(both products exact, one rounding at the addition), then rounded to ``out``'s dtype as
torch's ``.to`` does (bfloat16 by hand: the interpreter's cast truncates).

A symbol's table depends on the same lane's symbol at the previous token (its base
index for the base): each tier's program keeps them in a scratch ``[R, G, D]`` of its
own, read and rewritten by the thread that decodes the lane (the barrier after each
token orders them).

Corrupt streams: a read at or past the end of a group's tier is not made (the state
takes a zero word) and flags the group, as does a tier not ending where it should or a
final state other than ``L``; :func:`decode` raises :class:`RansError` (one sync).

Imports without Triton; :func:`available` says whether the GPU path can run, and
``TRITON_INTERPRET=1`` (set before Triton is first imported) runs it on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .nested import STATES, check_stride
from .rans import PROB_BITS, PROB_SCALE, RANS_L, RansError
from .rans_triton import array_to_device, available

try:  # the module must import (and report unavailable) where Triton is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

if triton is not None:
    from .rans_triton import store_rounded

__all__ = ["Tables", "available", "decode", "decode_with", "tables", "warm_up"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_G = 8  # groups a program: 8 x 4 states is one warp's 32 lanes


if triton is not None:

    @triton.jit
    def _renormalise(v, need, pos, end, words_ptr, bad):
        """States ``v`` that fell below L take the next word of their group's stream,
        in lane order; a read past the end is not made and flags the group."""
        need_i = need.to(tl.int32)
        idx = pos[:, None] + (tl.cumsum(need_i, axis=1) - need_i)
        inside = idx < end[:, None]
        w = tl.load(words_ptr + idx, mask=need & inside, other=0).to(tl.int32) & 0xFFFF
        bad = bad | tl.max((need & (idx >= end[:, None])).to(tl.int32), axis=1)
        return tl.where(need, (v << 16) | w.to(tl.uint32), v), pos + tl.sum(need_i, axis=1), bad

    # Sizes that vary from chunk to chunk are not specialised on (Triton compiles a
    # kernel for each value of 1 and each divisibility by 16): one compilation an
    # output dtype and width, which warm_up makes ahead of the first chunk.
    @triton.jit(do_not_specialize=["K", "G", "T", "NB", "CUM_STRIDE", "CONTEXT_STRIDE", "stride_og",
                                   "stride_ot"])  # fmt: skip
    def _decode_kernel(
        words_ptr, wbeg_ptr, wend_ptr, states_ptr, lut_ptr, cum_ptr, lanes_ptr, m_ptr,
        lo_ptr, base_ptr, refine_ptr, scale_ptr, mean_ptr, n_ptr, prev_ptr, out_ptr, err_ptr,
        done_ptr,
        K, G, T, D, NB, CUM_STRIDE, CONTEXT_STRIDE, stride_og, stride_ot, stride_od,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, N_STATES: tl.constexpr,
        PROB_BITS_C: tl.constexpr, RANS_L_C: tl.constexpr, OUT_BF16: tl.constexpr,
    ):  # fmt: skip
        # Program r * NB + b decodes tier r of group block b: lower tiers have lower
        # program ids, so a program waiting for the tier below waits for one already
        # started (or done), never for one not yet scheduled.
        pid = tl.program_id(0)
        r = pid // NB
        blk = pid % NB
        gv = blk.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        live_g = gv < G
        g2 = gv[:, None]
        lane = tl.arange(0, N_STATES)[None, :]
        live = live_g[:, None] & (lane < N_STATES)
        bad = tl.zeros([BLOCK_G], dtype=tl.int32)
        slot_mask = (1 << PROB_BITS_C) - 1
        scale_full = 1 << PROB_BITS_C
        dv = tl.arange(0, BLOCK_D)[None, :]
        live_d = live_g[:, None] & (dv < D)
        scale = tl.load(scale_ptr + g2 * D + dv, mask=live_d, other=0.0)
        mean = tl.load(mean_ptr + g2 * D + dv, mask=live_d, other=0.0)
        out_row = out_ptr + g2 * stride_og + dv * stride_od

        x = tl.load(states_ptr + (r * G + g2) * N_STATES + lane, mask=live, other=RANS_L_C)
        x = tl.cast(x, tl.uint32, bitcast=True)
        pos = tl.load(wbeg_ptr + r * G + gv, mask=live_g, other=0)
        end = tl.load(wend_ptr + r * G + gv, mask=live_g, other=0)
        m1 = tl.load(m_ptr + r * G + gv, mask=live_g, other=0)
        m = m1[:, None]
        steps = tl.cdiv(tl.max(m1, axis=0), N_STATES)
        below = done_ptr + (r - 1) * NB + blk  # tokens the tier below has finished
        for t in range(T):
            if r > 0:  # the parents of token t are the tier below's: wait for them
                finished = tl.atomic_add(below, 0, sem="acquire")
                while finished <= t:
                    finished = tl.atomic_add(below, 0, sem="acquire")
            for step in range(steps):
                q = step * N_STATES + lane
                act = live & (q < m)
                d = tl.load(lanes_ptr + (r * G + g2) * D + q, mask=act, other=0)
                at = (g2 * T + t) * D + d
                slot = x & slot_mask
                # the lane's symbol (base: index) at the previous token, this tier's own
                before = prev_ptr + (r * G + g2) * D + d
                p_prev = tl.load(before, mask=act, other=0)
                if r == 0:  # the base: a symbol of the lane's table, from the LUT
                    ctx = 1 + (p_prev > 0).to(tl.int32) - (p_prev < 0).to(tl.int32)
                    tab = tl.load(base_ptr + g2 * D + d, mask=act, other=0) + ctx * CONTEXT_STRIDE
                    tab = tab.to(tl.int64)
                    e = tl.load(lut_ptr + (tab << PROB_BITS_C) + slot, mask=act, other=0)
                    e = tl.cast(e, tl.uint32, bitcast=True)
                    v = (((e >> 8) & 0xFFF) + 1) * (x >> PROB_BITS_C) + (e >> 20)
                    low = tl.load(lo_ptr + g2 * D + d, mask=act, other=0)
                    n = (e & 0xFF).to(tl.int32) + low
                    tl.store(before, n, mask=act)
                else:  # a refinement: a ternary symbol, in context 3 min(|parent|, 2) + prev
                    # (volatile: the program of the tier below wrote it)
                    parent = tl.load(n_ptr + at, mask=act, other=0, volatile=True)
                    a = tl.abs(parent)
                    ctx = (a != 0).to(tl.int32) + (a > 1).to(tl.int32)
                    tab = tl.load(refine_ptr + (((r - 1) * 3 + ctx) * G + g2) * D + d,
                                  mask=act, other=0) + p_prev * CONTEXT_STRIDE  # fmt: skip
                    tab = tab.to(tl.int64)
                    c1 = tl.load(cum_ptr + tab * CUM_STRIDE + 1, mask=act, other=0)
                    c2 = tl.load(cum_ptr + tab * CUM_STRIDE + 2, mask=act, other=0)
                    c1 = tl.cast(c1, tl.uint32, bitcast=True)
                    c2 = tl.cast(c2, tl.uint32, bitcast=True)
                    s = (slot >= c1).to(tl.uint32) + (slot >= c2).to(tl.uint32)
                    start = tl.where(s == 0, 0, tl.where(s == 1, c1, c2))
                    freq = tl.where(s == 0, c1, tl.where(s == 1, c2 - c1, scale_full - c2))
                    v = freq * (x >> PROB_BITS_C) + slot - start
                    tl.store(before, s.to(tl.int32), mask=act)
                    sign = tl.where(parent < 0, -1, 1)  # counted from the mean's side
                    n = 3 * parent + (s.to(tl.int32) - 1) * sign
                tl.store(n_ptr + at, n, mask=act)
                v = tl.where(act, v, x)
                x, pos, bad = _renormalise(v, act & (v < RANS_L_C), pos, end, words_ptr, bad)
            tl.debug_barrier()  # every thread's indices of token t are written
            if r < K:  # the tier above may take token t now
                tl.atomic_xchg(done_ptr + r * NB + blk, t + 1, sem="release")
            else:  # the top tier: token t's values
                nt = tl.load(n_ptr + (g2 * T + t) * D + dv, mask=live_d, other=0, volatile=True)
                val = nt.to(tl.float32) * scale
                val = val + mean
                store_rounded(out_row, val, live_d, OUT_BF16)
                out_row += stride_ot
        bad = bad | tl.max((live & (x != RANS_L_C)).to(tl.int32), axis=1)
        bad = bad | (live_g & (pos != end)).to(tl.int32)
        tl.store(err_ptr + r * G + gv, bad, mask=live_g)


def coded_lanes(depth: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each tier's coded lanes per group, in order: ``lanes [k + 1, G, D]`` (the first
    ``m[r, g]`` of a row are tier ``r``'s, every lane for the base) and ``m [k + 1, G]``."""
    R, G, D = k + 1, depth.shape[1], depth.shape[2]
    coded = np.ones((R, G, D), dtype=bool)
    coded[1:] = depth[1:R] != depth[: R - 1]
    lanes = np.argsort(~coded, axis=2, kind="stable").astype(np.int32)
    return lanes, coded.sum(axis=2).astype(np.int32)


@dataclass(frozen=True)
class Tables:
    """What the decoder takes that is the same for every chunk: the tables and each
    group's lanes and values for tiers ``0..k``, on one device (:func:`tables`)."""

    k: int
    groups: int
    dim: int
    lut: torch.Tensor
    cum: torch.Tensor
    lanes: torch.Tensor
    m: torch.Tensor
    lo: torch.Tensor
    base: torch.Tensor
    refine: torch.Tensor
    scale: torch.Tensor
    mean: torch.Tensor
    stride: int  # 1 where the tables depend on the previous token (kernels.nested)


def tables(
    k: int, lut: np.ndarray | torch.Tensor, cum: np.ndarray, mean: np.ndarray,
    fine: np.ndarray, depth: np.ndarray, lo: np.ndarray, base_tid: np.ndarray,
    refine_tid: np.ndarray, stride: int, device: str | torch.device,
) -> Tables:  # fmt: skip
    """The arguments of :func:`kvcdn.kernels.nested.decode` that do not change from
    chunk to chunk, for tiers ``0..k``, copied to ``device``, where a caller can keep
    them for the chunks it decodes there (``lut`` may be there already: an int32
    tensor that several tables share)."""
    if lut.shape[-1] != PROB_SCALE or depth.shape[0] <= k:
        raise ValueError(f"lut must be [n_tables, {PROB_SCALE}] and depth name tier {k}")
    G, D = mean.shape
    depth = np.asarray(depth, dtype=np.int64)
    lanes, m = coded_lanes(depth, k)
    # The CPU kernel's scale, in the same float32 operations (exact: see the docstring).
    scale = (3 ** (depth[-1] - depth[k])).astype(np.float32) * fine.astype(np.float32)

    def put(a: np.ndarray, dtype: type, view: type | None = None) -> torch.Tensor:
        return array_to_device(a, dtype, device, view)

    refine = refine_tid[:k] if k else np.zeros((1, 3, G, D), dtype=np.int32)
    return Tables(k, G, D, put(lut.reshape(-1), np.uint32, np.int32), put(cum, np.uint32, np.int32),
                  put(lanes, np.int32), put(m, np.int32), put(lo, np.int32),
                  put(base_tid, np.int32), put(refine, np.int32), put(scale, np.float32),
                  put(mean, np.float32), check_stride(stride))  # fmt: skip


def decode(
    k: int, words: np.ndarray, wbeg: np.ndarray, wend: np.ndarray, states: np.ndarray,
    lut: np.ndarray, cum: np.ndarray, mean: np.ndarray, fine: np.ndarray, depth: np.ndarray,
    lo: np.ndarray, base_tid: np.ndarray, refine_tid: np.ndarray, stride: int,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """Tiers ``0..k`` of every group into ``out [G, T, D]`` (float32, float16 or
    bfloat16, any strides, on the device the kernel runs on): the arguments of
    :func:`kvcdn.kernels.nested.decode`, as numpy arrays, which this copies to
    ``out``'s device. Raises :class:`RansError` on a corrupt stream (``out`` is then
    partly written)."""
    if triton is None:
        raise RuntimeError("kvcdn.kernels.nested_triton needs triton")
    _check(k, words, wbeg, wend, states, out)
    t = tables(k, lut, cum, mean, fine, depth, lo, base_tid, refine_tid, stride, out.device)
    decode_with(t, words, wbeg, wend, states, out)


def _check(k: int, words: np.ndarray, wbeg: np.ndarray, wend: np.ndarray,
           states: np.ndarray, out: torch.Tensor) -> None:  # fmt: skip
    if out.dim() != 3 or out.dtype not in _OUT_DTYPES:
        raise ValueError("out must be a float32, float16 or bfloat16 tensor [G, T, D]")
    if not len(words) or np.any(wbeg > wend) or np.any(wend > len(words)) or np.any(wbeg < 0):
        raise ValueError("stream bounds outside the words")
    if wbeg.shape[0] < k + 1 or states.shape[:2] != wbeg.shape or states.shape[2] != STATES:
        raise ValueError(f"tiers 0..{k} need stream bounds and states for each")


def decode_with(
    t: Tables, words: np.ndarray, wbeg: np.ndarray, wend: np.ndarray, states: np.ndarray,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """:func:`decode` of a chunk's streams with its tiers' :func:`tables`, already on
    ``out``'s device."""
    if triton is None:
        raise RuntimeError("kvcdn.kernels.nested_triton needs triton")
    _check(t.k, words, wbeg, wend, states, out)
    G, T, D = out.shape
    R = t.k + 1
    if (G, D) != (t.groups, t.dim) or t.lut.device != out.device:
        raise ValueError(f"tables of {t.groups} groups of {t.dim} on {t.lut.device}, "
                         f"out {G} of {D} on {out.device}")  # fmt: skip
    if G == 0 or T == 0:
        return
    dev = out.device

    def put(a: np.ndarray, dtype: type, view: type | None = None) -> torch.Tensor:
        return array_to_device(a, dtype, dev, view)

    n = torch.empty((G, T, D), dtype=torch.int32, device=dev)
    prev = torch.ones((R, G, D), dtype=torch.int32, device=dev)  # before the first token
    prev[0] = 0
    err = torch.zeros(R * G, dtype=torch.int32, device=dev)
    nb = triton.cdiv(G, _BLOCK_G)
    done = torch.zeros(R * nb, dtype=torch.int32, device=dev)  # tokens each tier finished
    _decode_kernel[(R * nb,)](
        put(words, np.uint16, np.int16), put(wbeg[:R], np.int64), put(wend[:R], np.int64),
        put(states[:R], np.uint32, np.int32), t.lut, t.cum, t.lanes, t.m, t.lo, t.base,
        t.refine, t.scale, t.mean, n, prev, out, err, done,
        t.k, G, T, D, nb, t.cum.stride(0), t.stride, out.stride(0), out.stride(1),
        out.stride(2),
        BLOCK_G=_BLOCK_G, BLOCK_D=triton.next_power_of_2(D), N_STATES=STATES,
        PROB_BITS_C=PROB_BITS, RANS_L_C=RANS_L, OUT_BF16=out.dtype == torch.bfloat16,
        enable_fp_fusion=False,  # multiply, then add (exact either way: see the docstring)
    )  # fmt: skip
    bad = torch.nonzero(err).flatten()
    if bad.numel():
        raise RansError(f"group {int(bad[0]) % G}: its rANS stream does not end where it "
                        "should")  # fmt: skip


def warm_up(device: str | torch.device, dtype: torch.dtype, dim: int) -> None:
    """Compile (or load from Triton's cache) the decoder for ``dtype`` outputs of ``dim``
    channels on ``device``, so that a process's first chunk does not wait for it. The
    stream is made up and fails its end check, which is expected."""
    from .rans import build_decode_table, cumulative

    G, T = 2, 1
    freqs = np.zeros((2, 12), dtype=np.uint32)
    freqs[0, :4] = 1024  # a base table of 4 symbols
    freqs[1, :3] = (1366, 1365, 1365)  # a ternary refinement table
    zeros = np.zeros((G, dim), dtype=np.int64)
    depth = np.zeros((2, G, dim), dtype=np.int64)
    depth[1] = 1
    bounds = np.zeros((2, G), dtype=np.int64)
    states = np.full((2, G, STATES), RANS_L, dtype=np.uint32)
    out = torch.empty((G, T + 1, dim), dtype=dtype, device=device)[:, 1:]
    try:
        decode(1, np.zeros(4, dtype=np.uint16), bounds, bounds, states,
               build_decode_table(freqs), cumulative(freqs), zeros.astype(np.float32),
               np.ones((G, dim), dtype=np.float32), depth, zeros, zeros,
               np.ones((1, 3, G, dim), dtype=np.int64), 0, out)  # fmt: skip
    except RansError:
        pass
