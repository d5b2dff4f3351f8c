"""Nested ladder against independent levels: sizes, quality and decode speed, one run.

    python bench/progressive.py [--docs FILE ...] [--context-tokens 2048] [--quality] [--design]
                                [--base-bits 1.4] [--contexts] [--transforms]
                                [--channels | --profile FILE] [--json OUT.json]

On documents that are not calibration texts (bash(1) from character 60,000, curl(1),
grep(1), and a seed text where it exists, as ``bench/codec.py``), every level of both
layouts of the codec profile, from **real objects** (256-token chunks): the
independent ladder (``kvcdn-rans-v1``, one object a level) and the nested ladder
(one object a chunk, each level the index and its tiers); bits
per element of what a reader of the level fetches, the model's mean next-token KL and
perplexity change over the next 257 tokens against the exact KV, and decode speed
(fp16-equivalent MB/s, best of 3 after a warm-up, of bytes already checked against
their digests, as a reader decodes them; the nested ladder's also with its
scalar kernel, one group at a time, the baseline of the vector one, and for the whole
document: each chunk in turn on the kernels' threads, as a reader's loader decodes
today, against as many chunks at once as the kernels have threads, each on one,
medians of 5 passes alternated); then the store's bytes per document for all levels, before
(independent) and after (nested).

``--quality`` replaces that table by a paired comparison of the two layouts' quality
on more documents (the default set and nine more man pages, none a calibration
text), untimed: per level each layout's mean bits, KL and PPL change, and the mean
difference nested - independent of KL and of PPL change with a 95% bootstrap interval
over documents, and the documents where the nested level is at least as good.

``--design`` adds the design study the nested layout was chosen by: it plans a nested
ladder (:mod:`kvcdn.progressive`) for the embedded model on the
bundled calibration texts: a base quantiser whose strength gives ``--base-bits``
bits per element there, then one refinement per ladder level, each splitting
the fewest streams in three that bring the calibration KL to the level's
target (the targets today's levels were calibrated to). Then, on documents that
are not calibration texts (bash(1) from character 60,000, curl(1), grep(1), as
``bench/codec.py``), it scores every level of both ladders: the model's mean
next-token KL and perplexity change over the next 257 tokens, against the exact
KV, and the size.

Sizes here are entropy estimates for both ladders, so the comparison is fair:
per stream (layer, K/V, head, channel) the ideal code length of its symbols with
the stream's own frequencies on the document (a nested level: base symbols,
plus each refinement's ternary symbols given their context), over the tokens
after the 4 exact sinks (real objects add tables, coder states and indexes).

Also measured, as the design's ablation: the first refinement made by splitting
every cell in two (a midrise quantiser of half the base step) against the
midtread quantiser of the same step.

``--contexts`` adds what the profile's nested symbols cost coded with the previous
token's symbol as context and without (:mod:`codecbench.contexts`): tables built on
the calibration texts, code lengths on the held-out documents; then the base with
one more context beside the previous token's.

``--transforms`` adds what a transform before quantisation would save at the same
model quality (:mod:`codecbench.transforms`): keys taken back before RoPE, a KLT of
each head's channels in the Fisher-weighted domain, and both; each swept over its
step, its KL and perplexity measured on the held-out documents and its bits coded
with tables from the calibration texts, then compared at the held-out KL of today's
``default`` and ``low`` (the real objects' in the same run, else 2026-11-28's).

The real objects are those of the model's own profile: for the embedded model the
bundled one, whose nested ladder codes each head's KLT coefficients
(``kvcdn-nested-klt-v1``, keys taken back before RoPE), as ``kvcdn calibrate`` makes
by default. ``--channels`` measures instead a profile whose nested ladder codes the
channels (``kvcdn-nested-v1``, ``kvcdn calibrate --no-transform``), calibrated in the
run on the bundled texts (minutes); ``--profile FILE`` one made before. Both
calibrate the independent ladder the same way, so each table compares its nested
ladder with the same independent levels.

Writes a table and ``bench/results/progressive.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from codecbench.documents import gather_docs
from codecbench.log import log, warn

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
CONTINUATION_TOKENS = 257
CHUNK = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, nargs="+", metavar="FILE",
                   help="held-out documents (default: bash, curl and grep man pages)")
    p.add_argument("--context-tokens", type=int, default=2048, help="context length")
    p.add_argument("--base-bits", type=float, default=1.4,
                   help="bits per element of the base on the calibration texts (default 1.4)")
    p.add_argument("--model", default="smollm2-135m", help="model (default: the embedded one)")
    p.add_argument("--design", action="store_true",
                   help="also plan a ladder by real-KL bisection and compare entropy estimates")
    p.add_argument("--contexts", action="store_true",
                   help="also estimate the nested symbols' cost with the previous token as context")
    p.add_argument("--transforms", action="store_true",
                   help="also measure transforms before quantisation (keys before RoPE, a KLT "
                        "per head) at the same KL")
    p.add_argument("--channels", action="store_true",
                   help="the real objects of a profile whose nested ladder codes channels "
                        "(`kvcdn calibrate --no-transform`), calibrated now on the bundled "
                        "texts (minutes)")
    p.add_argument("--profile", type=Path, metavar="FILE",
                   help="use this codec profile file (e.g. `kvcdn calibrate --no-transform "
                        "--out FILE`) instead of the model's own")
    p.add_argument("--quality", action="store_true",
                   help="instead of the real objects' table, compare the two layouts' quality "
                        "document by document on more held-out documents (default: the "
                        "default set and 9 more man pages), with 95%% bootstrap intervals "
                        "of the differences (minutes: no speed measured)")
    p.add_argument("--no-real", action="store_true",
                   help="skip the real objects (with --design, --contexts or --transforms)")
    p.add_argument("--json", type=Path, default=RESULTS / "progressive.json")
    return p.parse_args()  # fmt: skip


def main() -> int:
    args = parse_args()
    from rich.console import Console

    from kvcdn.models import load_model
    from kvcdn.profile_store import ensure_profile
    from kvcdn.quality import make_sample
    from kvcdn.store import open_store

    started = time.perf_counter()
    console = Console(width=int(os.environ.get("COLUMNS", 140)))
    model = load_model(args.model)
    profile = _profile(args, model)
    if profile is None:
        profile, _ = ensure_profile(open_store("memory://progressive-bench"), model)
    if profile.nested is None:
        warn("the codec profile has no nested ladder (calibrated by an older kvcdn)")
        return 1
    docs_dir = tempfile.TemporaryDirectory(prefix="kvcdn-progressive-bench-")
    samples: dict[str, tuple[str, Any]] = {}
    for doc, path, origin in gather_docs(args.docs, Path(docs_dir.name), more=args.quality):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(model.document_ids(text)) < args.context_tokens + CONTINUATION_TOKENS:
            warn(f"{doc} is too short: skipped")
            continue
        samples[doc] = (origin, make_sample(model, text, args.context_tokens,
                                            CONTINUATION_TOKENS))  # fmt: skip
    if not samples:
        warn("no document was long enough")
        return 1
    out: dict[str, Any] = {"model": model.name, "context_tokens": args.context_tokens,
                           "profile": profile.sha256,
                           "transform": profile.nested.transform is not None}  # fmt: skip
    if args.quality:
        out["quality"] = quality_study(console, model, profile, samples)
    elif not args.no_real:
        out["real"] = real_objects(console, model, profile, samples)
    if args.contexts:
        out["contexts"] = contexts_study(console, args, model, profile, samples)
    if args.design:
        out["design"] = design_study(console, args, model, profile, samples)
    if args.transforms:
        out["transforms"] = transforms_study(console, args, model, profile, samples,
                                             out.get("real"))  # fmt: skip
    out["seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {args.json} in {out['seconds']:.0f} s")
    return 0


def _profile(args: argparse.Namespace, model: Any) -> Any:
    """The profile of ``--profile``, else with ``--channels`` one calibrated now with
    the nested ladder of channels, else None (the model's own)."""
    from kvcdn.calibrate import calibrate
    from kvcdn.codec_profile import parse_profile

    if args.profile is not None:
        profile = parse_profile(args.profile.read_bytes(), name=str(args.profile))
        profile.check_model(model.fingerprint, str(args.profile))
        return profile
    if not args.channels:
        return None
    started = time.perf_counter()
    profile = calibrate(model, transform=False)
    log(f"calibrated a profile of channels in {time.perf_counter() - started:.0f} s")
    return profile


def real_objects(console: Any, model: Any, profile: Any, samples: dict[str, tuple[str, Any]]
                 ) -> dict[str, Any]:  # fmt: skip
    """Both layouts of the profile as real objects: per level the bits a reader fetches,
    the quality of what it decodes, and the decode speed."""
    import numpy as np
    from rich.table import Table

    from kvcdn.codec_profile import LADDER

    tiers = list(profile.nested.tiers)
    rows: dict[str, dict[str, list[dict[str, float]]]] = {}
    for doc, (_, sample) in samples.items():
        for name, by in _document_levels(model, profile, sample, timed=True).items():
            for layout, row in by.items():
                rows.setdefault(name, {}).setdefault(layout, []).append(row)
        log(f"{doc}: real objects done")
    summary = {name: {layout: {key: float(np.mean([r[key] for r in runs])) for key in runs[0]}
                      for layout, runs in by.items()} for name, by in rows.items()}  # fmt: skip
    table = Table(title=f"Real objects, {model.name}, mean of {len(samples)} held-out documents, "
                  f"{CHUNK}-token chunks: bits a reader of the level fetches")  # fmt: skip
    for col in ("level", "independent bits", "KL", "PPL Δ%", "MB/s", "nested bits", "KL",
                "PPL Δ%", "MB/s", "MB/s group by group", "document MB/s", "chunks at once",
                "nested/independent"):  # fmt: skip
        table.add_column(col, justify="right")
    for name in tiers:
        n = summary[name]["nested"]
        cells = ["", "", "", ""]
        ratio = ""
        if "independent" in summary[name]:
            i = summary[name]["independent"]
            cells = [f"{i['bits']:.3f}", f"{i['kl']:.4f}", f"{i['ppl_delta_pct']:+.2f}",
                     f"{i['decode_mb_s']:.0f}"]  # fmt: skip
            ratio = f"{n['bits'] / i['bits']:.3f}x"
        table.add_row(name, *cells, f"{n['bits']:.3f}", f"{n['kl']:.4f}",
                      f"{n['ppl_delta_pct']:+.2f}", f"{n['decode_mb_s']:.0f}",
                      f"{n['scalar_decode_mb_s']:.0f}", f"{n['document_decode_mb_s']:.0f}",
                      f"{n['document_at_once_mb_s']:.0f} "
                      f"({n['document_at_once_mb_s'] / n['document_decode_mb_s']:.2f}x)",
                      ratio)  # fmt: skip
    console.print(table)
    independent = sum(summary[n]["independent"]["bits"] for n in LADDER)
    nested = summary[tiers[-1]]["nested"]["bits"]
    console.print(
        f"store bits per element for every level: independent {independent:.2f}, nested "
        f"{nested:.2f} ({nested / independent:.2f}x); the nested object is "
        f"{nested / summary[tiers[-1]]['independent']['bits']:.3f}x the independent "
        f"{tiers[-1]} alone"
    )
    return {"summary": summary, "store_bits": {"independent": independent, "nested": nested},
            "documents": rows}  # fmt: skip


def _document_levels(model: Any, profile: Any, sample: Any, *, timed: bool
                     ) -> dict[str, dict[str, dict[str, float]]]:  # fmt: skip
    """One document's real objects, both layouts: per level and layout the bits a reader
    of the level fetches and the quality of what it decodes; ``timed``, also the decode
    speeds (the independent ladder's, and the nested one's vector and scalar kernels,
    chunk by chunk and for the whole document)."""
    import torch

    from kvcdn.codec import decode_chunk, encode_chunk, ladder_level, nested_level, tier_bytes
    from kvcdn.codec_profile import LADDER
    from kvcdn.quality import measure

    tiers = list(profile.nested.tiers)
    top = nested_level(tiers[-1], profile)
    kv = sample.kv.contiguous()
    T = kv.shape[3]
    spans = [(a, min(a + CHUNK, T)) for a in range(0, T, CHUNK)]
    rows: dict[str, dict[str, dict[str, float]]] = {}
    # independent: one object a level
    for name in LADDER:
        out = torch.empty_like(kv)
        nbytes, seconds = 0, 0.0
        for a, b in spans:
            data = encode_chunk(ladder_level(name, profile), kv[:, :, :, a:b].contiguous(),
                                "0" * 64, profile=profile, start=a)  # fmt: skip
            nbytes += len(data)
            decode = partial(decode_chunk, data, profile=profile, out=out[:, :, :, a:b],
                             verified=True)  # fmt: skip
            if timed:
                seconds += _best(decode)
            else:
                decode()
        row = {"bits": 8 * nbytes / kv.numel(), **measure(model, sample, out)}
        if timed:
            row["decode_mb_s"] = 2 * kv.numel() / seconds / 1e6
        rows.setdefault(name, {})["independent"] = row
    # nested: one object a chunk, each level its first tiers
    objects = [encode_chunk(top, kv[:, :, :, a:b].contiguous(), "0" * 64, profile=profile,
                            start=a) for a, b in spans]  # fmt: skip
    for k, name in enumerate(tiers):
        out = torch.empty_like(kv)
        nbytes, seconds, scalar = 0, 0.0, 0.0
        decodes = []
        for data, (a, b) in zip(objects, spans, strict=True):
            nbytes += tier_bytes(data, k + 1)
            decode = partial(decode_chunk, data, profile=profile, out=out[:, :, :, a:b],
                             tiers=k + 1, verified=True)  # fmt: skip
            decodes.append(decode)
            if timed:
                seconds += _best(decode)
                with _group_by_group():
                    scalar += _best(decode)
            else:
                decode()
        row = {"bits": 8 * nbytes / kv.numel(), **measure(model, sample, out)}
        if timed:
            one, many = _whole_document(decodes)
            row |= {"decode_mb_s": 2 * kv.numel() / seconds / 1e6,
                    "scalar_decode_mb_s": 2 * kv.numel() / scalar / 1e6,
                    "document_decode_mb_s": 2 * kv.numel() / one / 1e6,
                    "document_at_once_mb_s": 2 * kv.numel() / many / 1e6}  # fmt: skip
        rows.setdefault(name, {})["nested"] = row
    return rows


#: Resamples of the documents for the quality study's intervals (seeded: a rerun on the
#: same figures gives the same intervals).
BOOTSTRAP_RESAMPLES = 10_000


def quality_study(console: Any, model: Any, profile: Any, samples: dict[str, tuple[str, Any]]
                  ) -> dict[str, Any]:  # fmt: skip
    """Both layouts' real objects on every document, untimed: per level the mean bits,
    KL and PPL change of each, and the paired difference nested - independent of KL and
    of PPL change, with a 95% bootstrap interval over documents (the unit whose texts
    differ: tokens of one document are not independent) and the documents where the
    nested level is at least as good."""
    import numpy as np
    from rich.table import Table

    per_doc: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for doc, (_, sample) in samples.items():
        per_doc[doc] = _document_levels(model, profile, sample, timed=False)
        log(f"{doc}: both layouts measured")
    tiers = [t for t in profile.nested.tiers if "independent" in next(iter(per_doc.values()))[t]]
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(per_doc), size=(BOOTSTRAP_RESAMPLES, len(per_doc)))
    table = Table(title=f"Nested against independent levels, {model.name}, {len(per_doc)} "
                  "held-out documents: means, and nested - independent with 95% bootstrap "
                  "intervals over documents")  # fmt: skip
    for col in ("level", "bits (ind., nested)", "KL (ind., nested)", "KL difference",
                "KL: nested as good", "PPL Δ% (ind., nested)", "PPL Δ% difference",
                "PPL: nested as good"):  # fmt: skip
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for name in tiers:
        got: dict[str, Any] = {}
        for key in ("bits", "kl", "ppl_delta_pct"):
            ind = np.array([per_doc[d][name]["independent"][key] for d in per_doc])
            nes = np.array([per_doc[d][name]["nested"][key] for d in per_doc])
            diff = nes - ind
            lo, hi = np.percentile(diff[picks].mean(axis=1), [2.5, 97.5])
            got[key] = {"independent": float(ind.mean()), "nested": float(nes.mean()),
                        "difference": float(diff.mean()), "interval": [float(lo), float(hi)],
                        "nested_as_good": int((diff <= 0).sum())}  # fmt: skip
        summary[name] = got
        b, kl, ppl = got["bits"], got["kl"], got["ppl_delta_pct"]
        n = len(per_doc)
        table.add_row(
            name, f"{b['independent']:.3f}, {b['nested']:.3f}",
            f"{kl['independent']:.4f}, {kl['nested']:.4f}",
            f"{kl['difference']:+.4f} [{kl['interval'][0]:+.4f}, {kl['interval'][1]:+.4f}]",
            f"{kl['nested_as_good']} of {n}",
            f"{ppl['independent']:+.2f}, {ppl['nested']:+.2f}",
            f"{ppl['difference']:+.2f} [{ppl['interval'][0]:+.2f}, {ppl['interval'][1]:+.2f}]",
            f"{ppl['nested_as_good']} of {n}",
        )  # fmt: skip
    console.print(table)
    return {"summary": summary, "documents": per_doc, "resamples": BOOTSTRAP_RESAMPLES}


