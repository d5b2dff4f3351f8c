"""Calibration: measure a model's KV once and derive its codec profile.

1. Prefill each calibration text (the bundled texts unless the caller gives
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

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import resources
from typing import Any

import numpy as np

from .codec_profile import (
    LADDER,
    NESTED_TIERS,
    CodecProfile,
    LevelSpec,
    NestedSpec,
    NestedTransform,
    round_to_4_bits,
)
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


@dataclass
class Ladder:
    """Steps 1-4 of a calibration (:func:`measure_ladder`): what every profile made from
    the same texts shares, whatever its nested ladder codes."""

    texts: list[str]
    sinks: int
    samples: list[Sample]
    fisher: np.ndarray  # [L, 2, H, D]
    body: np.ndarray  # the samples' KV after their sinks, [L, 2, H, T, D]
    mean: np.ndarray
    sd: np.ndarray
    unit: np.ndarray
    floor: np.ndarray
    specs: dict[str, LevelSpec]
    reached: dict[str, float]  # the KL of each level's chosen strength
    measured: list[tuple[float, float]]  # (strength, KL) of every search step

    def steps(self, strength: float) -> np.ndarray:
        return _step_array(self.unit, self.floor, strength)


def _step_array(unit: np.ndarray, floor: np.ndarray, strength: float) -> np.ndarray:
    """Each stream's step at ``strength``: its unit times the strength, never below its
    floor, rounded to 4 significant bits."""
    return round_to_4_bits(np.maximum(strength * unit, np.maximum(floor, 1e-6)))


def calibrate(
    model: LoadedModel,
    texts: dict[str, str] | None = None,
    *,
    context_tokens: int = CONTEXT_TOKENS,
    sinks: int = DEFAULT_SINKS,
    levels: Sequence[str] = tuple(LADDER),
    nested_tiers: Sequence[str] = NESTED_TIERS,
    transform: bool = True,
    progress: ProgressFn | None = None,
) -> CodecProfile:
    """Measure ``model`` on ``texts`` (name -> text) and return its codec profile, with
    the nested ladder's ``nested_tiers`` (none: a profile without one), coding each
    head's KLT coefficients where ``transform`` (:func:`klt_transform`), else its
    channels: :func:`measure_ladder`, then :func:`profile_of`."""
    ladder = measure_ladder(model, texts, context_tokens=context_tokens, sinks=sinks,
                            levels=levels, progress=progress)  # fmt: skip
    return profile_of(model, ladder, nested_tiers=nested_tiers, transform=transform,
                      progress=progress)  # fmt: skip


def measure_ladder(
    model: LoadedModel,
    texts: dict[str, str] | None = None,
    *,
    context_tokens: int = CONTEXT_TOKENS,
    sinks: int = DEFAULT_SINKS,
    levels: Sequence[str] = tuple(LADDER),
    progress: ProgressFn | None = None,
) -> Ladder:
    """Steps 1-4 of the module doc on ``texts`` (name -> text; default: the bundled
    ones): the reference, the sensitivity, the streams' statistics and each of
    ``levels``' steps."""
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
    samples = calibration_samples(model, texts, context_tokens, progress)
    fisher = sensitivity(model, samples, sinks, progress)

    body = torch.cat([s.kv[:, :, :, sinks:] for s in samples], dim=3).numpy()
    mean = body.mean(axis=3).astype(np.float32)  # [L, 2, H, D]
    sd = body.std(axis=3).astype(np.float64)
    unit, floor = step_scale(body, mean, fisher)
    steps = partial(_step_array, unit, floor)
    specs: dict[str, LevelSpec] = {}
    measured: list[tuple[float, float]] = []  # (strength, KL) of every search step
    reached: dict[str, float] = {}  # the KL of each level's chosen strength
    strength = 0.2
    total_steps = len(levels) * MAX_SEARCH_STEPS
    done = 0
    seen: dict[bytes, float] = {}  # the KL of every step array measured
    for lname in levels:
        target = LADDER[lname]
        tried: list[tuple[float, float]] = []
        for _ in range(MAX_SEARCH_STEPS):
            progress("search", done, total_steps)
            done += 1
            step = steps(strength)
            key = step.tobytes()
            if key in seen:
                # Steps measured before (every stream at its finest step, or a strength
                # within the 4-bit rounding of one tried): the search can learn nothing
                # more. A model that misses a target even at its finest steps (a
                # random-weight one) would otherwise be measured again and again.
                tried.append((strength, seen[key]))
                break
            kl = float(np.mean([_kl_plain(model, s, mean, step, sinks) for s in samples]))
            seen[key] = kl
            tried.append((strength, kl))
            measured.append((strength, kl))
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
        ok = [(st, kl) for st, kl in tried if kl <= target]
        if not ok:
            log.warning("calibrate %s: no strength tried reached KL %g (best %.5f); the level "
                        "takes a finer one", lname, target, min(k for _, k in tried))  # fmt: skip
        strength, reached[lname] = max(ok) if ok else (min(st for st, _ in tried) * 0.7, target)
        specs[lname] = LevelSpec(
            name=lname,
            strength=float(strength),
            step=steps(strength),
            table_id=np.zeros(mean.shape, dtype=np.uint16),
        )
        strength *= 1.3  # the next level is coarser: start the search above this one
    progress("search", total_steps, total_steps)

    return Ladder(sorted(texts), sinks, samples, fisher, body, mean, sd, unit, floor, specs,
                  reached, measured)  # fmt: skip


