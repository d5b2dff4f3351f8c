"""The one load path: a source to a manifest (resolved once), checked against the model,
then planned, fetched, verified and decoded chunk by chunk into a KV target.

:class:`~kvcdn.sdk.Client` drives it; nothing here keeps state between loads.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcdn import catalog
from kvcdn.codec import TEXT_LEVEL, IndexCache, is_exact, uses_profile
from kvcdn.codec_profile import CodecProfile
from kvcdn.document import document_text, is_document_path, read_document, source_digest
from kvcdn.errors import FingerprintMismatch, FormatError, InputError, KvcdnError, NotFound
from kvcdn.keys import NAME_PATTERN
from kvcdn.kv import split_chunks
from kvcdn.manifest import Manifest, ObjectRef
from kvcdn.models import LoadedModel, ModelIdentity
from kvcdn.profile_store import ProfileCache, load_profile
from kvcdn.signing import TrustPolicy
from kvcdn.store import Fetched, Reader, ReaderBase, Store, open_store

from . import checks
from .bounded import BoundedReader
from .context import LoadPlan
from .devspeed import DeviceSpeeds, assumed_speed
from .edges import EdgeStore
from .planner import Policy, ThroughputPredictor, fetch_first, plan
from .streaming import (
    AppLoad,
    ChunkReport,
    EngineLoad,
    LayerGroups,
    LoadOptions,
    Pipeline,
    PipelineResult,
)
from .targets import KVTarget

log = logging.getLogger(__name__)

#: ``quality="auto"``: each chunk's level (or recompute) chosen by the planner.
AUTO = "auto"
#: The deadline keeps room for a question of this many tokens (chat framing included)
#: to reach its first token.
ANSWER_RESERVE_TOKENS = 64
#: The planner aims this fraction of the deadline early: estimates of device work
#: running beside fetches (and the cache assembly after the last chunk) run short.
DEADLINE_MARGIN = 0.05
_REF = re.compile(rf"^{NAME_PATTERN}(@(\d+|latest))?$")

#: ``models(name)``: the loaded model called ``name`` (None: the default one).
ModelSource = Callable[[str | None], LoadedModel]


def open_reader(
    store: str | Reader | None,
    *,
    endpoint_url: str | None = None,
    edges: list[str] | None = None,
    edge_token: str | None = None,
    trust: TrustPolicy | None = None,
) -> Reader:
    """What loads read through: the edges (falling back to ``store``) or the store.

    Without ``trust``, manifests and pointers are read from ``store`` when one
    is given, not from the edges: only the origin decides which objects load.
    Every read can be given up at its deadline (:class:`BoundedReader`).
    """
    checks.store(store)
    checks.optional_string(endpoint_url, "endpoint_url")
    if isinstance(store, BoundedReader):
        return store
    inner: Reader
    if edges is not None:
        origin = None
        if isinstance(store, Store):
            origin = store
        elif isinstance(store, str):
            origin = open_store(store, endpoint_url=endpoint_url, create=False)
        inner = EdgeStore(edges, origin, token=edge_token, documents_from_origin=trust is None)
    elif store is None or isinstance(store, str):
        inner = open_store(store, endpoint_url=endpoint_url, create=False)
    else:
        inner = store  # a Store, or an EdgeStore the caller configured
    return BoundedReader(inner)


class TimedReader(ReaderBase):
    """A reader that times its reads, for a first look at a new link.

    Resolving a document reads a tiny pointer and then the manifest (tens of
    kilobytes); the difference of their times is the manifest's transfer
    without the per-request overhead, which would otherwise swamp it.
    """

    SMALL = 4096  # bytes: a read this small is all overhead

    def __init__(self, inner: Reader) -> None:
        self.inner = inner
        self.url = inner.url
        self.local = getattr(inner, "local", False)
        self.reads: list[tuple[int, float]] = []

    def fetch(self, key: str | ObjectRef, **options: Any) -> Fetched:
        """The inner reader's fetch (its options as :meth:`Reader.fetch`'s), timed."""
        got = self.inner.fetch(key, **options)
        self.reads.append((len(got.data), got.seconds))
        return got

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def throughput_bound(self, prior_bps: float) -> float:
        """A new link's throughput before any chunk: ``prior_bps``, or less if the
        largest read shows the link is slower.

        A read of tens of kilobytes over a fast link takes less time than the
        requests' overhead varies by, so it can only show that a link is slow,
        never that it is fast: the estimate never rises above the prior.
        """
        small = [s for n, s in self.reads if n <= self.SMALL]
        if not self.reads:
            return prior_bps
        nbytes, seconds = max(self.reads)
        if nbytes <= self.SMALL:
            return prior_bps
        transfer_s = seconds - min(small, default=0.0)
        if transfer_s <= 0:
            return prior_bps
        return max(1e3, min(prior_bps, nbytes / transfer_s))


def resolve_manifest(
    source: str | Path,
    reader: Reader,
    models: ModelSource,
    model: str | LoadedModel | None,
    trust: TrustPolicy | None = None,
) -> tuple[Manifest, LoadedModel | None, float]:
    """The manifest ``source`` names (``name[@version]``, a document path or its text).

    A document's text is found by its digest for a model, so that path loads
    the model (``model``, or the default, from ``models``) first; the
    manifest found must say it was published from that very text. Returns the
    manifest, the model if loaded (or given), and the seconds spent loading it.
    """
    source = checks.source(source)
    loaded = model if isinstance(model, LoadedModel) else None
    model_s = 0.0
    if isinstance(source, Path) or is_document_path(source):
        text, what = read_document(source), str(source)
    elif _REF.match(source.strip()):
        name, version = catalog.parse_ref(source.strip())
        return catalog.read_manifest(reader, name, version, trust=trust), loaded, model_s
    else:
        text, what = document_text(source.encode("utf-8"), "the text"), "the text"
    if loaded is None:
        t = time.perf_counter()
        loaded = models(model if isinstance(model, str) else None)
        model_s = time.perf_counter() - t
    found = catalog.find_by_source(reader, loaded.fingerprint, source_digest(text), trust=trust)
    if found is None:
        raise NotFound(
            f"{what} has not been published for model {loaded.name} in {reader.url}; "
            "publish it first (kvcdn publish)"
        )
    return found, loaded, model_s


def check_against_model(manifest: Manifest, loaded: LoadedModel | ModelIdentity) -> None:
    """Refuse KV that this model cannot hold, before anything is allocated for it:
    another model's, a layout that differs from the model's, more tokens than its
    context window, token ids outside its vocabulary, chunk hashes that do not
    follow from the manifest's own tokens (which tie every object key to its text)."""
    if loaded.fingerprint != manifest.model_fingerprint:
        raise FingerprintMismatch(
            f"{manifest.ref} holds KV of model {manifest.model_name} "
            f"(fingerprint {manifest.model_fingerprint[:12]}), not of {loaded.name} "
            f"({loaded.fingerprint[:12]}); load it with the model it was published with"
        )
    layout = loaded.layout
    mine = (layout.layers, layout.kv_heads, layout.head_dim)
    theirs = tuple(manifest.kv_layout[k] for k in ("layers", "kv_heads", "head_dim"))
    if theirs != mine:
        raise FormatError(
            f"{manifest.ref} describes KV of {theirs[0]} layers x {theirs[1]} heads x "
            f"{theirs[2]}, but {loaded.name} has {mine[0]} x {mine[1]} x {mine[2]}: "
            "the manifest is inconsistent"
        )
    dtype, possible = manifest.kv_layout["dtype"], kv_dtypes(loaded)
    if dtype not in possible:
        raise FormatError(
            f"{manifest.ref} says its KV was computed in {dtype}, which {loaded.name} never "
            f"computes KV in ({', '.join(sorted(possible))}): the manifest is inconsistent"
        )
    loaded.check_fits(manifest.token_count)
    vocab = loaded.vocab_size
    if any(t >= vocab for c in manifest.chunks for t in c.tokens):
        raise FormatError(f"{manifest.ref} holds token ids outside {loaded.name}'s vocabulary")
    expected = split_chunks(loaded.fingerprint, manifest.token_ids, manifest.chunk_tokens)
    if [c.hash for c in expected] != [c.hash for c in manifest.chunks]:
        raise FormatError(f"manifest of {manifest.ref}: chunk hashes do not match its tokens")


