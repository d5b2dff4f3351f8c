"""The manifest: a document version's table of contents.

Specified in ``docs/manifest.md``. A manifest is JSON with a ``schema_version``,
stored plain or inside a signed envelope (:mod:`kvcdn.signing`). The parser
accepts only versions it knows and checks every field's type and bound
before anything uses it: every object key must be the canonical key of its
chunk, level and sha256 (:mod:`kvcdn.keys`), and the KV layout must be
plausible before anyone allocates for it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import keys
from .container import MAX_CHUNK_TOKENS, MAX_TIERS
from .errors import FormatError, InputError, IntegrityError, OldSchema
from .jsonfmt import loads
from .signing import MANIFEST_TYPE, POINTER_TYPE, Signer, TrustPolicy, open_document

SCHEMA_VERSION = 3
MAX_MANIFEST_BYTES = 64 << 20
MAX_POINTER_BYTES = 64 << 10
MAX_TOKENS = 1 << 24
MAX_LEVELS = 64
MAX_OBJECT_BYTES = 1 << 30  # one chunk at one level; far above any real one
MAX_PROFILE_BYTES = 256 << 20
#: A version-2 object's index: its header and a section table of 40 bytes per section.
MAX_INDEX_BYTES = 4 << 20
MAX_LAYOUT = {"layers": 1024, "kv_heads": 1024, "head_dim": 1024}
KV_DTYPES = ("float16", "bfloat16", "float32")
TEXT_LEVEL = "text"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LEVEL_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class IndexRef:
    """A version-2 object's index (its first ``bytes`` bytes) and the index digest it
    ends with: what a reader of part of the object checks that index against."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class TierRef:
    """The tiers of a nested object a level reads: the first ``count``, which with the
    index are ``bytes`` bytes."""

    count: int
    bytes: int


@dataclass
class ObjectRef:
    key: str
    bytes: int
    sha256: str
    #: The section index of a version-2 object (None: version 1, read whole).
    index: IndexRef | None = None
    #: Of a nested object (one per chunk for every level): the tiers this level reads.
    tiers: TierRef | None = None

    @property
    def level_bytes(self) -> int:
        """What a reader of this level fetches: the whole object, or its tiers."""
        return self.bytes if self.tiers is None else self.tiers.bytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "bytes": self.bytes, "sha256": self.sha256}
        if self.index is not None:
            out["index"] = {"bytes": self.index.bytes, "sha256": self.index.sha256}
        if self.tiers is not None:
            out["tiers"] = {"count": self.tiers.count, "bytes": self.tiers.bytes}
        return out

    def check(self, data: bytes) -> None:
        """:class:`IntegrityError` unless ``data`` is exactly the bytes this ref names."""
        if len(data) != self.bytes or hashlib.sha256(data).hexdigest() != self.sha256:
            raise IntegrityError(
                f"{self.key} does not match the size and sha256 its manifest records "
                "(corrupted in the store or in transit)"
            )


@dataclass(frozen=True)
class ObjectSpan:
    """Bytes ``[start, end)`` of the object ``ref`` names: what a reader of part of a
    version-2 object fetches. Its bytes are checked by the caller (against the index
    digest, or the sections' sha256s), not by ``ref``'s whole-object digest."""

    ref: ObjectRef
    start: int
    end: int

    @property
    def key(self) -> str:
        return self.ref.key

    def check(self, data: bytes) -> None:
        if len(data) != self.end - self.start:
            raise IntegrityError(
                f"{self.key}: {len(data)} bytes arrived for bytes {self.start}-{self.end - 1}"
            )


@dataclass
class ChunkEntry:
    index: int
    start: int
    end: int
    hash: str
    tokens: list[int]
    objects: dict[str, ObjectRef]  # level name -> object


@dataclass
class LevelInfo:
    id: str
    codec: str
    params: dict[str, Any]
    total_bytes: int
    bits_per_element: float
    description: str = ""
    #: Measured quality against exact KV (kl, ppl_delta_pct, top1_agree; calibration texts).
    quality: dict[str, float] = field(default_factory=dict)


