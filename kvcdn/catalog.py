"""Reading what a store holds: documents, versions, manifests, the source index."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .errors import InputError, NotFound
from .manifest import (
    DOCS_PREFIX,
    Manifest,
    check_name,
    latest_key,
    manifest_key,
    parse_manifest,
    parse_pointer,
    source_index_key,
)
from .store import Reader

_VERSION_KEY = re.compile(r"^docs/([^/]+)/versions/(\d+)\.json$")


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``name``, ``name@latest`` or ``name@3`` -> (name, version or None)."""
    name, _, version = ref.partition("@")
    check_name(name)
    if not version or version == "latest":
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise InputError(f"invalid version {version!r} in {ref!r}: use name@N with N >= 1")
    return name, int(version)


def versions(store: Reader, name: str) -> list[int]:
    """Every complete version of ``name`` (those whose manifest exists), ascending."""
    found = []
    for key in store.list(f"docs/{name}/versions/"):
        match = _VERSION_KEY.match(key)
        if match and match.group(1) == name:
            found.append(int(match.group(2)))
    return sorted(found)


def latest_version(store: Reader, name: str) -> int | None:
    """The newest complete version, by listing (authoritative; the pointer may lag)."""
    found = versions(store, name)
    return found[-1] if found else None


def pointer_version(store: Reader, name: str) -> int | None:
    """The version ``latest.json`` points at, or None when there is no pointer."""
    try:
        data = store.get(latest_key(name))
    except NotFound:
        return None
    return parse_pointer(data, name=f"{name}'s latest pointer")["version"]


def read_manifest(store: Reader, name: str, version: int | None = None) -> Manifest:
    """The manifest of ``name`` at ``version`` (default: the latest pointer)."""
    if version is None:
        version = pointer_version(store, name) or latest_version(store, name)
        if version is None:
            raise NotFound(f"no document named '{name}' in {store.url}")
    key = manifest_key(name, version)
    try:
        data = store.get(key)
    except NotFound:
        known = versions(store, name)
        if not known:
            raise NotFound(f"no document named '{name}' in {store.url}") from None
        raise NotFound(
            f"'{name}' has no version {version} in {store.url} (versions: "
            f"{', '.join(map(str, known))})"
        ) from None
    manifest = parse_manifest(data, name=f"manifest {key}")
    if manifest.name != name or manifest.version != version:
        from .errors import FormatError

        raise FormatError(f"manifest {key} describes {manifest.name}@{manifest.version}")
    return manifest


@dataclass(frozen=True)
class DocumentSummary:
    name: str
    versions: list[int]
    latest: int


def list_documents(store: Reader) -> list[DocumentSummary]:
    by_name: dict[str, list[int]] = {}
    for key in store.list(DOCS_PREFIX):
        match = _VERSION_KEY.match(key)
        if match:
            by_name.setdefault(match.group(1), []).append(int(match.group(2)))
    return [DocumentSummary(name, sorted(vs), max(vs)) for name, vs in sorted(by_name.items())]


def find_by_source(store: Reader, fingerprint: str, source_sha256: str) -> tuple[str, int] | None:
    """The document version published from these exact bytes for this model, if any."""
    try:
        data = store.get(source_index_key(fingerprint, source_sha256))
    except NotFound:
        return None
    pointer = parse_pointer(data, name="source index entry")
    return pointer["name"], pointer["version"]


def pointer_bytes(name: str, version: int) -> bytes:
    return json.dumps(
        {"name": name, "version": version, "manifest": manifest_key(name, version)}
    ).encode()
