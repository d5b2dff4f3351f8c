"""``load_context``: from a document reference to a model cache ready to answer."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcdn import catalog
from kvcdn.codec import RANS_CODEC, TEXT_LEVEL
from kvcdn.errors import DocumentTooLong, FingerprintMismatch, FormatError, InputError, NotFound
from kvcdn.keys import NAME_PATTERN
from kvcdn.kv import split_chunks
from kvcdn.manifest import Manifest, ObjectRef
from kvcdn.models import LoadedModel, crop_cache, load_model
from kvcdn.profiles import load_profile
from kvcdn.publish import document_text, is_document_path, read_document, source_digest
from kvcdn.signing import TrustPolicy
from kvcdn.store import Reader, Store, open_store

from . import checks
from .devspeed import device_speed
from .edges import Cancel, EdgeStore
from .planner import INITIAL_BPS, HarmonicPredictor, Policy, ThroughputPredictor, plan
from .streaming import ChunkReport, FetchFn, Pipeline

if TYPE_CHECKING:
    import torch

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


@dataclass
class LoadPlan:
    """What ``load_context`` did: per chunk the level and source, the bytes, the times.

    ``predicted_ttft_s`` is what the first plan expected and ``ready_s`` what
    happened, both in seconds from the call (model loading excluded). The
    time to first token of a question asked at once is ``ready_s`` plus the
    answer's own ``ttft_s``; ``predicted_ttft_s`` includes an estimate of
    that last step, a 64-token question's forward pass (chat framing included).
    """

    store: str
    level: str  # what was asked for: "auto", a level name, or "text"
    chunk_levels: list[str]
    bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    #: Per chunk, what served its object: an edge URL, "origin" (after every
    #: edge failed), the store's URL (no edges), or "text" (recomputed).
    chunk_sources: list[str] = field(default_factory=list)
    chunks: list[ChunkReport] = field(default_factory=list)
    deadline_s: float | None = None
    predicted_ttft_s: float | None = None
    ready_s: float = 0.0
    #: The first plan expected to meet the deadline; False: it could not, and
    #: the load did its best (the fastest plan it found).
    feasible: bool = True
    replans: int = 0
    cancelled: int = 0  # fetches abandoned because they could no longer make the deadline
    #: Who signed the manifest (``Signer.to_json()``), or None when it is unsigned.
    signed_by: dict[str, Any] | None = None
    #: Edges that served bytes failing verification during the load (each was skipped).
    rejected: list[str] = field(default_factory=list)

    @property
    def mean_quality(self) -> float | None:
        """The quality score of the loaded chunks (1.0: exact), weighted by their tokens."""
        tokens = sum(c.tokens for c in self.chunks)
        if not tokens:
            return None
        return sum(c.quality * c.tokens for c in self.chunks) / tokens


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    ttft_s: float  # from the question's first token into the model to the first answer token
    first_token_logits: torch.Tensor


class Context:
    """A document's KV, loaded into a model's cache, ready for questions."""

    def __init__(self, manifest: Manifest, model: LoadedModel, cache: Any, plan: LoadPlan):
        self.manifest = manifest
        self.model = model
        self.cache = cache
        self.plan = plan
        self.token_ids = manifest.token_ids

    @property
    def name(self) -> str:
        return f"{self.manifest.name}@{self.manifest.version}"

    def _question_ids(self, question: str) -> list[int]:
        return self.model.question_ids(question)

    def generate(self, question: str, *, max_new_tokens: int = 64) -> Answer:
        """Answer ``question`` about the document (greedy decoding).

        The document, the question and ``max_new_tokens`` must fit the model's
        context window together (:class:`~kvcdn.errors.DocumentTooLong` at once
        otherwise).
        """
        window = self.model.context_window
        question = checks.question(question, window)
        max_new_tokens = checks.count(max_new_tokens, "max_new_tokens", 1, window)
        q_ids = self._question_ids(question)
        needed = len(self.token_ids) + len(q_ids) + max_new_tokens
        if needed > window:
            raise DocumentTooLong(
                f"the question is {len(q_ids):,} tokens: with the {len(self.token_ids):,} "
                f"tokens before it and up to {max_new_tokens} answer tokens that is "
                f"{needed:,}, more than {self.model.name}'s context window of {window:,}"
            )
        return self._answer(q_ids, max_new_tokens)

    def _answer(self, q_ids: list[int], max_new_tokens: int) -> Answer:
        try:
            out, ttft, logits = self.model.greedy(self.cache, q_ids, max_new_tokens)
        finally:
            crop_cache(self.cache, len(self.token_ids))  # ready for the next question
        return Answer(self.model.decode(out), out, ttft, logits)


def answer_with_prefill(
    model: LoadedModel, token_ids: list[int], question: str, *, max_new_tokens: int = 64
) -> Answer:
    """The baseline: answer after a full prefill of the document (no kvcdn)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.model.config)
    out, ttft, logits = model.greedy(
        cache, token_ids + model.question_ids(question), max_new_tokens
    )
    return Answer(model.decode(out), out, ttft, logits)