def kv_dtypes(model: LoadedModel | ModelIdentity) -> set[str]:
    """The dtypes a publisher computes this model's KV in: float32 (transformers on a
    CPU), bfloat16 (on a GPU, and vLLM's default for float32 checkpoints), and the
    checkpoint's own dtype (what an engine serving it as it is computes in)."""
    if isinstance(model, LoadedModel):
        stored = getattr(model.model.config, "dtype", None) or "float32"
        checkpoint = str(stored).removeprefix("torch.")
    else:
        checkpoint = model.layout.dtype  # from the model folder's config
    return {"float32", "bfloat16", checkpoint}


def check_quality(manifest: Manifest, quality: str) -> list[str]:
    """The stored levels a load at ``quality`` may fetch (``[]`` for ``text``)."""
    if quality == TEXT_LEVEL:
        return []
    if quality != AUTO and quality not in manifest.levels:
        raise InputError(
            f"{manifest.ref} has no level '{quality}' (it has "
            f"{', '.join(manifest.levels)}; or use 'auto', or 'text' to recompute)"
        )
    stored = [lv for lv in manifest.levels if lv != TEXT_LEVEL]
    levels = stored if quality == AUTO else [quality]
    for chunk in manifest.chunks:
        if not any(lv in chunk.objects for lv in levels):
            raise FormatError(f"{manifest.ref} lacks level {levels[0]} for chunk {chunk.index}")
    return levels


