"""Reading what a store holds: documents, versions, manifests, the source index.

Every read here is bounded (``max_bytes``) and checked where it is read
(``check``), so that a reader in front of several sources (edges, then the
origin) can move on from one that serves bad bytes. With a
:class:`~kvcdn.signing.TrustPolicy`, manifests and ``latest.json`` pointers
must be signed by a trusted key, and the latest version of a document never
goes back to one older than the reader has seen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import keys
from .errors import FormatError, InputError, IntegrityError, NotFound, TrustError
from .manifest import (
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    Manifest,
    Pointer,
    open_manifest,
    open_pointer,
)
from .signing import TrustPolicy
from .store import Reader, scope_of

log = logging.getLogger(__name__)


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``name``, ``name@latest`` or ``name@3`` -> (name, version or None)."""
    if not isinstance(ref, str):
        raise InputError(f"a document reference must be a string, not {type(ref).__name__}")
    name, _, version = ref.partition("@")
    name = keys.check_name(name)
    if not version or version == "latest":
        return name, None
    if not version.isascii() or not version.isdigit() or not 1 <= int(version) < 10**12:
        raise InputError(f"invalid version {version!r} in {ref!r}: use name@N with N >= 1")
    return name, int(version)


def versions(store: Reader, name: str) -> list[int]:
    """Every complete version of ``name`` (those whose manifest exists), ascending."""
    found = []
    for key in store.list(keys.versions_prefix(name)):
        info = keys.parse_key(key)
        if info is not None and info.kind == "manifest" and info.name == name:
            found.append(info.version)
    return sorted(found)


def latest_version(store: Reader, name: str) -> int | None:
    """The newest complete version, by listing (authoritative; the pointer may lag)."""
    found = versions(store, name)
    return found[-1] if found else None


def read_pointer(store: Reader, name: str, trust: TrustPolicy | None = None) -> Pointer | None:
    """``latest.json`` of ``name`` (None when there is none), signed by a trusted key
    when ``trust`` is given."""
    what = f"{name}'s latest pointer"
    found: list[Pointer] = []

    def check(data: bytes) -> None:
        pointer = open_pointer(data, what=what, trust=trust)
        if pointer.name != name:
            raise IntegrityError(f"{what} points at another document ({pointer.name})")
        found.append(pointer)

    try:
        store.get(keys.latest_key(name), max_bytes=MAX_POINTER_BYTES, check=check)
    except NotFound:
        return None
    return found[-1]


def resolve_latest(store: Reader, name: str, trust: TrustPolicy | None = None) -> int:
    """The version ``name@latest`` means: the pointer's, or the listing's newest.

    With ``trust``, a pointer that is unsigned, badly signed or older than a
    version this reader has seen is not believed: the listing decides, and a
    store that offers nothing newer than that seen version is refused
    (:class:`~kvcdn.errors.RollbackError`).
    """
    scope = scope_of(store)
    pointer = None
    try:
        pointer = read_pointer(store, name, trust)
    except (TrustError, FormatError) as exc:
        if trust is None:
            raise
        log.warning("not using %s's latest pointer: %s", name, exc)
    seen = trust.newest_seen(scope, name) if trust is not None else 0
    version = pointer.version if pointer is not None else None
    if version is None or version < seen:
        listed = latest_version(store, name)
        version = max(v for v in (version, listed, 0) if v is not None) or None
    if version is None:
        raise NotFound(f"no document named '{name}' in {store.url}")
    if trust is not None:
        trust.check_not_older(scope, name, version)
    return version


def read_manifest(
    store: Reader, name: str, version: int | None = None, *, trust: TrustPolicy | None = None
) -> Manifest:
    """The manifest of ``name`` at ``version`` (default: the latest)."""
    name = keys.check_name(name)
    if version is not None:
        return _read_version(store, name, version, trust)
    latest = resolve_latest(store, name, trust)
    try:
        return _read_version(store, name, latest, trust)
    except NotFound:
        # the pointer names a version that is gone: the listing decides
        listed = latest_version(store, name)
        if listed is None or listed == latest:
            raise
        if trust is not None:
            trust.check_not_older(scope_of(store), name, listed)
        return _read_version(store, name, listed, trust)


def _read_version(store: Reader, name: str, version: int, trust: TrustPolicy | None) -> Manifest:
    key = keys.manifest_key(name, version)
    found: list[Manifest] = []

    def check(data: bytes) -> None:
        manifest = open_manifest(data, name=f"manifest {key}", trust=trust)
        if manifest.name != name or manifest.version != version:
            raise IntegrityError(f"manifest {key} describes {manifest.ref}, not {name}@{version}")
        found.append(manifest)

    try:
        store.get(key, max_bytes=MAX_MANIFEST_BYTES, check=check)
    except NotFound:
        known = versions(store, name)
        if not known:
            raise NotFound(f"no document named '{name}' in {store.url}") from None
        raise NotFound(
            f"'{name}' has no version {version} in {store.url} (versions: "
            f"{', '.join(map(str, known))})"
        ) from None
    if trust is not None:
        trust.saw(scope_of(store), name, version)
    return found[-1]


@dataclass(frozen=True)
class DocumentSummary:
    name: str
    versions: list[int]
    latest: int


def list_documents(store: Reader) -> list[DocumentSummary]:
    by_name: dict[str, list[int]] = {}
    for key in store.list(keys.DOCS_PREFIX):
        info = keys.parse_key(key)
        if info is not None and info.kind == "manifest":
            by_name.setdefault(info.name, []).append(info.version)
    return [DocumentSummary(name, sorted(vs), max(vs)) for name, vs in sorted(by_name.items())]


def find_by_source(
    store: Reader, fingerprint: str, source_sha256: str, *, trust: TrustPolicy | None = None
) -> Manifest | None:
    """The manifest published from these exact bytes for this model, if any.

    The source index is a hint anyone who can write to the store could change,
    so the manifest it leads to must itself say it holds these bytes.
    """
    try:
        data = store.get(
            keys.source_index_key(fingerprint, source_sha256), max_bytes=MAX_POINTER_BYTES
        )
    except NotFound:
        return None
    pointer = open_pointer(data, what="source index entry")
    manifest = read_manifest(store, pointer.name, pointer.version, trust=trust)
    if manifest.source_sha256 != source_sha256 or manifest.model_fingerprint != fingerprint:
        raise IntegrityError(
            f"the source index points at {manifest.ref}, which was published from other text "
            "or for another model: the index entry was altered"
        )
    return manifest
