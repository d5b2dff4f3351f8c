"""What an edge may serve, how long others may cache it, and how it is verified.

Keys are the store's (:mod:`kvcdn.keys`). Everything an edge caches is checked
against something an attacker without the publisher's key cannot forge,
before it is cached and again on its first use from disk, so that neither a
poisoned origin nor a flipped bit on the edge's own disk is passed on:

* chunk objects and codec profiles: the sha256 in the key (and, for chunk
  objects, the container's structure and the chunk hash in the key);
* manifest versions: with trust keys (``edge serve --trust``), a signature by
  a trusted key over a manifest of that name and version; they are then
  immutable. Without trust keys the edge cannot tell a forged manifest from a
  real one, so it keeps manifests only as it keeps pointers: revalidated with
  the origin every few seconds, never served as immutable;
* pointers (``latest.json``): a valid pointer to that document, signed by a
  trusted key when the edge has trust keys; never older than the one the edge
  already holds (rollback). Its signed ``expires``, if any, is kept: a copy
  past it is never served stale (:mod:`.fill`);
* other pointers (source index entries, profile pointers): valid, readers
  check what they lead to.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from kvcdn.container import read_header
from kvcdn.errors import KvcdnError
from kvcdn.keys import MAX_KEY_LENGTH, KeyInfo, parse_key
from kvcdn.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_OBJECT_BYTES,
    MAX_POINTER_BYTES,
    MAX_PROFILE_BYTES,
    open_manifest,
    open_pointer,
)
from kvcdn.signing import PROFILE_POINTER_TYPE, TrustPolicy, open_document

IMMUTABLE = "public, max-age=31536000, immutable"
#: ``max-age``: how long the edge itself reuses the pointer (``--pointer-ttl``), so a
#: cache below it holds the copy no longer than the edge does.
REVALIDATE = "public, max-age={ttl}, must-revalidate"


class VerifyError(Exception):
    """Bytes that are not what their key promises."""


@dataclass(frozen=True)
class Verified:
    """What verification established about some bytes."""

    etag: str
    #: True when the bytes can never change (content-addressed, or signed and versioned).
    immutable: bool
    version: int = 0  # of a pointer, for rollback
    #: Of a pointer: when its publisher's word runs out (Unix seconds; None: no expiry).
    expires: int | None = None


def check_key(key: str) -> KeyInfo | None:
    """What ``key`` names, or None if it is not a servable kvcdn key."""
    if len(key) > MAX_KEY_LENGTH or "\\" in key or "\0" in key:
        return None
    return _check_key(key)


# Each key served is parsed once while it is among the 8,192 last asked for (KeyInfo
# is frozen): at most 8 MiB of keys, whatever the requests.
@functools.lru_cache(maxsize=8192)
def _check_key(key: str) -> KeyInfo | None:
    return parse_key(key)


def max_bytes(info: KeyInfo) -> int:
    """The most bytes an object of this kind can have: no origin may send more."""
    return {
        "object": MAX_OBJECT_BYTES,
        "profile": MAX_PROFILE_BYTES,
        "manifest": MAX_MANIFEST_BYTES,
    }.get(info.kind, MAX_POINTER_BYTES)


def revalidated(info: KeyInfo, trust: TrustPolicy | None) -> bool:
    """Kept a few seconds and refreshed from the origin, rather than kept for good."""
    return info.mutable or (info.kind == "manifest" and trust is None)


def cache_control(info: KeyInfo, trust: TrustPolicy | None, pointer_ttl_s: int,
                  expires: int | None = None) -> str:  # fmt: skip
    """``Cache-Control`` of an answer for ``info``; ``expires``: a pointer's signed
    expiry (Unix seconds), past which no cache below this edge may keep it either."""
    if revalidated(info, trust):
        ttl = pointer_ttl_s
        if expires is not None:
            ttl = max(0, min(ttl, math.floor(expires - time.time())))
        return REVALIDATE.format(ttl=ttl)
    return IMMUTABLE


#: Kinds whose bytes are checked by the sha256 in their key: never read into memory.
CONTENT_ADDRESSED = ("object", "profile")
_HASH_PIECE = 1 << 20


def verify_content(
    key: str, info: KeyInfo, *, size: int, sha256: str, read_at: Callable[[int, int], bytes]
) -> Verified:
    """What a chunk object or profile of ``size`` bytes whose sha256 is ``sha256`` is, its
    bytes readable by ``read_at(offset, n)``; :class:`VerifyError` unless it is what
    ``key`` promises. Only a chunk object's header is read."""
    if size > max_bytes(info):
        raise VerifyError(f"{key} is {size} bytes, more than such an object can be")
    if sha256 != info.sha256:
        raise VerifyError(f"{key} does not match the sha256 in its key")
    if info.kind == "object":
        # the whole object's sha256 is stronger than the container's own trailer
        try:
            header = read_header(read_at, size, name=key)
        except KvcdnError as exc:
            raise VerifyError(str(exc)) from None
        if header.chunk_hash != info.chunk_hash:
            raise VerifyError(f"{key} holds chunk {header.chunk_hash[:12]}, not its key's")
        if not info.level_id.startswith(f"{header.level}-"):
            raise VerifyError(f"{key} holds level {header.level!r}, not its key's")
    return Verified(_etag(sha256), immutable=True)


