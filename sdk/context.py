"""``load_context``: from a document reference to a model cache ready to answer."""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcdn import catalog
from kvcdn.codec import RANS_CODEC, TEXT_LEVEL, decode_chunk
from kvcdn.errors import FingerprintMismatch, FormatError, InputError, IntegrityError, NotFound
from kvcdn.kv import split_chunks
from kvcdn.manifest import NAME_PATTERN, Manifest
from kvcdn.models import LoadedModel, crop_cache, load_model
from kvcdn.profiles import load_profile
from kvcdn.publish import document_text, read_document, source_digest
from kvcdn.store import Reader, Store, open_store

from .edges import EdgeStore

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Without a level, the calibrated default, else the closest level above it.
DEFAULT_LEVEL_PREFERENCE = ("default", "high", "nearlossless", "int8", "fp16", "low", "lowest")
_REF = re.compile(rf"^{NAME_PATTERN}(@(\d+|latest))?$")


@dataclass
class LoadPlan:
    """What ``load_context`` did: which level per chunk, how many bytes, how long."""

    store: str
    level: str
    chunk_levels: list[str]
    bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    #: Per chunk, what served its object: an edge URL, "origin" (after every
    #: edge failed), the store's URL (no edges), or "text" (recomputed).
    chunk_sources: list[str] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


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

    def generate(self, question: str, *, max_new_tokens: int = 64) -> Answer:
        """Answer ``question`` about the document (greedy decoding)."""
        if not question.strip():
            raise InputError("the question is empty")
        q_ids = self.model.question_ids(question)
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


def load_context(
    source: str | Path,
    *,
    model: str | LoadedModel | None = None,
    store: str | Reader | None = None,
    level: str | None = None,
    device: str | None = None,
    endpoint_url: str | None = None,
    edges: list[str] | None = None,
    edge_token: str | None = None,
) -> Context:
    """Load a published document's KV into a model cache.

    ``source`` is a document path, its text, or ``name[@version]``. The model
    defaults to the one the document was published with; ``level`` defaults
    to the calibrated ``default`` level (else the closest the manifest has).

    With ``edges`` (edge node URLs), everything is read through them: each
    document from the edges its placement prefers, failing over to the next
    edge on errors and timeouts, and to ``store`` last when one is given
    (with ``edges`` and no ``store``, only the edges are asked).
    ``edge_token`` is the edges' read token.
    """
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    reader: Reader
    if edges:
        origin = None
        if isinstance(store, Store):
            origin = store
        elif isinstance(store, str):
            origin = open_store(store, endpoint_url=endpoint_url)
        reader = EdgeStore(edges, origin, token=edge_token)
    elif store is None or isinstance(store, str):
        reader = open_store(store, endpoint_url=endpoint_url)
    else:
        reader = store  # a Store, or an EdgeStore the caller configured
    loaded = model if isinstance(model, LoadedModel) else None
    manifest = None
    if isinstance(source, Path) or (isinstance(source, str) and _is_existing_file(source)):
        text, what = read_document(source), str(source)
    elif isinstance(source, str) and _REF.match(source.strip()):
        name, version = catalog.parse_ref(source.strip())
        manifest = catalog.read_manifest(reader, name, version)
    else:
        text, what = document_text(str(source).encode("utf-8"), "the text"), "the text"
    if manifest is None:
        if loaded is None:  # loading the model is a one-off cost, not part of resolving
            t_model = time.perf_counter()
            loaded = load_model(model if isinstance(model, str) else None, device)
            t += time.perf_counter() - t_model
        found = catalog.find_by_source(reader, loaded.fingerprint, source_digest(text))
        if found is None:
            raise NotFound(
                f"{what} has not been published for model {loaded.name} in {reader.url}; "
                "publish it first (kvcdn publish)"
            )
        manifest = catalog.read_manifest(reader, *found)
    seconds["resolve"] = time.perf_counter() - t

    if loaded is None:
        loaded = load_model(model or manifest.model_name, device)
    if loaded.fingerprint != manifest.model_fingerprint:
        raise FingerprintMismatch(
            f"{manifest.name}@{manifest.version} holds KV of model {manifest.model_name} "
            f"(fingerprint {manifest.model_fingerprint[:12]}), not of {loaded.name} "
            f"({loaded.fingerprint[:12]}); load it with the model it was published with"
        )
    level = _choose_level(manifest, level)
    return _assemble(manifest, loaded, reader, level, seconds)


def _is_existing_file(source: str) -> bool:
    if "\n" in source or len(source) > 4096:
        return False
    try:
        return Path(source).expanduser().is_file()
    except OSError:
        return False


