"""Object stores over fsspec: a local folder, ``s3://bucket/prefix``, ``memory://``.

A store is a flat namespace of keys (``a/b/c``) under a root. It offers what
publishing needs and nothing more: read (bounded, and checked by the caller's
``check``), atomic write, create-only write (the conditional write that keeps
two publishers from claiming one version), list (with sizes and modification
times, or page by page in key order), freshen (set a key's modification time
to now: what keeps :mod:`kvcdn.gc` off an object a publish is reusing) and
delete.

S3 works unchanged against AWS, MinIO, Ceph RGW, R2 or moto: the endpoint comes
from ``endpoint_url`` or ``AWS_ENDPOINT_URL``, credentials from the standard AWS
variables, and a custom endpoint gets path-style addressing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol
from urllib.parse import quote, urlsplit

import fsspec

from . import keys, paths
from .errors import FormatError, InputError, NotFound, StoreError
from .manifest import ObjectSpan
from .sigv4 import PresignedGetSigner

if TYPE_CHECKING:
    from .manifest import ObjectRef

log = logging.getLogger(__name__)


def default_store_url() -> str:
    """``$KVCDN_STORE``, else ``~/.cache/kvcdn/store``."""
    env = os.environ.get("KVCDN_STORE")
    if env:
        return env
    return str(paths.cache_dir() / "store")


#: ``check(data)`` raises a kvcdn error when bytes read for a key are not what
#: the caller expects (a checksum, a signature); a reader in front of several
#: sources moves on to the next one.
Check = Callable[[bytes], None]

#: Store reads are made in ranged pieces of this size: ``on_bytes`` hears of each,
#: and a cancelled fetch stops between two. One piece (one GET on S3) covers
#: most chunk objects.
FETCH_PIECE = 4 << 20


@dataclass(frozen=True)
class KeyStat:
    """A stored key's size in bytes and modification time (seconds since the epoch,
    by the store's clock)."""

    size: int
    modified: float


#: Keys asked for per request when listing page by page (S3's maximum).
LIST_PAGE = 1000
#: How long a presigned GET stays valid: long enough for one large object over a slow
#: link, short enough that a leaked URL (a log line) soon opens nothing.
PRESIGNED_FOR_S = 900


class FetchCancelled(Exception):
    """A fetch stopped because its caller cancelled it."""


