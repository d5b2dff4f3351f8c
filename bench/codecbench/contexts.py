"""What the nested ladder's symbols cost with the previous token as context, and without.

This is the study the codec's contexts were chosen by (2026-11-28). Before, the nested
codec coded each symbol with a static table chosen by the stream's spread class (the
base) or by spread class and the parent cell (a refinement): no symbol's table
depended on the token before it. Adjacent tokens are correlated in some channels
(the lag-1 correlation of the embedded model's streams, mean removed, has quartiles
0.13, 0.31 and 0.54 on the calibration texts), so a table chosen by the previous
token's symbol could cost less. This measures how much, with tables as a profile
would hold them (built on the calibration texts, rounded to the coder's 4,096-slot
frequencies) and applied to held-out documents: the code length of every tier's
symbols, tokens after the sinks, in both schemes:

* ``today`` (the key keeps its first name): what the codec did before (a
  base table per spread class (sd / step, thirds of an octave), a refinement table per
  tier, spread class and parent context);
* ``previous``, about what the codec does now (``kvcdn.calibrate``): a base table per
  spread class (halves of an octave), lag-1 correlation (above or below the
  calibration median) and the previous token's base index clipped to ``-1..1``; a
  refinement table per tier, spread class, parent context
  and the previous token's symbol of the same tier and stream.

Then, for the base alone, what other contexts would add to the previous token's (the
codec's since 2026-11-28), each with the ``previous`` scheme's classes: the previous
index clipped to ``-2..2`` instead of ``-1..1``; the sign of the index two tokens back;
the magnitude (0, 1, 2 or more) of the same token's previous channel; and of the
channel that RoPE rotates with this one (``d - D/2``, decoded before it in the token).

Also the channel decorrelation bound: per (layer, K/V, head), the high-resolution
coding gain of a KLT over its channels, ``(mean log2 var - mean log2 eigenvalue) / 2``
bits per element (calibration texts): what a rotation could save at most where steps
are fine, before its cost in sensitivity weighting (``docs/levels.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

SPREAD_PER_OCTAVE = {"today": 3, "previous": 2}
SLOTS = 4096


def _spread_class(spread: np.ndarray, per_octave: int) -> np.ndarray:
    return np.clip(np.round(per_octave * np.log2(np.maximum(spread, 1e-6))), -30, 20
                   ).astype(np.int64)  # fmt: skip


def _previous(sym: np.ndarray, first: int) -> np.ndarray:
    """Each token's previous symbol in its stream (``first`` for the first token)."""
    out = np.empty_like(sym)
    out[:, 0] = first
    out[:, 1:] = sym[:, :-1]
    return out


class _Tables:
    """One table per (row class, context), built from calibration symbols; code lengths
    of other symbols under them. Symbols are ``0..size-1``, clipped into the range a
    table spans as the encoder clips indices."""

    def __init__(self, sym: np.ndarray, row_class: np.ndarray, ctx: np.ndarray, size: int,
                 margin: bool) -> None:  # fmt: skip
        from kvcdn.kernels.rans import normalize_freqs

        self.size = size
        self.cost: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        for c in np.unique(row_class):
            rows = row_class == c
            s, k = sym[rows], ctx[rows]
            for context in np.unique(k):
                vals = s[k == context]
                lo, hi = 0, size - 1
                if margin:  # base tables span what calibration saw, with a margin
                    vmin, vmax = int(vals.min()), int(vals.max())
                    pad = max(1, int(np.ceil(0.25 * (vmax - vmin))))
                    lo, hi = max(vmin - pad, 0), min(vmax + pad, size - 1)
                freqs = normalize_freqs(np.bincount(vals - lo, minlength=hi - lo + 1))
                self.cost[(int(c), int(context))] = (lo, -np.log2(freqs / SLOTS))

    def bits(self, sym: np.ndarray, row_class: np.ndarray, ctx: np.ndarray) -> float:
        """Total code length of ``sym`` (rows with a class calibration never saw take
        the nearest class that has the context)."""
        total = 0.0
        known = np.array(sorted({c for c, _ in self.cost}))
        for c in np.unique(row_class):
            rows = row_class == c
            s, k = sym[rows], ctx[rows]
            for context in np.unique(k):
                have = [x for x in known if (int(x), int(context)) in self.cost]
                near = min(have, key=lambda x: abs(x - c))
                lo, cost = self.cost[(int(near), int(context))]
                idx = np.clip(s[k == context] - lo, 0, len(cost) - 1)
                total += float(cost[idx].sum())
        return total

    def __len__(self) -> int:
        return len(self.cost)


