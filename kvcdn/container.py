"""The chunk container: one chunk of KV at one quality level, as one object.

Specified in ``docs/format.md``. Two versions are read; publishers write version 2.
Everything is little-endian.

Version 1 (one payload, one trailing checksum)::

    0          8     magic  b"KVCDNCHK"
    8          2     format version (u16): 1
    10         2     flags (u16), must be 0
    12         4     header length H (u32), at most 1 MiB
    16         8     payload length P (u64)
    24         H     header: a UTF-8 JSON object (codec, level, params, shape, chunk_hash)
    24+H       P     payload: codec-specific bytes
    24+H+P     32    sha256 of bytes [0, 24+H+P)

Version 2 (sections a reader can fetch apart: one per KV head and layer)::

    0          8     magic  b"KVCDNCHK"
    8          2     format version (u16): 2
    10         2     flags (u16), must be 0
    12         4     header length H (u32), at most 1 MiB
    16         8     payload length P (u64): the sections' lengths added up
    24         4     section count N (u32): kv_heads x layers of the header's shape
    28         H     header (as in version 1)
    28+H       40 N  section table: per section, its length (u64) and its sha256
    28+H+40N   32    sha256 of bytes [0, 28+H+40N): the index digest
    I          P     the sections, in table order; I = 28+H+40N+32 is the index's size

Section ``h * layers + l`` holds KV head ``h`` of layer ``l`` (keys and values): a
reader holding heads ``[h0, h1)`` (a tensor-parallel rank) finds its sections in one
run of bytes. An object of a nested codec holds several *tiers* (a base and its
refinements): N is then ``tiers x kv_heads x layers``, and section
``r * kv_heads * layers + h * layers + l`` is tier ``r`` of head ``h`` of layer ``l``, so
the first ``k`` tiers of a reader's heads are ``k`` runs of bytes.

The manifest records the index's size and digest beside the whole object's, so a
reader that fetches only the index and some sections verifies each before a byte of
it is used.

The parser checks the magic, version, flags and every length against the object's
real size before it reads anything they point to, then the checksums, then the
header's fields and types. Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import FormatError, IntegrityError
from .jsonfmt import loads

MAGIC = b"KVCDNCHK"
#: The version publishers write.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
MAX_HEADER_BYTES = 1 << 20
MAX_CHUNK_ELEMENTS = 1 << 34  # far above any real chunk; stops absurd shapes early
#: Tokens of one chunk: a manifest's chunks hold at most this many, so no object of a
#: published chunk holds more (and a decode into a new tensor allocates no more).
MAX_CHUNK_TOKENS = 65536
#: Sections of one object: far above any model's kv_heads x layers (llama-70b: 640).
MAX_SECTIONS = 1 << 16
#: Tiers of one object (a nested codec's base and refinements).
MAX_TIERS = 16
_PREAMBLE = struct.Struct("<8sHHIQ")
_PREAMBLE_V2 = struct.Struct("<8sHHIQI")
_SECTION = struct.Struct("<Q32s")
_DIGEST_BYTES = 32
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ChunkHeader:
    codec: str  # the level's codec, e.g. "fp16" or "int8-channel-zstd"
    level: str  # the level name in the manifest
    params: dict[str, Any]
    shape: tuple[int, int, int, int, int]  # [layers, 2, kv_heads, tokens, head_dim]
    chunk_hash: str

    def to_json(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "level": self.level,
            "params": self.params,
            "shape": list(self.shape),
            "chunk_hash": self.chunk_hash,
        }


@dataclass(frozen=True)
class Part:
    """The layers ``[layers[0], layers[1])`` and KV heads ``[heads[0], heads[1])`` of a
    chunk that one reader holds: all of them, or a tensor- or pipeline-parallel
    rank's share."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    #: Tiers ``[0, tiers)`` of an object that has several (a nested codec's base and
    #: refinements); None: all of them.
    tiers: int | None = None

    @classmethod
    def whole(cls, layers: int, heads: int, tiers: int | None = None) -> Part:
        return cls((0, layers), (0, heads), tiers)

    @property
    def layer_count(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def head_count(self) -> int:
        return self.heads[1] - self.heads[0]

    def is_whole(self, shape: tuple[int, ...]) -> bool:
        """All layers and heads (of whatever tiers)."""
        return self.layers == (0, shape[0]) and self.heads == (0, shape[2])

    def fits(self, shape: tuple[int, ...]) -> bool:
        """The part lies within a chunk of ``shape`` (and is not empty)."""
        (l0, l1), (h0, h1) = self.layers, self.heads
        return 0 <= l0 < l1 <= shape[0] and 0 <= h0 < h1 <= shape[2]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
        """The shape of this part of a chunk of ``shape``."""
        return (self.layer_count, 2, self.head_count, shape[3], shape[4])

    def tier_count(self, tiers: int) -> int:
        """How many tiers of an object of ``tiers`` the part reads."""
        return tiers if self.tiers is None else self.tiers

    def section_ids(self, layers: int, heads: int = 1, tiers: int = 1) -> list[int]:
        """The version-2 sections that hold the part of an object of ``layers`` layers,
        ``heads`` KV heads and ``tiers`` tiers, in table (byte) order."""
        return [r * heads * layers + h * layers + lay for r in range(self.tier_count(tiers))
                for h in range(*self.heads) for lay in range(*self.layers)]  # fmt: skip


def section_id(layer: int, head: int, layers: int) -> int:
    """The section of a version-2 object that holds ``head`` of ``layer``."""
    return head * layers + layer


@dataclass(frozen=True)
class ChunkIndex:
    """A version-2 object's header and section table, checked."""

    header: ChunkHeader
    size: int  # bytes of the index (preamble, header, table, digest): where sections start
    digest: str  # the index digest (hex), what a manifest records
    lengths: tuple[int, ...]
    sha256s: tuple[bytes, ...]
    offsets: tuple[int, ...]  # each section's first byte in the object

    @property
    def object_size(self) -> int:
        return self.size + sum(self.lengths)

    @property
    def tiers(self) -> int:
        layers, _, heads = self.header.shape[:3]
        return len(self.lengths) // (layers * heads)

    def part_ids(self, part: Part) -> list[int]:
        """The sections of ``part``, in table order; :class:`FormatError` unless the part
        fits this object."""
        layers, _, heads = self.header.shape[:3]
        if not part.fits(self.header.shape) or not 1 <= part.tier_count(self.tiers) <= self.tiers:
            raise FormatError(f"part {part} is not within this object ({self.tiers} tiers of "
                              f"shape {list(self.header.shape)})")  # fmt: skip
        return part.section_ids(layers, heads, self.tiers)

    def runs(self, ids: list[int]) -> list[tuple[int, int, list[int]]]:
        """Sections ``ids`` (in table order) as runs of adjacent bytes: (start, end, ids)."""
        runs: list[tuple[int, int, list[int]]] = []
        for i in ids:
            start, end = self.offsets[i], self.offsets[i] + self.lengths[i]
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end, [*runs[-1][2], i])
            else:
                runs.append((start, end, [i]))
        return runs

    def check_section(self, i: int, data: bytes | memoryview, name: str) -> None:
        """:class:`IntegrityError` unless ``data`` is exactly section ``i``."""
        if len(data) != self.lengths[i] or hashlib.sha256(data).digest() != self.sha256s[i]:
            raise IntegrityError(f"{name}: section {i} fails its checksum (corrupted)")