def _whole_document(decodes: list[Any], rounds: int = 5) -> tuple[float, float]:
    """Seconds to decode every chunk of a document: one chunk at a time on the kernels'
    threads (as a reader's loader decodes today), and as many chunks at once as those
    threads, each on one (the kernels set to one thread, a pool of as many threads
    sharing the chunks); the medians of ``rounds`` passes after a warm-up, the two ways
    alternated."""
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn.kernels import parallel

    threads = parallel.get_threads()

    def in_turn() -> None:
        for decode in decodes:
            decode()

    def at_once() -> None:
        def share(first: int) -> None:
            for decode in decodes[first::threads]:
                decode()

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(share, range(threads)))  # a decode's error is raised here

    one: list[float] = []
    many: list[float] = []
    try:
        for _ in range(rounds + 1):
            parallel.set_threads(threads)
            t = time.perf_counter()
            in_turn()
            one.append(time.perf_counter() - t)
            parallel.set_threads(1)
            t = time.perf_counter()
            at_once()
            many.append(time.perf_counter() - t)
    finally:
        parallel.set_threads(threads)
    return statistics.median(one[1:]), statistics.median(many[1:])


@contextmanager
def _group_by_group() -> Iterator[None]:
    """The nested decoder's scalar kernel (one group at a time) instead of the vector
    one where the host has it: the baseline column."""
    from kvcdn.kernels import nested

    vector = nested.decode
    nested.decode = partial(vector, vector=False)
    try:
        yield
    finally:
        nested.decode = vector