def _stream_classes(x_cal: np.ndarray) -> tuple[Callable[[str, np.ndarray], np.ndarray],
                                                 np.ndarray]:  # fmt: skip
    """Each calibration stream's class under a scheme, given a tier's steps (spread in
    the scheme's fractions of an octave; for ``previous``, also whether the stream's
    lag-1 correlation is above the median), and the streams' lag-1 correlations."""
    from kvcdn.calibrate import lag1_correlation

    sd = x_cal.std(axis=1)
    rho = lag1_correlation(x_cal[:, :-1], x_cal[:, 1:])
    correlated = (rho > np.median(rho)).astype(np.int64)

    def classes(scheme: str, step: np.ndarray) -> np.ndarray:
        cls = _spread_class(sd / step, SPREAD_PER_OCTAVE[scheme])
        return cls * 2 + correlated if scheme == "previous" else cls

    return classes, rho


def _previous_base(n0: np.ndarray) -> np.ndarray:
    """The base's context of the ``previous`` scheme: the previous index's sign (0-2)."""
    return np.clip(_previous(n0, 0), -1, 1) + 1


def _symbols(x: np.ndarray, plan: Any) -> tuple[list[np.ndarray], list[tuple[Any, ...]]]:
    """Base indices, and per refinement (split rows, symbols, parent contexts)."""
    from kvcdn import progressive as pg

    n = pg.indices(x, plan)
    tiers = []
    for r in range(1, plan.levels):
        split = plan.depth[r] > plan.depth[r - 1]
        sym, ctx = pg.refinement_symbols(n[r - 1][split], n[r][split])
        tiers.append((split, sym, ctx))
    return n, tiers


