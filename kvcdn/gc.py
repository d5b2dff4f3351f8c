"""Removing versions, and collecting the objects and profiles no kept version names.

``remove`` deletes versions' manifests (and their pointer and index entries);
their chunk objects stay until ``collect`` finds that no remaining version
names them. Objects are shared between versions and documents (a chunk's key
is its chain hash, so unchanged chunks of a new version are the old objects),
which is why they are never deleted with a version.

Collecting is safe beside publishers, which never lock anything. The rules
(``docs/gc.md``):

- a publish freshens (:meth:`~kvcdn.store.Store.freshen`) every stored object
  and profile it names without uploading it, before it creates its manifest,
  and checks afterwards that they are all still there;
- ``collect`` deletes an object only when no manifest names it, listed both
  before and after it chose what to delete, and when its modification time,
  read again just before the delete, is older than the grace period.

An object a publish is about to name is therefore either young (uploaded or
freshened less than the grace period ago) or named by a manifest gc reads,
provided a publish takes less than the grace period. Times are the store's
own (:meth:`~kvcdn.store.Store.now`), so no machine's clock matters.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import catalog, keys
from .errors import FormatError, InputError, KvcdnError, NotFound
from .manifest import (
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    Manifest,
    open_manifest,
    open_pointer,
    pointer_bytes,
)
from .store import KeyStat, Store

log = logging.getLogger(__name__)

#: Objects unreferenced but younger than this are kept by default (a day: longer
#: than any publish, and than any clock or listing lag of a real store).
DEFAULT_GRACE_S = 24 * 3600.0
#: Manifests read at once while collecting (small GETs; a store of many documents).
READ_CONCURRENCY = 16
#: progress(stage, done, total): "read" (manifests), "delete" (keys).
ProgressFn = Callable[[str, int, int], None]


@dataclass
class Removal:
    """What ``remove`` (or ``collect --keep``) did to documents' keys."""

    versions: list[str] = field(default_factory=list)  # refs removed, name@N
    keys: list[str] = field(default_factory=list)  # manifests, pointers, index entries
    bytes: int = 0


@dataclass
class Collection:
    """What ``collect`` found and did."""

    dry_run: bool
    grace_s: float
    removal: Removal  # versions beyond --keep
    manifests: int = 0  # versions kept (read for their references)
    referenced: int = 0  # objects and profiles they name
    deleted: list[str] = field(default_factory=list)  # objects, profiles (would be, dry run)
    freed_bytes: int = 0
    kept_young: int = 0  # unreferenced, but younger than the grace period
    kept_young_bytes: int = 0
    kept_freshened: int = 0  # chosen, then found freshened by a publish before the delete
    seconds: float = 0.0


class ReferencesUnknown(KvcdnError):
    """A manifest could not be read, so what it names is unknown: nothing is deleted."""

    exit_code = 5


def remove(store: Store, name: str, version: int | None = None, *, dry_run: bool = False
           ) -> Removal:  # fmt: skip
    """Remove ``name@version``, or every version of ``name``.

    The manifest goes, then the ``latest`` pointer if it named a removed version
    (pointed at the newest version left; removed when none is left, or when it
    was signed, since only its publisher can sign a new one: readers then find
    the newest version by listing), then the source and prefix index entries
    that named it. A version a concurrent publish creates meanwhile stays.
    """
    name = keys.check_name(name)
    listed = _versions(store, name)
    if not listed:
        raise NotFound(f"no document named '{name}' in {store.url}")
    if version is not None and version not in listed:
        raise NotFound(
            f"'{name}' has no version {version} in {store.url} "
            f"(versions: {', '.join(map(str, sorted(listed)))})"
        )
    doomed = sorted(listed) if version is None else [version]
    removal = Removal()
    _remove_versions(store, name, doomed, listed, removal, dry_run)
    return removal


def _record_removed(store: Store, name: str, highest: int, removal: Removal, dry_run: bool
                    ) -> None:  # fmt: skip
    """Keep the highest removed version number, so that none is ever given twice: edges
    and readers may still hold the removed manifest under its number."""
    if highest <= catalog.removed_version(store, name):
        return
    key = keys.removed_key(name)
    removal.keys.append(key)
    if not dry_run:
        store.put(key, json.dumps({"name": name, "removed": highest}).encode())


