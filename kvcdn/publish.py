"""Publishing: document -> tokens -> KV -> chunk objects -> manifest -> latest pointer.

Order is the crash-safety argument. Objects are immutable and written first
(each atomically); the manifest is created last, with a create-only write, so
a version is visible exactly when all its objects are; the latest pointer is
a hint written after it. A publish that dies part-way leaves orphan objects
and no new version; the next run finds those objects, verifies them and
uploads only what is missing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import catalog
from .codec import (
    DEFAULT_LEVELS,
    TEXT_LEVEL,
    Level,
    check_level_names,
    encode_chunk,
    needs_profile,
    parse_levels,
)
from .container import unpack
from .errors import ConcurrentPublish, FormatError, InputError, OldSchema
from .kv import DEFAULT_CHUNK_TOKENS, split_chunks
from .manifest import (
    ChunkEntry,
    LevelInfo,
    Manifest,
    ObjectRef,
    check_name,
    latest_key,
    manifest_key,
    name_from_filename,
    object_key,
    source_index_key,
)
from .models import LoadedModel, load_model
from .profile import CodecProfile
from .store import Store, open_store

log = logging.getLogger(__name__)

#: progress(stage, done, total): stages are "prefill", "encode" and "upload", and
#: "calibrate:<step>" when the model has no codec profile yet.
ProgressFn = Callable[[str, int, int], None]
UPLOAD_CONCURRENCY = 8


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
) -> PublishResult:
    """Publish one document (a file ``path``, or ``text`` with a ``name``).

    ``on_object(key)`` is called after each object is stored.
    """
    started = time.perf_counter()
    if (path is None) == (text is None):
        raise InputError("publish needs either a path or a text")
    if path is not None:
        text = read_document(path)
        name = name or name_from_filename(Path(path).stem)
    else:
        assert text is not None
        text = document_text(text.encode("utf-8"), "the text")
        if not name:
            raise InputError("publishing a text needs a document name")
    check_name(name)
    if chunk_tokens < 16 or chunk_tokens > 65536:
        raise InputError(f"chunk size {chunk_tokens} is out of range (16..65536 tokens)")
    check_level_names(levels)  # spelling mistakes fail before the model loads
    store = store if isinstance(store, Store) else open_store(store)
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device)
    progress = progress or (lambda stage, done, total: None)
    profile = profile_ref = None
    if needs_profile(levels):
        from .profiles import ensure_profile

        profile, profile_ref = ensure_profile(
            store, loaded, lambda stage, done, total: progress(f"calibrate:{stage}", done, total)
        )
    chosen = parse_levels(levels, profile)
    on_object = on_object or (lambda key: None)
    seconds: dict[str, float] = {}

    fingerprint = loaded.fingerprint
    src_sha = source_digest(text)
    latest = catalog.latest_version(store, name)
    previous = None
    if latest:
        try:
            previous = catalog.read_manifest(store, name, latest)
        except OldSchema:  # an older kvcdn's version: this publish supersedes it
            log.info("%s@%d has an older manifest schema; publishing a new version", name, latest)
    if previous and _same_publication(previous, src_sha, fingerprint, chunk_tokens, chosen):
        _advance_pointer(store, name, previous.version)
        return PublishResult(
            name=name,
            version=previous.version,
            manifest_key=manifest_key(name, previous.version),
            unchanged=True,
            token_count=previous.token_count,
            chunks=len(previous.chunks),
            reused_objects=sum(len(c.objects) for c in previous.chunks),
            level_bytes={n: lv.total_bytes for n, lv in previous.levels.items() if n != TEXT_LEVEL},
            seconds={"total": time.perf_counter() - started},
        )

    t = time.perf_counter()
    ids = loaded.document_ids(text)
    loaded.check_fits(len(ids))
    chunks = split_chunks(fingerprint, ids, chunk_tokens)
    seconds["tokenize"] = time.perf_counter() - t

    # What already exists: objects named by an earlier manifest are trusted as
    # recorded; objects without one (left by a crashed run) are verified.
    known: dict[str, ObjectRef] = {}
    if previous:
        for c in previous.chunks:
            for ref in c.objects.values():
                known[ref.key] = ref
    refs: dict[tuple[int, str], ObjectRef] = {}
    missing: list[tuple[int, Level, str]] = []
    for chunk in chunks:
        for level in chosen:
            key = object_key(chunk.hash, level.id)
            ref = known.get(key) or _verified_leftover(store, key, chunk.hash, level)
            if ref:
                refs[(chunk.index, level.name)] = ref
            else:
                missing.append((chunk.index, level, key))

    uploaded_bytes = 0
    if missing:
        t = time.perf_counter()
        progress("prefill", 0, len(ids))
        kv = loaded.prefill(ids)
        progress("prefill", len(ids), len(ids))
        seconds["prefill"] = time.perf_counter() - t

        t_encode = 0.0
        t = time.perf_counter()

        def store_one(item: tuple[int, Level, str], data: bytes) -> ObjectRef:
            key = item[2]
            store.put(key, data)
            on_object(key)
            return ObjectRef(key=key, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

        with ThreadPoolExecutor(UPLOAD_CONCURRENCY) as pool:
            pending = []
            for n, item in enumerate(missing):
                index, level, _ = item
                chunk = chunks[index]
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
                pending.append((item, pool.submit(store_one, item, data)))
            for n, (item, future) in enumerate(pending):
                ref = future.result()
                refs[(item[0], item[1].name)] = ref
                uploaded_bytes += ref.bytes
                progress("upload", n + 1, len(missing))
        seconds["encode"] = t_encode
        seconds["upload"] = time.perf_counter() - t - t_encode

    layout = loaded.layout
    level_infos = {}
    for level in chosen:
        total = sum(refs[(c.index, level.name)].bytes for c in chunks)
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
    version = (latest or 0) + 1
    manifest = Manifest(
        name=name,
        version=version,
        source_sha256=src_sha,
        source_bytes=len(text.encode("utf-8")),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model_name=loaded.name,
        model_fingerprint=fingerprint,
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
                objects={lv.name: refs[(c.index, lv.name)] for lv in chosen},
            )
            for c in chunks
        ],
    )
    key = manifest_key(name, version)
    if not store.put_new(key, manifest.dumps()):
        raise ConcurrentPublish(
            f"version {version} of '{name}' was published by someone else meanwhile; "
            "run the publish again"
        )
    _advance_pointer(store, name, version)
    store.put(source_index_key(fingerprint, src_sha), catalog.pointer_bytes(name, version))
    seconds["total"] = time.perf_counter() - started
    log.info(
        "published %s@%d: %d chunks, %d objects uploaded", name, version, len(chunks), len(missing)
    )
    return PublishResult(
        name=name,
        version=version,
        manifest_key=key,
        unchanged=False,
        token_count=len(ids),
        chunks=len(chunks),
        uploaded_objects=len(missing),
        reused_objects=len(chunks) * len(chosen) - len(missing),
        uploaded_bytes=uploaded_bytes,
        level_bytes={n: lv.total_bytes for n, lv in level_infos.items() if n != TEXT_LEVEL},
        seconds=seconds,
    )


def _level_quality(level: Level, profile: CodecProfile | None) -> dict[str, float]:
    if level.name == "fp16":
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


def _verified_leftover(store: Store, key: str, chunk_hash: str, level: Level) -> ObjectRef | None:
    """An object a crashed publish left behind, if it is whole and is what ``key`` says."""
    if not store.exists(key):
        return None
    data = store.get(key)
    try:
        header, _ = unpack(data, name=key)
    except FormatError as exc:
        log.warning("replacing damaged leftover object: %s", exc)
        return None
    if header.chunk_hash != chunk_hash or header.codec != level.codec:
        log.warning("replacing leftover object %s: it holds another chunk or codec", key)
        return None
    return ObjectRef(key=key, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _advance_pointer(store: Store, name: str, version: int) -> None:
    """Move ``latest.json`` forward to ``version``; never backwards."""
    current = catalog.pointer_version(store, name)
    if current is None or current < version:
        store.put(latest_key(name), catalog.pointer_bytes(name, version))
