"""Answering from several published documents at once: ``load_contexts`` (CacheBlend).

from kvcdn import sdk
ctx = sdk.load_contexts(["sed-manual", "grep-manual"], store="s3://bucket/kv")
print(ctx.generate("How do I make both of them ignore case?").text)

Each document's cache is loaded as ``load_context`` loads one (any level, or
the adaptive loader), the documents are placed one after another with a
separator between them, their keys moved to their new positions, and a
fraction of the tokens recomputed so that later documents attend to earlier
ones (:mod:`kvcdn.blend`). The loads run while the first layers, which every
token goes through, are computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvcdn.blend import BlendReport, Piece
from kvcdn.blend import blend as blend_caches
from kvcdn.errors import ArgumentError, FingerprintMismatch, InputError
from kvcdn.manifest import Manifest
from kvcdn.models import LoadedModel, crop_cache, kv_from_cache, load_model
from kvcdn.signing import TrustPolicy
from kvcdn.store import Reader

from . import checks
from .context import (
    AUTO,
    Answer,
    Context,
    LoadPlan,
    check_against_model,
    load_context,
    open_reader,
    resolve_manifest,
)
from .devspeed import is_known

#: The fraction of the documents' tokens recomputed by default (the paper's choice).
RECOMPUTE_RATIO = 0.15


class BlendedContext(Context):
    """Several documents' KV, blended into one model cache, ready for questions."""

    def __init__(
        self,
        manifests: list[Manifest],
        model: LoadedModel,
        cache: Any,
        token_ids: list[int],
        plans: list[LoadPlan],
        report: BlendReport,
        ready_s: float,
        asked: tuple[list[int], Any] | None = None,
    ) -> None:
        self.manifests = manifests
        self.manifest = manifests[0]
        self.model = model
        self.cache = cache
        self.token_ids = token_ids
        self.plans = plans  # how each document's cache was loaded
        self.plan = plans[0]
        self.blend = report
        self.ready_s = ready_s  # seconds from the call to a cache ready for a question
        # the question the blend computed: its token ids and the logits after them
        # (the cache then holds its KV after the documents')
        self._asked = asked

    @property
    def name(self) -> str:
        return " + ".join(f"{m.name}@{m.version}" for m in self.manifests)

    def _question_ids(self, question: str) -> list[int]:
        return self.model.question_ids(question, documents=len(self.manifests))

    def _answer(self, q_ids: list[int], max_new_tokens: int) -> Answer:
        asked, self._asked = self._asked, None
        if asked is not None and q_ids == asked[0]:
            # the blend computed this question already: answer from its logits
            try:
                out, ttft, logits = self.model.greedy(
                    self.cache, [], max_new_tokens, logits=asked[1]
                )
            finally:
                crop_cache(self.cache, len(self.token_ids))
            return Answer(self.model.decode(out), out, ttft, logits)
        crop_cache(self.cache, len(self.token_ids))  # without the blend's question, if any
        return super()._answer(q_ids, max_new_tokens)


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
    edges: list[str] | None = None,
    edge_token: str | None = None,
    trust: TrustPolicy | str | Path | None = None,
) -> BlendedContext:
    """Load several published documents into one cache, to answer from all of them.

    ``sources`` are what ``load_context`` takes (``name[@version]``, a
    document path or its text), in the order the model reads them. Every
    document must have been published for the same model (and tokenizer).

    ``blend=True`` recomputes ``recompute_ratio`` of the documents' tokens
    (those whose cached KV deviates most from a fresh computation) so later
    documents attend to earlier ones; ``blend=False`` only concatenates the
    caches (full reuse: fastest, and the answer may miss links between the
    documents). ``recompute_ratio=1`` is a full prefill.

    ``quality`` and ``deadline_s`` apply to each document's load, each
    getting an equal share of the deadline. ``separator`` is the text put
    between documents (default: the model's chat template's boundary between
    two user turns).

    ``question``, when known at load time, makes the blend query-aware: the
    tokens recomputed are those whose deviation matters most to this
    question (weighted by the attention it pays them over the reused cache).
    The context still answers any question; it is closest to a full prefill
    for this one. ``trust`` is as for ``load_context``.
    """
    started = time.perf_counter()
    if isinstance(sources, (str, Path)) or not isinstance(sources, Sequence):
        raise ArgumentError(f"sources must be a list of documents, not {type(sources).__name__}")
    sources = [checks.source(s, "each source") for s in sources]
    if not sources:
        raise InputError("no documents to load")
    recompute_ratio = checks.ratio(recompute_ratio, "recompute_ratio")
    deadline_s = checks.deadline(deadline_s)
    quality = checks.quality(quality)
    checks.model(model)
    checks.optional_string(separator, "separator")
    if question is not None:
        checks.question(question, 1 << 20)  # its tokens are checked against the window below
    trust = checks.trust(trust)
    reader = open_reader(
        store, endpoint_url=endpoint_url, edges=edges, edge_token=edge_token, trust=trust
    )

    # Every manifest first: a mismatch is refused before anything is loaded.
    loaded = model if isinstance(model, LoadedModel) else None
    manifests: list[Manifest] = []
    for source in sources:
        manifest, got, model_s = resolve_manifest(source, reader, loaded or model, device, trust)
        started += model_s  # loading the model is a one-off cost, not part of the load
        loaded = loaded or got
        manifests.append(manifest)
    _check_same_model(manifests)
    if loaded is None:
        t = time.perf_counter()
        loaded = load_model(model or manifests[0].model_name, device)
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

    def load(m: Manifest) -> Context:
        return load_context(
            f"{m.name}@{m.version}",
            model=loaded,
            store=reader,
            quality=quality,
            deadline_s=share,
            device=device,
            trust=trust,
        )

    first: list[Context] = []
    if not is_known(loaded):
        # The first load measures the device (once per process and model); not
        # beside the blend's own work, which would skew what it measures.
        first.append(load(manifests[0]))
    loader = ThreadPoolExecutor(1, thread_name_prefix="kvcdn-blend-load")
    future = loader.submit(lambda: [*first, *(load(m) for m in manifests[len(first) :])])
    contexts: list[Context] = []

    def pieces() -> list[Piece]:
        contexts.extend(future.result())
        out: list[Piece] = []
        for i, (ctx, strip) in enumerate(zip(contexts, strips, strict=True)):
            if i:
                out.append(Piece(sep))
            kv = kv_from_cache(ctx.cache)
            ctx.cache = None  # the blended cache replaces it
            out.append(Piece(ctx.token_ids[strip:], kv[:, :, :, strip:], strip))
        return out

    try:
        blended = blend_caches(
            loaded,
            pieces,
            token_ids,
            recompute_ratio=recompute_ratio if blend else 0.0,
            exact_prefix=len(manifests[0].token_ids),
            query_ids=query_ids,
        )
    finally:
        loader.shutdown(wait=True)
    cache = loaded.cache_from_kv(blended.kv)
    # measuring the device is a one-off cost, like loading the model: not on the clock
    measuring_s = sum(c.plan.seconds.get("measure_device", 0.0) for c in contexts)
    ready_s = time.perf_counter() - started - measuring_s
    asked = None  # a blend that chose nothing (full reuse, full prefill) computed no question
    if query_ids is not None and blended.query_logits is not None:
        asked = (query_ids, blended.query_logits)
    plans = [c.plan for c in contexts]
    return BlendedContext(
        manifests, loaded, cache, token_ids, plans, blended.report, ready_s, asked
    )


def _check_same_model(manifests: list[Manifest]) -> None:
    first = manifests[0]
    for other in manifests[1:]:
        if other.model_fingerprint != first.model_fingerprint or other.tokenizer != first.tokenizer:
            what = "tokenizer" if other.model_fingerprint == first.model_fingerprint else "model"
            raise FingerprintMismatch(
                f"cannot blend {first.name}@{first.version} and {other.name}@{other.version}: "
                f"they were published for different {what}s ({first.model_name}, fingerprint "
                f"{first.model_fingerprint[:12]}, tokenizer {first.tokenizer[:12]}; and "
                f"{other.model_name}, fingerprint {other.model_fingerprint[:12]}, tokenizer "
                f"{other.tokenizer[:12]}); publish them all for one model"
            )


def answer_with_prefill_of(
    ctx: BlendedContext, question: str, *, max_new_tokens: int = 64
) -> Answer:
    """The baseline for a blend: a full prefill of the same tokens, then ``question``."""
    from transformers import DynamicCache

    model = ctx.model
    cache = DynamicCache(config=model.model.config)
    out, ttft, logits = model.greedy(
        cache, ctx.token_ids + ctx._question_ids(question), max_new_tokens
    )
    return Answer(model.decode(out), out, ttft, logits)