def _versions(store: Store, name: str) -> dict[int, KeyStat]:
    found = {}
    for key, stat in store.list_stats(keys.versions_prefix(name)).items():
        info = keys.parse_key(key)
        if info is not None and info.kind == "manifest" and info.name == name:
            found[info.version] = stat
    return found


def _remove_versions(
    store: Store, name: str, doomed: list[int], listed: dict[int, KeyStat], removal: Removal,
    dry_run: bool,
) -> None:  # fmt: skip
    manifests = [_read_quietly(store, name, v) for v in doomed]
    _record_removed(store, name, max(doomed), removal, dry_run)  # first: a crash keeps it
    for v in doomed:
        key = keys.manifest_key(name, v)
        if not dry_run:
            store.delete(key)
        removal.versions.append(f"{name}@{v}")
        removal.keys.append(key)
        removal.bytes += listed[v].size
    left = sorted(set(listed) - set(doomed))
    _repoint(store, name, set(doomed), left, removal, dry_run)
    newest_left = _read_quietly(store, name, left[-1]) if left else None
    for manifest in manifests:
        if manifest is not None:
            _drop_index_entries(store, manifest, newest_left, removal, dry_run)


def _read_quietly(store: Store, name: str, version: int) -> Manifest | None:
    """A manifest being removed, for its index entries (None when it cannot be read:
    its entries then point at nothing, which readers treat as no entry)."""
    key = keys.manifest_key(name, version)
    try:
        return open_manifest(store.get(key, max_bytes=MAX_MANIFEST_BYTES), name=key, trust=None)
    except KvcdnError as exc:
        log.warning("removing %s, which cannot be read: %s", key, exc)
        return None


def _repoint(
    store: Store, name: str, doomed: set[int], left: list[int], removal: Removal, dry_run: bool
) -> None:
    key = keys.latest_key(name)
    try:
        data = store.get(key, max_bytes=MAX_POINTER_BYTES)
        pointer = open_pointer(data, what=key)
    except NotFound:
        return
    except FormatError:
        pointer = None  # damaged: rewritten or removed like a stale one
    if pointer is not None and pointer.version not in doomed:
        return
    removal.keys.append(key)
    if dry_run:
        return
    if left and (pointer is None or pointer.signer is None):
        store.put(key, pointer_bytes(name, left[-1]))
    else:
        store.delete(key)


def _drop_index_entries(
    store: Store, manifest: Manifest, newest_left: Manifest | None, removal: Removal,
    dry_run: bool,
) -> None:  # fmt: skip
    """The index entries that named ``manifest``: pointed at the newest version left
    when it has the same entry (same text, or same first chunk), else deleted."""
    heir = set(catalog.index_keys(newest_left)) if newest_left is not None else set()
    for key in catalog.index_keys(manifest):
        try:
            pointer = open_pointer(store.get(key, max_bytes=MAX_POINTER_BYTES), what=key)
        except (NotFound, FormatError):
            continue
        if (pointer.name, pointer.version) != (manifest.name, manifest.version):
            continue  # another version took the entry over
        removal.keys.append(key)
        if dry_run:
            continue
        if key in heir:
            assert newest_left is not None
            store.put(key, pointer_bytes(newest_left.name, newest_left.version))
        else:
            store.delete(key)