@dataclass(frozen=True)
class Body:
    """A container's encoded KV: the one payload of a version-1 object, or (version 2)
    the sections read, by section id (all of them, or those of a part)."""

    version: int
    payload: memoryview | None = None
    sections: Mapping[int, memoryview] | None = None


def pack(header: ChunkHeader, payload: bytes) -> bytes:
    """Serialise a version-1 chunk object (one payload)."""
    head = _header_bytes(header)
    body = _PREAMBLE.pack(MAGIC, 1, 0, len(head), len(payload)) + head + payload
    return body + hashlib.sha256(body).digest()


def pack_sections(header: ChunkHeader, sections: list[bytes]) -> bytes:
    """Serialise a version-2 chunk object: ``sections`` in table order (tier-major, then
    head-major)."""
    layers, _, heads = header.shape[:3]
    if len(sections) % (layers * heads) or not 1 <= len(sections) // (layers * heads) <= MAX_TIERS:
        raise FormatError(f"{len(sections)} sections for {layers} layers x {heads} heads")
    head = _header_bytes(header)
    table = b"".join(_SECTION.pack(len(s), hashlib.sha256(s).digest()) for s in sections)
    index = (
        _PREAMBLE_V2.pack(MAGIC, 2, 0, len(head), sum(map(len, sections)), len(sections))
        + head
        + table
    )
    return b"".join((index, hashlib.sha256(index).digest(), *sections))