@dataclass
class Manifest:
    name: str
    version: int
    source_sha256: str
    source_bytes: int
    created_at: str
    model_name: str
    model_fingerprint: str
    tokenizer: str
    token_count: int
    chunk_tokens: int
    kv_layout: dict[str, Any]
    levels: dict[str, LevelInfo]
    chunks: list[ChunkEntry] = field(default_factory=list)
    codec_profile: ObjectRef | None = None  # needed by ladder levels
    #: Who signed the manifest as read (None: unsigned); not part of its bytes.
    signer: Signer | None = field(default=None, compare=False)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def chain_hash(self) -> str:
        """The document's identity: its last chunk's chained hash (model, all tokens)."""
        return self.chunks[-1].hash if self.chunks else ""

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "document": {
                "name": self.name,
                "source_sha256": self.source_sha256,
                "source_bytes": self.source_bytes,
            },
            "version": self.version,
            "created_at": self.created_at,
            "model": {"name": self.model_name, "fingerprint": self.model_fingerprint},
            "tokenizer": self.tokenizer,
            "token_count": self.token_count,
            "chunk_tokens": self.chunk_tokens,
            "kv_layout": self.kv_layout,
            "codec_profile": (
                None
                if self.codec_profile is None
                else {
                    "key": self.codec_profile.key,
                    "bytes": self.codec_profile.bytes,
                    "sha256": self.codec_profile.sha256,
                }
            ),
            "levels": {
                name: {
                    "id": lv.id,
                    "codec": lv.codec,
                    "params": lv.params,
                    "description": lv.description,
                    "total_bytes": lv.total_bytes,
                    "bits_per_element": lv.bits_per_element,
                    "quality": lv.quality,
                }
                for name, lv in self.levels.items()
            },
            "chunks": [
                {
                    "index": c.index,
                    "start": c.start,
                    "end": c.end,
                    "hash": c.hash,
                    "tokens": c.tokens,
                    "objects": {
                        lv: o.to_json() for lv, o in c.objects.items()
                    },
                }
                for c in self.chunks
            ],
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


def parse_manifest(data: bytes, *, name: str = "manifest") -> Manifest:
    """Parse and validate an unsigned manifest's bytes; :class:`FormatError` names ``name``."""
    return manifest_from_json(loads(data, what=name, max_bytes=MAX_MANIFEST_BYTES), name=name)


def open_manifest(data: bytes, *, name: str, trust: TrustPolicy | None) -> Manifest:
    """A stored manifest (plain or signed) as read by a reader with ``trust``.

    With ``trust``, only a manifest signed by a trusted key is accepted.
    """
    raw, signer = open_document(
        data, MANIFEST_TYPE, what=name, trust=trust, max_bytes=MAX_MANIFEST_BYTES
    )
    manifest = manifest_from_json(raw, name=name)
    manifest.signer = signer
    return manifest


