"""Publishing: document -> tokens -> KV -> chunk objects -> manifest -> latest pointer.

Order is the crash-safety argument. Objects are immutable and content-addressed
(their key ends in the sha256 of their bytes, so no key ever holds two byte
strings, whoever writes it and in whatever order) and are written first; the
manifest is created last, with a create-only write, so a version is visible
exactly when all its objects are; the latest pointer follows. A publish that
dies part-way leaves orphan objects and no new version; the next run finds
the objects it computes again already stored, checks them and uploads only
what is missing.

Concurrent publishers of one name converge: the one that loses the race for
version N publishes N+1 with the objects it has already uploaded. With
signing keys, manifests and pointers are signed (:mod:`kvcdn.signing`); a
signing publisher reuses objects and profiles only from versions signed by
a key it trusts, since its signature vouches for every sha256 it names.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import catalog
from .codec import (
    DEFAULT_LEVELS,
    TEXT_LEVEL,
    Level,
    check_level_names,
    encode_chunk,
    is_exact,
    needs_profile,
    object_ref,
    parse_levels,
    read_chunk,
)
from .codec_profile import CodecProfile
from .codecs import TensorDest
from .document import document_and_name, source_digest
from .errors import (
    ConcurrentPublish,
    FormatError,
    InputError,
    KvcdnError,
    NotFound,
    PointerExpired,
    StoreError,
    TrustError,
)
from .keys import MAX_VERSION, check_name, latest_key, manifest_key, object_key
from .kv import DEFAULT_CHUNK_TOKENS, split_chunks
from .manifest import (
    MAX_CHUNK_TOKENS,
    POINTER_VALID_FOR_S,
    ChunkEntry,
    LevelInfo,
    Manifest,
    ObjectRef,
    Pointer,
    check_valid_for,
    format_expiry,
    pointer_bytes,
)
from .models import LoadedModel, load_model
from .signing import MANIFEST_TYPE, POINTER_TYPE, SigningKey, TrustPolicy, seal
from .store import Store, open_store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: progress(stage, done, total): stages are "prefill", "encode" and "upload", and
#: "calibrate:<step>" when the model has no codec profile yet.
ProgressFn = Callable[[str, int, int], None]
UPLOAD_CONCURRENCY = 8
#: Versions a publish tries before giving up, when other publishers of the same
#: name keep creating the version it was about to create.
VERSION_ATTEMPTS = 8


@dataclass
class PublishResult:
    name: str
    version: int
    manifest_key: str
    unchanged: bool  # True when the document was already published as is
    token_count: int
    chunks: int
    uploaded_objects: int = 0
    reused_objects: int = 0
    uploaded_bytes: int = 0
    level_bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    signed_by: list[str] = field(default_factory=list)  # key ids
    #: Tokens the model computed: all of them, or those after an unchanged prefix.
    prefilled_tokens: int = 0
    #: "name@N level": the stored version whose KV of the unchanged prefix was used.
    prefix_from: str | None = None
    #: Why a new version of a document was prefilled from its first token.
    full_prefill_reason: str | None = None


def publish(
    path: str | Path | None = None,
    *,
    text: str | None = None,
    name: str | None = None,
    model: str | LoadedModel | None = None,
    store: str | Store | None = None,
    levels: str | list[str] | tuple[str, ...] = DEFAULT_LEVELS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | None = None,
    progress: ProgressFn | None = None,
    on_object: Callable[[str], None] | None = None,
    sign_keys: Sequence[SigningKey] = (),
    trust: TrustPolicy | None = None,
    prefill: Callable[[list[int]], torch.Tensor] | None = None,
    incremental: bool = True,
    pointer_valid_for: float = POINTER_VALID_FOR_S,
) -> PublishResult:
    """Publish one document (a file ``path``, or ``text`` with a ``name``).

    ``prefill(ids)`` computes the KV ``[L, 2, H, T, D]`` of the document's
    tokens when another engine does it (vLLM, :mod:`kvcdn.sdk.vllm`); by
    default the model's own prefill does.

    ``sign_keys`` sign the manifest and the pointer (several keys during a key
    rotation); the signed pointer expires ``pointer_valid_for`` seconds from now
    (a week by default), and every signed publish renews it, an unchanged one
    included (``docs/trust.md``). ``trust`` names other publishers whose versions
    and profiles this one may build on; a signing publisher always trusts its own
    keys. ``on_object(key)`` is called after each object is stored.

    With ``incremental`` (the default), a new version that begins like the
    previous one is prefilled only from its first changed token, after the
    unchanged prefix's KV read back from the store at its most exact level;
    what cannot be used that way is prefilled whole, and the result says why
    (``docs/incremental.md``).
    """
    started = time.perf_counter()
    valid_for = check_valid_for(pointer_valid_for)  # before the model loads
    job = _plan(path, text, name, model, store, levels, chunk_tokens, device, progress,
                on_object, sign_keys, trust, prefill, incremental)  # fmt: skip
    for _attempt in range(VERSION_ATTEMPTS):
        listing = _Listing.read(job)
        previous = listing.previous
        if previous is not None and job.unchanged_over(previous):
            _advance_pointer(job.store, job.name, previous.version, job.sign_keys, job.trust,
                             valid_for=valid_for)  # fmt: skip
            _write_indexes(job.store, previous)
            return _unchanged_result(job, previous, started)
        job.tokenize()  # not before: an unchanged republish needs no tokens
        job.remember(previous)
        if job.kv is None and job.missing():
            _compute_kv(job, previous)
        _encode_and_upload(job)
        manifest = _commit_version(job, listing.next_version)
        if manifest is not None:
            break
        log.info("%s@%d was published by someone else meanwhile; publishing as the next",
                 job.name, listing.next_version)  # fmt: skip
    else:
        raise ConcurrentPublish(
            f"other publishers of '{job.name}' took {VERSION_ATTEMPTS} versions in a row while "
            "this one tried to publish; run the publish again"
        )
    _advance_pointer(job.store, job.name, manifest.version, job.sign_keys, job.trust,
                     valid_for=valid_for)  # fmt: skip
    _write_indexes(job.store, manifest)
    job.seconds["total"] = time.perf_counter() - started
    log.info("published %s@%d: %d chunks, %d objects uploaded", job.name, manifest.version,
             len(job.chunks), job.uploaded)  # fmt: skip
    return job.result(manifest)


# ---- the stages ------------------------------------------------------------------------
@dataclass
class _Job:
    """One publish: what was asked for, checked once, and what the run has done so far."""

    name: str
    text: str
    src_sha: str
    store: Store
    loaded: LoadedModel
    levels: list[Level]  # parsed once
    profile: CodecProfile | None
    profile_ref: ObjectRef | None
    chunk_tokens: int
    sign_keys: tuple[SigningKey, ...]
    trust: TrustPolicy | None
    progress: ProgressFn
    on_object: Callable[[str], None]
    prefill: Callable[[list[int]], torch.Tensor] | None
    incremental: bool
    seconds: dict[str, float]
    ids: list[int] = field(default_factory=list)  # by tokenize(), once
    chunks: list = field(default_factory=list)  # kvcdn.kv.Chunk, by tokenize()
    kv: torch.Tensor | None = None  # computed once, whatever the attempts
    #: Objects known to be stored, by (chunk hash, level id): those this run uploaded
    #: or checked, and those a trusted earlier version names.
    stored: dict[tuple[str, str], ObjectRef] = field(default_factory=dict)
    freshened: set[str] = field(default_factory=set)  # named by this run, not uploaded
    uploaded: int = 0
    uploaded_bytes: int = 0
    prefilled: int = 0  # tokens the model computed
    prefix_from: str | None = None  # where the KV of an unchanged prefix came from
    full_prefill_reason: str | None = None  # why an edit was prefilled from its start

    def tokenize(self) -> None:
        """The text tokenized, checked against the model's window and chunked, once."""
        if self.chunks:
            return
        t = time.perf_counter()
        self.ids = self.loaded.document_ids(self.text)
        self.loaded.check_fits(len(self.ids))
        self.chunks = split_chunks(self.loaded.fingerprint, self.ids, self.chunk_tokens)
        self.seconds["tokenize"] = time.perf_counter() - t

    def unchanged_over(self, previous: Manifest) -> bool:
        """The same text, model, chunks and levels as ``previous``, which is whole and
        signed as this publish would sign it: nothing to publish."""
        return (
            _same_publication(previous, self.src_sha, self.loaded.fingerprint,
                              self.chunk_tokens, self.levels)  # fmt: skip
            and _signed_as_asked(previous, self.sign_keys)
            and _all_stored(self.store, previous)
        )

    def remember(self, previous: Manifest | None) -> None:
        """The objects ``previous`` names are stored (this publish reuses them), and are
        freshened so that a concurrent gc keeps them; one gone is uploaded anew."""
        if previous is not None:
            for c in previous.chunks:
                for lv_name, ref in c.objects.items():
                    self.stored.setdefault((c.hash, previous.levels[lv_name].id), ref)
        _freshen_reused(self.store, self.chunks, self.levels, self.stored, self.freshened)

    def missing(self) -> list[tuple[Any, Level]]:
        """(chunk, level) pairs with no stored object yet."""
        return [(c, lv) for c in self.chunks for lv in self.levels
                if (c.hash, lv.id) not in self.stored]  # fmt: skip

    def result(self, manifest: Manifest) -> PublishResult:
        # a nested ladder's levels share one object a chunk
        total_objects = len(self.chunks) * len({lv.object_id for lv in self.levels})
        return PublishResult(
            name=self.name,
            version=manifest.version,
            manifest_key=manifest_key(self.name, manifest.version),
            unchanged=False,
            token_count=len(self.ids),
            chunks=len(self.chunks),
            uploaded_objects=self.uploaded,
            reused_objects=total_objects - self.uploaded,
            uploaded_bytes=self.uploaded_bytes,
            level_bytes={n: lv.total_bytes for n, lv in manifest.levels.items()
                         if n != TEXT_LEVEL},  # fmt: skip
            seconds=self.seconds,
            signed_by=[k.public.id for k in self.sign_keys],
            prefilled_tokens=self.prefilled,
            prefix_from=self.prefix_from,
            full_prefill_reason=self.full_prefill_reason,
        )


