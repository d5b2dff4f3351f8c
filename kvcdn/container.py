"""The chunk container: one chunk of KV at one quality level, as one object.

Specified in ``docs/format.md``. Everything is little-endian::

    offset     size  field
    0          8     magic  b"KVCDNCHK"
    8          2     format version (u16), currently 1
    10         2     flags (u16), must be 0
    12         4     header length H (u32), at most 1 MiB
    16         8     payload length P (u64)
    24         H     header: a UTF-8 JSON object (codec, level, params, shape, chunk_hash)
    24+H       P     payload: codec-specific bytes
    24+H+P     32    sha256 of bytes [0, 24+H+P)

The parser checks the magic, version, flags and both lengths against the
object's real size before it reads anything they point to, then the checksum,
then the header's fields and types. Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import FormatError, IntegrityError
from .jsonfmt import loads

MAGIC = b"KVCDNCHK"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_CHUNK_ELEMENTS = 1 << 34  # far above any real chunk; stops absurd shapes early
_PREAMBLE = struct.Struct("<8sHHIQ")
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


def pack(header: ChunkHeader, payload: bytes) -> bytes:
    """Serialise a chunk object."""
    head = json.dumps(header.to_json(), sort_keys=True, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise FormatError("chunk header is larger than 1 MiB")
    body = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(head), len(payload)) + head + payload
    return body + hashlib.sha256(body).digest()


def unpack(
    data: bytes, *, name: str = "chunk object", verify_digest: bool = True
) -> tuple[ChunkHeader, memoryview]:
    """Parse and verify a chunk object; ``name`` goes into error messages.

    ``verify_digest=False`` skips only the trailer's sha256, for callers that
    have just checked the whole object against a digest they trust (the
    manifest's); every length and field is still validated.
    """
    view = memoryview(data)
    head_len = _check_preamble(bytes(view[: _PREAMBLE.size]), len(view), name)
    body_end = len(view) - _DIGEST_BYTES
    if verify_digest and hashlib.sha256(view[:body_end]).digest() != bytes(view[body_end:]):
        raise IntegrityError(f"{name} fails its checksum (corrupted)")
    head_start = _PREAMBLE.size
    header = _parse_header(bytes(view[head_start : head_start + head_len]), name)
    return header, view[head_start + head_len : body_end]


def read_header(read_at: Callable[[int, int], bytes], size: int, *,
                name: str = "chunk object") -> ChunkHeader:  # fmt: skip
    """The header of a chunk object of ``size`` bytes that is not in memory (a file):
    ``read_at(offset, n)`` returns its bytes ``[offset, offset + n)``. The same checks
    as :func:`unpack` but the trailer's, which callers replace by the whole object's
    sha256 (the one in its key), computed as it was written."""
    head_len = _check_preamble(read_at(0, _PREAMBLE.size), size, name)
    return _parse_header(read_at(_PREAMBLE.size, head_len), name)


def _check_preamble(preamble: bytes, size: int, name: str) -> int:
    """The header's length, once the preamble of an object of ``size`` bytes holds up."""
    if size < _PREAMBLE.size + _DIGEST_BYTES or len(preamble) < _PREAMBLE.size:
        raise FormatError(f"{name} is truncated ({size} bytes)")
    magic, version, flags, head_len, payload_len = _PREAMBLE.unpack_from(preamble)
    if magic != MAGIC:
        raise FormatError(f"{name} is not a kvcdn chunk (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{name} has chunk format version {version}; this kvcdn reads version "
            f"{FORMAT_VERSION} (upgrade kvcdn)"
        )
    if flags != 0:
        raise FormatError(f"{name} has unknown flags {flags:#x}")
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