def context_study(x_cal: np.ndarray, docs: dict[str, np.ndarray], plan: Any,
                  body_cal: np.ndarray) -> dict[str, Any]:  # fmt: skip
    """Both schemes' bits per element at every tier of ``plan`` on each of ``docs``
    (streams ``[N, T]``, mean removed), tables built on ``x_cal`` (the calibration
    streams, every token), and the KLT bound on ``body_cal`` (``[L, 2, H, T, D]``)."""
    from kvcdn import progressive as pg

    limit = pg.BASE_LIMIT
    classes, rho = _stream_classes(x_cal)
    n_cal, tiers_cal = _symbols(x_cal, plan)

    def base_ctx(scheme: str, n0: np.ndarray) -> np.ndarray:
        return np.zeros_like(n0) if scheme == "today" else _previous_base(n0)

    def refine_ctx(scheme: str, sym: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        return ctx if scheme == "today" else ctx * 3 + _previous(sym, 1)

    tables: dict[str, list[_Tables]] = {}
    for scheme in SPREAD_PER_OCTAVE:
        cls0 = np.broadcast_to(classes(scheme, plan.step(0))[:, None], n_cal[0].shape)
        built = [_Tables(n_cal[0] + limit, cls0, base_ctx(scheme, n_cal[0]), 2 * limit + 1,
                         margin=True)]  # fmt: skip
        for r, (split, sym, ctx) in enumerate(tiers_cal, start=1):
            cls = np.broadcast_to(classes(scheme, plan.step(r - 1))[split][:, None], sym.shape)
            built.append(_Tables(sym, cls, refine_ctx(scheme, sym, ctx), 3, margin=False))
        tables[scheme] = built

    per_doc: dict[str, dict[str, list[float]]] = {}
    for doc, x in docs.items():
        n, tiers = _symbols(x, plan)
        elements = x.size
        # the held-out streams keep the calibration's classes (a profile's are fixed)
        out: dict[str, list[float]] = {}
        for scheme, built in tables.items():
            cls0 = np.broadcast_to(classes(scheme, plan.step(0))[:, None], n[0].shape)
            total = built[0].bits(n[0] + limit, cls0, base_ctx(scheme, n[0]))
            levels = [total / elements]
            for r, (split, sym, ctx) in enumerate(tiers, start=1):
                cls = np.broadcast_to(classes(scheme, plan.step(r - 1))[split][:, None],
                                      sym.shape)  # fmt: skip
                total += built[r].bits(sym, cls, refine_ctx(scheme, sym, ctx))
                levels.append(total / elements)
            out[scheme] = levels
        per_doc[doc] = out
    mean = {scheme: np.mean([d[scheme] for d in per_doc.values()], axis=0).tolist()
            for scheme in tables}  # fmt: skip
    return {
        "bits": mean,
        "tables": {scheme: [len(t) for t in built] for scheme, built in tables.items()},
        "lag1_correlation_quartiles": np.quantile(rho, [0.25, 0.5, 0.75]).tolist(),
        "klt_gain_bits": klt_gain(body_cal),
        "documents": per_doc,
    }


def base_candidates(x_cal: np.ndarray, docs: dict[str, np.ndarray], plan: Any,
                    head_dim: int) -> dict[str, dict[str, float]]:  # fmt: skip
    """The base's bits per element (mean over ``docs``) and table count under the
    previous token's context and under each candidate added to it (module docstring).
    Streams are rows ``(layer, K/V, head, channel)``, channels ``head_dim`` a head."""
    from kvcdn import progressive as pg

    limit = pg.BASE_LIMIT
    channel = np.arange(x_cal.shape[0]) % head_dim
    half = head_dim // 2
    cls = _stream_classes(x_cal)[0]("previous", plan.step(0))

    def shifted(n0: np.ndarray, rows: int, tokens: int) -> np.ndarray:
        """``n0`` of the row ``rows`` before, ``tokens`` tokens before (0 outside)."""
        out = np.zeros_like(n0)
        out[rows:, tokens:] = n0[: n0.shape[0] - rows, : n0.shape[1] - tokens]
        return out

    def magnitude(values: np.ndarray, has: np.ndarray) -> np.ndarray:
        return np.where(has[:, None], np.minimum(np.abs(values), 2), 3)

    previous = _previous_base
    candidates = {
        "previous token": previous,
        "previous token, -2..2": lambda n0: np.clip(shifted(n0, 0, 1), -2, 2) + 2,
        "+ two tokens back": lambda n0: previous(n0) * 3 + np.clip(shifted(n0, 0, 2), -1, 1) + 1,
        "+ previous channel": lambda n0: previous(n0) * 4 + magnitude(shifted(n0, 1, 0),
                                                                     channel > 0),
        "+ RoPE partner": lambda n0: previous(n0) * 4 + magnitude(shifted(n0, half, 0),
                                                                 channel >= half),
    }  # fmt: skip
    n_cal = pg.indices(x_cal, plan)[0]
    n_docs = {doc: pg.indices(x, plan)[0] for doc, x in docs.items()}
    out: dict[str, dict[str, float]] = {}
    for name, context in candidates.items():
        tables = _Tables(n_cal + limit, np.broadcast_to(cls[:, None], n_cal.shape),
                         context(n_cal), 2 * limit + 1, margin=True)  # fmt: skip
        bits = [tables.bits(n + limit, np.broadcast_to(cls[:, None], n.shape), context(n))
                / docs[doc].size for doc, n in n_docs.items()]  # fmt: skip
        out[name] = {"bits": float(np.mean(bits)), "tables": len(tables)}
    return out


def klt_gain(body: np.ndarray) -> dict[str, float]:
    """Mean high-resolution coding gain of a KLT over each head's channels, K and V."""
    L, _, H, _, _ = body.shape
    gains: dict[str, list[float]] = {"K": [], "V": []}
    for layer in range(L):
        for kv, name in enumerate(("K", "V")):
            for head in range(H):
                x = body[layer, kv, head].astype(np.float64)
                cov = np.cov(x - x.mean(axis=0), rowvar=False)
                ev = np.linalg.eigvalsh(cov)
                gains[name].append(0.5 * float(np.log2(np.maximum(np.diag(cov), 1e-12)).mean()
                                               - np.log2(np.maximum(ev, 1e-12)).mean()))
    return {name: float(np.mean(g)) for name, g in gains.items()}
