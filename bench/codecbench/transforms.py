"""What a transform before quantisation would save: keys taken back before RoPE, and a
rotation of each head's channels (a KLT), at the same model quality (study, 2026-11-29).

The codec quantises each stream (layer, K/V, head, channel) on its own, with a step
weighted by the stream's Fisher information (``docs/levels.md``). Two transforms could
make the values cheaper to code without changing that weighting:

* **Keys before RoPE.** A key's channel pair ``(d, d + D/2)`` is rotated by an angle
  that grows with the token's position; taking the rotation back (an exact, orthogonal
  map for each token, the same on both sides of the store) leaves the key the
  projection made, whose channels vary less from token to token and between heads.
* **A KLT per head** (or one per layer and K/V, shared by its heads: a smaller
  profile). In the Fisher-weighted domain (each channel scaled by
  ``sqrt(fisher)``, so that one step serves every channel, as the codec's steps do),
  the eigenvectors of the head's channel covariance on the calibration texts. A head's
  values stay within the head, so a tensor-parallel rank still reads only its heads.

Each scheme quantises its coefficients with one uniform step ``delta`` (the weighted
domain's; floored, as the codec's steps, so that no coefficient needs more than 100
steps a side on the calibration texts) and is swept over ``delta``; each point is
decoded back (inverse transform, RoPE again, the sinks exact), and the model's KL and
perplexity change are measured on the held-out documents, as the codec bench does.
Bits are what the symbols cost under tables built on the calibration texts, one per
stream and previous-token class (the sign of the same stream's symbol at the token
before, as the codec's base): code lengths of the held-out symbols, tokens after the
sinks, no index or container. Each scheme's bits are then interpolated (in log KL) at
reference KLs, so that schemes are compared at the same quality. ``channels (today)``
is the codec's own design in this toy coder.

Also the price on the read path: the inverse transform of one 256-token chunk of the
whole model (a ``[D, D]`` product per head and token, and RoPE's rotation), in fp16
MB/s on this host's CPUs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .contexts import _previous
from .measure import best_seconds

#: Symbols are clipped to this magnitude, as the codec's base indices are.
LIMIT = 127
#: A coefficient's step is at least its calibration reach over this many steps, as the
#: codec floors a stream's step (``docs/levels.md``).
REACH_SYMBOLS = 100
#: Pseudo-count of a symbol the calibration texts never gave, within a table's span.
PRIOR = 0.05
#: Steps tried, as multiples of the step whose Gaussian estimate is 3 bits per element.
DELTAS = (0.7, 1.0, 1.4, 2.0, 2.8)
#: KLT bases: none, one per head, or one per (layer, K/V) shared by its heads (a
#: smaller profile: an 80-layer model with 8 heads of 128 channels has 84 MB of
#: float32 bases per head).
KLT = (None, "head", "layer")
SCHEMES = {  # name: (keys before RoPE, KLT basis)
    "channels (today)": (False, None),
    "keys before RoPE": (True, None),
    "KLT per head": (False, "head"),
    "keys before RoPE + KLT per head": (True, "head"),
    "keys before RoPE + KLT per layer": (True, "layer"),
}


def rope_tables(model: Any, tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """RoPE's ``cos`` and ``sin`` ``[tokens, D]`` (float64) from the model's own rotary
    embedding (its scaling included), or None where it has none."""
    import torch

    inner = getattr(model.model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return None
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, torch.arange(tokens)[None])
    # the model's angles, in float64: its float32 tables are not exactly orthogonal
    # (cos^2 + sin^2 is 1 to 1e-7), and the transform must invert exactly
    angle = np.arctan2(sin[0].double().numpy(), cos[0].double().numpy())
    return np.cos(angle), np.sin(angle)


def _rotate_keys(kv: np.ndarray, cos: np.ndarray, sin: np.ndarray, sign: float) -> np.ndarray:
    """Keys of ``kv`` ``[L, 2, H, T, D]`` rotated as RoPE does (``sign`` 1) or back (-1):
    ``k cos + rotate_half(k) sign sin``."""
    out = kv.copy()
    k = kv[:, 0]
    half = k.shape[-1] // 2
    turned = np.concatenate([-k[..., half:], k[..., :half]], axis=-1)
    t = k.shape[-2]
    out[:, 0] = k * cos[:t] + turned * (sign * sin[:t])
    return out


class Scheme:
    """One transform, fitted on calibration KV: coefficients ``[L, 2, H, T, D]`` of KV and
    KV of coefficients."""

    def __init__(self, before_rope: bool, klt: str | None, calibration: list[np.ndarray],
                 fisher: np.ndarray, sinks: int, rope: tuple[np.ndarray, np.ndarray]
                 ) -> None:  # fmt: skip
        self.before_rope, self.rope = before_rope, rope
        w = np.maximum(np.asarray(fisher, dtype=np.float64), 1e-30)
        if before_rope:  # a rotated pair shares its sensitivity
            half = w.shape[-1] // 2
            pair = (w[:, 0, :, :half] + w[:, 0, :, half:]) / 2
            w = w.copy()
            w[:, 0, :, :half] = w[:, 0, :, half:] = pair
        self.scale = np.sqrt(w)[:, :, :, None, :]
        body = np.concatenate([self._pre(c)[:, :, :, sinks:] for c in calibration], axis=3)
        self.mean = body.mean(axis=3, keepdims=True)
        y = (body - self.mean) * self.scale
        layers, two, heads, _, dim = y.shape
        self.basis = np.broadcast_to(np.eye(dim), (layers, two, heads, dim, dim)).copy()
        if klt not in KLT:
            raise ValueError(f"no KLT basis {klt!r}")
        if klt == "head":
            for idx in np.ndindex(layers, two, heads):
                self.basis[idx] = np.linalg.eigh(np.cov(y[idx], rowvar=False))[1]
        elif klt == "layer":  # the heads' covariances pooled
            for idx in np.ndindex(layers, two):
                pooled = sum(np.cov(y[idx][h], rowvar=False) for h in range(heads))
                self.basis[idx] = np.linalg.eigh(pooled)[1][None]
        reach = np.abs(np.einsum("lkhtd,lkhde->lkhte", y, self.basis)).max(axis=3, keepdims=True)
        self.reach = reach / REACH_SYMBOLS

    def steps(self, delta: float) -> np.ndarray:
        """Each coefficient's step ``[L, 2, H, 1, D]`` for the uniform step ``delta``."""
        return np.maximum(delta, self.reach)

    def _pre(self, kv: np.ndarray) -> np.ndarray:
        return _rotate_keys(kv, *self.rope, -1.0) if self.before_rope else kv

    def coefficients(self, kv: np.ndarray) -> np.ndarray:
        y = (self._pre(kv) - self.mean) * self.scale
        return np.einsum("lkhtd,lkhde->lkhte", y, self.basis)

    def values(self, coefficients: np.ndarray) -> np.ndarray:
        y = np.einsum("lkhte,lkhde->lkhtd", coefficients, self.basis)
        x = y / self.scale + self.mean
        return _rotate_keys(x, *self.rope, 1.0) if self.before_rope else x


