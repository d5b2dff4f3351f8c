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
import time
from dataclasses import dataclass

from . import keys
from .errors import (
    FormatError,
    FreshnessError,
    InputError,
    IntegrityError,
    KvcdnError,
    NotFound,
    PointerExpired,
    RollbackError,
    TrustError,
)
from .manifest import (
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    Manifest,
    Pointer,
    format_expiry,
    open_manifest,
    open_pointer,
)
from .signing import TrustPolicy
from .store import Reader, Store

log = logging.getLogger(__name__)

#: Listed versions a reader tries, newest first, before giving up on finding one it
#: can read (a store may hold keys that are not manifests, or not trusted ones).
WALK = 16


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``name``, ``name@latest`` or ``name@3`` -> (name, version or None)."""
    if not isinstance(ref, str):
        raise InputError(f"a document reference must be a string, not {type(ref).__name__}")
    name, _, version = ref.partition("@")
    name = keys.check_name(name)
    if not version or version == "latest":
        return name, None
    if not version.isascii() or not version.isdigit() or not 1 <= int(version) <= keys.MAX_VERSION:
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


def removed_version(store: Reader, name: str) -> int:
    """The highest version of ``name`` that ``kvcdn rm`` removed (0: none): a publisher
    numbers past it, so that no version number ever names two manifests."""
    import json

    key = keys.removed_key(name)
    try:
        data = store.get(key, max_bytes=MAX_POINTER_BYTES)
    except NotFound:
        return 0
    try:
        raw = json.loads(data)
        version = raw["removed"]
        if (
            raw.get("name") != name
            or type(version) is not int
            or not 0 < version <= keys.MAX_VERSION
        ):
            raise ValueError("not a removal record of this document")
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(
            f"{key} is damaged ({exc}); delete it only if no version was removed"
        ) from None
    return version


def read_pointer(
    store: Reader, name: str, trust: TrustPolicy | None = None, *, fresh: bool = False
) -> Pointer | None:
    """``latest.json`` of ``name`` (None when there is none), signed by a trusted key
    when ``trust`` is given; with ``fresh`` too, not past its expiry (:func:`check_fresh`).

    The checks run on each source's bytes, so that through edges a stale copy one
    edge holds is passed over for a current one from the next edge or the origin.
    """
    what = f"{name}'s latest pointer"
    found: list[Pointer] = []

    def check(data: bytes) -> None:
        pointer = open_pointer(data, what=what, trust=trust)
        if pointer.name != name:
            raise IntegrityError(f"{what} points at another document ({pointer.name})")
        if fresh and trust is not None:
            check_fresh(pointer, trust)
        found.append(pointer)

    try:
        store.get(keys.latest_key(name), max_bytes=MAX_POINTER_BYTES, check=check)
    except NotFound:
        return None
    return found[-1]


def check_fresh(pointer: Pointer, trust: TrustPolicy, *, now: float | None = None) -> None:
    """:class:`PointerExpired` when a trusted latest pointer is past its ``expires``
    (``trust.clock_skew_s`` allowed); :class:`FreshnessError` when it has no expiry
    and ``trust.require_expiry``. Its publisher renews it with ``kvcdn refresh``."""
    name = pointer.name
    if pointer.expires is None:
        if trust.require_expiry:
            raise FreshnessError(
                f"{name}'s latest pointer (naming {name}@{pointer.version}) carries no expiry, "
                "and this reader requires one (require_expiry, --require-expiry): its "
                f"publisher must renew it with `kvcdn refresh {name}` or a signed publish"
            )
        return
    now = time.time() if now is None else now
    if now > pointer.expires + trust.clock_skew_s:
        raise PointerExpired(
            f"{name}'s latest pointer (naming {name}@{pointer.version}) expired at "
            f"{format_expiry(pointer.expires)}; it is now {format_expiry(now)} (clock skew "
            f"allowed: {trust.clock_skew_s:g} s). Either the store is replaying an old "
            "pointer or its publisher has stopped renewing it: the publisher runs "
            f"`kvcdn refresh {name}`; an explicit version ({name}@N) still loads"
        )


def read_manifest(
    store: Reader, name: str, version: int | None = None, *, trust: TrustPolicy | None = None
) -> Manifest:
    """The manifest of ``name`` at ``version`` (default: the latest).

    The latest is the version ``latest.json`` names. With ``trust``, a pointer
    that is missing, unsigned or badly signed, or older than a version this
    reader has seen, is not believed: the newest listed version that verifies
    is taken instead. It is never older than the version this reader has seen,
    nor than the one a trusted pointer names (signed word that it exists): a
    store offering nothing that new is refused
    (:class:`~kvcdn.errors.RollbackError`), and when it is the trusted pointer's
    own version that fails verification, that failure is raised.

    A trusted pointer past its signed expiry is refused
    (:class:`~kvcdn.errors.PointerExpired`), never passed over for the listing:
    the listing is the store's word, which a store replaying the pointer would
    shape too. With ``trust.require_expiry``, the latest version is taken only
    from a trusted pointer with an unexpired expiry
    (:class:`~kvcdn.errors.FreshnessError` otherwise). Without ``trust`` an
    expired pointer is followed, with a warning.
    """
    name = keys.check_name(name)
    if version is not None:
        return _read_version(store, name, version, trust)
    seen = trust.newest_seen(name) if trust is not None else 0
    # What was not believed on the way: said if a version is found all the same (when
    # none is, the error raised says why)
    passed_over: list[str] = []
    try:
        pointer = read_pointer(store, name, trust, fresh=True)
    except FreshnessError:
        raise
    except (TrustError, FormatError) as exc:
        if trust is None:
            raise
        if trust.require_expiry:
            raise FreshnessError(
                f"{name}'s latest pointer cannot be believed ({exc}), and this reader "
                "takes the latest version only from a current signed pointer "
                f"(require_expiry); ask for an explicit version ({name}@N) instead"
            ) from None
        passed_over.append(f"its latest pointer ({exc})")
        pointer = None
    if pointer is None and trust is not None and trust.require_expiry and versions(store, name):
        raise FreshnessError(
            f"{name} has no latest pointer in {store.url}, and this reader takes the latest "
            "version only from a current signed pointer (require_expiry): its publisher "
            f"must write one (`kvcdn refresh {name}` or a signed publish), or ask for "
            f"an explicit version ({name}@N)"
        )
    if pointer is not None and trust is None and pointer.expires is not None:
        now = time.time()
        if now > pointer.expires:
            log.warning(
                "%s's latest pointer expired at %s (now %s); following it all the same: "
                "without a trust file this reader does not check freshness",
                name, format_expiry(pointer.expires), format_expiry(now),
            )  # fmt: skip
    failure: Exception | None = None
    if pointer is not None and pointer.version >= seen:
        try:
            return _read_version(store, name, pointer.version, trust)
        except NotFound:
            pass  # the pointer names a version that is gone: the listing decides
        except (TrustError, FormatError) as exc:
            if trust is None:
                raise
            failure = exc
        if trust is not None:  # a trusted pointer is signed knowledge its version exists
            seen = max(seen, pointer.version)
    refused: list[KvcdnError] = []
    found = newest_readable(store, name, trust, above=max(seen - 1, 0), refused=refused)
    if found is not None:
        if passed_over or refused:
            passed_over += [str(exc) for exc in refused]
            log.warning("loading %s; not used: %s", found.ref, "; ".join(passed_over))
        return found
    if failure is not None:
        raise failure
    listed = versions(store, name)
    if not listed:
        raise NotFound(f"no document named '{name}' in {store.url}")
    assert trust is not None  # without trust the walk raises what it could not read
    if refused:  # versions as new as any seen are there, and none verifies: say why
        newest = refused[0]
        raise type(newest)(
            f"{store.url} offers no version of {name} this reader accepts; the newest: {newest}"
        )
    raise RollbackError(
        f"this reader has already seen {name}@{seen}, and {store.url} offers no version as "
        f"new (the newest is {name}@{listed[-1]}): the store was rolled back"
    )


def newest_readable(
    store: Reader,
    name: str,
    trust: TrustPolicy | None,
    *,
    above: int = 0,
    skip: bool | None = None,
    refused: list[KvcdnError] | None = None,
    listed: list[int] | None = None,
) -> Manifest | None:
    """The newest listed version above ``above`` whose manifest reads (with ``trust``:
    verifies), trying at most :data:`WALK` of them; None when there is none.
    ``listed``: the versions as the caller just listed them (else they are listed).

    Versions that cannot be read or verified are skipped when ``skip`` (by
    default, with ``trust``), each one's error added to ``refused`` (newest
    first). Without ``trust`` a reader that believes the store is told when it
    is damaged: the first such version is an error.
    """
    skip = trust is not None if skip is None else skip
    listed = versions(store, name) if listed is None else listed
    candidates = [v for v in listed if v > above][::-1][:WALK]
    for version in candidates:
        try:
            return _read_version(store, name, version, trust)
        except NotFound:
            continue
        except (TrustError, FormatError) as exc:
            if not skip:
                raise
            if refused is not None:  # the caller reports it
                refused.append(exc)
            else:
                log.warning("skipping %s@%d: %s", name, version, exc)
    return None


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
        trust.saw(name, version)
    return found[-1]


@dataclass(frozen=True)
class DocumentSummary:
    name: str
    versions: list[int]
    latest: int


def list_documents(
    store: Store, *, prefix: str = "", after: str | None = None, limit: int | None = None
) -> list[DocumentSummary]:
    """Documents whose name starts with ``prefix``, in key order (``docs/NAME/``, so
    ``a-b`` lists before ``a``), those up to and including ``after`` skipped, at
    most ``limit``: one page of a store of any size. The next page starts
    after the last name of this one.

    Only keys are listed, page by page as needed: no manifest is read.
    """
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InputError(f"a page holds 1 document or more (not {limit})")
    if prefix and any(c in prefix for c in "/\0"):
        raise InputError(f"invalid name prefix {prefix!r}")
    # Every key of NAME starts with docs/NAME/; docs/NAME0 sorts after all of them
    # and before the keys of any later name ('0' follows '/').
    start = keys.DOCS_PREFIX + keys.check_name(after) + "0" if after else ""
    found: list[DocumentSummary] = []
    name, versions_of = None, []
    for key in store.iter_keys(keys.DOCS_PREFIX + prefix, after=start):
        info = keys.parse_key(key)
        if info is None or info.kind != "manifest":
            continue
        if info.name != name:
            if name is not None and versions_of:
                found.append(DocumentSummary(name, sorted(versions_of), max(versions_of)))
                if limit is not None and len(found) >= limit:
                    return found
            name, versions_of = info.name, []
        versions_of.append(info.version)
    if name is not None and versions_of:
        found.append(DocumentSummary(name, sorted(versions_of), max(versions_of)))
    return found


#: Latest pointers read at once by :func:`pointed_versions` (small GETs).
POINTER_READS = 16


def pointed_versions(store: Reader, names: list[str]) -> dict[str, int | None]:
    """The version each document's ``latest.json`` names (what a reader without trust
    keys loads), read :data:`POINTER_READS` at a time; None for a document without a
    readable pointer (a reader then takes the newest version that reads). A version
    key planted in the listing does not become the latest by being the highest."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> int | None:
        try:
            pointer = read_pointer(store, name)
        except (FormatError, TrustError, IntegrityError) as exc:
            log.warning("%s's latest pointer cannot be read: %s", name, exc)
            return None
        return None if pointer is None else pointer.version

    if not names:
        return {}
    with ThreadPoolExecutor(min(POINTER_READS, len(names))) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def index_keys(manifest: Manifest) -> list[str]:
    """The index entries that find ``manifest``: by its source text, and (for a
    document of at least one whole chunk) by its first chunk."""
    found = [keys.source_index_key(manifest.model_fingerprint, manifest.source_sha256)]
    if manifest.chunks and manifest.chunks[0].end == manifest.chunk_tokens:
        found.append(keys.prefix_index_key(manifest.model_fingerprint, manifest.chunks[0].hash))
    return found


