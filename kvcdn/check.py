"""Checking a store, as ``git fsck`` or ``restic check`` do: is everything there, intact?

:func:`check_store` reads every manifest version of the documents asked for (all
by default), and every object and codec profile they name, once each: each must
be present and hash to the sha256 its key and the manifest name, a chunk object's
container must hold the chunk and level its key names, and each manifest must
read, name what its key names and carry signatures that verify (with a trust
policy: one by a trusted key). Latest pointers and index entries must read and
name versions that exist. Nothing is changed.

Objects and profiles that no manifest names are listed as orphans when the whole
store is checked: what ``kvcdn gc`` would collect once old enough, after a
crashed or concurrent publish, or after ``kvcdn rm``. They are not damage.

Objects are read in pieces (:meth:`~kvcdn.store.Store.pieces`) and hashed as they
arrive, :data:`READS_AT_ONCE` at a time, so memory stays a few pieces whatever
the store holds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import keys
from .catalog import check_fresh, index_keys, parse_ref
from .container import read_header
from .errors import (
    FormatError,
    FreshnessError,
    KvcdnError,
    NotFound,
    StoreError,
    TrustError,
)
from .manifest import (
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    Manifest,
    ObjectRef,
    open_manifest,
    open_pointer,
)
from .signing import TrustPolicy
from .store import Store

log = logging.getLogger(__name__)

READS_AT_ONCE = 16  # objects and manifests read at once
_HEAD_BYTES = 24 + (1 << 20)  # a container's preamble and its largest header

#: progress(stage, done, total): "manifests", then "objects".
ProgressFn = Callable[[str, int, int], None]


#: Problem kinds reported without failing a check: nothing a reader meets is wrong.
NOTICES = ("dangling", "superseded")


@dataclass(frozen=True)
class Problem:
    """Something wrong with one key: ``kind`` is missing, damaged (bytes or format),
    unreadable (the store failed on it: permissions, I/O, a looping link), untrusted
    (with a trust policy), expired (with a trust policy: a latest pointer past its
    signed expiry, or without one where the policy requires one), dangling (a
    pointer or index entry that names a version that is not there: readers take it
    for no entry), or superseded (an index entry naming a version older than the
    document's newest: left by a publish that changed the text's beginning, or the
    text). The last two are :data:`NOTICES`: reported without failing the check."""

    key: str
    kind: str
    detail: str
    #: the versions (name@N) that name the key, for an object or profile
    used_by: tuple[str, ...] = ()


@dataclass
class StoreCheck:
    """What :func:`check_store` found."""

    store: str
    documents: int = 0
    versions: int = 0
    objects: int = 0  # objects and profiles checked, each once
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)
    #: objects and profiles no manifest names (only when the whole store is checked)
    orphans: list[str] = field(default_factory=list)
    orphan_bytes: int = 0
    whole_store: bool = True
    seconds: float = 0.0

    @property
    def failures(self) -> list[Problem]:
        """The problems a reader would meet (all but :data:`NOTICES`)."""
        return [p for p in self.problems if p.kind not in NOTICES]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        """0 when intact; 5 when something is missing or damaged; 6 when all that is
        wrong is trust (unsigned or signed by other keys, an expired latest pointer)."""
        failures = self.failures
        if not failures:
            return 0
        return 6 if all(p.kind in ("untrusted", "expired") for p in failures) else 5


def check_store(
    store: Store,
    refs: Iterable[str] = (),
    *,
    trust: TrustPolicy | None = None,
    progress: ProgressFn | None = None,
) -> StoreCheck:
    """Check ``store``: the documents ``refs`` name (``name`` or ``name@N``; every
    document when there are none), every version of each, and what they name."""
    started = time.perf_counter()
    progress = progress or (lambda stage, done, total: None)
    wanted = [parse_ref(ref) for ref in refs]
    report = StoreCheck(store=store.url, whole_store=not wanted)
    stored = listed = _listed_versions(store, report)
    if wanted:
        chosen: dict[str, list[int]] = {}
        for name, version in wanted:
            have = listed.get(name, [])
            if not have or (version is not None and version not in have):
                raise NotFound(
                    f"{name}{'' if version is None else f'@{version}'} is not in {store.url}"
                )
            chosen.setdefault(name, [])
            chosen[name] = sorted(set(chosen[name]) | ({version} if version else set(have)))
        listed = chosen
    report.documents = len(listed)
    report.versions = sum(len(v) for v in listed.values())

    manifests = _read_manifests(store, listed, trust, report, progress)
    users: dict[str, list[str]] = {}
    refs_by_key: dict[str, ObjectRef] = {}
    for manifest in manifests:
        named = [r for chunk in manifest.chunks for r in chunk.objects.values()]
        if manifest.codec_profile is not None:
            named.append(manifest.codec_profile)
        for ref in named:
            users.setdefault(ref.key, []).append(manifest.ref)
            refs_by_key.setdefault(ref.key, ref)
    _check_objects(store, refs_by_key, users, report, progress)
    for name in listed:
        _check_pointer(store, name, set(stored[name]), trust, report)
    if report.whole_store:
        _check_index_entries(store, stored, manifests, report)
        _find_orphans(store, set(refs_by_key), report)
    report.seconds = time.perf_counter() - started
    return report


def _listed_versions(store: Store, report: StoreCheck) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for key in store.list(keys.DOCS_PREFIX):
        info = keys.parse_key(key)
        if info is not None and info.kind == "manifest":
            found.setdefault(info.name, []).append(info.version)
        elif info is None and "/versions/" in key:
            report.problems.append(Problem(key, "damaged", "not a manifest key kvcdn knows"))
    return {name: sorted(v) for name, v in sorted(found.items())}


def _read_manifests(
    store: Store, listed: dict[str, list[int]], trust: TrustPolicy | None, report: StoreCheck,
    progress: ProgressFn,
) -> list[Manifest]:  # fmt: skip
    todo = [(name, v) for name, versions in listed.items() for v in versions]

    def read(item: tuple[str, int]) -> Manifest | Problem:
        name, version = item
        key = keys.manifest_key(name, version)
        try:
            data = store.get(key, max_bytes=MAX_MANIFEST_BYTES)
            manifest = open_manifest(data, name=f"manifest {key}", trust=None)
            if trust is not None:  # integrity first, then whether a trusted key signed it
                open_manifest(data, name=f"manifest {key}", trust=trust)
        except NotFound:
            return Problem(key, "missing", "listed, then gone (removed meanwhile?)")
        except _READ_FAILURES as exc:  # this one key: the rest of the store is still checked
            return Problem(key, _kind(exc), _line(exc))
        if (manifest.name, manifest.version) != (name, version):
            return Problem(key, "damaged", f"it holds {manifest.ref}, not {name}@{version}")
        return manifest

    found = []
    with ThreadPoolExecutor(READS_AT_ONCE) as pool:
        for n, result in enumerate(pool.map(read, todo), 1):
            progress("manifests", n, len(todo))
            if isinstance(result, Problem):
                report.problems.append(result)
            else:
                found.append(result)
    return found


def _check_objects(
    store: Store, refs: dict[str, ObjectRef], users: dict[str, list[str]], report: StoreCheck,
    progress: ProgressFn,
) -> None:  # fmt: skip
    def check(key: str) -> tuple[int, str | None, str]:
        """(bytes read, the problem's kind or None, its detail)."""
        ref = refs[key]
        digest, size, head = hashlib.sha256(), 0, b""
        try:
            for piece in store.pieces(key, max_bytes=ref.bytes):
                digest.update(piece)
                if len(head) < _HEAD_BYTES:
                    head += piece[: _HEAD_BYTES - len(head)]
                size += len(piece)
        except NotFound:
            return 0, "missing", "not in the store"
        except (FormatError, StoreError) as exc:
            return size, _kind(exc), _line(exc)
        if size != ref.bytes:
            return size, "damaged", f"{size} bytes, the manifest says {ref.bytes}"
        if digest.hexdigest() != ref.sha256:
            return size, "damaged", "its bytes do not hash to its sha256"
        info = keys.parse_key(key)
        if info is not None and info.kind == "object":
            try:
                header = read_header(lambda at, n: head[at : at + n], size, name=key)
            except KvcdnError as exc:
                return size, "damaged", _line(exc)
            if header.chunk_hash != info.chunk_hash:
                return size, "damaged", "its container holds another chunk"
        return size, None, ""

    todo = sorted(refs)
    report.objects = len(todo)
    with ThreadPoolExecutor(READS_AT_ONCE) as pool:
        for n, (key, (size, kind, detail)) in enumerate(
            zip(todo, pool.map(check, todo), strict=True), 1
        ):
            progress("objects", n, len(todo))
            report.bytes_read += size
            if kind is not None:
                report.problems.append(Problem(key, kind, detail, tuple(users[key])))


def _check_pointer(
    store: Store, name: str, versions: set[int], trust: TrustPolicy | None, report: StoreCheck
) -> None:
    key = keys.latest_key(name)
    try:
        data = store.get(key, max_bytes=MAX_POINTER_BYTES)
        pointer = open_pointer(data, what=key)
        if trust is not None:
            open_pointer(data, what=key, trust=trust)
    except NotFound:
        return  # readers take the newest listed version: nothing to fix
    except _READ_FAILURES as exc:
        report.problems.append(Problem(key, _kind(exc), _line(exc)))
        return
    if trust is not None:
        try:  # what a reader with the same trust would refuse to follow
            check_fresh(pointer, trust)
        except FreshnessError as exc:
            report.problems.append(Problem(key, "expired", _line(exc)))
    if pointer.name != name:
        report.problems.append(Problem(key, "damaged", f"it points at {pointer.name}"))
    elif pointer.version not in versions:
        report.problems.append(
            Problem(key, "dangling", f"it names {name}@{pointer.version}, which is not stored")
        )


def _check_index_entries(store: Store, stored: dict[str, list[int]], manifests: list[Manifest],
                         report: StoreCheck) -> None:  # fmt: skip
    """Source and prefix index entries: each reads and names a stored version (readers
    treat a dangling one as no entry: reported, since a publish rewrites it) that this
    key indexes (its text, or its first chunk: readers refuse an entry naming another
    version, so that is damage). One naming an older version than its document's
    newest that checked out (``manifests``) is reported as superseded: a prompt (or
    file) that begins as that version's did still finds it, where readers with a
    trust file that have seen a newer version refuse it as a rollback."""
    by_ref = {(m.name, m.version): m for m in manifests}
    newest: dict[str, int] = {}
    for m in manifests:
        newest[m.name] = max(newest.get(m.name, 0), m.version)
    for key in store.list("index/"):
        info = keys.parse_key(key)
        if info is None or info.kind not in ("index", "prefix-index"):
            continue
        try:
            pointer = open_pointer(store.get(key, max_bytes=MAX_POINTER_BYTES), what=key)
        except NotFound:
            continue
        except (FormatError, StoreError) as exc:
            report.problems.append(Problem(key, _kind(exc), _line(exc)))
            continue
        name, version = pointer.name, pointer.version
        named = by_ref.get((name, version))
        if version not in stored.get(name, ()):
            report.problems.append(Problem(
                key, "dangling", f"it names {name}@{version}, which is not stored"
            ))  # fmt: skip
        elif named is None:  # that manifest's own problem is reported already
            continue
        elif key not in index_keys(named):
            report.problems.append(Problem(
                key, "damaged", f"it names {name}@{version}, whose text and first chunk are "
                "not what this entry indexes: readers refuse it"
            ))  # fmt: skip
        elif version < newest[name]:
            report.problems.append(Problem(
                key, "superseded", f"it names {name}@{version}, older than "
                f"{name}@{newest[name]}: `kvcdn rm {name}@{version}` removes it with that version"
            ))  # fmt: skip


def _find_orphans(store: Store, named: set[str], report: StoreCheck) -> None:
    from .profile_store import read_profile_pointer

    current = set()
    for key in store.list(keys.PROFILES_PREFIX):
        info = keys.parse_key(key)
        if info is not None and info.kind == "profile-pointer":
            try:
                current.add(read_profile_pointer(store, key).key)
            except KvcdnError as exc:
                report.problems.append(Problem(key, _kind(exc), _line(exc)))
    for prefix in (keys.OBJECTS_PREFIX, keys.PROFILES_PREFIX, keys.CLOCK_PREFIX):
        for key, size in sorted(store.list_sizes(prefix).items()):
            info = keys.parse_key(key)
            ours = info is not None and info.kind in ("object", "profile")
            if (ours or key.startswith(keys.CLOCK_PREFIX)) and key not in named | current:
                report.orphans.append(key)
                report.orphan_bytes += size


#: what reading an entry can fail with, short of its absence (caught first: "missing")
_READ_FAILURES = (TrustError, FormatError, StoreError)


def _kind(exc: KvcdnError) -> str:
    """The kind of problem a read's error makes of its entry."""
    if isinstance(exc, TrustError):
        return "untrusted"
    if isinstance(exc, StoreError):
        return "unreadable"  # this one key: the rest of the store is still checked
    return "damaged"


def _line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