def manifest_from_json(raw: Any, *, name: str) -> Manifest:
    """A :class:`Manifest` from parsed JSON, every field checked."""
    v = _Validator(name)
    v.dict(raw, "manifest")
    schema = raw.get("schema_version")
    if type(schema) is int and 0 < schema < SCHEMA_VERSION:
        raise OldSchema(
            f"{name} was written by an older kvcdn (schema_version {schema}; this kvcdn reads "
            f"{SCHEMA_VERSION}); publish the document again to make a current version"
        )
    if schema != SCHEMA_VERSION:
        raise FormatError(
            f"{name} has schema_version {schema!r}; this kvcdn reads schema_version "
            f"{SCHEMA_VERSION} (upgrade kvcdn to read newer manifests)"
        )
    doc = v.dict(raw.get("document"), "document")
    model = v.dict(raw.get("model"), "model")
    fingerprint = v.hex64(model.get("fingerprint"), "model.fingerprint")
    layout = v.dict(raw.get("kv_layout"), "kv_layout")
    if set(layout) != {"layers", "kv_heads", "head_dim", "dtype"}:
        raise FormatError(f"{name}: kv_layout must have exactly layers, kv_heads, head_dim, dtype")
    for key, most in MAX_LAYOUT.items():
        v.int(layout.get(key), f"kv_layout.{key}", minimum=1, maximum=most)
    if layout.get("dtype") not in KV_DTYPES:
        raise FormatError(f"{name}: kv_layout.dtype must be one of {', '.join(KV_DTYPES)}")
    token_count = v.int(raw.get("token_count"), "token_count", minimum=1, maximum=MAX_TOKENS)
    chunk_tokens = v.int(raw.get("chunk_tokens"), "chunk_tokens", 1, MAX_CHUNK_TOKENS)

    raw_levels = v.dict(raw.get("levels"), "levels")
    if len(raw_levels) > MAX_LEVELS:
        raise FormatError(f"{name} declares {len(raw_levels)} levels (at most {MAX_LEVELS})")
    levels: dict[str, LevelInfo] = {}
    for lv_name, lv in raw_levels.items():
        where = f"levels.{lv_name}"
        if not _LEVEL_NAME.match(lv_name):
            raise FormatError(f"{name}: {lv_name[:40]!r} is not a level name")
        lv = v.dict(lv, where)
        level_id = v.str(lv.get("id"), f"{where}.id")
        if lv_name == TEXT_LEVEL:
            if level_id != TEXT_LEVEL:
                raise FormatError(f"{name}: level text must have the id 'text'")
        elif not (keys.is_level_id(level_id) and level_id.startswith(f"{lv_name}-")):
            raise FormatError(f"{name}: {where}.id {level_id[:60]!r} is not an id of this level")
        levels[lv_name] = LevelInfo(
            id=level_id,
            codec=v.str(lv.get("codec"), f"{where}.codec"),
            params=v.dict(lv.get("params"), f"{where}.params"),
            total_bytes=v.int(lv.get("total_bytes"), f"{where}.total_bytes", minimum=0),
            bits_per_element=v.num(lv.get("bits_per_element"), f"{where}.bits_per_element"),
            description=v.text(lv.get("description", ""), f"{where}.description"),
            quality={
                k: v.real(q, f"{where}.quality.{k}")
                for k, q in v.dict(lv.get("quality", {}), f"{where}.quality").items()
            },
        )

    raw_chunks = raw.get("chunks")
    if not isinstance(raw_chunks, list) or not raw_chunks:
        raise FormatError(f"{name}: 'chunks' is missing, empty or not a list")
    if len(raw_chunks) != math.ceil(token_count / chunk_tokens):
        raise FormatError(f"{name}: {len(raw_chunks)} chunks cannot hold {token_count} tokens")
    chunks: list[ChunkEntry] = []
    expected_start = 0
    for i, c in enumerate(raw_chunks):
        where = f"chunks[{i}]"
        c = v.dict(c, where)
        start = v.int(c.get("start"), f"{where}.start", minimum=0)
        end = v.int(c.get("end"), f"{where}.end", minimum=start + 1)
        tokens = c.get("tokens")
        if (
            start != expected_start
            or end - start > chunk_tokens
            or (end - start < chunk_tokens and i != len(raw_chunks) - 1)
            or not isinstance(tokens, list)
            or len(tokens) != end - start
            or not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens)
        ):
            raise FormatError(f"{name}: {where} has an inconsistent token range or token list")
        expected_start = end
        chunk_hash = v.hex64(c.get("hash"), f"{where}.hash")
        objects = {}
        for lv_name, o in v.dict(c.get("objects"), f"{where}.objects").items():
            o = v.dict(o, f"{where}.objects.{lv_name}")
            if lv_name not in levels or lv_name == TEXT_LEVEL:
                raise FormatError(f"{name}: {where} names undeclared level {lv_name[:40]!r}")
            ref = ObjectRef(
                key=v.str(o.get("key"), f"{where}.objects.{lv_name}.key"),
                bytes=v.int(
                    o.get("bytes"), f"{where}.objects.{lv_name}.bytes", 1, MAX_OBJECT_BYTES
                ),
                sha256=v.hex64(o.get("sha256"), f"{where}.objects.{lv_name}.sha256"),
                index=_index_ref(o.get("index"), f"{where}.objects.{lv_name}.index", v),
                tiers=_tier_ref(o.get("tiers"), f"{where}.objects.{lv_name}.tiers", v),
            )
            if ref.index is not None and ref.index.bytes >= ref.bytes:
                raise FormatError(f"{name}: {where}.objects.{lv_name}.index is not within it")
            if ref.tiers is not None and (ref.index is None or not
                                          ref.index.bytes < ref.tiers.bytes <= ref.bytes):
                raise FormatError(f"{name}: {where}.objects.{lv_name}.tiers is not within it")
            level_id = levels[lv_name].id
            if ref.tiers is not None:
                level_id = keys.tiered_object_id(level_id)
            if ref.key != keys.object_key(chunk_hash, level_id, ref.sha256):
                raise FormatError(
                    f"{name}: {where}.objects.{lv_name}.key {ref.key[:120]!r} is not the key of "
                    "this chunk, level and sha256"
                )
            objects[lv_name] = ref
        chunks.append(
            ChunkEntry(
                index=i, start=start, end=end, hash=chunk_hash, tokens=tokens, objects=objects
            )
        )
    if token_count != expected_start:
        raise FormatError(f"{name}: token_count {token_count} does not match its chunks")

    profile = None
    if raw.get("codec_profile") is not None:
        p = v.dict(raw.get("codec_profile"), "codec_profile")
        profile = ObjectRef(
            key=v.str(p.get("key"), "codec_profile.key"),
            bytes=v.int(p.get("bytes"), "codec_profile.bytes", 1, MAX_PROFILE_BYTES),
            sha256=v.hex64(p.get("sha256"), "codec_profile.sha256"),
        )
        if profile.key != keys.profile_key(fingerprint, profile.sha256):
            raise FormatError(f"{name}: codec_profile.key is not the key of its model and sha256")
    return Manifest(
        name=v.doc_name(doc.get("name"), "document.name"),
        version=v.int(raw.get("version"), "version", minimum=1),
        source_sha256=v.hex64(doc.get("source_sha256"), "document.source_sha256"),
        source_bytes=v.int(doc.get("source_bytes"), "document.source_bytes", minimum=0),
        created_at=v.str(raw.get("created_at"), "created_at"),
        model_name=v.str(model.get("name"), "model.name"),
        model_fingerprint=fingerprint,
        tokenizer=v.str(raw.get("tokenizer"), "tokenizer"),
        token_count=token_count,
        chunk_tokens=chunk_tokens,
        kv_layout=layout,
        levels=levels,
        chunks=chunks,
        codec_profile=profile,
    )