def open_reader(
    store: str | Reader | None,
    *,
    endpoint_url: str | None = None,
    edges: list[str] | None = None,
    edge_token: str | None = None,
    trust: TrustPolicy | None = None,
) -> Reader:
    """What ``load_context`` reads through: the edges (falling back to ``store``) or the store.

    Without ``trust``, manifests and pointers are read from ``store`` when one
    is given, not from the edges: only the origin decides which objects load.
    """
    checks.store(store)
    checks.optional_string(endpoint_url, "endpoint_url")
    if edges is not None:
        origin = None
        if isinstance(store, Store):
            origin = store
        elif isinstance(store, str):
            origin = open_store(store, endpoint_url=endpoint_url, create=False)
        return EdgeStore(edges, origin, token=edge_token, documents_from_origin=trust is None)
    if store is None or isinstance(store, str):
        return open_store(store, endpoint_url=endpoint_url, create=False)
    return store  # a Store, or an EdgeStore the caller configured


def resolve_manifest(
    source: str | Path,
    reader: Reader,
    model: str | LoadedModel | None,
    device: str | None = None,
    trust: TrustPolicy | None = None,
) -> tuple[Manifest, LoadedModel | None, float]:
    """The manifest ``source`` names (``name[@version]``, a document path or its text).

    A document's text is found by its digest for a model, so that path loads
    the model (``model``, or the default) first; the manifest found must say
    it was published from that very text. Returns the manifest, the model if
    loaded (or given), and the seconds spent loading it.
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
        loaded = load_model(model if isinstance(model, str) else None, device)
        model_s = time.perf_counter() - t
    found = catalog.find_by_source(reader, loaded.fingerprint, source_digest(text), trust=trust)
    if found is None:
        raise NotFound(
            f"{what} has not been published for model {loaded.name} in {reader.url}; "
            "publish it first (kvcdn publish)"
        )
    return found, loaded, model_s


def check_against_model(manifest: Manifest, loaded: LoadedModel) -> None:
    """Refuse KV that this model cannot hold, before anything is allocated for it:
    another model's, a layout that differs from the model's, more tokens than its
    context window, token ids outside its vocabulary."""
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
    loaded.check_fits(manifest.token_count)
    vocab = loaded.vocab_size
    if any(t >= vocab for c in manifest.chunks for t in c.tokens):
        raise FormatError(f"{manifest.ref} holds token ids outside {loaded.name}'s vocabulary")


def load_context(
    source: str | Path,
    *,
    model: str | LoadedModel | None = None,
    store: str | Reader | None = None,
    quality: str = AUTO,
    deadline_s: float | None = None,
    device: str | None = None,
    endpoint_url: str | None = None,
    edges: list[str] | None = None,
    edge_token: str | None = None,
    predictor: ThroughputPredictor | None = None,
    policy: Policy | None = None,
    trust: TrustPolicy | str | Path | None = None,
) -> Context:
    """Load a published document's KV into a model cache.

    ``source`` is a document path, its text, or ``name[@version]``. The model
    defaults to the one the document was published with.

    ``quality="auto"`` (the default) picks each chunk's level, or recomputes
    it from its tokens, to finish within ``deadline_s`` seconds of this call
    (model loading excluded) at the best quality the link and the device
    allow, re-planning as chunks arrive; without a deadline every chunk is
    fetched at the best level. A level name loads every chunk at that level;
    ``"text"`` recomputes the whole document (a full prefill).
    ``ctx.plan`` reports what was done, chunk by chunk.

    With ``edges`` (edge node URLs), everything is read through them: each
    document from the edges its placement prefers, failing over to the next
    edge on errors and timeouts, and to ``store`` last when one is given
    (with ``edges`` and no ``store``, only the edges are asked).
    ``edge_token`` is the edges' read token.

    ``predictor`` replaces the link's throughput predictor (by default one
    per source, kept for the process: RobustMPC's harmonic mean), and
    ``policy`` the planner (:func:`kvcdn.sdk.planner.plan`).

    ``trust`` (a :class:`~kvcdn.signing.TrustPolicy` or a trust file's path)
    loads only KV whose manifest is signed by a trusted publisher key, and
    never an older latest version than one already seen (keep one
    ``TrustPolicy`` across loads for that). Without it, unsigned documents
    load as before, and edges serve only what the origin's manifest names.
    """
    started = time.perf_counter()
    deadline_s = checks.deadline(deadline_s)
    quality = checks.quality(quality)
    checks.model(model)
    checks.optional_string(device, "device")
    trust = checks.trust(trust)
    seconds: dict[str, float] = {}
    reader = open_reader(
        store, endpoint_url=endpoint_url, edges=edges, edge_token=edge_token, trust=trust
    )
    rejected_before = len(getattr(reader, "rejected", ()))
    timed = _TimedReader(reader)
    manifest, loaded, model_s = resolve_manifest(source, timed, model, device, trust)
    started += model_s  # loading the model is a one-off cost, not part of resolving
    if loaded is None:
        t_model = time.perf_counter()
        loaded = load_model(model or manifest.model_name, device)
        started += time.perf_counter() - t_model
    seconds["resolve"] = time.perf_counter() - started
    check_against_model(manifest, loaded)
    _check_quality(manifest, quality)
    if predictor is None:
        predictor = _link_predictor(reader.url)
        if isinstance(predictor, HarmonicPredictor) and not predictor.samples:
            # from the default prior each time: a slow resolve must not lower it for good
            predictor.initial_bps = timed.throughput_bound(INITIAL_BPS)
    load = _Load(manifest, loaded, reader, quality, deadline_s, started, seconds)
    context = load.run(predictor, policy or plan)
    context.plan.signed_by = manifest.signer.to_json() if manifest.signer else None
    context.plan.rejected = [str(r) for r in getattr(reader, "rejected", ())[rejected_before:]]
    return context


class _TimedReader:
    """A reader that times its ``get`` calls, for a first look at a new link.

    Resolving a document reads a tiny pointer and then the manifest (tens of
    kilobytes); the difference of their times is the manifest's transfer
    without the per-request overhead, which would otherwise swamp it.
    """

    SMALL = 4096  # bytes: a read this small is all overhead

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads: list[tuple[int, float]] = []

    def get(self, key: str, **kwargs: Any) -> bytes:
        t = time.perf_counter()
        data = self.inner.get(key, **kwargs)
        self.reads.append((len(data), time.perf_counter() - t))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

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


#: The SDK's throughput predictors, one per source, kept for the process.
_predictors: dict[str, ThroughputPredictor] = {}
_predictors_lock = threading.Lock()


def forget_links() -> None:
    """Forget the throughput the SDK has learnt for each source (after a network
    change, or to measure loads that start cold)."""
    with _predictors_lock:
        _predictors.clear()


def _link_predictor(source: str) -> ThroughputPredictor:
    with _predictors_lock:
        if source not in _predictors:
            _predictors[source] = HarmonicPredictor()
        return _predictors[source]


def quality_scores(manifest: Manifest) -> dict[str, float]:
    """Each level's quality score for the planner: 1.0 is the model's exact KV.

    The score is the level's measured top-1 agreement with exact KV minus its
    mean KL (which orders levels of equal agreement). ``fp16`` and ``text``
    are exact. A lossy level without a measurement is scored like the best
    measured level with no more bits per element, else 0.99.
    """
    scores: dict[str, float] = {TEXT_LEVEL: 1.0}
    for name, lv in manifest.levels.items():
        if lv.codec == "fp16":
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


def _check_quality(manifest: Manifest, quality: str) -> None:
    if quality in (AUTO, TEXT_LEVEL) or quality in manifest.levels:
        return
    raise InputError(
        f"{manifest.name}@{manifest.version} has no level '{quality}' (it has "
        f"{', '.join(manifest.levels)}; or use 'auto', or 'text' to recompute)"
    )


class _Load:
    """One ``load_context`` call after resolving: the pipeline, then the cache."""

    def __init__(
        self,
        manifest: Manifest,
        loaded: LoadedModel,
        reader: Reader,
        quality: str,
        deadline_s: float | None,
        started: float,
        seconds: dict[str, float],
    ) -> None:
        self.manifest = manifest
        self.loaded = loaded
        self.reader = reader
        self.quality = quality
        self.deadline_s = deadline_s
        self.started = started  # perf_counter at the call, model loading excluded
        self.seconds = seconds

    def run(self, predictor: ThroughputPredictor, policy: Policy) -> Context:
        import torch

        manifest, loaded = self.manifest, self.loaded
        # The chain hashes must follow from the manifest's own tokens: this ties
        # every object key back to the text the manifest claims it holds.
        expected = split_chunks(loaded.fingerprint, manifest.token_ids, manifest.chunk_tokens)
        if [c.hash for c in expected] != [c.hash for c in manifest.chunks]:
            raise FormatError(
                f"manifest of {manifest.name}@{manifest.version}: chunk hashes do not match "
                "its tokens"
            )
        if self.quality == TEXT_LEVEL:
            return self._recompute()
        stored = [lv for lv in manifest.levels if lv != TEXT_LEVEL]
        levels = stored if self.quality == AUTO else [self.quality]
        for chunk in manifest.chunks:
            if not any(lv in chunk.objects for lv in levels):
                raise FormatError(
                    f"{manifest.name}@{manifest.version} lacks level {levels[0]} for chunk "
                    f"{chunk.index}"
                )
        placement = manifest.chain_hash
        t = time.perf_counter()
        profile = None
        if manifest.codec_profile is not None and any(
            manifest.levels[lv].codec == RANS_CODEC for lv in levels
        ):
            profile_reader = (
                self.reader.placed(placement) if isinstance(self.reader, EdgeStore) else self.reader
            )
            profile = load_profile(profile_reader, manifest.codec_profile)
            profile.check_model(loaded.fingerprint, f"the codec profile of {manifest.name}")
        speed, measured_s = device_speed(loaded, manifest, profile)
        if measured_s:  # once per device and model, like loading the model: not on the clock
            self.started += measured_s
            self.seconds["measure_device"] = measured_s
        self.seconds["prepare"] = time.perf_counter() - t - measured_s

        layout = manifest.kv_layout
        shape = (layout["layers"], 2, layout["kv_heads"], manifest.token_count, layout["head_dim"])
        # Every chunk is decoded (or recomputed) straight into its slice of one tensor.
        dtype = torch.float32 if loaded.device == "cpu" else next(loaded.model.parameters()).dtype
        kv = torch.empty(shape, dtype=dtype, device=loaded.device)
        reserve_s = speed.recompute_seconds(ANSWER_RESERVE_TOKENS, manifest.token_count)
        deadline_at = None
        if self.deadline_s is not None and self.quality == AUTO:
            deadline_at = self.started + self.deadline_s * (1 - DEADLINE_MARGIN) - reserve_s
        pipeline = Pipeline(
            manifest,
            loaded,
            kv,
            fetch=self._fetcher(placement),
            profile=profile,
            speed=speed,
            predictor=predictor,
            policy=policy,
            levels=levels,
            allow_text=self.quality == AUTO,
            quality_of=quality_scores(manifest),
            deadline_at=deadline_at,
            concurrency=2 if deadline_at is not None else 4,
            cancel_late_fetches=getattr(policy, "cancels_late_fetches", True),
        )
        t = time.perf_counter()
        result = pipeline.run()
        self.seconds["load"] = time.perf_counter() - t

        t = time.perf_counter()
        cache = loaded.cache_from_kv(kv)
        self.seconds["assemble"] = time.perf_counter() - t
        ready_s = time.perf_counter() - self.started
        head_s = t - self.started - self.seconds["load"]  # before the pipeline started
        plan = LoadPlan(
            store=self.reader.url,
            level=self.quality,
            chunk_levels=[c.level for c in result.chunks],
            bytes=sum(c.bytes for c in result.chunks),
            seconds=self.seconds,
            chunk_sources=[c.source for c in result.chunks],
            chunks=result.chunks,
            deadline_s=self.deadline_s,
            predicted_ttft_s=head_s + result.predicted_s + reserve_s,
            ready_s=ready_s,
            feasible=result.feasible,
            replans=result.replans,
            cancelled=result.cancelled,
        )
        log.info(
            "loaded %s@%d (%s): %s; %d bytes; ready in %.2f s (predicted %.2f s with the answer)",
            manifest.name,
            manifest.version,
            self.quality,
            ", ".join(f"{n}×{lv}" for lv, n in Counter(plan.chunk_levels).items()),
            plan.bytes,
            ready_s,
            plan.predicted_ttft_s,
        )
        return Context(manifest, loaded, cache, plan)

    def _fetcher(self, placement: str) -> FetchFn:
        reader = self.reader
        if isinstance(reader, EdgeStore):
            edges = reader

            def fetch_edge(ref: ObjectRef, on_bytes: Any, cancel: Cancel) -> tuple[bytes, str]:
                got = edges.fetch(
                    ref.key, placement, on_bytes=on_bytes, cancel=cancel,
                    max_bytes=ref.bytes, check=ref.check,
                )  # fmt: skip
                return got.data, got.source

            return fetch_edge

        def fetch_store(ref: ObjectRef, on_bytes: Any, cancel: Cancel) -> tuple[bytes, str]:
            # a store read cannot be interrupted; it is short
            data = reader.get(ref.key, max_bytes=ref.bytes, check=ref.check)
            on_bytes(len(data))
            return data, reader.url

        return fetch_store

    def _recompute(self) -> Context:
        """The ``text`` level: prefill the manifest's tokens on the device."""
        manifest, loaded = self.manifest, self.loaded
        t = time.perf_counter()
        cache = loaded.cache_from_kv(loaded.prefill(manifest.token_ids))
        self.seconds["recompute"] = time.perf_counter() - t
        ready_s = time.perf_counter() - self.started
        n = len(manifest.chunks)
        plan = LoadPlan(
            store=self.reader.url,
            level=TEXT_LEVEL,
            chunk_levels=[TEXT_LEVEL] * n,
            bytes=0,
            seconds=self.seconds,
            chunk_sources=[TEXT_LEVEL] * n,
            chunks=[
                ChunkReport(c.index, c.end - c.start, TEXT_LEVEL, TEXT_LEVEL, 0, 0.0, ready_s, 1.0)
                for c in manifest.chunks
            ],
            deadline_s=self.deadline_s,
            ready_s=ready_s,
        )
        return Context(manifest, loaded, cache, plan)