def quality_scores(manifest: Manifest) -> dict[str, float]:
    """Each level's quality score for the planner: 1.0 is the model's exact KV.

    The score is the level's measured top-1 agreement with exact KV minus its
    mean KL (which orders levels of equal agreement). ``fp16`` and ``text``
    are exact. A lossy level without a measurement is scored like the best
    measured level with no more bits per element, else 0.99.
    """
    scores: dict[str, float] = {TEXT_LEVEL: 1.0}
    for name, lv in manifest.levels.items():
        if is_exact(lv.codec):
            scores[name] = 1.0
        elif "top1_agree" in lv.quality:
            scores[name] = lv.quality["top1_agree"] - lv.quality.get("kl", 0.0)
    for name, lv in manifest.levels.items():
        if name not in scores:
            below = [
                scores[o]
                for o, other in manifest.levels.items()
                if o in scores and o != TEXT_LEVEL and other.bits_per_element <= lv.bits_per_element
            ]
            scores[name] = max(below, default=0.99)
    return scores


def _profile(
    manifest: Manifest, levels: list[str], reader: Reader, profiles: ProfileCache,
    fingerprint: str,
) -> CodecProfile | None:
    """The codec profile the ladder levels among ``levels`` decode with, if any."""
    if manifest.codec_profile is None or not any(
        uses_profile(manifest.levels[lv].codec) for lv in levels
    ):
        return None
    profile = load_profile(
        reader, manifest.codec_profile, placement=manifest.chain_hash, cache=profiles
    )
    profile.check_model(fingerprint, f"the codec profile of {manifest.name}")
    return profile


def _profile_or_fewer_levels(
    manifest: Manifest, levels: list[str], reader: Reader, profiles: ProfileCache,
    fingerprint: str,
) -> tuple[CodecProfile | None, dict[str, str]]:
    """:func:`_profile`; when it cannot be had (missing, damaged, not in by the
    deadline), the levels that need it fail (level -> why) and the others load."""
    try:
        return _profile(manifest, levels, reader, profiles, fingerprint), {}
    except KvcdnError as exc:
        reason = f"its codec profile cannot be used ({str(exc).splitlines()[0][:200]})"
        log.warning("%s: %s; loading without the levels that need it", manifest.ref, reason)
        return None, {lv: reason for lv in levels if uses_profile(manifest.levels[lv].codec)}


def monotonic_at(perf_deadline: float | None) -> float | None:
    """A ``time.perf_counter()`` instant on the readers' clock (``time.monotonic()``)."""
    if perf_deadline is None:
        return None
    return time.monotonic() + perf_deadline - time.perf_counter()


def within(reader: Reader, perf_deadline: float | None) -> Reader:
    """``reader`` with every read ending by ``perf_deadline`` (None: as it is)."""
    bounded = reader if isinstance(reader, BoundedReader) else BoundedReader(reader)
    return bounded.within(monotonic_at(perf_deadline))