def verify_file(
    key: str, info: KeyInfo, f: BinaryIO, trust: TrustPolicy | None
) -> tuple[Verified, bytes | None]:
    """What the open file ``f`` holds, read with explicit offsets (``f`` may share its
    offset with other readers): a content-addressed object is hashed a piece at a
    time and never held; other kinds (documents of at most a few MiB) are returned
    as bytes too."""
    fd = f.fileno()
    size = os.fstat(fd).st_size
    if size > max_bytes(info):
        raise VerifyError(f"{key} is {size} bytes, more than such an object can be")
    if info.kind not in CONTENT_ADDRESSED:
        data = os.pread(fd, size, 0)
        return verify(key, info, data, trust), data
    digest = hashlib.sha256()
    for at in range(0, size, _HASH_PIECE):
        digest.update(os.pread(fd, min(_HASH_PIECE, size - at), at))
    return verify_content(
        key, info, size=size, sha256=digest.hexdigest(), read_at=lambda at, n: os.pread(fd, n, at)
    ), None


def verify(key: str, info: KeyInfo, data: bytes, trust: TrustPolicy | None) -> Verified:
    """What ``data`` is; :class:`VerifyError` unless it is what ``key`` promises."""
    if len(data) > max_bytes(info):
        raise VerifyError(f"{key} is {len(data)} bytes, more than such an object can be")
    if info.kind in CONTENT_ADDRESSED:
        view = memoryview(data)
        return verify_content(
            key, info, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
            read_at=lambda at, n: bytes(view[at : at + n]),
        )  # fmt: skip
    try:
        digest = hashlib.sha256(data).hexdigest()
        if info.kind == "manifest":
            manifest = open_manifest(data, name=key, trust=trust)
            if manifest.name != info.name or manifest.version != info.version:
                raise VerifyError(f"{key} holds {manifest.ref}, not what its key names")
            return Verified(_etag(digest), immutable=trust is not None)
        if info.kind == "pointer":
            pointer = open_pointer(data, what=key, trust=trust)
            if pointer.name != info.name:
                raise VerifyError(f"{key} points at another document ({pointer.name})")
            return Verified(_etag(digest), immutable=False, version=pointer.version,
                            expires=pointer.expires)  # fmt: skip
        if info.kind == "removed":  # a publisher's record, read from the store itself
            raise VerifyError(f"{key} is not served by edges")
        if info.kind in ("index", "prefix-index"):
            open_pointer(data, what=key)
        else:  # profile-pointer
            open_document(
                data, PROFILE_POINTER_TYPE, what=key, trust=None, max_bytes=MAX_POINTER_BYTES
            )
        return Verified(_etag(digest), immutable=False)
    except KvcdnError as exc:
        raise VerifyError(str(exc)) from None


def _etag(digest: str) -> str:
    return f'"{digest[:32]}"'
