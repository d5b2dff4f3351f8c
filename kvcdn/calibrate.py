"""Calibration: measure a model's KV once and derive its codec profile.

1. Prefill each calibration text (bundled man pages unless the caller gives
   others) and run its continuation on the exact KV: the reference.
2. Sensitivity, a Fisher-information proxy: the squared gradient, with
   respect to every KV element, of the log-likelihood of continuations
   sampled from the model itself (one backward pass per text), averaged over
   tokens per stream.
3. Statistics per stream: mean and standard deviation.
4. Per ladder level, search the strength whose mean KL on the calibration
   texts meets the level's target (KL scales about with strength squared,
   so a few secant steps in log space suffice).
5. Static rANS tables from the calibration symbols, grouped by spread.
6. Encode and decode the calibration texts with the finished profile, for
   real, and record each level's bits per element and quality.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from importlib import resources

import numpy as np

from .codec_profile import LADDER, CodecProfile, LevelSpec, round_to_4_bits
from .errors import InputError
from .kv import DEFAULT_CHUNK_TOKENS
from .models import LoadedModel
from .quality import Sample, compare, continuation_logits, make_sample

log = logging.getLogger(__name__)

#: progress(stage, done, total); stages: "reference", "sensitivity", "search", "verify".
ProgressFn = Callable[[str, int, int], None]

DEFAULT_SINKS = 4
CONTEXT_TOKENS = 2048
CONTINUATION_TOKENS = 257
FISHER_SAMPLES = 4
SPREAD_CLASSES_PER_OCTAVE = 3
MAX_SEARCH_STEPS = 5


def bundled_texts() -> dict[str, str]:
    folder = resources.files("kvcdn") / "data" / "calibration"
    return {
        f.name.removesuffix(".txt"): f.read_text(encoding="utf-8")
        for f in sorted(folder.iterdir(), key=lambda f: f.name)
        if f.name.endswith(".txt")
    }


def calibrate(
    model: LoadedModel,
    texts: dict[str, str] | None = None,
    *,
    context_tokens: int = CONTEXT_TOKENS,
    sinks: int = DEFAULT_SINKS,
    levels: Sequence[str] = tuple(LADDER),
    progress: ProgressFn | None = None,
) -> CodecProfile:
    """Measure ``model`` on ``texts`` (name -> text) and return its codec profile."""
    import torch

    progress = progress or (lambda stage, done, total: None)
    texts = texts or bundled_texts()
    if not texts:
        raise InputError("calibration needs at least one text")
    unknown = [lv for lv in levels if lv not in LADDER]
    if unknown:
        raise InputError(
            f"unknown level(s) {', '.join(unknown)}; the ladder is {', '.join(LADDER)}"
        )
    samples: list[Sample] = []
    for i, (name, text) in enumerate(texts.items()):
        progress("reference", i, len(texts))
        n_ids = len(model.document_ids(text))
        ctx = min(context_tokens, n_ids - CONTINUATION_TOKENS)
        if ctx < 256:
            raise InputError(
                f"calibration text {name} has {n_ids} tokens; it needs at least "
                f"{256 + CONTINUATION_TOKENS}"
            )
        samples.append(make_sample(model, text, ctx, CONTINUATION_TOKENS))
    progress("reference", len(texts), len(texts))

    fisher = np.zeros(samples[0].kv[:, :, :, 0].shape, dtype=np.float64)
    for i, sample in enumerate(samples):
        progress("sensitivity", i, len(samples))
        fisher += _fisher_diagonal(model, sample, sinks)
    fisher /= len(samples)
    progress("sensitivity", len(samples), len(samples))

    body = torch.cat([s.kv[:, :, :, sinks:] for s in samples], dim=3).numpy()
    mean = body.mean(axis=3).astype(np.float32)  # [L, 2, H, D]
    sd = body.std(axis=3).astype(np.float64)
    rms_sd = math.sqrt(float((sd**2).mean()))
    f_floor = max(float(np.exp(np.log(np.maximum(fisher, 1e-30)).mean())), 1e-30)
    f = np.maximum(fisher, 1e-4 * f_floor)
    unit = np.sqrt(f_floor / f) * rms_sd  # step per unit strength
    unit = np.maximum(unit, 1e-6)
    # Symbols are 8-bit: no step may be so fine that a stream's calibrated
    # range (with room to spare) needs more than +-100 of them.
    floor = np.abs(body - mean[:, :, :, None, :]).max(axis=3) * 1.3 / 127

    def steps(strength: float) -> np.ndarray:
        return round_to_4_bits(np.maximum(strength * unit, np.maximum(floor, 1e-6)))

    specs: dict[str, LevelSpec] = {}
    strength = 0.2
    total_steps = len(levels) * MAX_SEARCH_STEPS
    done = 0
    for lname in levels:
        target = LADDER[lname]
        tried: list[tuple[float, float]] = []
        for _ in range(MAX_SEARCH_STEPS):
            progress("search", done, total_steps)
            done += 1
            step = steps(strength)
            kl = float(np.mean([_kl_plain(model, s, mean, step, sinks) for s in samples]))
            tried.append((strength, kl))
            log.info(
                "calibrate %s: strength %.4f -> KL %.5f (target %g)", lname, strength, kl, target
            )
            if 0.8 * target <= kl <= target:
                break
            below = [st for st, k in tried if k <= target]
            above = [st for st, k in tried if k > target]
            if below and above:  # bracketed: bisect in log space
                strength = math.sqrt(max(below) * min(above))
            else:  # KL grows about with strength squared
                strength *= math.sqrt(0.9 * target / max(kl, 1e-9))
        ok = [st for st, kl in tried if kl <= target]
        strength = max(ok) if ok else min(st for st, _ in tried) * 0.7
        specs[lname] = LevelSpec(
            name=lname,
            strength=float(strength),
            step=steps(strength),
            table_id=np.zeros(mean.shape, dtype=np.uint16),
        )
        strength *= 1.3  # the next level is coarser: start the search above this one
    progress("search", total_steps, total_steps)

    freqs, table_lo, table_size = _build_tables(specs, body, mean, sd)
    profile = CodecProfile(
        model_fingerprint=model.fingerprint,
        layout=model.layout,
        sinks=sinks,
        mean=mean,
        freqs=freqs,
        table_lo=table_lo,
        table_size=table_size,
        levels=specs,
        calibration={
            "texts": sorted(texts),
            "context_tokens": int(samples[0].kv.shape[3]),
            "continuation_tokens": CONTINUATION_TOKENS,
            "fisher_samples": FISHER_SAMPLES,
            "tables": int(freqs.shape[0]),
        },
    )
    for i, lname in enumerate(levels):
        progress("verify", i, len(levels))
        specs[lname].quality = _verify(model, profile, lname, samples)
        profile.changed()  # the quality figures are part of the profile
    progress("verify", len(levels), len(levels))
    return profile


def _fisher_diagonal(model: LoadedModel, sample: Sample, sinks: int) -> np.ndarray:
    """Per stream, the mean over tokens of the diagonal Fisher information.

    The Fisher of position ``i`` is ``E[(d log p(y_i) / d kv)^2]`` with ``y_i``
    sampled from the model. One backward pass of the sum over positions would
    square the cross terms too, so each pass weights every position's
    log-likelihood by a random sign (Hutchinson's trick): the cross terms then
    vanish in expectation, and ``FISHER_SAMPLES`` passes average the rest.
    """
    import torch
    from transformers import DynamicCache

    dtype = next(model.model.parameters()).dtype
    generator = torch.Generator(device="cpu").manual_seed(0)
    total = None
    for _ in range(FISHER_SAMPLES):
        kv = sample.kv.to(device=model.device, dtype=dtype, copy=True).requires_grad_(True)
        cache = DynamicCache(config=model.model.config)
        for layer in range(kv.shape[0]):
            cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        ids = torch.tensor([sample.continuation], device=model.device)
        logits = model.model(ids, past_key_values=cache, use_cache=True).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1)
        with torch.no_grad():
            targets = torch.multinomial(logp.exp().cpu(), 1, generator=generator)
            signs = torch.randint(0, 2, targets.shape, generator=generator) * 2.0 - 1.0
        picked = logp.gather(1, targets.to(logp.device))
        (grad,) = torch.autograd.grad((picked * signs.to(logp.device)).sum(), kv)
        g2 = (grad.float()[:, :, :, sinks:] ** 2).mean(dim=3).cpu().double().numpy()
        total = g2 if total is None else total + g2
    assert total is not None
    return total / FISHER_SAMPLES


def _reconstruct(sample_kv: np.ndarray, q_value: np.ndarray, sinks: int) -> np.ndarray:
    out = sample_kv.copy()
    out[:, :, :, sinks:] = q_value
    return out


def _kl_plain(
    model: LoadedModel, sample: Sample, mean: np.ndarray, step: np.ndarray, sinks: int
) -> float:
    """KL of the uniform quantiser alone (no table clamping), for the strength search."""
    import torch

    x = sample.kv.numpy()[:, :, :, sinks:]
    m, s = mean[:, :, :, None, :], step[:, :, :, None, :]
    value = (np.rint((x - m) / s) * s + m).astype(np.float32)
    kv = torch.from_numpy(_reconstruct(sample.kv.numpy(), value, sinks))
    return compare(sample, continuation_logits(model, kv, sample.continuation))["kl"]


def _build_tables(
    specs: dict[str, LevelSpec], body: np.ndarray, mean: np.ndarray, sd: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One static table per spread class (sd / step), over all levels' streams."""
    from kvcdn.kernels.rans import normalize_freqs

    classes: dict[int, list[np.ndarray]] = {}
    assignments: list[tuple[LevelSpec, np.ndarray]] = []
    for spec in specs.values():
        spread = np.maximum(sd / spec.step, 1e-6)
        cls = np.clip(np.round(SPREAD_CLASSES_PER_OCTAVE * np.log2(spread)), -30, 20).astype(int)
        assignments.append((spec, cls))
        q = np.rint((body - mean[:, :, :, None, :]) / spec.step[:, :, :, None, :])
        q = np.clip(q, -127, 127).astype(np.int16)
        q = np.moveaxis(q, 3, -1)  # [L, 2, H, D, T]
        for c in np.unique(cls):
            classes.setdefault(int(c), []).append(q[cls == c].ravel())
    keys = sorted(classes)
    n_tables = len(keys)
    freqs = np.zeros((n_tables, 256), dtype=np.uint32)
    table_lo = np.zeros(n_tables, dtype=np.int32)
    table_size = np.zeros(n_tables, dtype=np.int32)
    for t, key in enumerate(keys):
        q = np.concatenate(classes[key])
        lo, hi = int(q.min()), int(q.max())
        # Room for values a little beyond anything calibration saw.
        margin = max(1, int(math.ceil(0.25 * (hi - lo))))
        lo, hi = max(lo - margin, -128), min(hi + margin, 127)
        counts = np.bincount(q.astype(np.int64) - lo, minlength=hi - lo + 1)[: hi - lo + 1]
        size = hi - lo + 1
        freqs[t, :size] = normalize_freqs(counts)
        table_lo[t], table_size[t] = lo, size
    index = {key: t for t, key in enumerate(keys)}
    for spec, cls in assignments:
        spec.table_id = np.vectorize(index.__getitem__)(cls).astype(np.uint16)
    return freqs, table_lo, table_size


def _verify(
    model: LoadedModel, profile: CodecProfile, level: str, samples: list[Sample]
) -> dict[str, float]:
    """Real encode + decode of the calibration texts: bits per element and quality."""
    import torch

    from .codec import decode_chunk, encode_chunk, ladder_level

    lv = ladder_level(level, profile)
    results, bits, elements = [], 0, 0
    for sample in samples:
        kv = sample.kv
        out = torch.empty_like(kv)
        for start in range(0, kv.shape[3], DEFAULT_CHUNK_TOKENS):
            end = min(start + DEFAULT_CHUNK_TOKENS, kv.shape[3])
            data = encode_chunk(lv, kv[:, :, :, start:end], "0" * 64, profile=profile, start=start)
            decode_chunk(data, profile=profile, out=out[:, :, :, start:end])
            bits += 8 * len(data)
        elements += kv.numel()
        results.append(compare(sample, continuation_logits(model, out, sample.continuation)))
    quality = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
    quality["bits_per_element"] = bits / elements
    return quality