def _plan(
    path: str | Path | None, text: str | None, name: str | None,
    model: str | LoadedModel | None, store: str | Store | None,
    levels: str | list[str] | tuple[str, ...], chunk_tokens: int, device: str | None,
    progress: ProgressFn | None, on_object: Callable[[str], None] | None,
    sign_keys: Sequence[SigningKey], trust: TrustPolicy | None,
    prefill: Callable[[list[int]], torch.Tensor] | None, incremental: bool,
) -> _Job:  # fmt: skip
    """Stage 1: every argument checked (before the model loads), the store opened, the
    model loaded, its codec profile made or found, the levels parsed."""
    text, name = document_and_name(path, text, name)
    if type(chunk_tokens) is not int or not 16 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise InputError(f"chunk size {chunk_tokens!r} is out of range (16..65536 tokens)")
    names = check_level_names(levels)  # spelling mistakes fail before the model loads
    sign_keys = tuple(sign_keys)
    if sign_keys:
        own = [k.public for k in sign_keys]
        trust = trust.with_keys(own) if trust is not None else TrustPolicy(own)
    store = store if isinstance(store, Store) else open_store(store)
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device)
    progress = progress or (lambda stage, done, total: None)
    seconds: dict[str, float] = {}
    profile, profile_ref = _codec_profile(store, loaded, names, progress, sign_keys, trust,
                                          seconds)  # fmt: skip
    return _Job(
        name=name, text=text, src_sha=source_digest(text), store=store, loaded=loaded,
        levels=parse_levels(names, profile), profile=profile, profile_ref=profile_ref,
        chunk_tokens=chunk_tokens, sign_keys=sign_keys, trust=trust, progress=progress,
        on_object=on_object or (lambda key: None), prefill=prefill, incremental=incremental,
        seconds=seconds,
    )  # fmt: skip


