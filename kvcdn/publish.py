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
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from . import catalog
from .codec import (
    DEFAULT_LEVELS,
    TEXT_LEVEL,
    Level,
    check_level_names,
    decode_chunk,
    encode_chunk,
    is_exact,
    needs_profile,
    parse_levels,
)
from .codec_profile import CodecProfile
from .errors import (
    ConcurrentPublish,
    FormatError,
    InputError,
    KvcdnError,
    NotFound,
    StoreError,
    TrustError,
)
from .keys import (
    MAX_VERSION,
    check_name,
    latest_key,
    manifest_key,
    name_from_filename,
    object_key,
)
from .kv import DEFAULT_CHUNK_TOKENS, split_chunks
from .manifest import (
    MAX_CHUNK_TOKENS,
    ChunkEntry,
    LevelInfo,
    Manifest,
    ObjectRef,
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


def read_document(path: str | Path) -> str:
    """A document's text; clear errors for missing, empty or binary files."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a document")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    return document_text(data, str(path))


def expand_documents(paths: Sequence[str | Path]) -> list[Path]:
    """The documents ``paths`` name, each once, in the order given: a file as is, a
    folder as the files under it (recursively, sorted, hidden ones skipped), and a
    glob pattern (``*``, ``?``, ``[``; ``**`` recurses) as its matches, for shells
    that pass patterns through. A path that names nothing is an :class:`InputError`."""
    import glob

    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(
                f for f in path.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in
                                           f.relative_to(path).parts)
            )  # fmt: skip
            if not files:
                raise InputError(f"{path}: the folder holds no document")
        elif path.exists() or not any(c in str(raw) for c in "*?["):
            files = [path]  # a missing file is reported by name when it is read
        else:
            files = sorted(Path(f) for f in glob.glob(str(path), recursive=True))
            files = [f for f in files if f.is_file()]
            if not files:
                raise InputError(f"{raw}: no file matches")
        found.update(dict.fromkeys(files))
    return list(found)


def is_document_path(source: str) -> bool:
    """Whether ``source`` names a file on this machine (a text or a name never does:
    multi-line strings, strings longer than a path can be, and NUL bytes are not)."""
    if "\n" in source or len(source) > 4096:
        return False
    try:
        return Path(source).expanduser().is_file()
    except (OSError, ValueError):  # a name too long for the system, a NUL byte
        return False


def document_text(data: bytes, what: str) -> str:
    if b"\0" in data[:65536]:
        raise InputError(f"{what} is a binary file; kvcdn publishes text documents")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{what} is not UTF-8 text; kvcdn publishes text documents") from None
    if not text.strip():
        raise InputError(f"{what} is empty")
    return text


def source_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def document_and_name(
    path: str | Path | None, text: str | None, name: str | None
) -> tuple[str, str]:
    """The text to publish and its document name, checked (nothing is loaded yet)."""
    if (path is None) == (text is None):
        raise InputError("publish needs either a path or a text")
    if path is not None:
        text = read_document(path)
        name = name or name_from_filename(Path(path).stem)
    else:
        if not isinstance(text, str):
            raise InputError(f"text must be a string, not {type(text).__name__}")
        text = document_text(text.encode("utf-8"), "the text")
        if not name:
            raise InputError("publishing a text needs a document name")
    return text, check_name(name)


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
) -> PublishResult:
    """Publish one document (a file ``path``, or ``text`` with a ``name``).

    ``prefill(ids)`` computes the KV ``[L, 2, H, T, D]`` of the document's
    tokens when another engine does it (vLLM, :mod:`kvcdn.sdk.vllm`); by
    default the model's own prefill does.

    ``sign_keys`` sign the manifest and the pointer (several keys during a key
    rotation). ``trust`` names other publishers whose versions and profiles
    this one may build on; a signing publisher always trusts its own keys.
    ``on_object(key)`` is called after each object is stored.

    With ``incremental`` (the default), a new version that begins like the
    previous one is prefilled only from its first changed token, after the
    unchanged prefix's KV read back from the store at its most exact level;
    what cannot be used that way is prefilled whole, and the result says why
    (``docs/incremental.md``).
    """
    started = time.perf_counter()
    text, name = document_and_name(path, text, name)
    if type(chunk_tokens) is not int or not 16 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise InputError(f"chunk size {chunk_tokens!r} is out of range (16..65536 tokens)")
    check_level_names(levels)  # spelling mistakes fail before the model loads
    sign_keys = tuple(sign_keys)
    if sign_keys:
        own = [k.public for k in sign_keys]
        trust = trust.with_keys(own) if trust is not None else TrustPolicy(own)
    store = store if isinstance(store, Store) else open_store(store)
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device)
    progress = progress or (lambda stage, done, total: None)
    profile = profile_ref = None
    seconds: dict[str, float] = {}
    if needs_profile(levels):
        from .profile_store import ensure_profile

        calibrated = False

        def calibrating(stage: str, done: int, total: int) -> None:
            nonlocal calibrated
            calibrated = True
            progress(f"calibrate:{stage}", done, total)

        t = time.perf_counter()
        profile, profile_ref = ensure_profile(
            store, loaded, calibrating, sign_keys=sign_keys, trust=trust
        )
        store.freshen(profile_ref.key)  # named by this version: kept from a concurrent gc
        if calibrated:  # the model had no codec profile: a one-off, reported apart
            seconds["calibrate"] = time.perf_counter() - t
    chosen = parse_levels(levels, profile)
    on_object = on_object or (lambda key: None)
    fingerprint = loaded.fingerprint
    src_sha = source_digest(text)
    signed_by = [k.public.id for k in sign_keys]

    ids: list[int] | None = None
    chunks = []
    kv = None
    # Objects known to be stored, by (chunk hash, level id): those this run
    # uploaded or checked, and those a trusted earlier version names.
    stored: dict[tuple[str, str], ObjectRef] = {}
    freshened: set[str] = set()  # keys of objects this run names without uploading them
    prefilled = 0  # tokens the model computed
    prefix_from: str | None = None  # where the KV of an unchanged prefix came from
    full_prefill_reason: str | None = None  # why an edit was prefilled from its start
    uploaded = 0
    uploaded_bytes = 0
    for _attempt in range(VERSION_ATTEMPTS):
        # a removed version's number is never given again (edges and readers may hold it)
        latest = max(catalog.latest_version(store, name) or 0, catalog.removed_version(store, name))
        if latest >= MAX_VERSION:
            raise StoreError(
                f"{store.url} lists {manifest_key(name, latest)}: no version can follow it; "
                "remove that key if this publisher did not write it"
            )
        previous = _previous(store, name, trust)
        if (
            previous is not None
            and _same_publication(previous, src_sha, fingerprint, chunk_tokens, chosen)
            and _signed_as_asked(previous, sign_keys)
            and _all_stored(store, previous)
        ):
            _advance_pointer(store, name, previous.version, sign_keys, trust)
            _write_indexes(store, previous)
            return PublishResult(
                name=name,
                version=previous.version,
                manifest_key=manifest_key(name, previous.version),
                unchanged=True,
                token_count=previous.token_count,
                chunks=len(previous.chunks),
                reused_objects=sum(len(c.objects) for c in previous.chunks),
                level_bytes={
                    n: lv.total_bytes for n, lv in previous.levels.items() if n != TEXT_LEVEL
                },
                seconds={"total": time.perf_counter() - started},
                signed_by=[previous.signer.key.id] if previous.signer else [],
            )
        if previous is not None:
            for c in previous.chunks:
                for lv_name, ref in c.objects.items():
                    stored.setdefault((c.hash, previous.levels[lv_name].id), ref)

        if ids is None:
            t = time.perf_counter()
            ids = loaded.document_ids(text)
            loaded.check_fits(len(ids))
            chunks = split_chunks(fingerprint, ids, chunk_tokens)
            seconds["tokenize"] = time.perf_counter() - t
        _freshen_reused(store, chunks, chosen, stored, freshened)
        missing = [
            (chunk, level)
            for chunk in chunks
            for level in chosen
            if (chunk.hash, level.id) not in stored
        ]
        if missing:
            if kv is None:
                t = time.perf_counter()
                prefix = None
                if incremental:
                    prefix, why = _stored_prefix(store, previous, ids, missing, loaded,
                                                 prefill, profile, stored, chosen)  # fmt: skip
                    if prefix is None and why:
                        full_prefill_reason = why
                        log.info("%s: a full prefill (%s)", name, why)
                        # an object found damaged or gone is no longer reused: encoded again
                        missing = [(chunk, level) for chunk in chunks for level in chosen
                                   if (chunk.hash, level.id) not in stored]  # fmt: skip
                    if prefix is not None:
                        seconds["prefix_decode"] = time.perf_counter() - t
                        prefix_from = f"{previous.ref} {prefix[1]}"
                start = 0 if prefix is None else prefix[0].shape[3]
                progress("prefill", 0, len(ids) - start)
                if prefix is None:
                    kv = (prefill or loaded.prefill)(ids)
                elif start == len(ids):  # a cut at the end: every token's KV is stored
                    kv = prefix[0]
                else:
                    import torch

                    tail = loaded.extend(prefix[0], ids[start:])  # on the model's device
                    kv = torch.cat([prefix[0].to(tail.device, tail.dtype), tail], dim=3)
                _check_prefill(kv, loaded, len(ids))
                prefilled = len(ids) - start
                progress("prefill", prefilled, prefilled)
                seconds["prefill"] = time.perf_counter() - t - seconds.get("prefix_decode", 0.0)
            t = time.perf_counter()
            t_encode = 0.0

            def store_one(data: bytes, chunk_hash: str, level: Level) -> tuple[ObjectRef, bool]:
                sha = hashlib.sha256(data).hexdigest()
                ref = ObjectRef(object_key(chunk_hash, level.id, sha), len(data), sha)
                written = store.put_content(ref.key, data)
                on_object(ref.key)
                return ref, written

            with ThreadPoolExecutor(UPLOAD_CONCURRENCY) as pool:
                pending = []
                for n, (chunk, level) in enumerate(missing):
                    te = time.perf_counter()
                    data = encode_chunk(
                        level,
                        kv[:, :, :, chunk.start : chunk.end],
                        chunk.hash,
                        profile=profile,
                        start=chunk.start,
                    )
                    t_encode += time.perf_counter() - te
                    progress("encode", n + 1, len(missing))
                    pending.append((chunk, level, pool.submit(store_one, data, chunk.hash, level)))
                for n, (chunk, level, future) in enumerate(pending):
                    ref, written = future.result()
                    stored[(chunk.hash, level.id)] = ref
                    if written:
                        uploaded += 1
                        uploaded_bytes += ref.bytes
                    else:
                        freshened.add(ref.key)
                    progress("upload", n + 1, len(missing))
            seconds["encode"] = seconds.get("encode", 0.0) + t_encode
            seconds["upload"] = seconds.get("upload", 0.0) + time.perf_counter() - t - t_encode

        version = latest + 1
        manifest = _manifest(
            name, version, text, src_sha, loaded, ids, chunks, chosen, stored, profile,
            profile_ref, chunk_tokens,
        )  # fmt: skip
        data = manifest.dumps()
        if sign_keys:
            data = seal(data, MANIFEST_TYPE, sign_keys)
        if store.put_new(manifest_key(name, version), data):
            _check_still_stored(store, manifest, freshened)
            break
        log.info("%s@%d was published by someone else meanwhile; publishing as the next", name,
                 version)  # fmt: skip
    else:
        raise ConcurrentPublish(
            f"other publishers of '{name}' took {VERSION_ATTEMPTS} versions in a row while "
            "this one tried to publish; run the publish again"
        )
    _advance_pointer(store, name, version, sign_keys, trust)
    _write_indexes(store, manifest)
    seconds["total"] = time.perf_counter() - started
    log.info(
        "published %s@%d: %d chunks, %d objects uploaded", name, version, len(chunks), uploaded
    )
    total_objects = len(chunks) * len(chosen)
    return PublishResult(
        name=name,
        version=version,
        manifest_key=manifest_key(name, version),
        unchanged=False,
        token_count=len(ids),
        chunks=len(chunks),
        uploaded_objects=uploaded,
        reused_objects=total_objects - uploaded,
        uploaded_bytes=uploaded_bytes,
        level_bytes={n: lv.total_bytes for n, lv in manifest.levels.items() if n != TEXT_LEVEL},
        seconds=seconds,
        signed_by=signed_by,
        prefilled_tokens=prefilled,
        prefix_from=prefix_from,
        full_prefill_reason=full_prefill_reason,
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
            ref = entry.objects[level]
            try:
                data = store.get(ref.key, max_bytes=ref.bytes, check=ref.check)
            except (FormatError, NotFound):
                stored.pop((entry.hash, previous.levels[level].id), None)
                raise
            header, _ = decode_chunk(
                data, name=f"object {ref.key}", profile=codec_profile, verified=True,
                out=kv[:, :, :, entry.start : entry.end],
            )  # fmt: skip
            if header.chunk_hash != entry.hash:
                raise FormatError(f"object {ref.key} holds another chunk than its manifest says")
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
        total = sum(stored[(c.hash, level.id)].bytes for c in chunks)
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


def _previous(store: Store, name: str, trust: TrustPolicy | None) -> Manifest | None:
    """The newest version this publisher may build on: one it can read (with
    ``trust``: signed by a trusted key) in the current schema; None if there is none."""
    try:
        return catalog.newest_readable(store, name, trust, skip=True)
    except NotFound:  # removed while it was being read
        return None


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
) -> None:
    """Point ``latest.json`` at the newest version, never an older one, and never at one
    this publisher has not read (with ``trust``: verified).

    Another publisher may write the pointer between our read and our write;
    listing again afterwards and rewriting until the listing holds nothing
    newer makes concurrent publishers agree on the newest version.
    """
    target = version
    for _ in range(VERSION_ATTEMPTS):
        newer = catalog.newest_readable(store, name, trust, above=target, skip=True)
        target = newer.version if newer is not None else target
        try:
            current = catalog.read_pointer(store, name, trust)
        except (FormatError, TrustError):
            current = None  # damaged or not ours to believe: rewritten
        if current is None or current.version != target:
            data = pointer_bytes(name, target)
            if sign_keys:
                data = seal(data, POINTER_TYPE, sign_keys)
            store.put(latest_key(name), data)
        if catalog.newest_readable(store, name, trust, above=target, skip=True) is None:
            return
