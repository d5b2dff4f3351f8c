"""The manifest: a document version's table of contents, and where things live.

Specified in ``docs/manifest.md``. A manifest is JSON with a ``schema_version``;
the parser accepts only versions it knows and checks every field's type before
anything uses it. Store keys are defined here and only here, so publisher,
SDK and edge agree on them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError, InputError, OldSchema

SCHEMA_VERSION = 2
MAX_MANIFEST_BYTES = 64 << 20

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME = re.compile(f"^{NAME_PATTERN}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ---- keys ---------------------------------------------------------------------


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InputError(
            f"invalid document name {name!r}: use letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit)"
        )
    return name


def name_from_filename(stem: str) -> str:
    """A document name derived from a file name: unsafe characters become '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._")[:128]
    return name or "document"


def object_key(chunk_hash: str, level_id: str) -> str:
    return f"objects/{chunk_hash[:2]}/{chunk_hash}/{level_id}.kvc"


def manifest_key(name: str, version: int) -> str:
    return f"docs/{name}/versions/{version:06d}.json"


def latest_key(name: str) -> str:
    return f"docs/{name}/latest.json"


def source_index_key(fingerprint: str, source_sha256: str) -> str:
    return f"index/sources/{fingerprint[:16]}/{source_sha256}.json"


DOCS_PREFIX = "docs/"


# ---- the manifest -------------------------------------------------------------


@dataclass
class ObjectRef:
    key: str
    bytes: int
    sha256: str


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

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def chain_hash(self) -> str:
        """The document's identity: its last chunk's chained hash (model, all tokens)."""
        return self.chunks[-1].hash if self.chunks else ""

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
                        lv: {"key": o.key, "bytes": o.bytes, "sha256": o.sha256}
                        for lv, o in c.objects.items()
                    },
                }
                for c in self.chunks
            ],
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