def _indices(coefficients: np.ndarray, steps: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(coefficients / steps), -LIMIT, LIMIT)


def _symbols(coefficients: np.ndarray, steps: np.ndarray, sinks: int) -> np.ndarray:
    """Quantiser indices ``[streams, T]`` of the tokens after the sinks."""
    q = _indices(coefficients[:, :, :, sinks:], steps)
    return np.moveaxis(q, 3, -1).reshape(-1, q.shape[3]).astype(np.int64)


def _context(q: np.ndarray) -> np.ndarray:
    """The previous token's symbol's sign class (0, 1, 2); the first token's is 1."""
    return np.sign(_previous(q, 0)) + 1


class _Tables:
    """Per stream and context, a table over the span the calibration symbols reached
    (with a quarter of it as margin); code lengths of other symbols, clipped into it."""

    def __init__(self, calibration: list[np.ndarray]) -> None:
        q = np.concatenate(calibration, axis=1)
        streams, width = q.shape[0], 2 * LIMIT + 1
        self.lo = q.min(axis=1)
        hi = q.max(axis=1)
        pad = np.maximum(1, np.ceil(0.25 * (hi - self.lo))).astype(np.int64)
        self.lo = np.maximum(self.lo - pad, -LIMIT)
        self.hi = np.minimum(hi + pad, LIMIT)
        flat = (np.arange(streams)[:, None] * 3 + _context(q)) * width + (q + LIMIT)
        counts = np.bincount(flat.ravel(), minlength=streams * 3 * width).astype(np.float64)
        counts = counts.reshape(streams, 3, width)
        span = np.arange(-LIMIT, LIMIT + 1)
        inside = (span >= self.lo[:, None]) & (span <= self.hi[:, None])
        counts += PRIOR * inside[:, None, :]
        with np.errstate(divide="ignore"):
            self.bits = -np.log2(counts / counts.sum(axis=2, keepdims=True))

    def code_bits(self, q: np.ndarray) -> float:
        """Mean bits per symbol of ``q`` ``[streams, T]``."""
        q = np.clip(q, self.lo[:, None], self.hi[:, None])
        streams, width = q.shape[0], 2 * LIMIT + 1
        flat = (np.arange(streams)[:, None] * 3 + _context(q)) * width + (q + LIMIT)
        return float(self.bits.reshape(-1)[flat].mean())


def _gaussian_delta(scheme: Scheme, calibration: list[np.ndarray], sinks: int,
                    bits: float = 3.0) -> float:  # fmt: skip
    """The uniform step whose reverse water-filling estimate is ``bits`` per element on
    the calibration texts (the sweep's centre, the same for every scheme)."""
    var = np.concatenate([scheme.coefficients(c)[:, :, :, sinks:].var(axis=3).ravel()
                          for c in calibration])  # fmt: skip
    var = np.maximum(var, 1e-300)
    lo, hi = -300.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        rate = np.where(var > 2.0**mid, 0.5 * np.log2(var / 2.0**mid), 0.0).mean()
        lo, hi = (mid, hi) if rate > bits else (lo, mid)
    return float(np.sqrt(12 * 2.0**mid))