def _header_bytes(header: ChunkHeader) -> bytes:
    head = json.dumps(header.to_json(), sort_keys=True, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise FormatError("chunk header is larger than 1 MiB")
    return head


def unpack(
    data: bytes, *, name: str = "chunk object", verify_digest: bool = True
) -> tuple[ChunkHeader, Body]:
    """Parse and verify a whole chunk object of either version; ``name`` goes into
    error messages.

    ``verify_digest=False`` skips the object's own checksums (a version-1 trailer, a
    version-2 index digest and section sha256s), for callers that have just checked the
    whole object against a digest they trust (the manifest's); every length and field
    is still validated.
    """
    view = memoryview(data)
    version = _version(bytes(view[:_PREAMBLE.size]), len(view), name)
    if version == 2:
        index = parse_index(view, name=name, object_size=len(view), verify_digest=verify_digest)
        sections = {}
        for i, (at, n) in enumerate(zip(index.offsets, index.lengths, strict=True)):
            sections[i] = view[at : at + n]
            if verify_digest:
                index.check_section(i, sections[i], name)
        return index.header, Body(2, sections=sections)
    head_len = _check_preamble_v1(bytes(view[: _PREAMBLE.size]), len(view), name)
    body_end = len(view) - _DIGEST_BYTES
    if verify_digest and hashlib.sha256(view[:body_end]).digest() != bytes(view[body_end:]):
        raise IntegrityError(f"{name} fails its checksum (corrupted)")
    head_start = _PREAMBLE.size
    header = _parse_header(bytes(view[head_start : head_start + head_len]), name)
    return header, Body(1, payload=view[head_start + head_len : body_end])


def parse_index(
    data: bytes | memoryview, *, name: str = "chunk object", object_size: int | None = None,
    verify_digest: bool = True, digest: str | None = None,
) -> ChunkIndex:  # fmt: skip
    """The index of a version-2 object from its first bytes ``data`` (at least the
    whole index; more is ignored). ``object_size``, when known, must be the sum of the
    index and its sections; ``digest`` (the manifest's) must be the index digest."""
    view = memoryview(data)
    if len(view) < _PREAMBLE_V2.size:
        raise FormatError(f"{name} is truncated before its section table")
    magic, version, flags, head_len, payload_len, count = _PREAMBLE_V2.unpack_from(view)
    _check_magic(magic, version, flags, name)
    if version != 2:
        raise FormatError(f"{name} has no section table (format version {version})")
    if head_len > MAX_HEADER_BYTES:
        raise FormatError(f"{name} declares a {head_len}-byte header (limit {MAX_HEADER_BYTES})")
    if not 0 < count <= MAX_SECTIONS:
        raise FormatError(f"{name} declares {count} sections (limit {MAX_SECTIONS})")
    table_at = _PREAMBLE_V2.size + head_len
    size = table_at + _SECTION.size * count + _DIGEST_BYTES
    if len(view) < size:
        raise FormatError(f"{name}: {len(view)} bytes read, its index alone is {size}")
    if object_size is not None and size + payload_len != object_size:
        raise FormatError(
            f"{name} is {object_size} bytes but its lengths add up to {size + payload_len} "
            "(truncated or padded)"
        )
    stored = bytes(view[size - _DIGEST_BYTES : size])
    if digest is not None and stored.hex() != digest:
        raise IntegrityError(f"{name}: its index is not the one its manifest records")
    if verify_digest and hashlib.sha256(view[: size - _DIGEST_BYTES]).digest() != stored:
        raise IntegrityError(f"{name}: its index fails its checksum (corrupted)")
    header = _parse_header(bytes(view[_PREAMBLE_V2.size : table_at]), name)
    layers, _, heads = header.shape[:3]
    if count % (layers * heads) or count // (layers * heads) > MAX_TIERS:
        raise FormatError(f"{name} has {count} sections for {layers} layers x {heads} heads")
    # The table in one unpack (a 70B chunk has thousands of sections), into Python
    # integers, so that no sum of declared lengths can wrap.
    rows = struct.unpack_from(f"<{'Q32s' * count}", view, table_at)
    lengths, sha256s = rows[0::2], rows[1::2]
    offsets = tuple(itertools.accumulate(lengths[:-1], initial=size))
    total = offsets[-1] + lengths[-1] - size
    if total != payload_len:
        raise FormatError(f"{name}: its sections add up to {total} bytes, not {payload_len}")
    return ChunkIndex(header, size, stored.hex(), lengths, sha256s, offsets)


def index_size(data: bytes | memoryview) -> int | None:
    """The size of a version-2 object's index from its first bytes (None: version 1)."""
    if len(data) < _PREAMBLE_V2.size or bytes(data[8:10]) != b"\x02\x00":
        return None
    _, _, _, head_len, _, count = _PREAMBLE_V2.unpack_from(data)
    return _PREAMBLE_V2.size + head_len + _SECTION.size * count + _DIGEST_BYTES


def read_header(read_at: Callable[[int, int], bytes], size: int, *,
                name: str = "chunk object") -> ChunkHeader:  # fmt: skip
    """The header of a chunk object of ``size`` bytes that is not in memory (a file):
    ``read_at(offset, n)`` returns its bytes ``[offset, offset + n)``. The same checks
    as :func:`unpack` but the checksums, which callers replace by the whole object's
    sha256 (the one in its key), computed as it was written."""
    version = _version(read_at(0, _PREAMBLE.size), size, name)
    if version == 2:
        first = read_at(0, _PREAMBLE_V2.size)
        n = index_size(first)
        if n is None or n > size:
            raise FormatError(f"{name} is truncated before its section table ends")
        return parse_index(read_at(0, n), name=name, object_size=size,
                           verify_digest=False).header  # fmt: skip
    head_len = _check_preamble_v1(read_at(0, _PREAMBLE.size), size, name)
    return _parse_header(read_at(_PREAMBLE.size, head_len), name)


def _version(preamble: bytes, size: int, name: str) -> int:
    if size < _PREAMBLE.size + _DIGEST_BYTES or len(preamble) < _PREAMBLE.size:
        raise FormatError(f"{name} is truncated ({size} bytes)")
    magic, version, flags, _, _ = _PREAMBLE.unpack_from(preamble)
    _check_magic(magic, version, flags, name)
    return version


def _check_magic(magic: bytes, version: int, flags: int, name: str) -> None:
    if magic != MAGIC:
        raise FormatError(f"{name} is not a kvcdn chunk (bad magic)")
    if version not in READ_VERSIONS:
        raise FormatError(
            f"{name} has chunk format version {version}; this kvcdn reads versions "
            f"{', '.join(map(str, READ_VERSIONS))} (upgrade kvcdn)"
        )
    if flags != 0:
        raise FormatError(f"{name} has unknown flags {flags:#x}")


def _check_preamble_v1(preamble: bytes, size: int, name: str) -> int:
    """The header's length, once the preamble of a version-1 object of ``size`` bytes
    holds up."""
    _, _, _, head_len, payload_len = _PREAMBLE.unpack_from(preamble)
    if head_len > MAX_HEADER_BYTES:
        raise FormatError(f"{name} declares a {head_len}-byte header (limit {MAX_HEADER_BYTES})")
    expected = _PREAMBLE.size + head_len + payload_len + _DIGEST_BYTES
    if expected != size:
        raise FormatError(
            f"{name} is {size} bytes but its lengths add up to {expected} "
            "(truncated or padded)"
        )
    return head_len


def _parse_header(raw: bytes, name: str) -> ChunkHeader:
    if len(raw) > MAX_HEADER_BYTES:
        raise FormatError(f"{name} header is larger than {MAX_HEADER_BYTES} bytes")
    return _validate_header(loads(raw, what=f"{name} header", max_bytes=MAX_HEADER_BYTES), name)


def _validate_header(raw: Any, name: str) -> ChunkHeader:
    if not isinstance(raw, dict):
        raise FormatError(f"{name} header is not a JSON object")
    for field, kind in (("codec", str), ("level", str), ("params", dict), ("shape", list)):
        if not isinstance(raw.get(field), kind):
            raise FormatError(f"{name} header field '{field}' is missing or not a {kind.__name__}")
    shape = raw["shape"]
    if len(shape) != 5 or not all(type(n) is int and n > 0 for n in shape) or shape[1] != 2:
        raise FormatError(f"{name} header has an invalid shape {shape!r}")
    if math.prod(shape) > MAX_CHUNK_ELEMENTS:
        raise FormatError(f"{name} header shape {shape!r} is implausibly large")
    if shape[3] > MAX_CHUNK_TOKENS:
        raise FormatError(f"{name} header shape {shape!r} holds more than {MAX_CHUNK_TOKENS} "
                          "tokens, the most a chunk has")  # fmt: skip
    chunk_hash = raw.get("chunk_hash")
    if not isinstance(chunk_hash, str) or not _HEX64.match(chunk_hash):
        raise FormatError(f"{name} header has an invalid chunk_hash")
    return ChunkHeader(
        codec=raw["codec"],
        level=raw["level"],
        params=raw["params"],
        shape=tuple(shape),  # type: ignore[arg-type]
        chunk_hash=chunk_hash,
    )