def _codec_profile(
    store: Store, loaded: LoadedModel, levels: list[str],
    progress: ProgressFn, sign_keys: tuple[SigningKey, ...], trust: TrustPolicy | None,
    seconds: dict[str, float],
) -> tuple[CodecProfile | None, ObjectRef | None]:  # fmt: skip
    """The model's codec profile when a level needs one: found in the store, or
    calibrated now (a one-off, timed apart as ``calibrate``)."""
    if not needs_profile(levels):
        return None, None
    from .profile_store import ensure_profile

    calibrated = False

    def calibrating(stage: str, done: int, total: int) -> None:
        nonlocal calibrated
        calibrated = True
        progress(f"calibrate:{stage}", done, total)

    t = time.perf_counter()
    profile, profile_ref = ensure_profile(store, loaded, calibrating, sign_keys=sign_keys,
                                          trust=trust)  # fmt: skip
    store.freshen(profile_ref.key)  # named by this version: kept from a concurrent gc
    if calibrated:
        seconds["calibrate"] = time.perf_counter() - t
    return profile, profile_ref


@dataclass(frozen=True)
class _Listing:
    """The document's versions as listed once for an attempt: the number the next
    version takes, and the newest version this publisher may build on."""

    next_version: int
    previous: Manifest | None

    @classmethod
    def read(cls, job: _Job) -> _Listing:
        store, name = job.store, job.name
        listed = catalog.versions(store, name)
        # a removed version's number is never given again (edges and readers may hold it)
        latest = max(listed[-1] if listed else 0, catalog.removed_version(store, name))
        if latest >= MAX_VERSION:
            raise StoreError(
                f"{store.url} lists {manifest_key(name, latest)}: no version can follow it; "
                "remove that key if this publisher did not write it"
            )
        try:
            previous = catalog.newest_readable(store, name, job.trust, skip=True, listed=listed)
        except NotFound:  # removed while it was being read
            previous = None
        return cls(latest + 1, previous)