def at_kl(points: list[dict[str, float]], kl: float, key: str) -> float | None:
    """``key`` interpolated in log KL at ``kl`` between the sweep's points (None outside)."""
    pts = sorted(points, key=lambda p: p["kl"])
    for a, b in zip(pts, pts[1:], strict=False):
        if a["kl"] <= kl <= b["kl"] and b["kl"] > a["kl"] > 0:
            f = (np.log(kl) - np.log(a["kl"])) / (np.log(b["kl"]) - np.log(a["kl"]))
            return float(a[key] + f * (b[key] - a[key]))
    return None


def inverse_cost(shape: tuple[int, ...], chunk: int = 256, repeat: int = 5) -> dict[str, float]:
    """fp16-equivalent MB/s of the inverse transforms of one ``chunk``-token chunk of KV
    ``[L, 2, H, *, D]``: the KLT's product per head, and RoPE's rotation of the keys."""
    import torch

    layers, two, heads, _, dim = shape
    y = torch.randn(layers * two * heads, chunk, dim)
    basis = torch.randn(layers * two * heads, dim, dim)
    cos, sin = torch.randn(chunk, dim), torch.randn(chunk, dim)
    keys = torch.randn(layers, heads, chunk, dim)
    mb = layers * two * heads * chunk * dim * 2 / 1e6

    def best(fn: Any) -> float:
        fn()  # a warm-up
        return mb / best_seconds(fn, repeat)

    def rope() -> None:
        half = dim // 2
        turned = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
        (keys * cos + turned * sin).to(torch.float16)

    return {"klt_mb_s": best(lambda: torch.bmm(y, basis)), "rope_mb_s": best(rope),
            "threads": torch.get_num_threads()}  # fmt: skip


def transform_study(model: Any, calibration: list[Any], fisher: np.ndarray, sinks: int,
                    docs: dict[str, Any], reference_kls: dict[str, float],
                    progress: Any = None) -> dict[str, Any]:  # fmt: skip
    """Every scheme's sweep on the held-out ``docs`` (:class:`kvcdn.quality.Sample`), and
    its bits and perplexity change at each of ``reference_kls`` (name: KL)."""
    import torch

    from kvcdn.quality import measure

    log = progress or (lambda msg: None)
    cal = [np.asarray(s.kv, dtype=np.float64) for s in calibration]
    held = {name: np.asarray(s.kv, dtype=np.float64) for name, s in docs.items()}
    longest = max(x.shape[3] for x in [*cal, *held.values()])
    rope = rope_tables(model, longest)
    schemes = {n: v for n, v in SCHEMES.items() if rope is not None or not v[0]}
    out: dict[str, Any] = {"schemes": {}, "reference_kls": reference_kls,
                           "inverse": inverse_cost(cal[0].shape)}  # fmt: skip
    centre: float | None = None
    for name, (before_rope, klt) in schemes.items():
        scheme = Scheme(before_rope, klt, cal, fisher, sinks, rope or (None, None))  # type: ignore[arg-type]
        if centre is None:  # today's design sets the sweep, the same steps for all
            centre = _gaussian_delta(scheme, cal, sinks)
        coefficients = {n: scheme.coefficients(x) for n, x in held.items()}
        cal_coefficients = [scheme.coefficients(c) for c in cal]
        points = []
        for factor in DELTAS:
            delta = centre * factor
            steps = scheme.steps(delta)
            tables = _Tables([_symbols(c, steps, sinks) for c in cal_coefficients])
            kls, ppls, bits = [], [], []
            for doc, sample in docs.items():
                c = coefficients[doc]
                kv = scheme.values(_indices(c, steps) * steps)
                kv[:, :, :, :sinks] = held[doc][:, :, :, :sinks]  # the sinks stay exact
                m = measure(model, sample, torch.from_numpy(kv.astype(np.float32)))
                kls.append(m["kl"])
                ppls.append(m["ppl_delta_pct"])
                bits.append(tables.code_bits(_symbols(c, steps, sinks)))
            point = {"delta": delta, "kl": float(np.mean(kls)), "ppl_delta_pct":
                     float(np.mean(ppls)), "bits": float(np.mean(bits))}  # fmt: skip
            points.append(point)
            log(f"{name}: step x{factor}: {point['bits']:.3f} bits, KL {point['kl']:.4f}")
        out["schemes"][name] = {
            "points": points,
            "at": {ref: {"bits": at_kl(points, kl, "bits"),
                         "ppl_delta_pct": at_kl(points, kl, "ppl_delta_pct")}
                   for ref, kl in reference_kls.items()},
        }  # fmt: skip
    return out