def load_into(
    target: KVTarget,
    manifest: Manifest,
    loaded: LoadedModel,
    reader: Reader,
    *,
    quality: str,
    deadline_s: float | None,
    started: float,
    seconds: dict[str, float],
    predictor: ThroughputPredictor,
    policy: Policy | None,
    cancel_late_fetches: bool = True,
    refine: bool = True,
    profiles: ProfileCache,
    speeds: DeviceSpeeds,
    rejected_since: int | None = None,
) -> LoadPlan:
    """Fill ``target`` with ``manifest``'s KV (checked against ``loaded`` already) and
    :meth:`~KVTarget.finish` it; the load's report, built once.

    ``started`` is the ``perf_counter`` the deadline counts from (one-off
    costs such as measuring the device move it on); ``seconds`` holds the
    stages before this one (resolving), and the report's gains this load's.
    The report names the edges that served bad bytes since the reader's
    ``rejected`` record held ``rejected_since`` entries (default: from now).
    ``policy`` None: :func:`default_policy`'s.
    """
    seconds = dict(seconds)
    policy = policy or default_policy(manifest, refine)
    if rejected_since is None:
        rejected_since = len(getattr(reader, "rejected", ()))
    levels = check_quality(manifest, quality)
    if not levels:
        t = time.perf_counter()
        target.chunk(0, manifest.token_count).write(loaded.prefill(manifest.token_ids))
        seconds["recompute"] = time.perf_counter() - t
        ready_s = time.perf_counter() - started
        chunks = [ChunkReport(c.index, c.end - c.start, TEXT_LEVEL, TEXT_LEVEL, 0, 0.0, ready_s,
                              1.0) for c in manifest.chunks]  # fmt: skip
        result = PipelineResult(chunks, 0.0, True, 0, 0, len(chunks))
        return _report(target, manifest, reader, quality, deadline_s, started, seconds, result,
                       None, rejected_since)  # fmt: skip
    t = time.perf_counter()
    ends_at = None if deadline_s is None else started + deadline_s
    profile, failed = _profile_or_fewer_levels(
        manifest, levels, within(reader, ends_at), profiles, loaded.fingerprint
    )
    # what the device costs steers an adaptive load only: a load at one level does
    # not wait seconds to measure it (it is measured on the first adaptive load)
    speed, measured_s = speeds.get(loaded, manifest, profile, measure=quality == AUTO)
    if measured_s:  # once per device and model, like loading the model: not on the clock
        started += measured_s
        ends_at = None if ends_at is None else ends_at + measured_s
        seconds["measure_device"] = measured_s
    seconds["prepare"] = time.perf_counter() - t - measured_s

    reserve_s = speed.recompute_seconds(ANSWER_RESERVE_TOKENS, manifest.token_count)
    deadline_at = None
    if deadline_s is not None and quality == AUTO:
        deadline_at = started + deadline_s * (1 - DEADLINE_MARGIN) - reserve_s
    options = LoadOptions(
        levels=tuple(levels),
        quality_of=quality_scores(manifest),
        deadline_at=deadline_at,
        fetch_deadline=ends_at,
        concurrency=2 if deadline_at is not None else 4,
        cancel_late_fetches=cancel_late_fetches,
        failed_levels=failed,
        refine=refine,
    )
    pipeline = Pipeline(manifest, target, reader, profile, speed, predictor, policy, options,
                        AppLoad(loaded, allow_text=quality == AUTO))  # fmt: skip
    t = time.perf_counter()
    result = pipeline.run()
    seconds["load"] = time.perf_counter() - t
    head_s = t - started  # before the pipeline started
    predicted = head_s + result.predicted_s + reserve_s if speed.measured else None
    plan = _report(target, manifest, reader, quality, deadline_s, started, seconds, result,
                   predicted, rejected_since)  # fmt: skip
    refused = sum(1 for c in result.chunks if c.failed)
    if refused:
        log.warning("%s: %d chunk(s) loaded another way than planned: objects that could "
                    "not be used (see the load's report)", manifest.ref, refused)  # fmt: skip
    log.info(
        "loaded %s (%s): %s; %d bytes; ready in %.2f s%s",
        manifest.ref,
        quality,
        ", ".join(f"{n}×{lv}" for lv, n in Counter(plan.chunk_levels).items()),
        plan.bytes,
        plan.ready_s,
        "" if plan.predicted_ttft_s is None  # the device was not measured: no prediction
        else f" (predicted {plan.predicted_ttft_s:.2f} s with the answer)",
    )
    return plan