class Cancel:
    """Cancels a fetch from another thread, even one blocked on a stalled link, and
    says by when it must end.

    Setting it marks the fetch cancelled and runs the abort the reader bound
    (an edge read shuts its socket, so the read returns at once instead of at
    its timeout); a store read sees the flag between pieces. ``deadline``
    (``time.monotonic()`` seconds, or None) bounds the waits of readers that
    can bound them (an edge read's timeouts); a reader that cannot is given up
    by its caller (:class:`kvcdn.sdk.bounded.BoundedReader`).
    """

    def __init__(self, deadline: float | None = None) -> None:
        self._set = False
        self._abort: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self.deadline = deadline

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            abort = self._abort
        if abort is not None:
            try:
                abort()
            except (OSError, ValueError, RuntimeError):
                pass  # already closed or released: the reader sees the flag

    def bind(self, abort: Callable[[], None] | None) -> None:
        with self._lock:
            self._abort = abort
        if abort is not None and self._set:
            self.set()

    def limit(self, deadline: float | None) -> None:
        """Make the deadline ``deadline`` if that is sooner (None changes nothing)."""
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline

    def time_left(self) -> float | None:
        """Seconds until the deadline (negative once passed); None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def deadline_passed(self) -> bool:
        left = self.time_left()
        return left is not None and left <= 0


@dataclass(frozen=True)
class ReadSpec:
    """What one read is: its key, at most how many bytes, the check they must pass, and
    the byte range ``[start, end)`` when only part of the object is read."""

    key: str
    max_bytes: int | None
    check: Check | None
    span: tuple[int, int] | None = None


def read_bounds(
    key: str | ObjectRef | ObjectSpan, max_bytes: int | None, check: Check | None
) -> ReadSpec:
    """What a read of ``key`` is: an :class:`~kvcdn.manifest.ObjectRef` is its key, read
    at most its size (or the caller's smaller bound) and checked against its size and
    sha256 (then by the caller's check, if any); an :class:`~kvcdn.manifest.ObjectSpan`
    is its byte range, exactly as long as asked; a plain key is read as asked."""
    if isinstance(key, str):
        return ReadSpec(key, max_bytes, check)
    own = key.check
    if isinstance(key, ObjectSpan):
        length = key.end - key.start
        bound = length if max_bytes is None else min(max_bytes, length)
        return ReadSpec(key.key, bound, _both(own, check), (key.start, key.end))
    bound = key.bytes if max_bytes is None else min(max_bytes, key.bytes)
    return ReadSpec(key.key, bound, _both(own, check))


def _both(first: Check, then: Check | None) -> Check:
    if then is None:
        return first

    def both(data: bytes) -> None:
        first(data)
        then(data)

    return both


def key_of(key: str | ObjectRef | ObjectSpan) -> str:
    """The store key a read is of (for messages)."""
    return key if isinstance(key, str) else key.key


@dataclass
class Fetched:
    """The bytes of one key, and what served them."""

    key: str
    data: bytes
    source: str  # an edge URL, "origin" (an edge reader's store), or the store's URL
    seconds: float


class Reader(Protocol):
    """What reading documents needs; every :class:`Store` and the SDK's edge reader are one.

    ``placement`` groups keys that belong together (a document's chain hash):
    a reader in front of several sources serves them from the same one; a
    store ignores it. ``max_bytes`` bounds what is read (a larger object is
    refused, never read whole) and ``check`` must pass on the bytes returned.
    """

    url: str
    #: Reads come from this machine's files (a local folder): they take about as long as
    #: the disk, so an engine may load synchronously; False for anything over a network.
    local: bool

    def get(
        self,
        key: str | ObjectRef,
        *,
        max_bytes: int | None = None,
        check: Check | None = None,
        placement: str | None = None,
    ) -> bytes:
        """The bytes of ``key`` (a key, or an :class:`~kvcdn.manifest.ObjectRef`: its key,
        read at most its size and checked against its sha256)."""
        ...

    def fetch(
        self,
        key: str | ObjectRef,
        *,
        max_bytes: int | None = None,
        check: Check | None = None,
        placement: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
        cancel: Cancel | None = None,
    ) -> Fetched:
        """As :meth:`get`, streamed: ``on_bytes(n)`` as pieces arrive, stopped by
        ``cancel`` (:class:`FetchCancelled`), and saying which source served it."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix ending in ``/``, or empty)."""
        ...


class ReaderBase:
    """What every reader shares: :meth:`get`, the bytes of a :meth:`fetch`. A reader
    implements ``fetch`` and ``list`` (the :class:`Reader` protocol) and inherits this."""

    def get(
        self,
        key: str | ObjectRef,
        *,
        max_bytes: int | None = None,
        check: Check | None = None,
        placement: str | None = None,
    ) -> bytes:
        """The bytes of ``key``: :meth:`fetch` without progress, cancel or source."""
        return self.fetch(  # type: ignore[attr-defined]  # every reader's own
            key, max_bytes=max_bytes, check=check, placement=placement
        ).data


class Store(ReaderBase):
    """Keys and bytes under one root of an fsspec filesystem."""

    local = False

    #: Extra arguments of every read (``cat_file``) on this kind of filesystem.
    read_kwargs: dict[str, Any] = {}

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")
        self._create_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _path(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid store key {key!r}")
        return f"{self.root}/{key}"

    def _require_root(self) -> None:
        """Raise :class:`StoreError` if the store itself is gone (then a key is not
        merely missing); stores that cannot tell do nothing."""

    def _key(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.fs._strip_protocol(self.root).rstrip("/")
        return path[len(root) + 1 :] if path.startswith(root + "/") else path

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn filesystem and network exceptions into kvcdn errors."""
        try:
            yield
        except FileNotFoundError as exc:
            if _s3_code(exc) == "NoSuchBucket":  # the store is gone, not the key
                raise StoreError(f"{what}: the bucket of {self.url} does not exist") from None
            self._require_root()
            raise NotFound(f"{what}: not found in {self.url} ({exc})") from None
        except PermissionError as exc:
            raise StoreError(
                f"{what}: access denied by {self.url} ({exc}); check the credentials "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or the AWS profile)"
            ) from None
        except (StoreError, FormatError, ValueError, FetchCancelled):
            raise
        except Exception as exc:  # network stacks raise many types; all mean the same here
            raise StoreError(f"{what}: store {self.url} failed: {exc}") from None

    # ---- reading ---------------------------------------------------------------
    def fetch(
        self,
        key: str | ObjectRef,
        *,
        max_bytes: int | None = None,
        check: Check | None = None,
        placement: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
        cancel: Cancel | None = None,
    ) -> Fetched:
        """The bytes of ``key``, read in pieces (:meth:`pieces`: a larger object than
        ``max_bytes`` is refused once one byte more has arrived), reporting each and
        stopping between two when ``cancel`` is set; ``check`` runs on what was read."""
        started = time.perf_counter()
        spec = read_bounds(key, max_bytes, check)
        pieces: list[bytes] = []
        if spec.span is None:
            read = self.pieces(spec.key, max_bytes=spec.max_bytes, cancel=cancel)
        else:
            read = self.span_pieces(spec.key, *spec.span, cancel=cancel)
        for piece in read:
            pieces.append(piece)
            if on_bytes is not None:
                on_bytes(len(piece))
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if spec.check is not None:
            spec.check(data)
        return Fetched(spec.key, data, self.url, time.perf_counter() - started)

    def span_pieces(
        self, key: str, start: int, end: int, *, cancel: Cancel | None = None
    ) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``key`` in ranged pieces (fewer if the object is
        shorter: the caller's check sees it), stopping between two at ``cancel``."""
        path = self._path(key)
        at = start
        while at < end:
            if cancel is not None and cancel.is_set():
                raise FetchCancelled
            stop = min(end, at + FETCH_PIECE)
            with self._errors(f"reading {key}"):
                piece = self.fs.cat_file(path, start=at, end=stop, **self.read_kwargs)
            if not piece:
                return
            at += len(piece)
            yield piece
            if at < stop:  # the object ended first
                return

    def pieces(
        self, key: str, *, max_bytes: int | None = None, cancel: Cancel | None = None
    ) -> Iterator[bytes]:
        """The bytes of ``key`` in ranged pieces of at most :data:`FETCH_PIECE`, never
        held together: a larger object than ``max_bytes`` is refused
        (:class:`FormatError`) once one byte more has arrived, and ``cancel`` stops
        the read between two pieces (:class:`FetchCancelled`)."""
        path = self._path(key)
        limit = None if max_bytes is None else max_bytes + 1  # one byte more shows "too large"
        received = 0
        end = FETCH_PIECE if limit is None else min(limit, FETCH_PIECE)
        first = True
        while True:
            if cancel is not None and cancel.is_set():
                raise FetchCancelled
            with self._errors(f"reading {key}"):
                piece = self.fs.cat_file(path, start=received, end=end, **self.read_kwargs)
            received += len(piece)
            self._check_size(key, received, max_bytes)
            if piece:
                yield piece
            if received < end or received == limit:
                return
            if first:
                # A large object: its size bounds the next ranges (a range past the end
                # is an error on S3, where a short read would be the only other sign).
                first = False
                with self._errors(f"reading {key}"):
                    size = int(self.fs.size(path))
                limit = size if limit is None else min(limit, size)
                if received >= limit:
                    return
            end = received + FETCH_PIECE if limit is None else min(limit, received + FETCH_PIECE)

    def _check_size(self, key: str, size: int, max_bytes: int | None) -> None:
        if max_bytes is not None and size > max_bytes:
            raise FormatError(f"{key} in {self.url} is larger than the {max_bytes} bytes expected")

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix ending in ``/``, or empty)."""
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Keys under ``prefix`` (as for :meth:`list`) with their sizes in bytes."""
        return {key: stat.size for key, stat in self.list_stats(prefix).items()}

    def list_stats(self, prefix: str = "") -> dict[str, KeyStat]:
        """Keys under ``prefix`` (as for :meth:`list`) with their sizes and times."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        with self._errors(f"listing {prefix or '/'}"):
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
        return {
            self._key(path): KeyStat(int(info.get("size") or 0), _modified(info))
            for path, info in found.items()
        }

    def iter_keys(self, prefix: str = "", *, after: str = "") -> Iterator[str]:
        """Keys that start with ``prefix`` (any string, not only a folder) and sort
        after ``after``, in ascending order, read page by page as they are consumed:
        the cost of a listing grows with what its caller takes, not with the store."""
        folder = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
        for key in self.list(folder):  # stores without a paged listing: filter one
            if key.startswith(prefix) and key > after:
                yield key

    def stat(self, key: str) -> KeyStat:
        """``key``'s size and modification time (:class:`NotFound` if it does not exist)."""
        with self._errors(f"reading the time of {key}"):
            info = self.fs.info(self._path(key))
        return KeyStat(int(info.get("size") or 0), _modified(info))

    # ---- writing ---------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Write ``key``; readers see the old bytes or the new, never a part."""
        with self._errors(f"writing {key}"):
            self._put(self._path(key), data)

    def _put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def put_content(self, key: str, data: bytes) -> bool:
        """Store a content-addressed object (``key`` names the sha256 of ``data``);
        False when it was already there, whole (then it is freshened).

        An existing object under the key holds either these bytes or damaged ones
        (a disk fault, a store attacker): it is read back and replaced if damaged.
        """
        if self.put_new(key, data):
            return True
        try:
            existing = self.get(key, max_bytes=len(data))
            if hashlib.sha256(existing).digest() == hashlib.sha256(data).digest():
                self.freshen(key)  # about to be named again: kept from a concurrent gc
                return False
            reason = "it holds other bytes"
        except (FormatError, NotFound) as exc:
            reason = str(exc)
        log.warning("replacing the damaged or vanished object %s: %s", key, reason)
        self.put(key, data)
        return True

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; False if it already did."""
        with self._errors(f"creating {key}"):
            try:
                return self._create(self._path(key), data)
            except FileExistsError:
                return False

    def _create(self, path: str, data: bytes) -> bool:
        # Generic filesystems have no conditional write; this is exact within
        # one process, which is what memory:// is for.
        with self._create_lock:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

    def freshen(self, key: str) -> None:
        """Set ``key``'s modification time to now, keeping its bytes (:class:`NotFound`
        if it is gone). A publisher freshens every stored object it names without
        uploading it, so that a concurrent gc, which deletes only objects unchanged
        for its grace period, cannot take it (what git does for the same race)."""
        with self._errors(f"freshening {key}"):
            self._freshen(self._path(key))

    def _freshen(self, path: str) -> None:
        with self._create_lock:
            self.fs.pipe_file(path, self.fs.cat_file(path))

    def delete(self, key: str) -> None:
        """Delete ``key``; one that does not exist is no error (S3 cannot tell)."""
        with self._errors(f"deleting {key}"):
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass

    def presigned_get(self, key: str, expires_s: int = PRESIGNED_FOR_S) -> str | None:
        """A URL that a plain HTTP client can GET ``key`` from, without credentials,
        for ``expires_s`` seconds; None where the store has no such URL (a folder).

        For servers that stream bytes on their own event loop (an edge): one HTTP
        request, with no thread or filesystem layer between the socket and them."""
        return None

    def now(self) -> float:
        """The store's clock (seconds since the epoch), which stamps modification
        times: read from a key written and deleted for the purpose, so that a
        publisher's or gc's own clock being off does not matter."""
        key = f"{keys.CLOCK_PREFIX}{uuid.uuid4().hex}"
        self.put(key, b"")
        try:
            return self.stat(key).modified
        finally:
            self.delete(key)

    def check(self, create: bool = True) -> None:
        """Raise a clear :class:`StoreError` if the store cannot be used; with
        ``create=False`` (readers), a store that does not exist yet is :class:`NotFound`."""


class LocalStore(Store):
    """A folder on a local disk; writes go to a temporary name, then are renamed."""

    local = True

    def _tmp(self, path: str) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")

    def _put(self, path: str, data: bytes) -> None:
        tmp = self._tmp(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _create(self, path: str, data: bytes) -> bool:
        tmp = self._tmp(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # fails if path exists: an atomic create-only write
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def pieces(
        self, key: str, *, max_bytes: int | None = None, cancel: Cancel | None = None
    ) -> Iterator[bytes]:
        """:meth:`Store.pieces` from one open file, without reopening it and asking its
        size for each piece (a local load of a document's chunks is dominated by
        copies and hashes; one piece, the usual chunk object, is read straight into
        the result).

        Only a regular file is read: a FIFO, a device or a socket in an object's
        place would block the read or never end (:class:`FormatError`)."""
        path = self._path(key)
        limit = -1 if max_bytes is None else max_bytes + 1  # one byte more shows "too large"
        received = 0
        if cancel is not None and cancel.is_set():
            raise FetchCancelled
        with self._errors(f"reading {key}"), _open_regular(path, key, self.url) as f:
            while True:
                if cancel is not None and cancel.is_set():
                    raise FetchCancelled
                want = FETCH_PIECE if limit < 0 else min(FETCH_PIECE, limit - received)
                piece = f.read(want) if want > 0 else b""
                if not piece:
                    return
                received += len(piece)
                self._check_size(key, received, max_bytes)
                yield piece
                if len(piece) < want:
                    return

    def span_pieces(
        self, key: str, start: int, end: int, *, cancel: Cancel | None = None
    ) -> Iterator[bytes]:
        """:meth:`Store.span_pieces` from one open regular file."""
        path = self._path(key)
        if cancel is not None and cancel.is_set():
            raise FetchCancelled
        with self._errors(f"reading {key}"), _open_regular(path, key, self.url) as f:
            f.seek(start)
            at = start
            while at < end:
                if cancel is not None and cancel.is_set():
                    raise FetchCancelled
                piece = f.read(min(FETCH_PIECE, end - at))
                if not piece:
                    return
                at += len(piece)
                yield piece

    def list_stats(self, prefix: str = "") -> dict[str, KeyStat]:
        self._require_root()
        found = super().list_stats(prefix)  # without temporary files of unfinished writes
        return {k: n for k, n in found.items() if not k.rsplit("/", 1)[-1].startswith(".")}

    def iter_keys(self, prefix: str = "", *, after: str = "") -> Iterator[str]:
        self._require_root()
        folder, _, start = prefix.rpartition("/")
        base = Path(self.root, folder) if folder else Path(self.root)
        yield from _walk_sorted(base, f"{folder}/" if folder else "", start, prefix, after)

    def _freshen(self, path: str) -> None:
        os.utime(path)

    def delete(self, key: str) -> None:
        # Folders left empty stay: removing one could race a publisher about to
        # write into it, and listings see only files.
        try:
            Path(self._path(key)).unlink()
        except FileNotFoundError:
            self._require_root()
        except OSError as exc:
            raise StoreError(f"deleting {key} from {self.url}: {exc.strerror}") from None

    def _require_root(self) -> None:
        """A store that is gone is a failure, not a missing key."""
        if not Path(self.root).is_dir():
            raise StoreError(f"the store folder {self.root} does not exist (any more)")

    def check(self, create: bool = True) -> None:
        root = Path(self.root)
        if not create:
            if not root.is_dir():
                raise NotFound(f"there is no store at {root} (no such folder)")
            return
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot use {root} as a store: {exc.strerror}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise StoreError(f"cannot write to the store folder {root}")


class S3Store(Store):
    """S3 and S3-compatible services through s3fs."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str) -> None:
        super().__init__(url, fs, root)
        self._signers: dict[str, PresignedGetSigner | None] = {}  # by bucket

    def _create(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")  # If-None-Match: *
        except OSError as exc:
            # s3fs maps a 412 to FileExistsError only when the message is AWS's;
            # Ceph RGW sends none, so look at the S3 error code itself.
            if _s3_code(exc) == "PreconditionFailed":
                return False
            raise
        return True

    def pieces(
        self, key: str, *, max_bytes: int | None = None, cancel: Cancel | None = None
    ) -> Iterator[bytes]:
        """One GET (of at most ``max_bytes`` + 1 bytes), its body read a piece at a time
        as it streams in: one request per object, whatever its size."""
        limit = None if max_bytes is None else (0, max_bytes)  # one byte more: "too large"
        return self._get(key, limit, max_bytes, cancel)

    def span_pieces(
        self, key: str, start: int, end: int, *, cancel: Cancel | None = None
    ) -> Iterator[bytes]:
        """One ranged GET of bytes ``[start, end)``."""
        return self._get(key, (start, end - 1), end - start, cancel)

    def _get(self, key: str, byte_range: tuple[int, int] | None, max_bytes: int | None,
             cancel: Cancel | None) -> Iterator[bytes]:  # fmt: skip
        from fsspec.asyn import sync

        bucket, _, path = self._path(key).partition("/")
        args: dict[str, Any] = {"Bucket": bucket, "Key": path}
        if byte_range is not None:
            args["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        if cancel is not None and cancel.is_set():
            raise FetchCancelled
        with self._errors(f"reading {key}"):
            try:
                body = self.fs.call_s3("get_object", **args)["Body"]
            except Exception as exc:
                if _s3_code(exc) == "InvalidRange":  # an empty object has no byte 0
                    return
                raise
        try:
            received = 0
            while True:
                if cancel is not None and cancel.is_set():
                    raise FetchCancelled
                with self._errors(f"reading {key}"):
                    piece = sync(self.fs.loop, body.read, FETCH_PIECE)
                if not piece:
                    return
                received += len(piece)
                self._check_size(key, received, max_bytes)
                yield piece
        finally:
            body.close()

    def iter_keys(self, prefix: str = "", *, after: str = "") -> Iterator[str]:
        bucket, _, root = self.root.partition("/")
        base = f"{root}/" if root else ""
        token: str | None = None
        start = base + after if after > prefix else ""
        while True:
            args: dict[str, Any] = {"Bucket": bucket, "Prefix": base + prefix, "MaxKeys": LIST_PAGE}
            if token:
                args["ContinuationToken"] = token
            elif start:
                args["StartAfter"] = start
            with self._errors(f"listing {prefix or '/'}"):
                page = self.fs.call_s3("list_objects_v2", **args)
            for item in page.get("Contents", []):
                yield item["Key"][len(base) :]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _freshen(self, path: str) -> None:
        # A copy onto itself is how S3 sets a new modification time without moving
        # the bytes; it must change something, so the metadata is replaced (by none).
        bucket, _, key = path.partition("/")
        self.fs.call_s3(
            "copy_object", Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key},
            MetadataDirective="REPLACE",
        )  # fmt: skip

    def check(self, create: bool = True) -> None:
        bucket = self.root.split("/", 1)[0]
        with self._errors(f"bucket {bucket}"):
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                raise NotFound(f"bucket '{bucket}' does not exist at {self.endpoint}") from None

    @property
    def endpoint(self) -> str:
        return self.fs.client_kwargs.get("endpoint_url") or "AWS S3"

    def presigned_get(self, key: str, expires_s: int = PRESIGNED_FOR_S) -> str | None:
        """A SigV4 query-signed GET of ``key``: the same endpoint, addressing style,
        region and credentials (refreshed as they expire) as the store's own reads.
        None without credentials to sign with.

        botocore's client resolves where a bucket's keys live once; each key is then
        signed by :class:`~.sigv4.PresignedGetSigner` (an edge signs one per miss)."""
        bucket, _, path = self._path(key).partition("/")
        try:
            signer = self._signer(bucket)
            if signer is None:
                return None
            return signer.url(quote(path, safe="/~"), expires_s)
        except Exception as exc:  # a broken profile, expired and unrenewable credentials
            log.debug("no presigned URL for %s in %s: %s", key, self.url, exc)
            return None

    def _signer(self, bucket: str) -> PresignedGetSigner | None:
        """What signs GETs of ``bucket``'s keys; None without credentials. Made once,
        from botocore's (blocking) client: signing needs no connection, and s3fs's
        client is asynchronous, bound to its loop thread."""
        with self._create_lock:
            if bucket not in self._signers:
                import botocore.session
                from botocore.config import Config

                config = {k: v for k, v in self.fs.config_kwargs.items() if k != "retries"}
                session = botocore.session.get_session()
                client = session.create_client(
                    "s3", **self.fs.client_kwargs,
                    config=Config(signature_version="s3v4", **config),
                )  # fmt: skip
                credentials = session.get_credentials()  # the chain the client signs with
                if credentials is None:
                    self._signers[bucket] = None
                else:
                    # where the client sends a key of this bucket (its endpoint rules:
                    # path or virtual-host style, the region's host), learnt from one URL
                    probe = "kvcdn-probe"
                    url = client.generate_presigned_url(
                        "get_object", Params={"Bucket": bucket, "Key": probe}
                    )
                    parts = urlsplit(url)
                    base = f"{parts.scheme}://{parts.netloc}{parts.path[: -len(probe)]}"
                    self._signers[bucket] = PresignedGetSigner(
                        base, client.meta.region_name, credentials
                    )
            return self._signers[bucket]


#: Store URL schemes kvcdn reads and writes; anything else is refused by name.
SCHEMES = ("file", "s3", "s3a", "memory")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?")
# Schemes people may type by mistake: named in the error rather than taken for a folder.
_URL_LIKE = {*SCHEMES, "gs", "gcs", "az", "abfs", "http", "https", "ftp", "sftp", "hdfs", "r2"}
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


def open_store(
    url: str | None = None, *, endpoint_url: str | None = None, create: bool = True
) -> Store:
    """Open the store at ``url`` (default: :func:`default_store_url`).

    ``url`` is a folder, ``file://PATH``, ``s3://BUCKET[/PREFIX]`` or
    ``memory://NAME``; anything else is an :class:`InputError` that says what
    is accepted. ``create=False`` (readers) refuses a folder that does not exist
    instead of making it.
    """
    if url is not None and not isinstance(url, str):
        raise InputError(f"a store URL must be a string, not {type(url).__name__}")
    url = url or default_store_url()
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if match is None or (not match.group(2) and scheme not in _URL_LIKE):
        path = str(Path(url).expanduser().absolute())  # a plain path (may contain ':')
        store: Store = LocalStore(url, fsspec.filesystem("file"), path)
    elif scheme not in SCHEMES:
        raise InputError(
            f"unsupported store '{url}': kvcdn stores are a folder, file://PATH, "
            "s3://BUCKET[/PREFIX] (AWS, MinIO, Ceph RGW, R2) or memory://NAME"
            + (" (for an edge, use --edge URL)" if scheme in ("http", "https") else "")
        )
    elif not match.group(2):
        rest = url[match.end() :].lstrip("/")
        raise InputError(f"'{url}' is not a store URL; did you mean {scheme}://{rest}?")
    else:
        rest = url[match.end() :]
        if scheme == "file":
            if not rest.strip("/"):
                raise InputError(f"'{url}' names no folder")
            path = str(Path(rest).expanduser().absolute())
            store = LocalStore(url, fsspec.filesystem("file"), path)
        elif scheme in ("s3", "s3a"):
            bucket = rest.strip("/").split("/", 1)[0]
            if not bucket:
                raise InputError(f"'{url}' names no bucket; use s3://BUCKET[/PREFIX]")
            if not _BUCKET.match(bucket) or "//" in rest.strip("/"):
                raise InputError(f"'{url}' is not a valid S3 URL (s3://BUCKET[/PREFIX])")
            store = S3Store(url, _s3_filesystem(endpoint_url), rest.strip("/"))
        else:
            if not rest.strip("/"):
                raise InputError(f"'{url}' names no store; use memory://NAME")
            fs = fsspec.filesystem("memory")
            store = Store(url, fs, fs._strip_protocol(url))
    store.check(create)
    return store


def _open_regular(path: str, key: str, url: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (:class:`FormatError`
    otherwise). The open does not wait for a FIFO's writer (``O_NONBLOCK``, which
    does nothing to a regular file's reads)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{key} in {url} is not a regular file; it cannot be an object")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _modified(info: dict[str, Any]) -> float:
    """A listing entry's modification time: S3's ``LastModified``, a local file's
    ``mtime``, or the memory filesystem's ``created``."""
    value = info.get("LastModified") or info.get("mtime") or info.get("created")
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value) if value is not None else 0.0


def _walk_sorted(folder: Path, key_prefix: str, start: str, prefix: str, after: str
                 ) -> Iterator[str]:  # fmt: skip
    """The files under ``folder`` in the order S3 lists keys (by the whole key, so
    ``a-b/x`` before ``a/x``), entries not starting with ``start`` skipped, and
    folders that hold nothing after ``after`` not entered."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    keyed = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.startswith(start):
            continue  # temporary files of unfinished writes, or outside the prefix
        is_dir = entry.is_dir(follow_symlinks=False)
        keyed.append((key_prefix + entry.name + ("/" if is_dir else ""), entry, is_dir))
    for key, entry, is_dir in sorted(keyed):
        if is_dir:
            if after[: len(key)] > key:  # every key inside sorts before ``after``
                continue
            yield from _walk_sorted(Path(entry.path), key, "", prefix, after)
        elif key > after and key.startswith(prefix):
            yield key


def check_endpoint_url(endpoint_url: str | None) -> str | None:
    """``endpoint_url`` if it is an http(s) URL with a host; :class:`InputError` otherwise."""
    if endpoint_url is None:
        return None
    try:
        parts = urlsplit(endpoint_url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except (ValueError, TypeError, AttributeError):
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(
            f"{endpoint_url!r} is not an endpoint URL; give http(s)://HOST[:PORT], "
            "for example http://127.0.0.1:9000"
        )
    return endpoint_url


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception s3fs translated, if any."""
    response = getattr(exc.__cause__, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _s3_filesystem(endpoint_url: str | None) -> Any:
    import s3fs

    endpoint = check_endpoint_url(
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    config: dict[str, Any] = {
        "connect_timeout": 5,
        "read_timeout": 60,
        "retries": {"max_attempts": 3, "mode": "standard"},
    }
    client: dict[str, Any] = {}
    if endpoint:
        # MinIO, Ceph RGW and friends are addressed by path, not virtual host.
        config["s3"] = {"addressing_style": "path"}
        client["endpoint_url"] = endpoint
        client.setdefault("region_name", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    return s3fs.S3FileSystem(
        client_kwargs=client,
        config_kwargs=config,
        use_listings_cache=False,
        skip_instance_cache=True,
    )