def _choose_level(manifest: Manifest, level: str | None) -> str:
    if level:
        if level not in manifest.levels:
            raise InputError(
                f"{manifest.name}@{manifest.version} has no level '{level}' "
                f"(it has {', '.join(manifest.levels)})"
            )
        return level
    for preferred in DEFAULT_LEVEL_PREFERENCE:
        if preferred in manifest.levels:
            return preferred
    return next(iter(manifest.levels))


def _recompute(
    manifest: Manifest, loaded: LoadedModel, reader: Reader, seconds: dict[str, float]
) -> Context:
    """The ``text`` level: prefill the manifest's tokens on the device."""
    t = time.perf_counter()
    cache = loaded.cache_from_kv(loaded.prefill(manifest.token_ids))
    seconds["recompute"] = time.perf_counter() - t
    plan = LoadPlan(
        store=reader.url,
        level=TEXT_LEVEL,
        chunk_levels=[TEXT_LEVEL] * len(manifest.chunks),
        bytes=0,
        seconds=seconds,
        chunk_sources=[TEXT_LEVEL] * len(manifest.chunks),
    )
    return Context(manifest, loaded, cache, plan)


def _assemble(
    manifest: Manifest, loaded: LoadedModel, reader: Reader, level: str, seconds: dict[str, float]
) -> Context:
    import torch

    # The chain hashes must follow from the manifest's own tokens: this ties
    # every object key back to the text the manifest claims it holds.
    expected = split_chunks(loaded.fingerprint, manifest.token_ids, manifest.chunk_tokens)
    if [c.hash for c in expected] != [c.hash for c in manifest.chunks]:
        raise FormatError(
            f"manifest of {manifest.name}@{manifest.version}: chunk hashes do not match its tokens"
        )
    if level == TEXT_LEVEL:
        return _recompute(manifest, loaded, reader, seconds)
    refs = [chunk.objects.get(level) for chunk in manifest.chunks]
    if any(ref is None for ref in refs):
        raise FormatError(f"{manifest.name}@{manifest.version} lacks level {level} for a chunk")

    t = time.perf_counter()
    keys = [ref.key for ref in refs]  # type: ignore[union-attr]
    if isinstance(reader, EdgeStore):  # one document's objects live on the same edges
        fetched = reader.fetch_many(keys, manifest.chain_hash)
        blobs = {k: f.data for k, f in fetched.items()}
        sources = [fetched[k].source for k in keys]
        profile_reader: Reader = reader.placed(manifest.chain_hash)
    else:
        blobs = reader.get_many(keys)
        sources = [reader.url] * len(keys)
        profile_reader = reader
    seconds["fetch"] = time.perf_counter() - t

    t = time.perf_counter()
    profile = None
    if manifest.codec_profile is not None and manifest.levels[level].codec == RANS_CODEC:
        profile = load_profile(profile_reader, manifest.codec_profile)
        profile.check_model(loaded.fingerprint, f"the codec profile of {manifest.name}")
    layout = manifest.kv_layout
    shape = (layout["layers"], 2, layout["kv_heads"], manifest.token_count, layout["head_dim"])
    # Decode every chunk straight into its slice of one cache-sized tensor.
    dtype = torch.float32 if loaded.device == "cpu" else next(loaded.model.parameters()).dtype
    kv = torch.empty(shape, dtype=dtype, device=loaded.device)
    for chunk, ref in zip(manifest.chunks, refs, strict=True):
        assert ref is not None
        data = blobs[ref.key]
        if len(data) != ref.bytes or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise IntegrityError(
                f"object {ref.key} does not match its manifest checksum (corrupted in the store "
                "or in transit)"
            )
        header, _ = decode_chunk(
            data,
            name=f"object {ref.key}",
            device=loaded.device,
            profile=profile,
            out=kv[:, :, :, chunk.start : chunk.end],
            verified=True,  # just checked against the manifest's sha256
        )
        if header.chunk_hash != chunk.hash:
            raise FormatError(f"object {ref.key} holds another chunk than its manifest says")
    seconds["decode"] = time.perf_counter() - t

    t = time.perf_counter()
    cache = loaded.cache_from_kv(kv)
    seconds["assemble"] = time.perf_counter() - t
    plan = LoadPlan(
        store=reader.url,
        level=level,
        chunk_levels=[level] * len(refs),
        bytes=sum(ref.bytes for ref in refs if ref is not None),
        seconds=seconds,
        chunk_sources=sources,
    )
    log.info(
        "loaded %s@%d at %s: %d bytes in %.2f s",
        manifest.name,
        manifest.version,
        level,
        plan.bytes,
        plan.total_seconds,
    )
    return Context(manifest, loaded, cache, plan)
