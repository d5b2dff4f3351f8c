"""What a load gives: a context that answers questions, and the report of how it was loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcdn.cacheblend import BlendReport
from kvcdn.errors import DocumentTooLong
from kvcdn.manifest import Manifest
from kvcdn.models import LoadedModel, crop_cache

from . import checks
from .streaming import ChunkReport

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
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
    #: Per chunk: the level it was loaded at, what served it (an edge URL, "origin"
    #: after every edge failed, the store's URL without edges, or "text":
    #: recomputed), its bytes and times.
    chunks: list[ChunkReport] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    deadline_s: float | None = None
    predicted_ttft_s: float | None = None
    ready_s: float = 0.0
    #: The first plan expected to meet the deadline; False: it could not, and
    #: the load did its best (the fastest plan it found).
    feasible: bool = True
    replans: int = 0
    cancelled: int = 0  # fetches abandoned because they could no longer make the deadline
    #: Loaded chunks raised to a better level by fetching their nested objects' further
    #: tiers (each chunk's ``refined_from`` says from what); and refinements started but
    #: dropped (not in by the deadline, or failed: the chunk kept its level).
    refined: int = 0
    refinements_dropped: int = 0
    #: Who signed the manifest (``Signer.to_json()``), or None when it is unsigned.
    signed_by: dict[str, Any] | None = None
    #: Edges that served bytes failing verification during the load (each was skipped).
    rejected: list[str] = field(default_factory=list)

    @property
    def chunk_levels(self) -> list[str]:
        """Each chunk's level, "text" (recomputed) or "skipped"."""
        return [c.level for c in self.chunks]

    @property
    def chunk_sources(self) -> list[str]:
        """What served each chunk (see :attr:`chunks`)."""
        return [c.source for c in self.chunks]

    @property
    def bytes(self) -> int:
        """Bytes fetched for the chunks loaded."""
        return sum(c.bytes for c in self.chunks)

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


class BaseContext:
    """KV loaded into a model's cache, ready for questions (one document or several)."""

    def __init__(self, model: LoadedModel, cache: Any, token_ids: list[int]) -> None:
        self.model = model
        self.cache = cache
        self.token_ids = token_ids  # what the cache holds, in order

    @property
    def name(self) -> str:
        raise NotImplementedError

    def _question_ids(self, question: str) -> list[int]:
        return self.model.question_ids(question)

    def generate(self, question: str, *, max_new_tokens: int = 64) -> Answer:
        """Answer ``question`` from the loaded KV (greedy decoding).

        The documents, the question and ``max_new_tokens`` must fit the model's
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

    def answer_with_prefill(self, question: str, *, max_new_tokens: int = 64) -> Answer:
        """The baseline: the same answer after a full prefill of the same tokens (no kvcdn)."""
        return answer_with_prefill(
            self.model, self.token_ids, question, max_new_tokens=max_new_tokens,
            question_ids=self._question_ids(question),
        )  # fmt: skip


class Context(BaseContext):
    """One document's KV, loaded into a model's cache, ready for questions."""

    def __init__(self, manifest: Manifest, model: LoadedModel, cache: Any, plan: LoadPlan):
        super().__init__(model, cache, manifest.token_ids)
        self.manifest = manifest
        self.plan = plan  # how it was loaded

    @property
    def name(self) -> str:
        return f"{self.manifest.name}@{self.manifest.version}"


class BlendedContext(BaseContext):
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
        super().__init__(model, cache, token_ids)
        self.manifests = manifests
        self.plans = plans  # how each document was loaded, in order
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


def answer_with_prefill(
    model: LoadedModel,
    token_ids: list[int],
    question: str,
    *,
    max_new_tokens: int = 64,
    question_ids: list[int] | None = None,
) -> Answer:
    """The baseline: answer after a full prefill of ``token_ids`` (no kvcdn)."""
    from transformers import DynamicCache

    if question_ids is None:
        question_ids = model.question_ids(question)
    cache = DynamicCache(config=model.model.config)
    out, ttft, logits = model.greedy(cache, token_ids + question_ids, max_new_tokens)
    return Answer(model.decode(out), out, ttft, logits)