def collect(
    store: Store,
    *,
    keep: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
) -> Collection:
    """Delete the objects and profiles no kept version names, once older than
    ``grace_s``; first, with ``keep``, every document's versions but its newest
    ``keep``. With ``dry_run`` nothing is deleted and the report says what would be."""
    if keep is not None and (type(keep) is not int or keep < 1):
        raise InputError(f"--keep must be a whole number of versions, 1 or more (not {keep})")
    if not grace_s >= 0:
        raise InputError(f"the grace period must be 0 seconds or more (not {grace_s})")
    started = time.perf_counter()
    progress = progress or (lambda stage, done, total: None)
    now = store.now()
    cutoff = now - grace_s
    report = Collection(dry_run=dry_run, grace_s=grace_s, removal=Removal())

    documents = _documents(store)
    if keep is not None:
        for name, listed in documents.items():
            doomed = sorted(listed)[:-keep]
            if doomed:
                _remove_versions(store, name, doomed, listed, report.removal, dry_run)
                for v in doomed:
                    del listed[v]
    kept = {keys.manifest_key(n, v) for n, listed in documents.items() for v in listed}
    report.manifests = len(kept)
    referenced = _referenced(store, kept, progress)
    referenced |= _current_profiles(store)

    candidates: dict[str, KeyStat] = {}
    for prefix in (keys.OBJECTS_PREFIX, keys.PROFILES_PREFIX, keys.CLOCK_PREFIX):
        for key, stat in store.list_stats(prefix).items():
            info = keys.parse_key(key)
            ours = info is not None and info.kind in ("object", "profile")
            if (ours or key.startswith(keys.CLOCK_PREFIX)) and key not in referenced:
                if stat.modified < cutoff:
                    candidates[key] = stat
                else:
                    report.kept_young += 1
                    report.kept_young_bytes += stat.size
    # Versions created while the above ran: what they name stays.
    later = {
        keys.manifest_key(n, v) for n, listed in _documents(store).items() for v in listed
    } - kept - set(report.removal.keys)  # fmt: skip
    if later:
        referenced |= _referenced(store, later, progress)
        for key in referenced & set(candidates):
            del candidates[key]
    report.referenced = len(referenced)

    done = 0
    for key, stat in sorted(candidates.items()):
        done += 1
        progress("delete", done, len(candidates))
        if not dry_run:
            try:
                fresh = store.stat(key)
            except NotFound:
                continue  # someone else collected it
            if fresh.modified >= cutoff:  # a publish freshened it: it is about to be named
                report.kept_freshened += 1
                continue
            store.delete(key)
        report.deleted.append(key)
        report.freed_bytes += stat.size
    report.seconds = time.perf_counter() - started
    log.info(
        "gc of %s: %d versions removed, %d keys %s (%d bytes), %d unreferenced kept as young",
        store.url, len(report.removal.versions), len(report.deleted),
        "to delete" if dry_run else "deleted", report.freed_bytes, report.kept_young,
    )  # fmt: skip
    return report


def _documents(store: Store) -> dict[str, dict[int, KeyStat]]:
    """Every document's versions, from one listing of ``docs/``. A key where versions
    live that is not a manifest key this kvcdn knows stops gc: it may be a version
    (of a newer kvcdn, say) whose objects must not be taken for unreferenced."""
    found: dict[str, dict[int, KeyStat]] = {}
    for key, stat in store.list_stats(keys.DOCS_PREFIX).items():
        info = keys.parse_key(key)
        if info is not None and info.kind == "manifest":
            found.setdefault(info.name, {})[info.version] = stat
        elif info is None and "/versions/" in key:
            raise ReferencesUnknown(
                f"{key} is not a manifest key this kvcdn knows; nothing was deleted, since "
                "what it names is unknown (remove it, or collect with the kvcdn that wrote it)"
            )
    return found


def _referenced(store: Store, manifest_keys: Iterable[str], progress: ProgressFn) -> set[str]:
    """The object and profile keys the manifests at ``manifest_keys`` name.

    A manifest that cannot be read stops the collection: what it names is
    unknown, and deleting it is the user's decision (``kvcdn rm``)."""
    todo = sorted(manifest_keys)
    names: set[str] = set()

    def read(key: str) -> list[str] | None:
        try:
            data = store.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except NotFound:
            return None  # removed meanwhile: it names nothing any more
        try:
            manifest = open_manifest(data, name=f"manifest {key}", trust=None)
        except FormatError as exc:
            raise ReferencesUnknown(
                f"{exc}; nothing was deleted, since what it names is unknown: remove that "
                "version first (kvcdn rm NAME@VERSION)"
            ) from None
        found = [ref.key for chunk in manifest.chunks for ref in chunk.objects.values()]
        if manifest.codec_profile is not None:
            found.append(manifest.codec_profile.key)
        return found

    with ThreadPoolExecutor(READ_CONCURRENCY) as pool:
        for n, found in enumerate(pool.map(read, todo), 1):
            names.update(found or ())
            progress("read", n, len(todo))
    return names


def _current_profiles(store: Store) -> set[str]:
    """The profiles the models' ``current.json`` pointers name: kept even when no
    version names them yet (the next publish will)."""
    from .profile_store import read_profile_pointer

    found = set()
    for key in store.list(keys.PROFILES_PREFIX):
        info = keys.parse_key(key)
        if info is None or info.kind != "profile-pointer":
            continue
        try:
            found.add(read_profile_pointer(store, key).key)
        except NotFound:
            continue  # replaced meanwhile
        except KvcdnError as exc:
            raise ReferencesUnknown(
                f"{key} cannot be read ({exc}); nothing was deleted: fix or delete that pointer"
            ) from None
    return found