def _report(
    target: KVTarget, manifest: Manifest, reader: Reader, quality: str,
    deadline_s: float | None, started: float, seconds: dict[str, float],
    result: PipelineResult, predicted_ttft_s: float | None, rejected_since: int,
) -> LoadPlan:  # fmt: skip
    """The target finished (its cache assembled) and the load's report."""
    t = time.perf_counter()
    target.finish()
    seconds["assemble"] = time.perf_counter() - t
    rejected = getattr(reader, "rejected", ())
    return LoadPlan(
        store=reader.url,
        level=quality,
        chunks=result.chunks,
        seconds=seconds,
        deadline_s=deadline_s,
        predicted_ttft_s=predicted_ttft_s,
        ready_s=time.perf_counter() - started,
        feasible=result.feasible,
        replans=result.replans,
        cancelled=result.cancelled,
        refined=result.refined,
        refinements_dropped=result.refinements_dropped,
        signed_by=manifest.signer.to_json() if manifest.signer else None,
        rejected=[str(r) for r in rejected[rejected_since:]],
    )


def default_policy(manifest: Manifest, refine: bool) -> Policy:
    """The planner of an adaptive load unless told otherwise: where the load raises
    chunks of nested objects (``refine``), :func:`~kvcdn.sdk.planner.fetch_first`, which
    leaves what the deadline allows to refinement rather than recompute; else
    :func:`~kvcdn.sdk.planner.plan`. On ``bench/abr.py --deadline 2`` the nested
    ladder met 95.0% of deadlines at quality 0.979 with the first, 92.5% at 0.971
    with the second (docs/streaming.md)."""
    nested = any(ref.tiers is not None for c in manifest.chunks for ref in c.objects.values())
    return fetch_first if refine and nested else plan


def load_prefix_into(
    target: KVTarget | LayerGroups,
    manifest: Manifest,
    reader: Reader,
    *,
    chunks: tuple[int, int],
    quality: str,
    device: str,
    predictor: ThroughputPredictor,
    policy: Policy,
    profiles: ProfileCache,
    fingerprint: str,
    deadline_s: float | None = None,
    indexes: IndexCache | None = None,
) -> PipelineResult:
    """An engine's load: the longest run of ``manifest``'s chunks ``[first, end)``
    (``chunks``) that arrives, verifies and decodes into ``target``, by
    ``deadline_s`` when given. What is not loaded is left to the engine, which
    computes it.

    The caller has checked the manifest against the model (:func:`check_against_model`,
    once, when it found the document); ``fingerprint`` is the model's. A chunk that
    fails ends the prefix (nothing after it is written) instead of failing the load. With
    ``quality="auto"`` and a deadline, each chunk's level is planned to arrive
    in time, from the link's throughput as measured while it loads. ``indexes``: the
    engine's checked indexes of objects it reads in part (:class:`IndexCache`).
    ``target`` may be :class:`LayerGroups`: a layer-ordered load, one pipeline over
    its groups' chunks, which reports each group as it ends.
    """
    if manifest.model_fingerprint != fingerprint:  # the caller's full check covers the rest
        raise FingerprintMismatch(f"{manifest.ref} holds KV of model {manifest.model_name}, "
                                  "not of the one this engine serves")  # fmt: skip
    levels = check_quality(manifest, quality)
    if not levels:
        raise InputError("an engine loads stored levels; 'text' is the engine's own prefill")
    started = time.perf_counter()
    give_up_at = None if deadline_s is None else started + deadline_s
    profile = _profile(manifest, levels, within(reader, give_up_at), profiles, fingerprint)
    deadline_at = None
    if deadline_s is not None:
        deadline_at = started + deadline_s * (1 - DEADLINE_MARGIN)
    options = LoadOptions(
        levels=tuple(levels),
        quality_of=quality_scores(manifest),
        deadline_at=deadline_at if quality == AUTO else None,
        fetch_deadline=give_up_at,
    )
    mode = EngineLoad(chunks, give_up_at, device, indexes)
    pipeline = Pipeline(manifest, target, reader, profile, assumed_speed(manifest), predictor,
                        policy, options, mode)  # fmt: skip
    result = pipeline.run()
    log.info(
        "loaded %d of %d chunks of %s into the engine (%s) in %.3f s",
        result.loaded_chunks, chunks[1] - chunks[0], manifest.ref,
        ", ".join(f"{n}×{lv}" for lv, n in Counter(c.level for c in result.chunks).items()),
        time.perf_counter() - started,
    )  # fmt: skip
    return result