def find_by_source(
    store: Reader, fingerprint: str, source_sha256: str, *, trust: TrustPolicy | None = None
) -> Manifest | None:
    """The manifest published from these exact bytes for this model, if any.

    The source index is a hint anyone who can write to the store could change,
    so the manifest it leads to must itself say it holds these bytes.
    """
    key = keys.source_index_key(fingerprint, source_sha256)
    manifest = _indexed(store, key, "source index entry", trust)
    if manifest is None:
        return None
    if manifest.source_sha256 != source_sha256 or manifest.model_fingerprint != fingerprint:
        raise IntegrityError(
            f"the source index points at {manifest.ref}, which was published from other text "
            "or for another model: the index entry was altered"
        )
    return manifest


def find_by_prefix(
    store: Reader, fingerprint: str, first_chunk_hash: str, *, trust: TrustPolicy | None = None
) -> Manifest | None:
    """The manifest last published for this model whose first chunk has this chain hash.

    What a serving engine reads to find the document a prompt begins with:
    one small read per first chunk. The entry is a hint like the source
    index, so the manifest must start with that very chunk.
    """
    key = keys.prefix_index_key(fingerprint, first_chunk_hash)
    manifest = _indexed(store, key, "prefix index entry", trust)
    if manifest is None:
        return None
    if (
        manifest.model_fingerprint != fingerprint
        or not manifest.chunks
        or manifest.chunks[0].hash != first_chunk_hash
    ):
        raise IntegrityError(
            f"the prefix index points at {manifest.ref}, which starts with another chunk "
            "or is for another model: the index entry was altered"
        )
    return manifest


