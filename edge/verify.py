"""What an edge may serve, how long others may cache it, and how it is verified.

Keys are the store's (``kvcdn.manifest`` defines them). Everything an edge
caches is checked against what its key promises before it is cached and each
time it is served from disk, so a flipped bit on the way in or on the edge's
own disk is never passed on:

* chunk objects (``objects/ab/{chunk hash}/{level}.kvc``): the container's own
  sha256 trailer, and the header's chunk hash equals the one in the key;
* codec profiles (``profiles/{fp}/{sha256}.safetensors``): sha256 of the bytes;
* manifest versions (``docs/{name}/versions/N.json``): a valid manifest of that
  name and version;
* pointers (``latest.json``, ``current.json``, ``index/...``): valid JSON.
"""

from __future__ import annotations

import hashlib
import json
import re

from kvcdn.container import unpack
from kvcdn.errors import FormatError
from kvcdn.manifest import NAME_PATTERN, parse_manifest

MAX_KEY_LENGTH = 1024
_OBJECT = re.compile(r"^objects/([0-9a-f]{2})/([0-9a-f]{64})/[A-Za-z0-9._-]{1,160}\.kvc$")
_PROFILE = re.compile(r"^profiles/[0-9a-f]{16}/([0-9a-f]{64})\.safetensors$")
_VERSION = re.compile(rf"^docs/({NAME_PATTERN})/versions/(\d{{6,}})\.json$")
_POINTER = re.compile(
    rf"^(docs/{NAME_PATTERN}/latest\.json|profiles/[0-9a-f]{{16}}/current\.json"
    r"|index/sources/[0-9a-f]{16}/[0-9a-f]{64}\.json)$"
)

IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "public, max-age=5, must-revalidate"


class VerifyError(Exception):
    """Bytes that are not what their key promises."""


def check_key(key: str) -> str | None:
    """The key's kind (object, profile, version, pointer), or None if not servable."""
    if len(key) > MAX_KEY_LENGTH or "\\" in key or "\0" in key:
        return None
    for kind, pattern in (
        ("object", _OBJECT),
        ("profile", _PROFILE),
        ("version", _VERSION),
        ("pointer", _POINTER),
    ):
        if pattern.match(key):
            return kind
    return None


def cache_control(kind: str) -> str:
    """Content-addressed and versioned keys never change; pointers do."""
    return REVALIDATE if kind == "pointer" else IMMUTABLE


def verify(key: str, kind: str, data: bytes) -> str:
    """The ETag of ``data``; :class:`VerifyError` unless it is what ``key`` promises."""
    try:
        if kind == "object":
            header, _ = unpack(data, name=key)
            m = _OBJECT.match(key)
            assert m is not None
            if header.chunk_hash != m.group(2) or m.group(1) != m.group(2)[:2]:
                raise VerifyError(f"{key} holds chunk {header.chunk_hash[:12]}, not its key's")
            # unpack checked the container's sha256 trailer: a strong validator
            # of these bytes, without hashing them a second time
            return '"' + data[-32:].hex()[:32] + '"'
        if kind == "profile":
            m = _PROFILE.match(key)
            assert m is not None
            if hashlib.sha256(data).hexdigest() != m.group(1):
                raise VerifyError(f"{key} does not match the sha256 in its key")
            return '"' + m.group(1)[:32] + '"'
        if kind == "version":
            m = _VERSION.match(key)
            assert m is not None
            manifest = parse_manifest(data, name=key)
            if manifest.name != m.group(1) or manifest.version != int(m.group(2)):
                raise VerifyError(f"{key} holds another document or version")
        if kind == "pointer":
            json.loads(data)
    except (FormatError, ValueError) as exc:
        raise VerifyError(str(exc)) from None
    return '"' + hashlib.sha256(data).hexdigest()[:32] + '"'