def _best(fn: Any, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def contexts_study(console: Any, args: argparse.Namespace, model: Any, profile: Any,
                   samples: dict[str, tuple[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Today's nested symbol coding against tables chosen by the previous token's
    symbol, both with tables built on the calibration texts (:mod:`codecbench.contexts`)."""
    import numpy as np
    import torch
    from codecbench.contexts import base_candidates, context_study
    from rich.table import Table

    from kvcdn import progressive as pg
    from kvcdn.calibrate import bundled_texts, calibration_samples

    sinks, mean, spec = profile.sinks, profile.mean, profile.nested
    depth = spec.depth.reshape(len(spec.tiers), -1).astype(np.int64)
    fine = spec.fine_step.reshape(-1).astype(np.float64)
    plan = pg.NestedPlan(fine * 3.0 ** depth[-1], depth)
    t = time.perf_counter()
    calib = calibration_samples(model, bundled_texts(), args.context_tokens)
    body = torch.cat([s.kv[:, :, :, sinks:] for s in calib], dim=3).numpy()
    docs = {doc: pg.streams_of(sample.kv[:, :, :, sinks:].numpy(), mean)
            for doc, (_, sample) in samples.items()}  # fmt: skip
    x_cal = pg.streams_of(body, mean)
    result = context_study(x_cal, docs, plan, body)
    result["base_candidates"] = base_candidates(x_cal, docs, plan, body.shape[-1])
    log(f"contexts study in {time.perf_counter() - t:.0f} s")
    table = Table(title=f"Nested symbols with the previous token as context: {model.name}, "
                  f"mean of {len(docs)} held-out documents, tables from the calibration "
                  "texts (bits: code lengths, tokens after the sinks)")  # fmt: skip
    for col in ("tier", "no-context bits", "previous-token bits", "ratio", "tables no context",
                "tables previous"):  # fmt: skip
        table.add_column(col, justify="right")
    for k, name in enumerate(spec.tiers):
        a, b = result["bits"]["today"][k], result["bits"]["previous"][k]
        table.add_row(name, f"{a:.3f}", f"{b:.3f}", f"{b / a:.3f}x",
                      str(sum(result["tables"]["today"][: k + 1])),
                      str(sum(result["tables"]["previous"][: k + 1])))  # fmt: skip
    console.print(table)
    table = Table(title="The base with the previous token and one more context (bits per element "
                  "of the documents, held-out mean)")  # fmt: skip
    for col in ("context", "base bits", "vs previous token", "tables"):
        table.add_column(col, justify="right")
    first = result["base_candidates"]["previous token"]["bits"]
    for name, c in result["base_candidates"].items():
        table.add_row(name, f"{c['bits']:.4f}", f"{c['bits'] - first:+.4f}", str(c["tables"]))
    console.print(table)
    q = result["lag1_correlation_quartiles"]
    g = result["klt_gain_bits"]
    console.print(f"lag-1 correlation of the calibration streams, quartiles {q[0]:.2f} "
                  f"{q[1]:.2f} {q[2]:.2f}; a KLT per head could save at most K {g['K']:.3f}, "
                  f"V {g['V']:.3f} bits per element (high-resolution coding gain)")  # fmt: skip
    return result


#: Held-out KL of the nested levels the transforms are compared at, where the run has
#: no real objects (bench/progressive.py, 2026-11-28: docs/levels.md).
REFERENCE_KLS = {"default": 0.0043, "low": 0.0120}


def transforms_study(console: Any, args: argparse.Namespace, model: Any, profile: Any,
                     samples: dict[str, tuple[str, Any]], real: dict[str, Any] | None
                     ) -> dict[str, Any]:  # fmt: skip
    """Keys before RoPE and a KLT per head against today's channels, at the same KL."""
    from codecbench.transforms import transform_study
    from rich.table import Table

    from kvcdn.calibrate import bundled_texts, calibration_samples, sensitivity

    t = time.perf_counter()
    calib = calibration_samples(model, bundled_texts(), args.context_tokens)
    fisher = sensitivity(model, calib, profile.sinks)
    references = dict(REFERENCE_KLS)
    if real is not None:
        references = {name: real["summary"][name]["nested"]["kl"] for name in references}
    result = transform_study(model, calib, fisher, profile.sinks,
                             {doc: sample for doc, (_, sample) in samples.items()},
                             references, progress=log)  # fmt: skip
    log(f"transforms study in {time.perf_counter() - t:.0f} s")
    table = Table(title=f"Transforms before quantisation: {model.name}, mean of {len(samples)} "
                  "held-out documents; bits of the symbols (tables from the calibration texts, "
                  "the previous token's sign as context) at the KL of today's levels")  # fmt: skip
    table.add_column("scheme")
    for ref, kl in references.items():
        for col in (f"bits at {ref}'s KL {kl:.4f}", "vs today", "PPL Δ%"):
            table.add_column(col, justify="right")
    today = result["schemes"]["channels (today)"]["at"]
    for name, scheme in result["schemes"].items():
        cells = []
        for ref in references:
            at, base = scheme["at"][ref], today[ref]
            if at["bits"] is None or base["bits"] is None:
                cells += ["outside the sweep", "", ""]
                continue
            cells += [f"{at['bits']:.3f}", f"{at['bits'] - base['bits']:+.3f}",
                      f"{at['ppl_delta_pct']:+.2f}"]  # fmt: skip
        table.add_row(name, *cells)
    console.print(table)
    inv = result["inverse"]
    console.print(f"the inverse transforms of a 256-token chunk on {inv['threads']} threads: "
                  f"a KLT per head {inv['klt_mb_s']:.0f} MB/s, RoPE's rotation of the keys "
                  f"{inv['rope_mb_s']:.0f} MB/s (fp16-equivalent)")  # fmt: skip
    return result


def design_study(console: Any, args: argparse.Namespace, model: Any, profile: Any,
                 samples: dict[str, tuple[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """A ladder planned by real-KL bisection on the calibration texts, both layouts'
    entropy estimates on the held-out documents, and the split-in-two ablation."""
    import numpy as np
    import torch
    from rich.table import Table

    from kvcdn import progressive as pg
    from kvcdn.calibrate import bundled_texts, calibration_samples, sensitivity, step_scale
    from kvcdn.codec_profile import LADDER
    from kvcdn.quality import measure

    sinks, mean = profile.sinks, profile.mean
    ladder = [name for name in reversed(LADDER) if name in profile.levels]  # coarsest first
    t = time.perf_counter()
    calib = calibration_samples(model, bundled_texts(), args.context_tokens)
    fisher = sensitivity(model, calib, sinks)
    body = torch.cat([s.kv[:, :, :, sinks:] for s in calib], dim=3).numpy()
    unit, floor = step_scale(body, mean, fisher)
    x_cal = pg.streams_of(body, mean)
    per_sample = [pg.streams_of(s.kv[:, :, :, sinks:].numpy(), mean) for s in calib]
    fisher_n, unit_n, floor_n = fisher.reshape(-1), unit.reshape(-1), floor.reshape(-1)
    log(f"calibration samples and sensitivity in {time.perf_counter() - t:.1f} s")

    def with_body(sample: Any, streams: np.ndarray) -> torch.Tensor:
        kv = sample.kv.clone()
        kv[:, :, :, sinks:] = torch.from_numpy(pg.values_of(streams, mean))
        return kv

    def nested_kv(sample: Any, x: np.ndarray, plan: pg.NestedPlan, level: int) -> torch.Tensor:
        n = pg.indices(x, plan)[level]
        return with_body(sample, pg.reconstruct(n, plan, level))

    def kl_of(plan: pg.NestedPlan) -> float:
        top = plan.levels - 1
        return float(np.mean([measure(model, s, nested_kv(s, x, plan, top))["kl"]
                              for s, x in zip(calib, per_sample, strict=True)]))  # fmt: skip

    # The base: the strength whose calibration bits are --base-bits (bisection, no model).
    def base_step(strength: float) -> np.ndarray:
        return np.maximum(strength * unit_n, np.maximum(floor_n, 1e-6))

    lo, hi = 0.2, 8.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        bits = pg.level_bits(x_cal, pg.base_plan(base_step(mid)))[0]
        lo, hi = (mid, hi) if bits > args.base_bits else (lo, mid)
    base_strength = hi
    plan = pg.base_plan(base_step(base_strength))
    t = time.perf_counter()
    for name in ladder:
        plan = pg.plan_refinement(x_cal, plan, fisher_n, kl_of, LADDER[name])
        split = float((plan.depth[-1] > plan.depth[-2]).mean())
        log(f"refinement {name}: {split:.1%} of streams split ({time.perf_counter() - t:.0f} s)")
    names = ["base", *ladder]

    results: dict[str, Any] = {}
    for doc, (origin, sample) in samples.items():
        x = pg.streams_of(sample.kv[:, :, :, sinks:].numpy(), mean)
        rows: dict[str, Any] = {}
        nested_bits = pg.level_bits(x, plan)
        for k, name in enumerate(names):
            row = {"nested": {"bits": nested_bits[k],
                              **measure(model, sample, nested_kv(sample, x, plan, k))}}  # fmt: skip
            if name in profile.levels:
                step = profile.levels[name].step.astype(np.float64).reshape(-1)
                n = np.clip(np.rint(x / step[:, None]), -pg.BASE_LIMIT, pg.BASE_LIMIT)
                kv = with_body(sample, n * step[:, None])
                row["independent"] = {"bits": float(pg.base_bits(n.astype(np.int64)).mean()),
                                      **measure(model, sample, kv)}  # fmt: skip
            rows[name] = row
        half = plan.base_step[:, None] / 2
        rows["ablation"] = {
            "midtread-half-step": measure(model, sample,
                                          with_body(sample, np.rint(x / half) * half)),
            "midrise-half-step": measure(model, sample,
                                         with_body(sample, (np.floor(x / half) + 0.5) * half)),
        }  # fmt: skip
        results[doc] = {"origin": origin, "rows": rows}
        log(f"{doc}: done")
    def mean_of(name: str, layout: str, key: str) -> float:
        return float(np.mean([r["rows"][name][layout][key] for r in results.values()]))

    table = Table(title=f"Nested against independent levels: {model.name}, mean of "
                  f"{len(results)} held-out documents, {args.context_tokens}-token contexts "
                  "(bits: entropy estimates)")  # fmt: skip
    for col in ("level", "independent bits", "KL", "PPL Δ%", "nested bits", "KL", "PPL Δ%",
                "nested/independent bits", "streams split"):  # fmt: skip
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for k, name in enumerate(names):
        nb, nk, npp = (mean_of(name, "nested", key) for key in ("bits", "kl", "ppl_delta_pct"))
        split = float((plan.depth[k] > plan.depth[k - 1]).mean()) if k else 0.0
        summary[name] = {"nested": {"bits": nb, "kl": nk, "ppl_delta_pct": npp},
                         "streams_split": split}  # fmt: skip
        if "independent" in results[next(iter(results))]["rows"][name]:
            ib, ik, ip = (mean_of(name, "independent", key)
                          for key in ("bits", "kl", "ppl_delta_pct"))  # fmt: skip
            summary[name]["independent"] = {"bits": ib, "kl": ik, "ppl_delta_pct": ip}
            table.add_row(name, f"{ib:.3f}", f"{ik:.4f}", f"{ip:+.2f}", f"{nb:.3f}",
                          f"{nk:.4f}", f"{npp:+.2f}", f"{nb / ib:.3f}x", f"{split:.1%}")
        else:
            table.add_row(name, "", "", "", f"{nb:.3f}", f"{nk:.4f}", f"{npp:+.2f}", "",
                          f"{split:.1%}")  # fmt: skip
    console.print(table)
    top = ladder[-1]
    stored_independent = sum(summary[n]["independent"]["bits"] for n in ladder)
    stored_nested = summary[top]["nested"]["bits"]
    abl = {key: float(np.mean([r["rows"]["ablation"][key]["kl"] for r in results.values()]))
           for key in ("midtread-half-step", "midrise-half-step")}  # fmt: skip
    console.print(
        f"store bits per element, every level: independent {stored_independent:.2f}, nested "
        f"{stored_nested:.2f} ({stored_nested / stored_independent:.2f}x); the whole nested "
        f"object is {stored_nested / summary[top]['independent']['bits']:.3f}x the "
        f"independent {top} alone\n"
        f"ablation, half the base step: midtread KL {abl['midtread-half-step']:.4f}, midrise "
        f"(split in two) KL {abl['midrise-half-step']:.4f} "
        f"({abl['midrise-half-step'] / abl['midtread-half-step']:.1f}x)"
    )
    return {"base_strength": base_strength, "summary": summary,
            "store_bits": {"independent": stored_independent, "nested": stored_nested},
            "ablation_kl": abl, "documents": results,
            "estimator": "ideal per-stream entropy on the document, tokens after the sinks"}


if __name__ == "__main__":
    sys.exit(main())