def _compute_kv(job: _Job, previous: Manifest | None) -> None:
    """Stage 2: the document's KV: after the stored KV of an unchanged prefix when
    there is one (incremental), else a full prefill (the reason recorded)."""
    t = time.perf_counter()
    prefix = None
    if job.incremental:
        prefix, why = _stored_prefix(job.store, previous, job.ids, job.missing(), job.loaded,
                                     job.prefill, job.profile, job.stored, job.levels)  # fmt: skip
        if prefix is None and why:
            job.full_prefill_reason = why
            log.info("%s: a full prefill (%s)", job.name, why)
        if prefix is not None:
            job.seconds["prefix_decode"] = time.perf_counter() - t
            job.prefix_from = f"{previous.ref} {prefix[1]}" if previous else None
    ids, loaded = job.ids, job.loaded
    start = 0 if prefix is None else prefix[0].shape[3]
    job.progress("prefill", 0, len(ids) - start)
    if prefix is None:
        kv = (job.prefill or loaded.prefill)(ids)
    elif start == len(ids):  # a cut at the end: every token's KV is stored
        kv = prefix[0]
    else:
        import torch

        tail = loaded.extend(prefix[0], ids[start:])  # on the model's device
        kv = torch.cat([prefix[0].to(tail.device, tail.dtype), tail], dim=3)
    _check_prefill(kv, loaded, len(ids))
    job.kv = kv
    job.prefilled = len(ids) - start
    job.progress("prefill", job.prefilled, job.prefilled)
    job.seconds["prefill"] = time.perf_counter() - t - job.seconds.get("prefix_decode", 0.0)


def _encode_and_upload(job: _Job) -> None:
    """Stage 3: every missing (chunk, level) encoded and stored under its content key,
    uploads overlapping the encoding."""
    missing = job.missing()
    if not missing:
        return
    assert job.kv is not None
    store, kv = job.store, job.kv
    t = time.perf_counter()
    t_encode = 0.0

    # the levels of one object (a nested ladder's tiers share one a chunk): encoded once
    objects: dict[tuple[str, str], tuple[Any, list[Level]]] = {}
    for chunk, level in missing:
        objects.setdefault((chunk.hash, level.object_id), (chunk, []))[1].append(level)

    def store_one(data: bytes, chunk_hash: str, levels: list[Level]
                  ) -> tuple[list[ObjectRef], bool]:  # fmt: skip
        key = object_key(chunk_hash, levels[0].object_id, hashlib.sha256(data).hexdigest())
        refs = [object_ref(key, data, level.tiers) for level in levels]
        written = store.put_content(key, data)
        job.on_object(key)
        return refs, written

    uploaded = 0

    def finish(chunk: Any, levels: list[Level], future: Future) -> None:
        nonlocal uploaded
        refs, written = future.result()
        for level, ref in zip(levels, refs, strict=True):
            job.stored[(chunk.hash, level.id)] = ref
        if written:
            job.uploaded += 1
            job.uploaded_bytes += refs[0].bytes
        else:
            job.freshened.add(refs[0].key)
        uploaded += 1
        job.progress("upload", uploaded, len(objects))

    with ThreadPoolExecutor(UPLOAD_CONCURRENCY) as pool:
        # encoded objects wait for their upload in a bounded queue: a long document's
        # objects are never all in memory at once
        pending: deque[tuple[Any, list[Level], Future]] = deque()
        for n, (chunk, levels) in enumerate(objects.values()):
            te = time.perf_counter()
            data = encode_chunk(levels[0], kv[:, :, :, chunk.start : chunk.end], chunk.hash,
                                profile=job.profile, start=chunk.start)  # fmt: skip
            t_encode += time.perf_counter() - te
            job.progress("encode", n + 1, len(objects))
            pending.append((chunk, levels, pool.submit(store_one, data, chunk.hash, levels)))
            if len(pending) > 2 * UPLOAD_CONCURRENCY:
                finish(*pending.popleft())
        while pending:
            finish(*pending.popleft())
    job.seconds["encode"] = job.seconds.get("encode", 0.0) + t_encode
    job.seconds["upload"] = (job.seconds.get("upload", 0.0) + time.perf_counter() - t
                             - t_encode)  # fmt: skip