def profile_of(
    model: LoadedModel,
    ladder: Ladder,
    *,
    nested_tiers: Sequence[str] = NESTED_TIERS,
    transform: bool = True,
    progress: ProgressFn | None = None,
) -> CodecProfile:
    """Steps 5 and 6 of the module doc on a measured ``ladder``: the tables, the nested
    ladder's ``nested_tiers`` (coding each head's KLT coefficients where ``transform``,
    else its channels), and every level and tier encoded and decoded for real. A
    ladder gives several profiles (one of each nested ladder) without measuring the
    texts again; each has its own level specs."""
    progress = progress or (lambda stage, done, total: None)
    samples, sinks, body, mean = ladder.samples, ladder.sinks, ladder.body, ladder.mean
    specs = {name: dataclasses.replace(spec) for name, spec in ladder.specs.items()}
    levels = list(specs)
    freqs, table_lo, table_size = _build_tables(specs, body, mean, ladder.sd)
    nested = None
    if nested_tiers:
        progress("nested", 0, 1)
        # each tier as good as the independent level of its name, never worse than its target
        targets = {name: min(LADDER[name], ladder.reached.get(name, LADDER[name]))
                   for name in nested_tiers[1:]}  # fmt: skip
        fit = _kl_fit(body, mean, ladder.unit, ladder.steps, ladder.measured)
        stage = _nested_of_coefficients if transform else _nested_of_channels
        nested, tables = stage(model, samples, body, mean, ladder.fisher, ladder.unit,
                               ladder.floor, sinks, fit, nested_tiers, targets)  # fmt: skip
        nested.base_table += freqs.shape[0]  # the new tables come after the ladder's
        nested.refine_table += freqs.shape[0]
        freqs, table_lo, table_size = _append_tables((freqs, table_lo, table_size), tables)
        progress("nested", 1, 1)
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
            "texts": list(ladder.texts),
            "context_tokens": int(samples[0].kv.shape[3]),
            "continuation_tokens": CONTINUATION_TOKENS,
            "fisher_samples": FISHER_SAMPLES,
            "tables": int(freqs.shape[0]),
        },
        nested=nested,
    )
    checks = [*levels, *(nested.tiers if nested else ())]
    for i, lname in enumerate(levels):
        progress("verify", i, len(checks))
        specs[lname].quality = _verify(model, profile, lname, samples)
        profile.changed()  # the quality figures are part of the profile
    if nested is not None:
        progress("verify", len(levels), len(checks))
        nested.quality.update(_verify_nested(model, profile, samples))
        profile.changed()
    progress("verify", len(checks), len(checks))
    return profile