def parse_manifest(data: bytes, *, name: str = "manifest") -> Manifest:
    """Parse and validate a manifest; raises :class:`FormatError` with ``name`` in it."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{name} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{name} is not valid JSON: {exc}") from None
    v = _Validator(name)
    v.dict(raw, "manifest")
    schema = raw.get("schema_version")
    if isinstance(schema, int) and not isinstance(schema, bool) and 0 < schema < SCHEMA_VERSION:
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
    layout = v.dict(raw.get("kv_layout"), "kv_layout")
    for key in ("layers", "kv_heads", "head_dim"):
        v.int(layout.get(key), f"kv_layout.{key}", minimum=1)
    v.str(layout.get("dtype"), "kv_layout.dtype")
    levels: dict[str, LevelInfo] = {}
    for lv_name, lv in v.dict(raw.get("levels"), "levels").items():
        lv = v.dict(lv, f"levels.{lv_name}")
        levels[lv_name] = LevelInfo(
            id=v.str(lv.get("id"), f"levels.{lv_name}.id"),
            codec=v.str(lv.get("codec"), f"levels.{lv_name}.codec"),
            params=v.dict(lv.get("params"), f"levels.{lv_name}.params"),
            total_bytes=v.int(lv.get("total_bytes"), f"levels.{lv_name}.total_bytes", minimum=0),
            bits_per_element=v.num(lv.get("bits_per_element"), f"levels.{lv_name}.bits"),
            description=str(lv.get("description", "")),
            quality={
                k: v.real(q, f"levels.{lv_name}.quality.{k}")
                for k, q in v.dict(lv.get("quality", {}), f"levels.{lv_name}.quality").items()
            },
        )
    chunks: list[ChunkEntry] = []
    expected_start = 0
    raw_chunks = raw.get("chunks")
    if not isinstance(raw_chunks, list):
        raise FormatError(f"{name}: 'chunks' is missing or not a list")
    for i, c in enumerate(raw_chunks):
        where = f"chunks[{i}]"
        c = v.dict(c, where)
        start = v.int(c.get("start"), f"{where}.start", minimum=0)
        end = v.int(c.get("end"), f"{where}.end", minimum=start + 1)
        tokens = c.get("tokens")
        if (
            start != expected_start
            or not isinstance(tokens, list)
            or len(tokens) != end - start
            or not all(type(t) is int and t >= 0 for t in tokens)
        ):
            raise FormatError(f"{name}: {where} has an inconsistent token range or token list")
        expected_start = end
        objects = {}
        for lv_name, o in v.dict(c.get("objects"), f"{where}.objects").items():
            o = v.dict(o, f"{where}.objects.{lv_name}")
            if lv_name not in levels:
                raise FormatError(f"{name}: {where} names undeclared level {lv_name!r}")
            objects[lv_name] = ObjectRef(
                key=v.str(o.get("key"), f"{where}.key"),
                bytes=v.int(o.get("bytes"), f"{where}.bytes", minimum=1),
                sha256=v.hex64(o.get("sha256"), f"{where}.sha256"),
            )
        chunks.append(
            ChunkEntry(
                index=i,
                start=start,
                end=end,
                hash=v.hex64(c.get("hash"), f"{where}.hash"),
                tokens=tokens,
                objects=objects,
            )
        )
    profile = None
    if raw.get("codec_profile") is not None:
        p = v.dict(raw.get("codec_profile"), "codec_profile")
        profile = ObjectRef(
            key=v.str(p.get("key"), "codec_profile.key"),
            bytes=v.int(p.get("bytes"), "codec_profile.bytes", minimum=1),
            sha256=v.hex64(p.get("sha256"), "codec_profile.sha256"),
        )
    token_count = v.int(raw.get("token_count"), "token_count", minimum=1)
    if token_count != expected_start:
        raise FormatError(f"{name}: token_count {token_count} does not match its chunks")
    return Manifest(
        name=v.doc_name(doc.get("name"), "document.name"),
        version=v.int(raw.get("version"), "version", minimum=1),
        source_sha256=v.hex64(doc.get("source_sha256"), "document.source_sha256"),
        source_bytes=v.int(doc.get("source_bytes"), "document.source_bytes", minimum=0),
        created_at=v.str(raw.get("created_at"), "created_at"),
        model_name=v.str(model.get("name"), "model.name"),
        model_fingerprint=v.hex64(model.get("fingerprint"), "model.fingerprint"),
        tokenizer=v.str(raw.get("tokenizer"), "tokenizer"),
        token_count=token_count,
        chunk_tokens=v.int(raw.get("chunk_tokens"), "chunk_tokens", minimum=1),
        kv_layout=layout,
        levels=levels,
        chunks=chunks,
        codec_profile=profile,
    )


class _Validator:
    """Type checks that name the manifest and field in their errors."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _fail(self, where: str, what: str) -> FormatError:
        return FormatError(f"{self.name}: '{where}' is missing or not {what}")

    def dict(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self._fail(where, "an object")
        return value

    def str(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self._fail(where, "a string")
        return value

    def int(self, value: Any, where: str, minimum: int = 0) -> int:
        if type(value) is not int or value < minimum:
            raise self._fail(where, f"an integer >= {minimum}")
        return value

    def num(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or value < 0:
            raise self._fail(where, "a non-negative number")
        return float(value)

    def real(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self._fail(where, "a finite number")
        return float(value)

    def doc_name(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not _NAME.match(value):
            raise self._fail(where, "a valid document name")
        return value

    def hex64(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not _HEX64.match(value):
            raise self._fail(where, "a 64-digit lowercase hex digest")
        return value


def parse_pointer(data: bytes, *, name: str) -> dict[str, Any]:
    """Parse a small JSON pointer object (``latest.json``, source index entries)."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise FormatError(f"{name} is not valid JSON") from None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("name"), str)
        or type(raw.get("version")) is not int
        or raw["version"] < 1
    ):
        raise FormatError(f"{name} is not a valid version pointer")
    return raw