def _commit_version(job: _Job, version: int) -> Manifest | None:
    """Stage 4: the manifest created as ``version`` (create-only, signed as asked);
    None when another publisher created that version first."""
    manifest = _manifest(
        job.name, version, job.text, job.src_sha, job.loaded, job.ids, job.chunks, job.levels,
        job.stored, job.profile, job.profile_ref, job.chunk_tokens,
    )  # fmt: skip
    data = manifest.dumps()
    if job.sign_keys:
        data = seal(data, MANIFEST_TYPE, job.sign_keys)
    if not job.store.put_new(manifest_key(job.name, version), data):
        return None
    _check_still_stored(job.store, manifest, job.freshened)
    return manifest


def _unchanged_result(job: _Job, previous: Manifest, started: float) -> PublishResult:
    return PublishResult(
        name=job.name,
        version=previous.version,
        manifest_key=manifest_key(job.name, previous.version),
        unchanged=True,
        token_count=previous.token_count,
        chunks=len(previous.chunks),
        reused_objects=sum(len(c.objects) for c in previous.chunks),
        level_bytes={n: lv.total_bytes for n, lv in previous.levels.items() if n != TEXT_LEVEL},
        seconds={"total": time.perf_counter() - started},
        signed_by=[previous.signer.key.id] if previous.signer else [],
    )