def step_scale(
    body: np.ndarray, mean: np.ndarray, fisher: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per stream ``[L, 2, H, D]``: the quantiser step per unit of strength (Fisher
    weighted, step 4 of the module doc) and the finest step 8-bit symbols allow, from
    the calibration KV ``body`` ``[L, 2, H, T, D]``."""
    sd = body.std(axis=3).astype(np.float64)
    rms_sd = math.sqrt(float((sd**2).mean()))
    f_floor = max(float(np.exp(np.log(np.maximum(fisher, 1e-30)).mean())), 1e-30)
    f = np.maximum(fisher, 1e-4 * f_floor)
    unit = np.maximum(np.sqrt(f_floor / f) * rms_sd, 1e-6)
    # Symbols are 8-bit: no step may be so fine that a stream's calibrated
    # range (with room to spare) needs more than +-100 of them.
    floor = np.abs(body - mean[:, :, :, None, :]).max(axis=3) * 1.3 / 127
    return unit, floor


def calibration_samples(
    model: LoadedModel, texts: dict[str, str], context_tokens: int = CONTEXT_TOKENS,
    progress: ProgressFn | None = None,
) -> list[Sample]:  # fmt: skip
    """Step 1: each text's context KV and the reference logits of its continuation."""
    progress = progress or (lambda stage, done, total: None)
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
    return samples


def sensitivity(
    model: LoadedModel, samples: list[Sample], sinks: int, progress: ProgressFn | None = None
) -> np.ndarray:
    """Step 2: every stream's Fisher information ``[L, 2, H, D]``, averaged over the
    samples' tokens after the first ``sinks``."""
    progress = progress or (lambda stage, done, total: None)
    fisher = np.zeros(samples[0].kv[:, :, :, 0].shape, dtype=np.float64)
    for i, sample in enumerate(samples):
        progress("sensitivity", i, len(samples))
        fisher += _fisher_diagonal(model, sample, sinks)
    progress("sensitivity", len(samples), len(samples))
    return fisher / len(samples)


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


def _verify_nested(
    model: LoadedModel, profile: CodecProfile, samples: list[Sample]
) -> dict[str, dict[str, float]]:
    """:func:`_verify` of every nested tier: each chunk encoded once, each tier decoded
    from it; a tier's bits are what its reader fetches (the index and its sections)."""
    import torch

    from .codec import decode_chunk, encode_chunk, nested_level, tier_bytes

    assert profile.nested is not None
    tiers = profile.nested.tiers
    level = nested_level(tiers[-1], profile)
    outs = {t: [] for t in tiers}
    bits = dict.fromkeys(tiers, 0)
    for sample in samples:
        kv = sample.kv
        decoded = {t: torch.empty_like(kv) for t in tiers}
        for start in range(0, kv.shape[3], DEFAULT_CHUNK_TOKENS):
            end = min(start + DEFAULT_CHUNK_TOKENS, kv.shape[3])
            data = encode_chunk(level, kv[:, :, :, start:end], "0" * 64, profile=profile,
                                start=start)  # fmt: skip
            for k, tier in enumerate(tiers):
                decode_chunk(data, profile=profile, out=decoded[tier][:, :, :, start:end],
                             tiers=k + 1)  # fmt: skip
                bits[tier] += 8 * tier_bytes(data, k + 1)
        for tier in tiers:
            logits = continuation_logits(model, decoded[tier], sample.continuation)
            outs[tier].append(compare(sample, logits))
    elements = sum(s.kv.numel() for s in samples)
    quality = {}
    for tier in tiers:
        q = {k: float(np.mean([r[k] for r in outs[tier]])) for k in outs[tier][0]}
        q["bits_per_element"] = bits[tier] / elements
        quality[tier] = q
    return quality


# ---- the nested ladder ----------------------------------------------------------------

#: The nested base's bits per element on the calibration texts (entropy estimate): the
#: rung below ``lowest``, for the slowest links.
NESTED_BASE_BITS = 1.3
#: Every fourth calibration token is enough to plan splits and build tables.
NESTED_TOKEN_STRIDE = 4
#: A transformed nested ladder's tiers are planned to this fraction of their KL targets:
#: planned to the targets themselves, the embedded model's held-out KL was 1.4x its
#: calibration KL, where the channels' is 1.1x (2026-11-29, docs/levels.md).
TRANSFORM_TARGET_MARGIN = 0.8
#: Replans of a nested tier whose measured KL missed its target (one measure each).
NESTED_CORRECTIONS = 3


def _nested_of_channels(
    model: LoadedModel, samples: list[Sample], body: np.ndarray, mean: np.ndarray,
    fisher: np.ndarray, unit: np.ndarray, floor: np.ndarray, sinks: int,
    fit: tuple[float, float], tiers: Sequence[str], targets: dict[str, float],
) -> tuple[NestedSpec, Tables]:  # fmt: skip
    """The nested ladder of each head's channels, around their calibrated ``mean``."""

    def real_kl(plan: Any) -> float:
        return _kl_nested(model, samples, mean, plan, sinks)

    sd = body.std(axis=3).astype(np.float64)
    return _plan_nested(body, mean, sd, unit, floor, fit, tiers, targets, real_kl)


def _nested_of_coefficients(
    model: LoadedModel, samples: list[Sample], body: np.ndarray, mean: np.ndarray,
    fisher: np.ndarray, unit: np.ndarray, floor: np.ndarray, sinks: int,
    fit: tuple[float, float], tiers: Sequence[str], targets: dict[str, float],
) -> tuple[NestedSpec, Tables]:  # fmt: skip
    """The nested ladder of each head's KLT coefficients (:func:`klt_transform`): every
    coefficient has weight 1 (one step serves all), splits are ranked by the error they
    remove, and tiers are planned to :data:`TRANSFORM_TARGET_MARGIN` of their targets
    (their KL on other texts runs higher than on these: docs/levels.md)."""
    tf = klt_transform(model, samples, body, mean, fisher, unit, sinks)
    coefficients = [_coefficients(tf, s.kv.numpy()) for s in samples]
    streams = np.concatenate([c[:, :, :, sinks:] for c in coefficients], axis=3)
    tf.mean = streams.mean(axis=3).astype(np.float32)
    reach = np.abs(streams - tf.mean[:, :, :, None, :]).max(axis=3) * 1.3 / 127

    def real_kl(plan: Any) -> float:
        return _kl_nested(model, samples, tf.mean, plan, sinks, tf, coefficients)

    margin = {name: TRANSFORM_TARGET_MARGIN * t for name, t in targets.items()}
    nested, tables = _plan_nested(streams, tf.mean, streams.std(axis=3).astype(np.float64),
                                  np.ones_like(unit), reach, fit, tiers, margin, real_kl,
                                  measured=True)  # fmt: skip
    nested.transform = tf
    return nested, tables


def _kl_fit(body: np.ndarray, mean: np.ndarray, unit: np.ndarray,
            steps: Callable[[float], np.ndarray], measured: list[tuple[float, float]]
            ) -> tuple[float, float]:  # fmt: skip
    """KL as a function of the Fisher-weighted squared error (``sum((err / unit)**2)``
    over streams, each its mean over tokens) that a quantiser makes on the calibration
    data: ``log KL = slope log error + intercept``, fitted to the ladder search's
    measurements (where most values fall in the middle cell the error is their
    spread, not the step's). A transform that keeps the weighted error (the KLT in
    the weighted domain) keeps the fit."""
    from . import progressive as pg

    x = pg.streams_of(body[:, :, :, ::NESTED_TOKEN_STRIDE], mean)
    weight = (1.0 / unit**2).reshape(-1)

    def error(step: np.ndarray) -> float:
        s = step.reshape(-1)[:, None].astype(np.float64)
        err = x - np.clip(np.rint(x / s), -pg.BASE_LIMIT, pg.BASE_LIMIT) * s
        return float((weight * (err**2).mean(axis=1)).sum())

    pts = np.array([(math.log(error(steps(st))), math.log(max(kl, 1e-9)))
                    for st, kl in measured])  # fmt: skip
    if len(pts) < 2:
        return 1.0, 0.0
    slope, icept = np.polyfit(pts[:, 0], pts[:, 1], 1)
    return float(slope), float(icept)


def _plan_nested(
    body: np.ndarray, mean: np.ndarray, sd: np.ndarray, unit: np.ndarray, floor: np.ndarray,
    fit: tuple[float, float], tiers: Sequence[str], targets: dict[str, float],
    real_kl: Callable[[Any], float], measured: bool = False,
) -> tuple[NestedSpec, list[tuple[np.ndarray, int, int]]]:  # fmt: skip
    """The nested ladder (:mod:`kvcdn.progressive`) of the streams ``body`` ``[L, 2, H,
    T, D]`` (channels, or a transform's coefficients) and its new rANS tables
    (frequencies, lo, size); ``targets`` is each refinement's KL. A refinement's KL is
    predicted (a bisection needs many) from the weighted squared error, by ``fit``
    (:func:`_kl_fit`); each planned tier's KL is then measured (``real_kl``) and,
    while it is above the target or more than a fifth below it, the tier is planned
    again with the target corrected by the miss (at most ``NESTED_CORRECTIONS``
    times; the cheapest plan measured within its target wins)."""
    from . import progressive as pg

    names = list(tiers)
    if tuple(names) != NESTED_TIERS[: len(names)] or len(names) < 2:
        raise InputError(f"nested tiers must be a prefix of {', '.join(NESTED_TIERS)}")
    x = pg.streams_of(body[:, :, :, ::NESTED_TOKEN_STRIDE], mean)
    shape = mean.shape
    weight = (1.0 / unit**2).reshape(-1)
    unit_n, floor_n = unit.reshape(-1), np.maximum(floor.reshape(-1), 1e-6)
    slope, icept = fit

    # each stream's share of the weighted error (a refinement's bisection sums them,
    # split or not)
    def shares(err: np.ndarray) -> np.ndarray:
        return weight * (err**2).mean(axis=1)

    def shares_at(plan: pg.NestedPlan, depth: np.ndarray) -> np.ndarray:
        # at ``depth`` each stream is the midtread quantiser of its step (boundaries aside)
        s = (plan.base_step / float(pg.SPLIT) ** depth)[:, None]
        limit = (pg.BASE_LIMIT + 0.5) * plan.base_step[:, None]
        return shares(x - np.rint(np.clip(x, -limit, limit) / s) * s)

    # A refinement's bisection asks for the KL of many splits of one level below: each
    # stream's share, split or not, is computed once per level below, not per ask.
    known: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    def kl_of(plan: pg.NestedPlan) -> float:
        below, top = plan.depth[-2], plan.depth[-1]
        key = below.tobytes()
        if key not in known:
            known.clear()
            known[key] = (shares_at(plan, below), shares_at(plan, below + 1))
        unsplit, split = known[key]
        total = float(np.where(top > below, split, unsplit).sum())
        return math.exp(icept + slope * math.log(total))

    def base_step(strength: float) -> np.ndarray:
        return np.maximum(strength * unit_n, floor_n)

    lo, hi = 0.2, 16.0
    for _ in range(30):  # the base: the strength that gives NESTED_BASE_BITS
        mid = math.sqrt(lo * hi)
        bits = pg.base_level_bits(x, base_step(mid))
        lo, hi = (mid, hi) if bits > NESTED_BASE_BITS else (lo, mid)
    plan = pg.base_plan(base_step(hi))
    for name in names[1:]:
        plan = _plan_tier(x, plan, weight, kl_of, real_kl, targets[name], measured)
        log.info("calibrate nested %s: %.1f%% of streams split (target KL %.5f)", name,
                 100 * float((plan.depth[-1] > plan.depth[-2]).mean()), targets[name])  # fmt: skip
    # Steps exact in float32: the finest with 4 significant bits, the others 3**j times it.
    top = plan.depth[-1]
    fine = round_to_4_bits(plan.base_step / 3.0**top)
    plan = pg.NestedPlan(fine.astype(np.float64) * 3.0**top, plan.depth)
    # Tables from pairs of adjacent tokens: each stride's first token (``x``) is the
    # previous token of its second, whose symbols the tables count.
    x_next = pg.streams_of(body[:, :, :, 1::NESTED_TOKEN_STRIDE], mean)
    pairs = min(x.shape[1], x_next.shape[1])
    base_id, refine_id, tables = _nested_tables(plan, x[:, :pairs], x_next[:, :pairs],
                                                sd.reshape(-1))  # fmt: skip
    del x_next
    spec = NestedSpec(
        tiers=tuple(names),
        base_strength=float(hi),
        fine_step=fine.reshape(shape).astype(np.float32),
        depth=plan.depth.reshape(len(names), *shape).astype(np.uint8),
        base_table=base_id.reshape(-1, *shape).astype(np.uint16),  # offsets into `tables`
        refine_table=refine_id.reshape(len(names) - 1, -1, *shape).astype(np.uint16),
    )
    return spec, tables


#: Spread classes a table of the nested ladder serves, per octave of sd / step (each
#: also split by the stream's lag-1 correlation: a table per context costs more
#: classes than the ladder's thirds of an octave can fill).
NESTED_CLASSES_PER_OCTAVE = 2


Tables = list[tuple[np.ndarray, int, int]]  # (frequencies, lo, size) each


def lag1_correlation(x: np.ndarray, x_next: np.ndarray) -> np.ndarray:
    """Each stream's correlation between its values ``x [N, T]`` and the next token's
    ``x_next [N, T]`` (pairs of adjacent tokens)."""
    a = x - x.mean(axis=1, keepdims=True)
    b = x_next - x_next.mean(axis=1, keepdims=True)
    return (a * b).mean(axis=1) / np.maximum(a.std(axis=1) * b.std(axis=1), 1e-12)


def _nested_tables(plan: Any, x: np.ndarray, x_next: np.ndarray, sd: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, Tables]:  # fmt: skip
    """The nested ladder's rANS tables, chosen by the previous token's symbol
    (``kvcdn.kernels.nested``): a base table per class and context (the previous base
    index below, at or above 0), a refinement table per tier, class and context
    (parent cell, previous symbol). Counted on ``x_next`` (streams ``[N, T]``, mean
    removed), whose previous tokens are ``x``; a class is the spread (``sd`` / step,
    :data:`NESTED_CLASSES_PER_OCTAVE`) and whether the stream's lag-1 correlation is
    above the median. Returns base ids ``[3, N]``, refinement ids ``[R - 1, 9, N]``
    and the tables (frequencies, lo, size). A stream's tables of one parent context
    are consecutive (the kernels add the previous symbol): tables 0-2 are uniform
    ternary ones, named so by the streams a tier does not split (never used)."""
    from kvcdn.kernels.rans import normalize_freqs

    from . import progressive as pg

    rho = lag1_correlation(x, x_next)
    correlated = (rho > np.median(rho)).astype(np.int64)

    def classes(step: np.ndarray) -> np.ndarray:
        spread = np.maximum(sd / step, 1e-6)
        cls = np.clip(np.round(NESTED_CLASSES_PER_OCTAVE * np.log2(spread)), -30, 20)
        return cls.astype(np.int64) * 2 + correlated

    tables: Tables = [(normalize_freqs(np.ones(3)), 0, 3)] * 3
    N, R = x.shape[0], plan.levels
    base_id = np.zeros((3, N), dtype=np.int64)
    refine_id = np.zeros((R - 1, 9, N), dtype=np.int64)
    refine_id[:] = (np.arange(9) % 3)[None, :, None]  # unsplit: tables 0-2
    prev, now = pg.level_indices(x, plan, 0), pg.level_indices(x_next, plan, 0)
    context = np.sign(prev) + 1
    cls = classes(plan.step(0))
    for c in np.unique(cls):
        rows = cls == c
        vals = now[rows]
        vmin, vmax = int(vals.min()), int(vals.max())
        margin = max(1, int(math.ceil(0.25 * (vmax - vmin))))
        lo = max(vmin - margin, -pg.BASE_LIMIT)
        size = min(vmax + margin, pg.BASE_LIMIT) - lo + 1
        for k in range(3):  # every context's table spans the class's range
            counts = np.bincount(vals[context[rows] == k] - lo, minlength=size)[:size]
            base_id[k, rows] = len(tables)
            tables.append((normalize_freqs(counts), lo, size))
    for r in range(1, R):
        prev_up, now_up = pg.level_indices(x, plan, r), pg.level_indices(x_next, plan, r)
        split = plan.depth[r] > plan.depth[r - 1]
        sym_prev, _ = pg.refinement_symbols(prev[split], prev_up[split])
        sym, parent = pg.refinement_symbols(now[split], now_up[split])
        context = parent * 3 + sym_prev
        cls = classes(plan.step(r - 1))[split]
        ids = np.zeros((9, int(split.sum())), dtype=np.int64)
        for c in np.unique(cls):
            rows = cls == c
            s, k = sym[rows], context[rows]
            for j in range(9):
                ids[j, rows] = len(tables)
                tables.append((normalize_freqs(np.bincount(s[k == j], minlength=3)[:3]), 0, 3))
        refine_id[r - 1][:, split] = ids
        prev, now = prev_up, now_up
    return base_id, refine_id, tables


def _plan_tier(x: np.ndarray, below: Any, weight: np.ndarray, kl_of: Callable[[Any], float],
               real_kl: Callable[[Any], float], target: float, measured: bool = False
               ) -> Any:  # fmt: skip
    """One refinement on ``below`` whose measured KL meets ``target``, as cheaply as the
    measures found: planned for the predicted KL (``kl_of``), measured (``real_kl``),
    and while the measure is above the target or more than a fifth below it, planned
    again for a corrected prediction (at most ``NESTED_CORRECTIONS`` times): scaled by
    the miss until a measure on each side brackets the target, then interpolated
    between the two nearest in log-log (a measure is the model's KL on the calibration
    texts, ~5 s on 2 CPUs for the embedded model, so the search must be short).
    Of the plans measured within the target, the one that splits fewest streams.

    Why not one correction: the KL of a fraction split is far from a factor of its
    prediction; the embedded model's ``default`` tier measured 0.0072 for a target of
    0.006 after one, and a scaled correction then jumped between 1,530 streams split
    (KL 0.0070) and 4,410 (0.0031) for a target of 0.0048."""
    from . import progressive as pg

    aim = target
    tried: list[tuple[float, float, int, Any]] = []  # (aim, real KL, streams split, plan)
    order = pg.split_order(x, below, weight, measured=measured)  # the same for every aim
    for _ in range(NESTED_CORRECTIONS + 1):
        plan = pg.plan_refinement(x, below, weight, kl_of, aim, order=order)
        if any(np.array_equal(plan.depth[-1], t[3].depth[-1]) for t in tried):
            break  # a plan measured before (all streams split, and still above): no better
        real = max(real_kl(plan), 1e-12)
        split = int((plan.depth[-1] > plan.depth[-2]).sum())
        log.info("calibrate nested: aim %.5f, %d streams split -> KL %.5f (target %.5f)", aim,
                 split, real, target)  # fmt: skip
        tried.append((aim, real, split, plan))
        if 0.8 * target <= real <= target:
            break
        want = 0.9 * target
        over = [t for t in tried if t[1] > target]
        under = [t for t in tried if t[1] <= target]
        if over and under:
            a1, r1, *_ = max(under, key=lambda t: t[1])  # the nearest on each side
            a2, r2, *_ = min(over, key=lambda t: t[1])
            if r1 == r2 or a1 == a2:
                break
            f = (math.log(want) - math.log(r1)) / (math.log(r2) - math.log(r1))
            aim = math.exp(math.log(a1) + f * (math.log(a2) - math.log(a1)))
        else:
            aim = aim * want / real
    fits = [t for t in tried if t[1] <= target]
    return min(fits, key=lambda t: t[2])[3] if fits else tried[-1][3]


def _kl_nested(model: LoadedModel, samples: list[Sample], mean: np.ndarray, plan: Any,
               sinks: int, transform: NestedTransform | None = None,
               coefficients: list[np.ndarray] | None = None) -> float:  # fmt: skip
    """Mean KL on the calibration texts of the nested plan's last level (no coding); of
    the samples' ``coefficients`` and back through ``transform``, where given."""
    import torch

    from . import progressive as pg

    top = plan.levels - 1
    kls = []
    for i, sample in enumerate(samples):
        if transform is None:
            kv = pg.level_values(sample.kv.numpy(), mean, plan, top, sinks)
        else:
            assert coefficients is not None
            kv = pg.level_values(coefficients[i], mean, plan, top, sinks)
            _values_in_place(transform, kv)
            kv[:, :, :, :sinks] = sample.kv.numpy()[:, :, :, :sinks]
        kv = torch.from_numpy(kv)
        kls.append(compare(sample, continuation_logits(model, kv, sample.continuation))["kl"])
    return float(np.mean(kls))


# ---- the nested ladder's transform ------------------------------------------------------


def klt_transform(model: LoadedModel, samples: list[Sample], body: np.ndarray,
                  mean: np.ndarray, fisher: np.ndarray, unit: np.ndarray, sinks: int
                  ) -> NestedTransform:  # fmt: skip
    """The nested ladder's transform (its ``mean`` still to be set): per head, keys
    taken back before RoPE (the model's own frequencies), scaled by their Fisher
    weight (``1 / unit``: a pair of channels RoPE turns together shares one, their
    mean), and turned by the KLT of that weighted domain, the eigenvectors of the
    head's covariance on the calibration texts, largest first. One step then serves
    every coefficient; the study behind it is ``bench/progressive.py --transforms``
    (docs/levels.md)."""
    layers, two, heads, dim = mean.shape
    inv_freq = _rotary_frequencies(model, dim)
    weight = 1.0 / unit.astype(np.float64) ** 2
    if inv_freq is not None:  # a pair turned together shares its weight
        half = dim // 2
        pair = (weight[:, 0, :, :half] + weight[:, 0, :, half:]) / 2
        weight[:, 0, :, :half] = weight[:, 0, :, half:] = pair
    scale = np.sqrt(weight)
    plain = NestedTransform(mean=np.zeros_like(mean), inv_freq=inv_freq,
                            synthesis=np.broadcast_to(np.eye(dim, dtype=np.float32),
                                                      (*mean.shape, dim)).copy())  # fmt: skip
    turned = np.concatenate([_coefficients(plain, s.kv.numpy())[:, :, :, sinks:]
                             for s in samples], axis=3)  # fmt: skip
    synthesis = np.empty((*mean.shape, dim), dtype=np.float32)
    for idx in np.ndindex(layers, two, heads):
        y = turned[idx] * scale[idx]
        _, vectors = np.linalg.eigh(np.cov(y, rowvar=False))
        basis = vectors[:, ::-1]  # the largest variance first
        synthesis[idx] = (basis / scale[idx][:, None]).astype(np.float32)
    return NestedTransform(mean=np.zeros_like(mean), synthesis=synthesis, inv_freq=inv_freq)


def _rotary_frequencies(model: LoadedModel, dim: int) -> np.ndarray | None:
    """The model's rotary frequencies ``[D / 2]`` (float64), or None where it has none
    of that shape (the transform then turns nothing)."""
    inner = getattr(model.model, "model", None)
    freq = getattr(getattr(inner, "rotary_emb", None), "inv_freq", None)
    if freq is None or tuple(freq.shape) != (dim // 2,):
        return None
    return freq.detach().double().cpu().numpy()


def _coefficients(transform: NestedTransform, kv: np.ndarray) -> np.ndarray:
    """A sample's KV ``[L, 2, H, T, D]`` (from position 0) as coefficients."""
    layers, two, heads, tokens, dim = kv.shape
    g = layers * two * heads
    y = transform.coefficients(kv.reshape(g, tokens, dim), np.arange(g), heads, 0)
    return y.reshape(kv.shape)


def _values_in_place(transform: NestedTransform, y: np.ndarray) -> None:
    """Coefficients ``[L, 2, H, T, D]`` (from position 0) turned into values, in place."""
    layers, two, heads, tokens, dim = y.shape
    g = layers * two * heads
    flat = y.reshape(g, tokens, dim)
    transform.values_into(flat, np.arange(g), heads, 0, flat)


def _append_tables(
    have: tuple[np.ndarray, np.ndarray, np.ndarray], new: list[tuple[np.ndarray, int, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The profile's tables with ``new`` after them (the nested ids are offset by the
    caller's count)."""
    freqs, table_lo, table_size = have
    width = freqs.shape[1]
    add = np.zeros((len(new), width), dtype=np.uint32)
    for i, (f, _, size) in enumerate(new):
        add[i, :size] = f
    return (np.vstack([freqs, add]),
            np.concatenate([table_lo, np.array([lo for _, lo, _ in new], dtype=np.int32)]),
            np.concatenate([table_size, np.array([n for _, _, n in new], dtype=np.int32)]))
