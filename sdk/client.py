"""``Client``: where a process's kvcdn reading state lives.

A client holds the store (or edges in front of it) it reads from, the trust
policy, the models it has loaded, the codec profiles it has parsed, what it
has learnt of each link's throughput and of the device's speed, and which
models passed the position self-check for blending. Two clients share none
of it; the module-level :func:`load_context` and :func:`load_contexts` use one
default client's caches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvcdn import codec
from kvcdn.cacheblend import Piece, check_positions
from kvcdn.cacheblend import blend as blend_caches
from kvcdn.errors import ArgumentError, FingerprintMismatch, InputError
from kvcdn.manifest import Manifest
from kvcdn.models import LoadedModel, ModelRegistry
from kvcdn.profile_store import ProfileCache
from kvcdn.signing import TrustPolicy
from kvcdn.store import Reader

from . import checks, planner
from .bounded import BoundedReader
from .context import BlendedContext, Context, LoadPlan
from .devspeed import DeviceSpeeds
from .edges import check_edges
from .loader import (
    AUTO,
    TimedReader,
    check_against_model,
    load_into,
    monotonic_at,
    open_reader,
    resolve_manifest,
)
from .planner import INITIAL_BPS, HarmonicPredictor, Policy, ThroughputPredictor
from .stats import ReaderStats, lookup_failure
from .targets import CacheTarget, TensorTarget

log = logging.getLogger(__name__)

#: The fraction of the documents' tokens a blend recomputes by default (the paper's choice).
RECOMPUTE_RATIO = 0.15
#: Links whose throughput a client remembers (the least recently used forgotten first).
MAX_LINKS = 64


class _Caches:
    """What a client learns and keeps (shared only with the clients it makes by
    :meth:`Client.with_options`)."""

    def __init__(self, max_models: int) -> None:
        self.models = ModelRegistry(max_models)
        self.profiles = ProfileCache()
        self.speeds = DeviceSpeeds()
        self.predictors: dict[str, ThroughputPredictor] = {}
        self.positions_checked: set[tuple[str, str]] = set()
        self.lock = threading.Lock()


class Client:
    """Reads published documents into model caches.

    ``store`` is a store URL (``s3://bucket/prefix``, a folder; default
    ``$KVCDN_STORE``) or a :class:`~kvcdn.store.Store`. With ``edges`` (edge
    node URLs), everything is read through them, each document from the edges
    its placement prefers, failing over to the next edge and then to
    ``store`` (with ``edges`` and no ``store``, only the edges are asked);
    ``edge_token`` is the edges' read token.

    ``trust`` (a :class:`~kvcdn.signing.TrustPolicy` or a trust file's path)
    loads only KV whose manifest is signed by a trusted publisher key, and
    never an older latest version than one this client has seen. Without it,
    unsigned documents load, and edges serve only what the origin's manifest
    names.

    ``device`` is where models run (default: a CUDA GPU if there is one);
    at most ``max_models`` models are kept loaded. With ``warm`` (the
    default), the client prepares in the background what a process's first
    request would otherwise wait for: the decode kernels, and the connection
    to the store (an error there is raised by the first request, not here).
    Use it as a context manager, or call :meth:`close`, to release
    connections and models.

        with sdk.Client(store="s3://bucket/kv", trust="publishers.trust") as client:
            ctx = client.load_context("sed-manual")
            print(ctx.generate("How do I edit a file in place?").text)
    """

    def __init__(
        self,
        store: str | Reader | None = None,
        *,
        edges: Sequence[str] | None = None,
        edge_token: str | None = None,
        endpoint_url: str | None = None,
        trust: TrustPolicy | str | Path | None = None,
        device: str | None = None,
        max_models: int = 2,
        warm: bool = True,
    ) -> None:
        checks.store(store)
        checks.optional_string(endpoint_url, "endpoint_url")
        checks.optional_string(device, "device")
        max_models = checks.count(max_models, "max_models", 1, 64)
        self.trust = checks.trust(trust)
        self.device = device
        self._store = store
        self._edges = None if edges is None else check_edges(edges)
        self._edge_token = checks.optional_string(edge_token, "edge_token")
        self._endpoint_url = endpoint_url
        self._reader: BoundedReader | None = None
        self._reader_lock = threading.Lock()
        self._caches = _Caches(max_models)
        self._owns_caches = True  # False for a client made by with_options
        #: What this client's lookups and loads did (docs/sdk.md): ``snapshot()`` for its
        #: totals, or ``prometheus_client.REGISTRY.register(client.stats)``.
        self.stats = ReaderStats(self._edges or ())
        # a reader the caller made is the caller's to close
        self._owns_reader = edges is not None or store is None or isinstance(store, str)
        if checks.flag(warm, "warm"):
            # The kernels in a thread Python joins at exit (a daemon thread inside
            # native code at exit aborts the process); the store's first connection in
            # a daemon thread, which an exit need not wait for.
            threading.Thread(target=self._warm_kernels, name="kvcdn-warm-up").start()
            threading.Thread(target=self._open_reader, name="kvcdn-open", daemon=True).start()

    def _warm_kernels(self) -> None:
        try:
            codec.warm_up()
            planner.warm_up()
        except Exception:  # the first request meets the same error and raises it
            log.debug("warming up the decode kernels failed", exc_info=True)

    def _open_reader(self) -> None:
        try:
            self.reader  # noqa: B018  (opens it: S3's first connection, edges' pools)
        except Exception:  # the first request meets the same error and raises it
            log.debug("opening the store failed", exc_info=True)

    def __repr__(self) -> str:
        where = self._reader.url if self._reader is not None else self._store or "default store"
        return f"Client({where!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connections to edges, and the loaded models (a client made by
        :meth:`with_options` leaves those to the client it shares them with)."""
        with self._reader_lock:  # after a warm-up that may be opening it
            reader, self._reader = self._reader, None
        if reader is not None and self._owns_reader:
            reader.close()
        if self._owns_caches:
            self._caches.models.clear()

    def with_options(
        self,
        *,
        store: str | Reader | None = None,
        edges: Sequence[str] | None = None,
        edge_token: str | None = None,
        endpoint_url: str | None = None,
        trust: TrustPolicy | str | Path | None = None,
        device: str | None = None,
    ) -> Client:
        """A client reading from another store or edges (or trusting other keys) that
        shares this one's models, profiles, link and device measurements."""
        other = Client(
            store, edges=edges, edge_token=edge_token, endpoint_url=endpoint_url, trust=trust,
            device=device if device is not None else self.device, warm=False,
        )  # fmt: skip
        other._caches = self._caches
        other._owns_caches = False
        other.stats = self.stats  # one app's figures, whichever store each load read
        self.stats.add_edges(other._edges or ())
        return other

    # ---- what the client holds ---------------------------------------------------
    @property
    def reader(self) -> BoundedReader:
        """What this client reads through (opened on first use)."""
        with self._reader_lock:
            if self._reader is None:
                self._reader = open_reader(
                    self._store, endpoint_url=self._endpoint_url, edges=self._edges,
                    edge_token=self._edge_token, trust=self.trust,
                )  # fmt: skip
            return self._reader

    def model(self, name: str | None = None) -> LoadedModel:
        """The model ``name`` (an alias, Hugging Face id or local path; default: the
        embedded one) on this client's device, loaded once."""
        checks.optional_string(name, "model")
        loaded = self._caches.models.get(name, self.device)
        # the decode kernels for its device and dtype (once per process)
        codec.warm_up(loaded.device, loaded.dtype, loaded.layout.head_dim)
        return loaded

    def resolve(self, source: str | Path, *, model: str | LoadedModel | None = None) -> Manifest:
        """The manifest ``source`` names (``name[@version]``, a document path or its
        text), verified as a load would; nothing is fetched but the manifest."""
        checks.model(model)
        manifest, _, _ = resolve_manifest(source, self.reader, self.model, model, self.trust)
        return manifest

    def predictor(self, link: str) -> ThroughputPredictor:
        """The throughput predictor of ``link`` (a reader's URL), kept for the client's life."""
        caches = self._caches
        with caches.lock:
            found = caches.predictors.pop(link, None) or HarmonicPredictor()
            caches.predictors[link] = found  # the most recently used last
            while len(caches.predictors) > MAX_LINKS:
                del caches.predictors[next(iter(caches.predictors))]
            return found

    def forget_links(self) -> None:
        """Forget the throughput learnt for each link (after a network change, or to
        measure loads that start cold)."""
        with self._caches.lock:
            self._caches.predictors.clear()

    # ---- loading -----------------------------------------------------------------
    def load_context(
        self,
        source: str | Path,
        *,
        model: str | LoadedModel | None = None,
        quality: str = AUTO,
        deadline_s: float | None = None,
        predictor: ThroughputPredictor | None = None,
        policy: Policy | None = None,
        cancel_late_fetches: bool = True,
        refine: bool = True,
    ) -> Context:
        """Load a published document's KV into a model cache.

        ``source`` is a document path, its text, or ``name[@version]``. The
        model defaults to the one the document was published with.

        ``quality="auto"`` (the default) picks each chunk's level, or
        recomputes it from its tokens, to finish within ``deadline_s`` seconds
        of this call (model loading excluded) at the best quality the link and
        the device allow, re-planning as chunks arrive; without a deadline
        every chunk is fetched at the best level. A level name loads every
        chunk at that level; ``"text"`` recomputes the whole document (a full
        prefill). ``ctx.plan`` reports what was done, chunk by chunk.

        ``predictor`` replaces the link's throughput predictor (by default
        the client's for this link: RobustMPC's harmonic mean), and ``policy``
        the planner (:func:`kvcdn.sdk.planner.plan`; for a nested publication
        with ``refine``, :func:`kvcdn.sdk.planner.fetch_first`). ``cancel_late_fetches``:
        a fetch that can no longer make the deadline is abandoned and its chunk
        planned again (False for policies that never revisit a choice, such as
        CacheGen's controller). ``refine``: with a deadline, once every chunk has
        its level, chunks of nested objects (``--levels nested``) are raised to
        better levels while the deadline allows, each fetching only the tiers it
        lacks (``ctx.plan.refined``).
        """
        started = time.perf_counter()
        deadline_s = checks.deadline(deadline_s)
        quality = checks.quality(quality)
        checks.model(model)
        predictor = checks.predictor(predictor)
        policy = checks.policy(policy)
        cancel_late_fetches = checks.flag(cancel_late_fetches, "cancel_late_fetches")
        refine = checks.flag(refine, "refine")
        load = _Loading(self)
        clock = _Clock(started, deadline_s)

        def model_off_the_clock(name: str | None) -> LoadedModel:
            t = time.perf_counter()
            try:
                return self.model(name)
            finally:
                clock.pause(time.perf_counter() - t)

        # the pointer and the manifest are read within the deadline (asked at each read:
        # resolving a document's text loads the model first, off the clock)
        timed = TimedReader(load.reader.within(clock.deadline))
        manifest, loaded, model_s = load.resolve(source, timed, model_off_the_clock, model)
        started += model_s  # loading the model is a one-off cost, not part of resolving
        if loaded is None:
            t = time.perf_counter()
            loaded = self.model(model if isinstance(model, str) else manifest.model_name)
            started += time.perf_counter() - t
        seconds = {"resolve": time.perf_counter() - started}
        check_against_model(manifest, loaded)
        if predictor is None:
            predictor = self.predictor(load.reader.url)
            if isinstance(predictor, HarmonicPredictor) and not predictor.samples:
                # from the default prior each time: a slow resolve must not lower it for good
                predictor.initial_bps = timed.throughput_bound(INITIAL_BPS)
        target = CacheTarget(loaded, manifest.token_count)
        plan_ = load.into(target, manifest, loaded, quality, deadline_s, started, seconds,
                          predictor, policy, cancel_late_fetches=cancel_late_fetches,
                          refine=refine)  # fmt: skip
        return Context(manifest, loaded, target.cache(), plan_)

    def load_contexts(
        self,
        sources: Sequence[str | Path],
        *,
        model: str | LoadedModel | None = None,
        blend: bool = True,
        recompute_ratio: float = RECOMPUTE_RATIO,
        quality: str = AUTO,
        deadline_s: float | None = None,
        separator: str | None = None,
        question: str | None = None,
    ) -> BlendedContext:
        """Load several published documents into one cache, to answer from all of them.

        ``sources`` are what :meth:`load_context` takes, in the order the model
        reads them. Every document must have been published for the same
        model (and tokenizer).

        ``blend=True`` recomputes ``recompute_ratio`` of the documents' tokens
        (those whose cached KV deviates most from a fresh computation) so
        later documents attend to earlier ones (CacheBlend); ``blend=False``
        only concatenates the caches (full reuse: fastest, and the answer may
        miss links between the documents). ``recompute_ratio=1`` is a full
        prefill.

        ``quality`` and ``deadline_s`` apply to each document's load, each
        getting an equal share of the deadline. ``separator`` is the text put
        between documents (default: the model's chat template's boundary
        between two user turns).

        ``question``, when known at load time, makes the blend query-aware:
        the tokens recomputed are those whose deviation matters most to this
        question. The context still answers any question; it is closest to a
        full prefill for this one.

        Each document is decoded into its own tensor while the layers that
        every token goes through are computed; the blend moves each
        document's keys to their new positions as it places them, and the
        context's cache is laid over the blend's result without a copy.
        """
        started = time.perf_counter()
        if isinstance(sources, (str, Path)) or not isinstance(sources, Sequence):
            raise ArgumentError(
                f"sources must be a list of documents, not {type(sources).__name__}"
            )
        sources = [checks.source(s, "each source") for s in sources]
        if not sources:
            raise InputError("no documents to load")
        recompute_ratio = checks.ratio(recompute_ratio, "recompute_ratio")
        deadline_s = checks.deadline(deadline_s)
        quality = checks.quality(quality)
        checks.model(model)
        blend = checks.flag(blend, "blend")
        checks.optional_string(separator, "separator")
        if question is not None:
            checks.question(question, 1 << 20)  # its tokens are checked against the window below
        load = _Loading(self)

        # Every manifest first, each resolved once: a mismatch is refused before
        # anything is loaded.
        loaded = model if isinstance(model, LoadedModel) else None
        manifests: list[Manifest] = []
        for source in sources:
            manifest, got, model_s = load.resolve(source, load.reader, self.model, loaded or model)
            started += model_s  # loading the model is a one-off cost, not part of the load
            loaded = loaded or got
            manifests.append(manifest)
        _check_same_model(manifests)
        if loaded is None:
            t = time.perf_counter()
            loaded = self.model(model if isinstance(model, str) else manifests[0].model_name)
            started += time.perf_counter() - t
        for manifest in manifests:
            check_against_model(manifest, loaded)

        # The layout: the first document whole (its framing included), then for
        # each next one a separator and its tokens after its framing.
        prefix = loaded.prefix_ids()
        sep = loaded.separator_ids(separator)
        token_ids: list[int] = []
        strips: list[int] = []
        for i, manifest in enumerate(manifests):
            ids = manifest.token_ids
            strip = len(prefix) if i and prefix and ids[: len(prefix)] == prefix else 0
            if i:
                token_ids += sep
            strips.append(strip)
            token_ids += ids[strip:]
        loaded.check_fits(len(token_ids))
        query_ids = None
        if question is not None:
            query_ids = loaded.question_ids(question, documents=len(manifests))
            loaded.check_fits(len(token_ids) + len(query_ids))

        share = None if deadline_s is None else deadline_s / len(manifests)

        def load_one(manifest: Manifest) -> tuple[TensorTarget, LoadPlan]:
            target = TensorTarget(loaded, manifest.token_count)
            seconds: dict[str, float] = {}
            plan_ = load.into(target, manifest, loaded, quality, share, time.perf_counter(),
                              seconds, self.predictor(load.reader.url), None)  # fmt: skip
            return target, plan_

        first: list[tuple[TensorTarget, LoadPlan]] = []
        if quality == AUTO and not self._caches.speeds.is_known(loaded):
            # The first adaptive load measures the device (once per client and model);
            # not beside the blend's own work, which would skew what it measures.
            first.append(load_one(manifests[0]))
        loader = ThreadPoolExecutor(1, thread_name_prefix="kvcdn-blend-load")
        future = loader.submit(lambda: [*first, *(load_one(m) for m in manifests[len(first) :])])
        done: list[tuple[TensorTarget, LoadPlan]] = []

        def pieces() -> list[Piece]:
            done.extend(future.result())
            out: list[Piece] = []
            for i, ((target, _), manifest, strip) in enumerate(
                zip(done, manifests, strips, strict=True)
            ):
                if i:
                    out.append(Piece(sep))
                out.append(Piece(manifest.token_ids[strip:], target.kv[:, :, :, strip:], strip))
            return out

        checked = (loaded.fingerprint, loaded.device)
        try:
            if checked not in self._caches.positions_checked:
                check_positions(loaded)
                self._caches.positions_checked.add(checked)
            blended = blend_caches(
                loaded,
                pieces,
                token_ids,
                recompute_ratio=recompute_ratio if blend else 0.0,
                exact_prefix=len(manifests[0].token_ids),
                query_ids=query_ids,
                positions_checked=True,
            )
        finally:
            loader.shutdown(wait=True)
        cache = loaded.cache_from_kv(blended.kv)  # a view of the blend's result
        plans = [p for _, p in done]
        done.clear()  # each document's tensor is freed: its KV is in the blend's now
        # measuring the device is a one-off cost, like loading the model: not on the clock
        measuring_s = sum(p.seconds.get("measure_device", 0.0) for p in plans)
        ready_s = time.perf_counter() - started - measuring_s
        asked = None  # a blend that chose nothing (full reuse, full prefill) computed no question
        if query_ids is not None and blended.query_logits is not None:
            asked = (query_ids, blended.query_logits)
        return BlendedContext(
            manifests, loaded, cache, token_ids, plans, blended.report, ready_s, asked
        )


class _Clock:
    """A load's deadline: ``deadline_s`` after ``started`` (``perf_counter``), moved on by
    the one-off costs that are not on the clock (loading the model)."""

    def __init__(self, started: float, deadline_s: float | None) -> None:
        self.started = started
        self.deadline_s = deadline_s

    def pause(self, seconds: float) -> None:
        self.started += seconds

    def deadline(self) -> float | None:
        """The deadline on the readers' clock (``time.monotonic()``), or None."""
        if self.deadline_s is None:
            return None
        return monotonic_at(self.started + self.deadline_s)


class _Loading:
    """One call's view of its client: the reader, and what each document's load needs."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.reader = client.reader
        # edges that served bad bytes before this call are not this call's to report
        self._rejected_before = len(getattr(self.reader, "rejected", ()))

    def into(
        self,
        target: TensorTarget,
        manifest: Manifest,
        loaded: LoadedModel,
        quality: str,
        deadline_s: float | None,
        started: float,
        seconds: dict[str, float],
        predictor: ThroughputPredictor,
        policy: Policy | None,
        *,
        cancel_late_fetches: bool = True,
        refine: bool = True,
    ) -> LoadPlan:
        caches = self.client._caches
        plan_ = load_into(
            target, manifest, loaded, self.reader, quality=quality, deadline_s=deadline_s,
            started=started, seconds=seconds, predictor=predictor, policy=policy,
            cancel_late_fetches=cancel_late_fetches, refine=refine, profiles=caches.profiles,
            speeds=caches.speeds, rejected_since=self._rejected_before,
        )  # fmt: skip
        self.client.stats.load(plan_.chunks, plan_.ready_s,
                               refinements_dropped=plan_.refinements_dropped)  # fmt: skip
        return plan_

    def resolve(
        self, source: str | Path, reader: Reader, model_of: Callable[[str | None], LoadedModel],
        model: str | LoadedModel | None,
    ) -> tuple[Manifest, LoadedModel | None, float]:  # fmt: skip
        """:func:`resolve_manifest`, counted in the client's stats as a lookup (its time
        less the model's loading)."""
        stats, t = self.client.stats, time.perf_counter()
        try:
            manifest, loaded, model_s = resolve_manifest(source, reader, model_of, model,
                                                         self.client.trust)  # fmt: skip
        except BaseException as exc:
            stats.lookup(*lookup_failure(exc), seconds=time.perf_counter() - t)
            raise
        stats.lookup("hit", seconds=time.perf_counter() - t - model_s)
        return manifest, loaded, model_s


def _check_same_model(manifests: list[Manifest]) -> None:
    first = manifests[0]
    for other in manifests[1:]:
        if other.model_fingerprint != first.model_fingerprint or other.tokenizer != first.tokenizer:
            what = "tokenizer" if other.model_fingerprint == first.model_fingerprint else "model"
            raise FingerprintMismatch(
                f"cannot blend {first.ref} and {other.ref}: they were published for "
                f"different {what}s ({first.model_name}, fingerprint "
                f"{first.model_fingerprint[:12]}, tokenizer {first.tokenizer[:12]}; and "
                f"{other.model_name}, fingerprint {other.model_fingerprint[:12]}, tokenizer "
                f"{other.tokenizer[:12]}); publish them all for one model"
            )


# ---- the module-level conveniences -------------------------------------------------

_default: Client | None = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client whose caches the module-level functions use (made on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def load_context(
    source: str | Path,
    *,
    model: str | LoadedModel | None = None,
    store: str | Reader | None = None,
    quality: str = AUTO,
    deadline_s: float | None = None,
    device: str | None = None,
    endpoint_url: str | None = None,
    edges: Sequence[str] | None = None,
    edge_token: str | None = None,
    predictor: ThroughputPredictor | None = None,
    policy: Policy | None = None,
    cancel_late_fetches: bool = True,
    trust: TrustPolicy | str | Path | None = None,
    refine: bool = True,
) -> Context:
    """:meth:`Client.load_context` on a client for ``store``/``edges``/``trust`` that
    shares the default client's models and measurements. Keep one
    :class:`Client` (or one :class:`~kvcdn.signing.TrustPolicy`) across loads
    for rollback protection to span them."""
    with default_client().with_options(
        store=store, edges=edges, edge_token=edge_token, endpoint_url=endpoint_url,
        trust=trust, device=device,
    ) as client:  # fmt: skip
        return client.load_context(
            source, model=model, quality=quality, deadline_s=deadline_s, predictor=predictor,
            policy=policy, cancel_late_fetches=cancel_late_fetches, refine=refine,
        )  # fmt: skip


def load_contexts(
    sources: Sequence[str | Path],
    *,
    model: str | LoadedModel | None = None,
    store: str | Reader | None = None,
    blend: bool = True,
    recompute_ratio: float = RECOMPUTE_RATIO,
    quality: str = AUTO,
    deadline_s: float | None = None,
    separator: str | None = None,
    question: str | None = None,
    device: str | None = None,
    endpoint_url: str | None = None,
    edges: Sequence[str] | None = None,
    edge_token: str | None = None,
    trust: TrustPolicy | str | Path | None = None,
) -> BlendedContext:
    """:meth:`Client.load_contexts` on a client for ``store``/``edges``/``trust`` that
    shares the default client's models and measurements."""
    with default_client().with_options(
        store=store, edges=edges, edge_token=edge_token, endpoint_url=endpoint_url,
        trust=trust, device=device,
    ) as client:  # fmt: skip
        return client.load_contexts(
            sources, model=model, blend=blend, recompute_ratio=recompute_ratio,
            quality=quality, deadline_s=deadline_s, separator=separator, question=question,
        )  # fmt: skip


def forget_links() -> None:
    """Forget the throughput the default client has learnt for each link."""
    default_client().forget_links()