def _index_ref(raw: Any, where: str, v: _Validator) -> IndexRef | None:
    """An object's ``index`` entry (absent: a version-1 object)."""
    if raw is None:
        return None
    raw = v.dict(raw, where)
    return IndexRef(v.int(raw.get("bytes"), f"{where}.bytes", 1, MAX_INDEX_BYTES),
                    v.hex64(raw.get("sha256"), f"{where}.sha256"))  # fmt: skip


def _tier_ref(raw: Any, where: str, v: _Validator) -> TierRef | None:
    """An object's ``tiers`` entry (absent: the object is the level's own)."""
    if raw is None:
        return None
    raw = v.dict(raw, where)
    return TierRef(v.int(raw.get("count"), f"{where}.count", 1, MAX_TIERS),
                   v.int(raw.get("bytes"), f"{where}.bytes", 1, MAX_OBJECT_BYTES))  # fmt: skip


class _Validator:
    """Type checks that name the manifest and field in their errors."""

    MAX_TEXT = 4096

    def __init__(self, name: str) -> None:
        self.name = name

    def _fail(self, where: str, what: str) -> FormatError:
        return FormatError(f"{self.name}: '{where}' is missing or not {what}")

    def dict(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self._fail(where, "an object")
        return value

    def str(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value or len(value) > self.MAX_TEXT:
            raise self._fail(where, f"a string of 1 to {self.MAX_TEXT} characters")
        return value

    def text(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or len(value) > self.MAX_TEXT:
            raise self._fail(where, f"a string of at most {self.MAX_TEXT} characters")
        return value

    def int(self, value: Any, where: str, minimum: int = 0, maximum: int = 1 << 62) -> int:
        if type(value) is not int or not minimum <= value <= maximum:
            raise self._fail(where, f"an integer from {minimum} to {maximum}")
        return value

    def num(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or not 0 <= value < 1e6:
            raise self._fail(where, "a non-negative number")
        return float(value)

    def real(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self._fail(where, "a finite number")
        return float(value)

    def doc_name(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or keys.parse_key(keys.latest_key(value)) is None:
            raise self._fail(where, "a valid document name")
        return value

    def hex64(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not _HEX64.match(value):
            raise self._fail(where, "a 64-digit lowercase hex digest")
        return value


# ---- pointers ---------------------------------------------------------------------

#: How long a signed latest pointer is believed after it is written, by default: its
#: publisher renews it (``kvcdn refresh``, or any publish) before then. A week lets a
#: weekly refresh job miss a run by a day without readers noticing, and bounds how long
#: a store can replay an old pointer to a reader that has never seen the document.
POINTER_VALID_FOR_S = 7 * 86400
#: The longest window a publisher may sign: beyond ten years an expiry bounds nothing.
MAX_POINTER_VALID_FOR_S = 3650 * 86400
#: ``expires``: RFC 3339 in UTC, whole seconds, "Z": one spelling per instant, so that
#: no reader has to interpret offsets, fractions or lower-case letters.
_EXPIRES = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})Z")


@dataclass(frozen=True)
class Pointer:
    """``latest.json`` or a source index entry: a document version, who signed it, and
    (for a latest pointer, when its publisher signed one) when it stops being believed."""

    name: str
    version: int
    signer: Signer | None = None
    #: Unix seconds (None: the pointer carries no expiry; see ``docs/trust.md``).
    expires: int | None = None


def format_expiry(seconds: float) -> str:
    """Unix ``seconds`` as a pointer's ``expires``: ``2026-01-31T12:00:00Z``."""
    return datetime.fromtimestamp(int(seconds), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_expiry(value: Any, what: str) -> int:
    """A pointer's ``expires`` as Unix seconds; :class:`FormatError` unless it is an
    RFC 3339 UTC time of the one spelling :func:`format_expiry` writes, from 1970."""
    match = _EXPIRES.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise FormatError(f"{what}: 'expires' must be a UTC time like 2026-01-31T12:00:00Z, "
                          f"not {shown}")  # fmt: skip
    try:
        when = datetime(*(int(g) for g in match.groups()), tzinfo=timezone.utc)
    except ValueError as exc:
        raise FormatError(
            f"{what}: 'expires' {value!r} is not a real date and time ({exc})"
        ) from None
    if when.year < 1970:
        raise FormatError(f"{what}: 'expires' {value!r} is before 1970")
    return int(when.timestamp())


def check_valid_for(seconds: Any) -> int:
    """A pointer's validity window in whole seconds (rounded up), checked:
    :class:`InputError` outside 1 s to :data:`MAX_POINTER_VALID_FOR_S`."""
    if type(seconds) not in (int, float) or not math.isfinite(seconds):
        raise InputError(f"a pointer's validity window is a number of seconds, not {seconds!r}")
    if not 1 <= seconds <= MAX_POINTER_VALID_FOR_S:
        raise InputError(
            f"a pointer's validity window must be from 1 s to {MAX_POINTER_VALID_FOR_S // 86400}"
            f" days (--pointer-valid-for), not {seconds:g} s"
        )
    return math.ceil(seconds)


def pointer_bytes(name: str, version: int, expires: int | None = None) -> bytes:
    """A pointer's JSON (unsigned; :func:`kvcdn.signing.seal` signs it), with ``expires``
    (Unix seconds) when given: publishers give it to the latest pointers they sign."""
    raw: dict[str, Any] = {
        "name": name, "version": version, "manifest": keys.manifest_key(name, version)
    }  # fmt: skip
    if expires is not None:
        raw["expires"] = format_expiry(expires)
    return json.dumps(raw).encode()


_POINTER_FIELDS = ({"name", "version", "manifest"}, {"name", "version", "manifest", "expires"})


def open_pointer(data: bytes, *, what: str, trust: TrustPolicy | None = None) -> Pointer:
    """Parse a pointer (plain or signed); with ``trust``, only a trusted signed one.

    Whether it is still current (its ``expires``) is the caller's to decide:
    :func:`kvcdn.catalog.check_fresh` for readers, the edge for stale copies."""
    raw, signer = open_document(
        data, POINTER_TYPE, what=what, trust=trust, max_bytes=MAX_POINTER_BYTES
    )
    if (
        not isinstance(raw, dict)
        or set(raw) not in _POINTER_FIELDS
        or not isinstance(raw["name"], str)
        or type(raw["version"]) is not int
        or raw["version"] < 1
        or keys.parse_key(keys.latest_key(raw["name"])) is None
        or raw["manifest"] != keys.manifest_key(raw["name"], raw["version"])
    ):
        raise FormatError(f"{what} is not a valid version pointer")
    expires = parse_expiry(raw["expires"], what) if "expires" in raw else None
    return Pointer(raw["name"], raw["version"], signer, expires)