def _indexed(store: Reader, key: str, what: str, trust: TrustPolicy | None) -> Manifest | None:
    """The manifest an index entry names (None without the entry); the caller checks
    that it is what the entry was found by.

    An entry is unsigned (anyone who can write to the store can change it), so with
    ``trust`` the version it names is held to what a latest version is held to: never
    older than one this reader has seen (:class:`~kvcdn.errors.RollbackError`), and
    with ``trust.require_expiry`` only while the document's signed latest pointer is
    current (:func:`check_fresh`): an entry rewritten to name an old version, beside a
    replayed expired pointer, is refused as the pointer alone would be."""
    try:
        data = store.get(key, max_bytes=MAX_POINTER_BYTES)
    except NotFound:
        return None
    pointer = open_pointer(data, what=what)
    if trust is not None:
        trust.check_not_older(pointer.name, pointer.version, f"the {what} in {store.url}")
        if trust.require_expiry and read_pointer(store, pointer.name, trust, fresh=True) is None:
            raise FreshnessError(
                f"the {what} names {pointer.name}@{pointer.version}, but {pointer.name} has no "
                f"latest pointer in {store.url}, and this reader takes documents only while "
                "their signed pointer is current (require_expiry)"
            )
    try:
        return read_manifest(store, pointer.name, pointer.version, trust=trust)
    except NotFound:  # the version was removed (kvcdn rm, gc --keep): no entry
        return None
