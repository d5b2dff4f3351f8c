"""Rows whose sizes are entropy estimates, not bitstreams: baselines and ablations.

* baselines (ideal empirical entropy per stream, plus the frequency tables at
  16 bits per non-zero bin, plus scales): CacheGen-style anchor/delta
  quantisation with 32/16/16 bins per layer band, and per-token asymmetric int4;
* ablations of the default level (ideal empirical entropy per stream, no table
  cost, sinks at 16 bits): the same quantiser with one design choice changed.
  ``default-est`` is the default level under that same estimator, the fair
  reference for them.

Their quality is real: each reconstruction is scored like the real rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .log import warn

if TYPE_CHECKING:
    import torch

    from .measure import Bench

GROUP_TOKENS = 10  # anchor spacing of the CacheGen-style rows
CACHEGEN_BINS = (32, 16, 16)  # quantisation bins of the three layer bands
TABLE_BITS_PER_BIN = 16  # what a per-document frequency table costs, per non-zero bin
BASELINE_ROWS = ("cachegen-32/16/16", "int4-token+entropy")
ABLATION_ROWS = ("default-est", "no-sinks", "no-fisher", "hadamard", "anchor-delta")

#: How each kind of row's size is obtained (written into the JSON result).
ESTIMATORS = {
    "real": "real container objects: 8 * bytes / elements; real encode and decode",
    "baseline": (
        "entropy estimate, not a bitstream: sum over streams (layer, K/V, head, channel) of "
        "the symbols' empirical entropy measured on the document itself, plus frequency "
        f"tables at {TABLE_BITS_PER_BIN} bits per non-zero bin, plus fp16 scales"
    ),
    "ablation": (
        "entropy estimate, not a bitstream: sum over streams (layer, K/V, head, channel) of "
        "the symbols' empirical entropy on the document (an ideal static table: no table "
        "cost), plus exact sinks at 16 bits; uniform quantiser x -> round((x-m)/step)*step+m "
        "without clipping"
    ),
}


# ---- estimators ------------------------------------------------------------------


def entropy_bits(sym: np.ndarray) -> tuple[float, int]:
    """Integer symbols ``[G, N, D]``, one stream per (g, d) -> (bits, non-zero bins).

    ``bits`` is the sum over streams of N times the stream's empirical entropy:
    what an ideal entropy coder with each stream's own exact frequencies spends.
    """
    sym = np.asarray(sym)
    G, N, D = sym.shape
    if sym.size == 0:
        return 0.0, 0
    lo, hi = int(sym.min()), int(sym.max())
    K = hi - lo + 1
    stream = (np.arange(G, dtype=np.int64)[:, None, None] * D + np.arange(D)[None, None, :]) * K
    keys = (sym.astype(np.int64) - lo + stream).ravel()
    if G * D * K <= 1 << 26:
        counts = np.bincount(keys, minlength=G * D * K)
        counts = counts[counts > 0]
    else:  # a few wild symbols (e.g. unprotected sinks): sort instead of a huge histogram
        counts = np.unique(keys, return_counts=True)[1]
    c = counts.astype(np.float64)
    bits = G * D * N * math.log2(N) - float((c * np.log2(c)).sum())
    return max(bits, 0.0), int(counts.size)


def anchor_map(tokens: int, chunk: int, skip: int) -> np.ndarray:
    """For each token ``t >= skip``: its anchor (the first token of its group of 10).

    Groups restart at every chunk boundary, as chunks are coded independently.
    """
    out = np.empty(tokens - skip, dtype=np.int64)
    for c0 in range(0, tokens, chunk):
        c1 = min(c0 + chunk, tokens)
        b = max(c0, skip)
        if b >= c1:
            continue
        t = np.arange(b, c1)
        out[b - skip : c1 - skip] = b + ((t - b) // GROUP_TOKENS) * GROUP_TOKENS
    return out


def hadamard(n: int) -> np.ndarray:
    """The orthonormal ``n x n`` Sylvester-Hadamard matrix (``n`` a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def fit_scale(
    evaluate: Callable[[float], tuple[float, Any]],
    scale: float,
    target: float,
    tol: float = 0.02,
    iters: int = 6,
) -> tuple[float, float, Any]:
    """Find ``scale`` whose bits per element (``evaluate(scale)[0]``) are about ``target``.

    Bits fall about one per doubling of a quantiser step; secant steps in log2.
    Returns (scale, bits, payload) of the closest try.
    """
    tried: list[tuple[float, float]] = []
    best: tuple[float, float, Any] | None = None
    for _ in range(iters):
        bpe, payload = evaluate(scale)
        tried.append((scale, bpe))
        if best is None or abs(bpe - target) < abs(best[1] - target):
            best = (scale, bpe, payload)  # keep only the closest payload (they are large)
        if abs(bpe - target) <= tol:
            break
        slope = -1.0
        if len(tried) >= 2:
            (s1, b1), (s2, b2) = tried[-2], tried[-1]
            if s1 != s2 and b1 != b2:
                slope = min((b2 - b1) / (math.log2(s2) - math.log2(s1)), -0.2)
        scale *= 2.0 ** ((target - bpe) / slope)
    assert best is not None
    return best


# ---- baselines -------------------------------------------------------------------


def baselines(bench: Bench, sample: Any) -> dict[str, dict[str, Any]]:
    """The rows of :data:`BASELINE_ROWS`, in that order."""
    return {
        "cachegen-32/16/16": cachegen(bench, sample)[0],
        "int4-token+entropy": int4_token(bench, sample)[0],
    }


def cachegen(bench: Bench, sample: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """CacheGen-style: anchors every 10 tokens, deltas from their reconstruction,
    32/16/16 bins per layer band spanning each channel's [min, max] in the chunk."""
    import torch

    kv = sample.kv
    L, two, H, T, D = kv.shape
    G = L * two * H
    band = [min(3 * layer // L, 2) for layer in range(L)]
    nb = torch.tensor([CACHEGEN_BINS[b] for b in band], dtype=torch.float32)
    nb = nb[:, None, None, None, None]

    def binq(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        lo = x.amin(3, keepdim=True).half().float()
        hi = x.amax(3, keepdim=True).half().float()
        w = (hi - lo) / nb
        w = torch.where(w > 0, w, torch.ones_like(w))
        q = torch.minimum(torch.floor((x - lo) / w).clamp_(min=0), nb - 1)
        return q, lo + (q + 0.5) * w, 2 * 16 * G * D  # (symbols, values, scale bits)

    amap = anchor_map(T, bench.chunk, 0)
    recon = torch.empty_like(kv)
    qa_all, qd_all, scale_bits = [], [], 0
    for a in range(0, T, bench.chunk):
        b = min(a + bench.chunk, T)
        t = np.arange(a, b)
        is_anchor = amap[a:b] == t
        anchors = torch.from_numpy(t[is_anchor])
        others = torch.from_numpy(t[~is_anchor])
        qa, ra, sb = binq(kv[:, :, :, anchors])
        recon[:, :, :, anchors] = ra
        scale_bits += sb
        qa_all.append(qa)
        if others.numel():
            ref = recon[:, :, :, torch.from_numpy(amap[t[~is_anchor]])]
            qd, rd, sb = binq(kv[:, :, :, others] - ref)
            recon[:, :, :, others] = ref + rd
            scale_bits += sb
            qd_all.append(qd)
    qa = torch.cat(qa_all, 3).reshape(G, -1, D).numpy().astype(np.int16)
    qd = torch.cat(qd_all, 3).reshape(G, -1, D).numpy().astype(np.int16)
    ha, na = entropy_bits(qa)
    hd, nd = entropy_bits(qd)
    hj, nj = entropy_bits(np.concatenate([qa, qd], axis=1))
    separate = ha + hd + TABLE_BITS_PER_BIN * (na + nd)
    joint = hj + TABLE_BITS_PER_BIN * nj
    tables = "separate anchor and delta tables" if separate <= joint else "one table"
    payload = min(separate, joint)
    n = kv.numel()
    row = {
        "bits_per_element": (payload + scale_bits) / n,
        **bench.quality(sample, recon),
        "encode_mb_s": None,
        "decode_mb_s": None,
        "estimate": True,
        "detail": {
            "symbols_bits_per_element": (ha + hd if separate <= joint else hj) / n,
            "tables_bits_per_element": TABLE_BITS_PER_BIN
            * ((na + nd) if separate <= joint else nj)
            / n,
            "scales_bits_per_element": scale_bits / n,
            "tables": f"per (layer, K/V, head, channel), {tables} (the cheaper)",
            "layer_bins": list(CACHEGEN_BINS),
        },
    }
    return row, recon


def int4_token(bench: Bench, sample: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """Per-token asymmetric int4 over head_dim, min/max scales, entropy-coded."""
    import torch

    kv = sample.kv
    L, two, H, T, D = kv.shape
    G = L * two * H
    mn = kv.amin(-1, keepdim=True).half().float()
    mx = kv.amax(-1, keepdim=True).half().float()
    step = (mx - mn) / 15.0
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((kv - mn) / step).clamp_(0, 15)
    recon = q * step + mn
    bits, nz = entropy_bits(q.reshape(G, T, D).numpy().astype(np.int16))
    n = kv.numel()
    scale_bits = 2 * 16 * G * T
    row = {
        "bits_per_element": (bits + TABLE_BITS_PER_BIN * nz + scale_bits) / n,
        **bench.quality(sample, recon),
        "encode_mb_s": None,
        "decode_mb_s": None,
        "estimate": True,
        "detail": {
            "symbols_bits_per_element": bits / n,
            "tables_bits_per_element": TABLE_BITS_PER_BIN * nz / n,
            "scales_bits_per_element": scale_bits / n,
        },
    }
    return row, recon


# ---- ablations of the default level -----------------------------------------------


def _uniform(
    x: torch.Tensor, step: torch.Tensor, mean: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    q = torch.round((x - mean) / step)
    return q, q * step + mean


def _ablation_row(
    bench: Bench, sample: Any, recon: torch.Tensor, bits: float, detail: dict[str, Any]
) -> dict[str, Any]:
    return {
        "bits_per_element": bits / sample.kv.numel(),
        **bench.quality(sample, recon),
        "encode_mb_s": None,
        "decode_mb_s": None,
        "estimate": True,
        "detail": detail,
    }


def _with_sinks(kv: torch.Tensor, body: torch.Tensor, sinks: int) -> torch.Tensor:
    out = kv.clone()
    out[:, :, :, sinks:] = body
    return out


def _sink_bits(kv: torch.Tensor, sinks: int) -> float:
    L, two, H, _, D = kv.shape
    return 16.0 * L * two * H * sinks * D


def _plain(
    bench: Bench, kv: torch.Tensor, step: torch.Tensor, sinks: int
) -> tuple[float, torch.Tensor]:
    """Uniform quantiser on tokens >= sinks; (bits, body reconstruction)."""
    L, two, H, T, D = kv.shape
    q, r = _uniform(kv[:, :, :, sinks:], step, bench.mean)
    bits, _ = entropy_bits(q.reshape(L * two * H, T - sinks, D).numpy().astype(np.int64))
    return bits + _sink_bits(kv, sinks), r


def _fit_eval(
    bench: Bench, kv: torch.Tensor, step: torch.Tensor, sinks: int
) -> tuple[float, tuple[float, torch.Tensor]]:
    bits, body = _plain(bench, kv, step, sinks)
    return bits / kv.numel(), (bits, body)


def ablations(bench: Bench, sample: Any, level: str = "default") -> dict[str, dict[str, Any]]:
    """The rows of :data:`ABLATION_ROWS` that apply (no-fisher needs ``bench.sd_cal``)."""
    import torch

    p = bench.profile
    kv = sample.kv
    L, two, H, T, D = kv.shape
    n = kv.numel()
    s = p.sinks
    step = torch.from_numpy(p.levels[level].step)[:, :, :, None, :]
    rows: dict[str, dict[str, Any]] = {}

    bits, body = _plain(bench, kv, step, s)
    target = bits / n
    rows["default-est"] = _ablation_row(
        bench,
        sample,
        _with_sinks(kv, body, s),
        bits,
        {"what": f"the {level} level's quantiser, sinks exact (the reference for ablations)"},
    )

    bits, recon = _plain(bench, kv, step, 0)
    rows["no-sinks"] = _ablation_row(
        bench, sample, recon, bits, {"what": f"the {level} level's steps on every token, no sinks"}
    )

    if bench.sd_cal is not None:
        sd = torch.from_numpy(np.maximum(bench.sd_cal, 1e-6).astype(np.float32))
        sd = sd[:, :, :, None, :]
        start = math.exp(float(torch.log(step).mean() - torch.log(sd).mean()))
        strength, bpe, (bits, body) = fit_scale(
            lambda c: _fit_eval(bench, kv, c * sd, s), start, target
        )
        rows["no-fisher"] = _ablation_row(
            bench,
            sample,
            _with_sinks(kv, body, s),
            bits,
            {
                "what": "step = strength * calibrated sd per channel (no Fisher weighting)",
                "strength": strength,
                "bits_target": target,
            },
        )

    if D & (D - 1) == 0:
        rows["hadamard"] = _hadamard(bench, sample, step, target)
    else:
        warn(f"head_dim {D} is not a power of two: no hadamard ablation")

    rows["anchor-delta"] = _anchor_delta(bench, sample, step)
    return rows


def _hadamard(bench: Bench, sample: Any, step: torch.Tensor, target: float) -> dict[str, Any]:
    import torch

    kv = sample.kv
    L, two, H, T, D = kv.shape
    s = bench.profile.sinks
    had = torch.from_numpy(hadamard(D))
    rot = (kv[:, :, :, s:] - bench.mean) @ had  # rows times an orthonormal, symmetric H
    # Fisher steps do not survive the rotation: one step per (layer, K/V), at the
    # geometric mean of the level's steps there, times a global factor fitted to bits.
    base = torch.exp(torch.log(step).mean(dim=(2, 4), keepdim=True))

    def evaluate(c: float) -> tuple[float, tuple[float, torch.Tensor]]:
        q, r = _uniform(rot, c * base, 0.0)
        bits, _ = entropy_bits(q.reshape(L * two * H, T - s, D).numpy().astype(np.int64))
        bits += _sink_bits(kv, s)
        return bits / kv.numel(), (bits, r)

    factor, _, (bits, r) = fit_scale(evaluate, 1.0, target)
    body = r @ had + bench.mean
    return _ablation_row(
        bench,
        sample,
        _with_sinks(kv, body, s),
        bits,
        {
            "what": "head_dim rotated by a normalised Hadamard; one step per (layer, K/V)",
            "factor": factor,
            "bits_target": target,
        },
    )


def _anchor_delta(bench: Bench, sample: Any, step: torch.Tensor) -> dict[str, Any]:
    import torch

    kv = sample.kv
    L, two, H, T, D = kv.shape
    G = L * two * H
    s = bench.profile.sinks
    amap = anchor_map(T, bench.chunk, s)
    t = np.arange(s, T)
    is_anchor = amap == t
    anchors = torch.from_numpy(t[is_anchor])
    others = torch.from_numpy(t[~is_anchor])
    recon = kv.clone()
    qa, ra = _uniform(kv[:, :, :, anchors], step, bench.mean)
    recon[:, :, :, anchors] = ra
    ref = recon[:, :, :, torch.from_numpy(amap[~is_anchor])]
    qd, rd = _uniform(kv[:, :, :, others] - ref, step, 0.0)
    recon[:, :, :, others] = ref + rd
    ha, _ = entropy_bits(qa.reshape(G, -1, D).numpy().astype(np.int64))
    hd, _ = entropy_bits(qd.reshape(G, -1, D).numpy().astype(np.int64))
    n = kv.numel()
    return _ablation_row(
        bench,
        sample,
        recon,
        ha + hd + _sink_bits(kv, s),
        {
            "what": "the level's steps on anchors (every 10 tokens per chunk) and on "
            "deltas from the anchor's reconstruction; separate anchor/delta streams",
            "anchor_bits_per_element": ha / n,
            "delta_bits_per_element": hd / n,
        },
    )