def _stored_prefix(
    store: Store,
    previous: Manifest | None,
    ids: list[int],
    missing: list,
    loaded: LoadedModel,
    prefill: Callable[[list[int]], torch.Tensor] | None,
    profile: CodecProfile | None,
    stored: dict[tuple[str, str], ObjectRef],
    levels: list[Level],
) -> tuple[tuple[torch.Tensor, str] | None, str | None]:
    """The KV of the longest run of leading tokens the new version shares with
    ``previous``, read from the store at its most exact level, so that the model
    prefills only what follows: ``((kv, level), None)``, or ``(None, why not)``
    (``why`` None when the document has no previous version). An object found
    damaged or gone is dropped from ``stored``, so that the publish stores it anew.

    A token's KV depends only on the tokens up to it, so the previous version's
    KV holds for every token before the first changed one, in the middle of a
    chunk too. Every object is read bounded, checked against the manifest's
    sha256 and must hold the chunk it is named for, before its KV is used."""
    import torch

    if previous is None:
        return None, None
    if previous.model_fingerprint != loaded.fingerprint:
        return None, f"{previous.ref} holds KV of another model ({previous.model_name})"
    old_ids = previous.token_ids
    same = 0
    for a, b in zip(old_ids, ids, strict=False):
        if a != b:
            break
        same += 1
    if same == 0:
        return None, "no token is unchanged"
    if prefill is not None:
        return None, "another engine prefills; only the model's own prefill continues a prefix"
    chunk_tokens = previous.chunk_tokens
    # The objects are found by chunk hash: the manifest's tokens must be the ones its
    # hashes chain (as a reader checks), or its KV could be another text's.
    expected = split_chunks(previous.model_fingerprint, old_ids, chunk_tokens)
    if [c.hash for c in expected] != [c.hash for c in previous.chunks]:
        return None, f"{previous.ref}'s chunk hashes do not follow from its tokens"
    if any(chunk.end <= same for chunk, _ in missing):
        return None, "the unchanged chunks lack a level this publish asks for"
    kept_levels = [n for n in previous.levels if n != TEXT_LEVEL]
    level = min(kept_levels, key=lambda n: _exactness(previous.levels[n]))
    # The chunk holding the first changed token is encoded again from the stored KV
    # of its first part, at every level asked for: the stored level must be at least
    # as exact as each of them (an int8 prefix must not become "fp16" objects).
    stored_kl = _kl(previous.levels[level].codec, previous.levels[level].quality)
    for wanted in levels:
        if wanted.name != level and stored_kl > _kl(wanted.codec, _level_quality(wanted, profile)):
            return None, (
                f"{previous.ref}'s most exact level, {level}, is less exact than {wanted.name}"
            )
    entries = previous.chunks[: -(-same // chunk_tokens)]
    if any(level not in c.objects for c in entries):
        return None, f"{previous.ref} lacks level {level} for some chunks"
    layout = loaded.layout
    shape = (layout.layers, 2, layout.kv_heads, entries[-1].end, layout.head_dim)
    kv = torch.empty(shape, dtype=torch.float32)
    try:
        codec_profile = profile
        if previous.codec_profile is not None and (
            profile is None or profile.sha256 != previous.codec_profile.sha256
        ):
            from .profile_store import load_profile

            codec_profile = load_profile(store, previous.codec_profile)
        for entry in entries:
            try:
                read_chunk(store, entry, level, TensorDest(kv[:, :, :, entry.start : entry.end]),
                           profile=codec_profile)  # fmt: skip
            except (FormatError, NotFound):  # damaged or gone: stored anew by this publish
                stored.pop((entry.hash, previous.levels[level].id), None)
                raise
    except (KvcdnError, ValueError) as exc:
        return None, f"the stored prefix of {previous.ref} cannot be used: {exc}"
    return (kv[:, :, :, :same], level), None


def _kl(codec: str, quality: dict[str, float]) -> float:
    """A level's measured KL against exact KV: 0 for an exact codec (fp16), unknown (inf)
    when unmeasured."""
    return 0.0 if is_exact(codec) else quality.get("kl", float("inf"))


def _exactness(level: LevelInfo) -> tuple[bool, float, float]:
    """Orders stored levels from the most exact: an exact codec (fp16), then the smallest
    measured KL, then the most bits per element."""
    return (not is_exact(level.codec), level.quality.get("kl", float("inf")),
            -level.bits_per_element)  # fmt: skip


def _freshen_reused(
    store: Store, chunks: list, levels: list[Level], stored: dict[tuple[str, str], ObjectRef],
    freshened: set[str],
) -> None:  # fmt: skip
    """Freshen the stored objects this version will name without uploading them (an
    earlier version's), so that a concurrent gc keeps them (:mod:`kvcdn.gc`); one
    that is gone is dropped from ``stored``, to be encoded and uploaded again."""
    todo = [
        (chunk.hash, level.id)
        for chunk in chunks
        for level in levels
        if (chunk.hash, level.id) in stored and stored[chunk.hash, level.id].key not in freshened
    ]

    def freshen(item: tuple[str, str]) -> tuple[str, str] | None:
        try:
            store.freshen(stored[item].key)
        except NotFound:
            return item
        return None

    with ThreadPoolExecutor(UPLOAD_CONCURRENCY) as pool:
        gone = [item for item in pool.map(freshen, todo) if item is not None]
    for item in gone:
        log.warning("%s is gone from %s (collected?); uploading it again", stored[item].key,
                    store.url)  # fmt: skip
        del stored[item]
    freshened.update(stored[item].key for item in todo if item in stored)


def _gone(store: Store, keys: set[str]) -> list[str]:
    """Which of ``keys`` the store no longer holds (one HEAD each, concurrently)."""

    def gone(key: str) -> bool:
        try:
            store.stat(key)
        except NotFound:
            return True
        return False

    ordered = sorted(keys)
    with ThreadPoolExecutor(UPLOAD_CONCURRENCY) as pool:
        return [key for key, g in zip(ordered, pool.map(gone, ordered), strict=True) if g]


def _all_stored(store: Store, manifest: Manifest) -> bool:
    """Whether every object ``manifest`` names is stored. One that is gone (a gc that ran
    beside the publish that made the version) makes the same text a new version that
    stores it anew."""
    gone = _gone(store, {ref.key for c in manifest.chunks for ref in c.objects.values()})
    if gone:
        log.warning("%s names %d object(s) that are gone (first: %s); publishing it again",
                    manifest.ref, len(gone), gone[0])  # fmt: skip
    return not gone


def _check_still_stored(store: Store, manifest: Manifest, freshened: set[str]) -> None:
    """The objects a new version names without having uploaded them must still exist:
    a gc that decided to delete one just before it was freshened could have."""
    gone = _gone(store, {ref.key for c in manifest.chunks for ref in c.objects.values()}
                 & freshened)  # fmt: skip
    if gone:
        raise StoreError(
            f"{manifest.ref} was published, but {len(gone)} object(s) it names were deleted "
            f"meanwhile (by a gc that ran alongside, first: {gone[0]}); publish again, which "
            "uploads them anew"
        )


def _write_indexes(store: Store, manifest: Manifest) -> None:
    """The hints that find a version from its text, and from its first chunk's tokens."""
    entry = pointer_bytes(manifest.name, manifest.version)
    for key in catalog.index_keys(manifest):
        store.put(key, entry)


def _check_prefill(kv: torch.Tensor, loaded: LoadedModel, tokens: int) -> None:
    """An engine's KV must have the model's shape for every token, before it is encoded."""
    layout = loaded.layout
    expected = (layout.layers, 2, layout.kv_heads, tokens, layout.head_dim)
    if tuple(kv.shape) != expected or not kv.dtype.is_floating_point:
        raise FormatError(
            f"the prefill returned KV of shape {tuple(kv.shape)} ({kv.dtype}); "
            f"{loaded.name} needs {expected}"
        )


def _manifest(
    name: str,
    version: int,
    text: str,
    src_sha: str,
    loaded: LoadedModel,
    ids: list[int],
    chunks: list,
    chosen: list[Level],
    stored: dict[tuple[str, str], ObjectRef],
    profile: CodecProfile | None,
    profile_ref: ObjectRef | None,
    chunk_tokens: int,
) -> Manifest:
    layout = loaded.layout
    level_infos = {}
    for level in chosen:
        total = sum(stored[(c.hash, level.id)].level_bytes for c in chunks)
        level_infos[level.name] = LevelInfo(
            id=level.id,
            codec=level.codec,
            params=level.params,
            total_bytes=total,
            bits_per_element=round(total * 8 / layout.elements(len(ids)), 4),
            description=level.description,
            quality=_level_quality(level, profile),
        )
    level_infos[TEXT_LEVEL] = LevelInfo(
        id=TEXT_LEVEL,
        codec="recompute",
        params={},
        total_bytes=0,
        bits_per_element=0.0,
        description="recompute the chunk from the manifest's tokens on the device",
        quality={"kl": 0.0, "ppl_delta_pct": 0.0, "top1_agree": 1.0},
    )
    return Manifest(
        name=name,
        version=version,
        source_sha256=src_sha,
        source_bytes=len(text.encode("utf-8")),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model_name=loaded.name,
        model_fingerprint=loaded.fingerprint,
        tokenizer=f"{loaded.source.directory}:{loaded.source.gguf_file or ''}".rstrip(":"),
        token_count=len(ids),
        chunk_tokens=chunk_tokens,
        kv_layout=layout.to_json(),
        levels=level_infos,
        codec_profile=profile_ref,
        chunks=[
            ChunkEntry(
                index=c.index,
                start=c.start,
                end=c.end,
                hash=c.hash,
                tokens=ids[c.start : c.end],
                objects={lv.name: stored[(c.hash, lv.id)] for lv in chosen},
            )
            for c in chunks
        ],
    )


def _level_quality(level: Level, profile: CodecProfile | None) -> dict[str, float]:
    if is_exact(level.codec):
        return {"kl": 0.0, "ppl_delta_pct": 0.0, "top1_agree": 1.0}
    if profile is not None and level.tiers is not None and profile.nested is not None:
        return dict(profile.nested.quality.get(level.name, {}))
    if profile is not None and level.name in profile.levels:
        return dict(profile.levels[level.name].quality)
    return {}


def _same_publication(
    previous: Manifest, src_sha: str, fingerprint: str, chunk_tokens: int, levels: list[Level]
) -> bool:
    return (
        previous.source_sha256 == src_sha
        and previous.model_fingerprint == fingerprint
        and previous.chunk_tokens == chunk_tokens
        and [lv.name for lv in levels] == [n for n in previous.levels if n != TEXT_LEVEL]
        and all(previous.levels[lv.name].id == lv.id for lv in levels)
    )


def _signed_as_asked(previous: Manifest, sign_keys: Sequence[SigningKey]) -> bool:
    """A signing publisher republishes unchanged text only over a version its keys signed."""
    if not sign_keys:
        return True
    return previous.signer is not None and any(
        previous.signer.key.raw == k.public.raw for k in sign_keys
    )


def _advance_pointer(
    store: Store,
    name: str,
    version: int,
    sign_keys: Sequence[SigningKey],
    trust: TrustPolicy | None,
    *,
    valid_for: int = POINTER_VALID_FOR_S,
) -> Pointer:
    """Point ``latest.json`` at the newest version, never an older one, and never at one
    this publisher has not read (with ``trust``: verified); return the pointer as left.

    Another publisher (or a refresh) may write the pointer between our read and our
    write; listing again afterwards and rewriting until the listing holds nothing
    newer makes concurrent publishers agree on the newest version. The store has no
    compare-and-swap for an existing key: this is the guarantee instead, and it holds
    because every writer of the pointer creates its version's manifest before it.

    With ``sign_keys`` the pointer is always written anew, signed, expiring
    ``valid_for`` seconds from now: a signed publish, unchanged or not, renews it.
    """
    target = version
    written: Pointer | None = None
    current: Pointer | None = None
    for _ in range(VERSION_ATTEMPTS):
        # a newer readable version first: the pointer never moves back, even for a moment
        newer = catalog.newest_readable(store, name, trust, above=target, skip=True)
        target = newer.version if newer is not None else target
        try:
            current = catalog.read_pointer(store, name, trust)  # expired or not: replaced
        except (FormatError, TrustError):
            current = None  # damaged or not ours to believe: rewritten
        renew = bool(sign_keys) and (written is None or written.version != target)
        if current is None or current.version != target or renew:
            expires = math.ceil(time.time() + valid_for) if sign_keys else None
            data = pointer_bytes(name, target, expires)
            if sign_keys:
                data = seal(data, POINTER_TYPE, sign_keys)
            store.put(latest_key(name), data)
            written = current = Pointer(name, target, None, expires)
        if catalog.newest_readable(store, name, trust, above=target, skip=True) is None:
            break
    assert current is not None  # the first attempt read a pointer or wrote one
    return current


@dataclass
class RefreshResult:
    """One pointer renewed by :func:`refresh`."""

    name: str
    #: The version the renewed pointer names: the one it named before, or a newer one
    #: that a publish running at the same time made (never an older one).
    version: int
    previous_version: int
    expires: int  # Unix seconds
    signed_by: list[str] = field(default_factory=list)  # key ids

    @property
    def expires_text(self) -> str:
        return format_expiry(self.expires)


def refresh(
    name: str,
    *,
    store: str | Store | None = None,
    sign_keys: Sequence[SigningKey],
    trust: TrustPolicy | None = None,
    pointer_valid_for: float = POINTER_VALID_FOR_S,
    renew_expired: bool = False,
) -> RefreshResult:
    """Sign ``name``'s latest pointer again with a new expiry, ``pointer_valid_for``
    seconds from now, naming the version it names (``kvcdn refresh``).

    Only a pointer one of ``sign_keys`` (or a key of ``trust``) signed is
    renewed, and only when the version it names is still stored and verifies: a
    signature renews the publisher's word, so it is never put on what the store
    alone says. A pointer already past its expiry (give or take the trust's
    clock skew) is renewed only with ``renew_expired``
    (:class:`~kvcdn.errors.PointerExpired` otherwise): a store replaying an old
    pointer, and leaving newer versions out of its listings, looks just like
    that, and a scheduled refresh would put a new expiry on the replay.

    A publish that runs meanwhile is never undone: the pointer is written as a
    publish writes it (:func:`_advance_pointer`), so when a newer version
    appears it names that one.
    """
    valid_for = check_valid_for(pointer_valid_for)
    name = check_name(name)
    sign_keys = tuple(sign_keys)
    if not sign_keys:
        raise InputError(
            "refreshing a pointer signs it again: give the publisher's signing key "
            "(--sign-key or KVCDN_SIGN_KEY)"
        )
    own = [k.public for k in sign_keys]
    trust = trust.with_keys(own) if trust is not None else TrustPolicy(own)
    store = store if isinstance(store, Store) else open_store(store, create=False)
    try:
        current = catalog.read_pointer(store, name, trust)  # expired or not: that is the point
    except TrustError as exc:
        raise type(exc)(
            f"{exc}. kvcdn refresh renews only pointers signed by the keys it signs with "
            "(or those of --trust); publish the document with --sign-key to sign one"
        ) from None
    if current is None:
        listed = catalog.versions(store, name)
        if not listed:
            raise NotFound(f"no document named '{name}' in {store.url}")
        raise NotFound(
            f"'{name}' has no latest pointer in {store.url} to refresh (versions: "
            f"{', '.join(map(str, listed))}); publish it again with --sign-key to write one"
        )
    if not renew_expired and current.expires is not None and (
        time.time() > current.expires + trust.clock_skew_s
    ):
        raise PointerExpired(
            f"{name}'s latest pointer (naming {name}@{current.version}) expired at "
            f"{format_expiry(current.expires)}: a store replaying an old pointer (and "
            "hiding newer versions) looks the same, so refresh does not renew it on its "
            f"own. Check the versions (`kvcdn ls {name} --store ...`), then renew it with "
            "--renew-expired, or publish again"
        )
    # The version must still be there, signed by a trusted key: never vouch for a pointer
    # to a version that was removed (kvcdn rm) or altered since.
    catalog.read_manifest(store, name, current.version, trust=trust)
    left = _advance_pointer(store, name, current.version, sign_keys, trust, valid_for=valid_for)
    assert left.expires is not None  # written just now, signed
    log.info("refreshed %s's latest pointer: %s@%d until %s", name, name, left.version,
             format_expiry(left.expires))  # fmt: skip
    return RefreshResult(
        name=name,
        version=left.version,
        previous_version=current.version,
        expires=left.expires,
        signed_by=[k.public.id for k in sign_keys],
    )
