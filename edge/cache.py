"""The edge's disk cache: whole objects, atomic writes, LRU by bytes, rebuilt on start.

Layout under the cache folder: ``objects/{d[:2]}/{d}`` holds the bytes of the
key whose sha256 is ``d``, and ``objects/{d[:2]}/{d}.meta`` a small JSON
record (key, size, etag). Both are written to a temporary name and renamed,
data first, so a crash leaves either a whole entry, an orphan data file
(removed at start), or nothing. The in-memory index is rebuilt from the meta
files at start, in order of last use (the meta files' mtimes, which hits
refresh; the data files are never touched, so their ctime changes only when
their bytes do).

Writes are not fsynced. A power cut may leave a renamed file whose bytes never
reached the disk, but the server re-verifies every entry at its first use
after a start (:attr:`Entry.verified` lives in memory only), so such a file is
dropped and refetched, never served; the fsyncs would only slow misses down.

A miss is written to a :class:`Spool` in the same folder while it arrives,
hashed on the way, and renamed into place once verified (:meth:`DiskCache.adopt`):
an object is never held in memory, whatever its size. Spools in all hold at most
:data:`MAX_SPOOL_BYTES`, so a hostile origin's endless bodies fill neither memory nor
the disk.

A full disk stops caching, not serving: on ``ENOSPC`` the cache turns itself
read-only for a while, and a miss is served from its spool, removed after.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .shared import LedgerBusy

if TYPE_CHECKING:
    from .shared import Shared

log = logging.getLogger(__name__)

FULL_DISK_BACKOFF_S = 30.0
# Entries indexed in memory (about 1 KiB each, so 1 GiB at most), least recently
# used dropped beyond it as beyond max_bytes: the index is keyed by what readers
# ask for, and a cache of many small objects (pointers, index entries) would
# otherwise grow it far beyond its bytes on disk. Chunk objects are about a MiB:
# a cache of them reaches any max_bytes below a TiB first.
MAX_ENTRIES = 1_000_000


#: Buffers one write takes at most (Linux's and macOS's IOV_MAX).
IOV_MAX = 1024

TOUCH_EVERY_S = 10.0  # recency is written to disk at most this often per entry
#: Bytes all spools (misses being fetched) may hold at once, at most: far above what
#: the misses of real chunk objects (about a MiB each) hold, and no more than the
#: cache itself may.
MAX_SPOOL_BYTES = 2 << 30
#: ... and may hold in memory while the disk is full (spools are files otherwise).
MAX_MEMORY_SPOOL_BYTES = 256 << 20

#: What identifies one state of a file's bytes: (inode, size, mtime, ctime) in
#: ns. Any write to the file changes its ctime, which user space cannot set back.
Stamp = tuple[int, int, int, int]


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Entry:
    key: str
    size: int
    etag: str
    path: Path
    #: The stamp of the data file when its bytes were last verified in this
    #: process; None until then. Serving skips re-hashing while it matches.
    verified: Stamp | None = None
    touched: float = 0.0


class SpoolFull(Exception):
    """A spool would pass its object's limit, or all spools theirs."""


class Spool:
    """One miss on its way to the cache: a temporary file in the cache folder, written
    as the bytes arrive and hashed on the way. ``limit`` is the most bytes its kind of
    object can have; the cache's spools share ``max_spool_bytes``.

    While the disk is full a spool holds its bytes in memory instead, all such
    spools sharing :data:`MAX_MEMORY_SPOOL_BYTES`: the edge keeps serving misses,
    uncached, in bounded memory.

    One writer at a time (the fetch that owns it) adds what it receives with
    :meth:`write`: a fetch on the event loop each read as it arrives, a thread's
    fetch each piece it reads. Once finished,
    :meth:`source` gives each reader a handle of its own (read it with explicit
    offsets) or the bytes. The file leaves the folder by :meth:`DiskCache.adopt`
    (renamed into the cache) or :meth:`discard`, and its bytes live on until the
    last reader's handle is closed.
    """

    def __init__(self, cache: DiskCache, key: str, limit: int) -> None:
        self.cache = cache
        self.key = key
        self.limit = limit
        self.size = 0
        self._sha256 = hashlib.sha256()
        self._reserved = 0  # bytes counted against the cache's spool budget
        self._reserved_memory = 0  # and against its memory budget
        self._placed = False  # renamed into the cache or removed
        # a store origin's thread may still be writing when its fetch is given up
        self._lock = threading.Lock()
        self._memory: bytearray | bytes | None = None
        self._readers = 0  # responses still sending the bytes held in memory
        self._fd: int | None = None
        self._opened = False  # the file is made by the first write, on the writer's thread
        digest = _digest(key)
        name = f".{digest}.spool.{os.getpid()}.{next(_spools)}"
        self.path = cache.root / "objects" / digest[:2] / name

    def _open(self) -> None:
        """Where the bytes go: a new file in the folder of the key's cached copy, or
        memory while the disk is full."""
        self._opened = True
        if self.cache.read_only:
            self._memory = bytearray()
            return
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                self._fd = os.open(self.path, flags, 0o644)
            except FileNotFoundError:  # the key's folder is made by its first spool
                self.path.parent.mkdir(exist_ok=True)
                self._fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            self.cache._write_failed(self.key, exc)
            self._memory = bytearray()

    @property
    def sha256(self) -> str:
        return self._sha256.hexdigest()

    @property
    def on_disk(self) -> bool:
        return self._fd is not None

    def write(self, piece: bytes) -> None:
        """Append ``piece`` and hash it, now. On an event loop this is one write to the
        page cache per read of the socket (as nginx writes its temporary files): a
        hand-over to a thread per miss cost more CPU than the write and the hash,
        in futexes (the GIL passed back and forth around each system call) and in
        the memory of a piece held until the hand-over. :class:`SpoolFull` past the
        object's limit (so an endless body stops here) or the cache's."""
        n = len(piece)
        with self._lock:
            if self._placed:
                raise SpoolFull(f"the fetch of {self.key} was given up")
            if self.size + n > self.limit:
                raise SpoolFull(f"more than the {self.limit} bytes {self.key} can have")
            if not n:
                return
            if not self._opened:
                self._open()
            if self._fd is not None:
                self.cache._reserve(self, n, memory=False)
                try:
                    _write_all(self._fd, [piece], self.size)
                except OSError as exc:
                    self.cache._write_failed(self.key, exc)
                    self._to_memory()  # the disk filled up: go on in memory, or fail
            if self._memory is not None:
                self.cache._reserve(self, n, memory=True)
                self._memory += piece
            self._sha256.update(piece)
            self.size += n

    def _to_memory(self) -> None:
        assert self._fd is not None
        held = os.pread(self._fd, self.size, 0)
        self._drop_file()
        self.cache._reserve(self, len(held), memory=True)
        self._memory = bytearray(held)

    def read_at(self, offset: int, n: int) -> bytes:
        if self._fd is not None:
            return os.pread(self._fd, n, offset)
        if not self._opened:
            return b""  # nothing was written
        assert self._memory is not None
        return bytes(self._memory[offset : offset + n])

    def read_all(self) -> bytes:
        """The whole spool: for small documents (pointers, manifests) only."""
        return self.read_at(0, self.size)

    def source(self) -> tuple[BinaryIO | None, bytes, Callable[[], None] | None]:
        """What a reader sends: a handle of its own on the spooled file (a duplicate
        descriptor, to be read with explicit offsets), or the bytes held in memory (one
        copy, shared by every reader) and what to call once they are sent: memory held
        for a response counts against the budget until the last one is sent."""
        with self._lock:
            if not self._opened and not self._placed:
                self._opened, self._memory = True, bytearray()  # nothing was written
            if self._fd is not None:
                return os.fdopen(os.dup(self._fd), "rb"), b"", None
            if self._memory is None:
                raise RuntimeError(f"the spool of {self.key} was discarded")
            if not isinstance(self._memory, bytes):
                self._memory = bytes(self._memory)  # finished: frozen once, then shared
            self._readers += 1
            sent = threading.Event()  # one reader ends once

            def done() -> None:
                if not sent.is_set():
                    sent.set()
                    self._end_read()

            return None, self._memory, done

    def _end_read(self) -> None:
        with self._lock:
            self._readers -= 1
            if self._placed and self._readers == 0:
                self._memory = None
                self.cache._release(self, memory=True)

    def discard(self) -> None:
        """Remove the file unless the cache took it, and close this spool's own handle.
        Its bytes stop counting against the budgets (readers' handles keep a removed
        file's bytes until they are closed: a response's length at most); bytes held in
        memory once the last response reading them is sent."""
        with self._lock:
            if not self._placed:
                self._drop_file()
                self._placed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._readers == 0:
                self._memory = None
                self.cache._release(self)

    def _drop_file(self) -> None:
        if self._fd is not None:
            _unlink(self.path)
            os.close(self._fd)
            self._fd = None
            self.cache._release(self, memory=False)


class DiskCache:
    """The cache folder. With ``shared`` (an edge of several worker processes, see
    :mod:`.shared`), the folder is shared: the bound on its bytes is kept in the
    shared ledger, and the in-memory index holds what this worker has seen, each
    entry found on disk when first asked for (:meth:`load`); a file a sibling
    evicted is a miss. The supervisor rebuilds the folder once (:meth:`rebuild`)
    before its workers start."""

    def __init__(self, root: str | Path, max_bytes: int, *, shared: Shared | None = None
                 ) -> None:  # fmt: skip
        self.root = Path(root)
        self.shared = shared
        self.max_bytes = max_bytes
        # independent of max_bytes: an object too big to cache is still served (from its
        # spool), as any other miss
        self.max_spool_bytes = MAX_SPOOL_BYTES
        self._spooled = 0  # bytes held by spools in the folder, not yet in the index
        self._spooled_memory = 0  # and by spools held in memory while the disk is full
        self._index: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._read_only_until = 0.0
        self.evictions = 0
        self.writes = 0  # objects written since start
        self.skips = 0  # objects not written: too big, disk full, write errors
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        if shared is None:  # a worker's siblings may be writing: it neither cleans nor scans
            self._rebuild()

    # ---- start-up ------------------------------------------------------------
    def _rebuild(self) -> None:
        found: list[tuple[float, Entry]] = []
        for meta_path in (self.root / "objects").glob("*/*.meta"):
            data_path = meta_path.with_suffix("")
            try:
                meta = json.loads(meta_path.read_text())
                st = data_path.stat()
                if st.st_size != meta["size"] or _digest(meta["key"]) != data_path.name:
                    raise ValueError("size or name does not match")
                used = meta_path.stat().st_mtime
                found.append((used, Entry(meta["key"], st.st_size, meta["etag"], data_path)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping damaged cache entry %s: %s", meta_path, exc)
                _unlink(meta_path)
                _unlink(data_path)
        for tmp in (self.root / "objects").glob("*/.*"):  # interrupted writes
            _unlink(tmp)
        for data_path in (self.root / "objects").glob("*/*"):  # data without meta
            if data_path.suffix != ".meta" and not data_path.with_suffix(".meta").exists():
                _unlink(data_path)
        for _, entry in sorted(found, key=lambda f: f[0]):
            self._index[entry.key] = entry
            self._bytes += entry.size
        log.info("edge cache: %d objects, %d bytes", len(self._index), self._bytes)
        self._evict()

    # ---- queries -------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """Bytes of cached objects (in the whole shared folder, for a worker)."""
        return self.shared.totals()[0] if self.shared else self._bytes

    def __len__(self) -> int:
        return self.shared.totals()[1] if self.shared else len(self._index)

    def load(self, key: str) -> Entry | None:
        """A worker's way to an entry a sibling cached: read from its meta file and
        indexed, or None. Always None without ``shared``. It is verified here before
        use unless the sibling verified the file as it is now, in this run."""
        if self.shared is None:
            return None
        digest = _digest(key)
        data_path = self.root / "objects" / digest[:2] / digest
        try:
            meta = json.loads(data_path.with_suffix(".meta").read_bytes())
            stamp = stamp_of(data_path.stat())
            if meta["key"] != key or meta["size"] != stamp[1]:
                return None  # being replaced, or damaged: fetched again, under the key lock
            entry = Entry(key, stamp[1], meta["etag"], data_path)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        run = self.shared.run
        if run is not None and meta.get("run") == run and meta.get("verified") == list(stamp):
            # a sibling verified these very bytes in this run: not hashed again here
            entry.verified = stamp
        with self._lock:
            self._index[key] = entry
            self._index.move_to_end(key)
            while len(self._index) > MAX_ENTRIES:
                self._index.popitem(last=False)  # forgotten here, still on disk
        return entry

    def forget(self, key: str) -> None:
        """Drop ``key`` from this worker's index, not from disk (a sibling evicted it)."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes -= entry.size

    def lookup(self, key: str) -> Entry | None:
        """The entry for ``key`` (marked as just used), or None."""
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
        now = time.monotonic()
        if entry is not None and now - entry.touched > TOUCH_EVERY_S:
            entry.touched = now
            try:
                os.utime(entry.path.with_suffix(".meta"))  # recency survives a restart
            except OSError:
                pass
        return entry

    # ---- changes -------------------------------------------------------------
    def store(self, key: str, data: bytes, etag: str) -> bool:
        """Cache ``data`` (verified bytes) for ``key``; False when not cached (too big,
        disk full). Room is made first, so the folder never holds more than the limit."""
        if len(data) > self.max_bytes or self.read_only:
            self.skips += 1
            return False
        self.drop(key)
        digest = _digest(key)
        folder = self.root / "objects" / digest[:2]
        data_path = folder / digest
        meta_path = folder / f"{digest}.meta"
        tmp = folder / f".{digest}.{os.getpid()}.{threading.get_ident()}"
        placed = False

        def place() -> None:
            nonlocal placed
            folder.mkdir(exist_ok=True)
            _write_atomic(tmp, data_path, data)
            placed = True

        try:
            if not self._make_room(len(data), place):
                self.skips += 1
                return False
            written = stamp_of(data_path.stat())
            _write_atomic(tmp, meta_path, self._meta(key, len(data), etag, written))
        except OSError as exc:
            _unlink(tmp)
            if placed:
                _unlink(data_path)
                self._unreserve(len(data))
            self._write_failed(key, exc)
            self.skips += 1
            return False
        with self._lock:
            self._index[key] = Entry(key, len(data), etag, data_path, verified=written)
            self._bytes += len(data)
            self.writes += 1
        self._evict()  # another thread may have stored meanwhile
        return True

    def _meta(self, key: str, size: int, etag: str, written: Stamp) -> bytes:
        """An entry's meta file; with siblings, also this run and the stamp of the bytes
        just verified and written, which they may trust (:meth:`load`)."""
        meta: dict[str, object] = {"key": key, "size": size, "etag": etag}
        if self.shared is not None and self.shared.run is not None:
            meta |= {"run": self.shared.run, "verified": list(written)}
        return json.dumps(meta).encode()

    def spool(self, key: str, limit: int) -> Spool:
        """A new spool for a miss of ``key`` of at most ``limit`` bytes."""
        return Spool(self, key, limit)

    def adopt(self, spool: Spool, etag: str, *, wait: bool = True) -> bool:
        """Make ``spool``'s verified bytes the cached copy of its key, by a rename; False
        when they are not cached (too big, disk full) and stay the spool's. With
        siblings and ``wait=False``, :class:`~.shared.LedgerBusy` (nothing changed)
        rather than wait for the shared ledger or scan the folder."""
        key, size = spool.key, spool.size
        if size > self.max_bytes or self.read_only or not spool.on_disk:
            self.skips += 1
            return False
        digest = _digest(key)
        data_path = spool.path.with_name(digest)
        if not wait and self.shared is not None and data_path.exists():
            # a copy to replace: its drop and this adopt are one change (the key's lock,
            # held by this fill, keeps siblings from making a copy meanwhile)
            raise LedgerBusy("a cached copy is to be replaced")
        self.drop(key)
        meta_path = spool.path.with_name(f"{digest}.meta")
        tmp = spool.path.with_name(f".{digest}.meta.{os.getpid()}.{threading.get_ident()}")

        def place() -> None:
            os.replace(spool.path, data_path)
            spool._placed = True

        try:
            if not self._make_room(size, place, wait=wait):
                self.skips += 1
                return False
            written = stamp_of(data_path.stat())
            _write_atomic(tmp, meta_path, self._meta(key, size, etag, written))
        except OSError as exc:
            _unlink(tmp)
            if spool._placed:
                _unlink(data_path)
                # (waits for the ledger even with wait=False: the reservation is made,
                # and must not outlive its file; a failed write, rare)
                self._unreserve(size)
            self._write_failed(key, exc)
            self.skips += 1
            return False
        with self._lock:
            self._index[key] = Entry(key, size, etag, data_path, verified=written)
            self._bytes += size
            self.writes += 1
        self._release(spool, memory=False)  # its bytes count as the cache's now
        self._evict()  # another thread may have stored meanwhile
        return True

    @property
    def read_only(self) -> bool:
        """Whether the disk was found full lately: nothing is written for a while."""
        return time.monotonic() < self._read_only_until

    def _write_failed(self, key: str, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            if not self.read_only:
                log.warning("edge cache disk is full: serving without caching for a while")
            self._read_only_until = time.monotonic() + FULL_DISK_BACKOFF_S
        else:
            log.warning("cannot cache %s: %s", key, exc)

    def _reserve(self, spool: Spool, n: int, *, memory: bool) -> None:
        """Count ``n`` more bytes of ``spool`` against the spool budget on disk, or the
        memory budget; :class:`SpoolFull` when they do not fit."""
        limit = MAX_MEMORY_SPOOL_BYTES if memory else self.max_spool_bytes
        with self._lock:
            held = self._spooled_memory if memory else self._spooled
            if held + n > limit:
                where = "memory (the disk is full)" if memory else "the cache folder"
                raise SpoolFull(f"misses being fetched hold {held} bytes in {where}, and at "
                                f"most {limit} may be")  # fmt: skip
            if memory:
                self._spooled_memory += n
                spool._reserved_memory += n
            else:
                self._spooled += n
                spool._reserved += n

    def _release(self, spool: Spool, *, memory: bool | None = None) -> None:
        """Stop counting ``spool``'s bytes on disk (``memory=False``), in memory
        (``True``) or both (None); each once."""
        with self._lock:
            if memory is not True:
                self._spooled -= spool._reserved
                spool._reserved = 0
            if memory is not False:
                self._spooled_memory -= spool._reserved_memory
                spool._reserved_memory = 0

    @property
    def spooled_bytes(self) -> int:
        """Bytes of misses being fetched, on disk and in memory."""
        return self._spooled + self._spooled_memory

    def drop(self, key: str) -> None:
        """Remove ``key``'s cached copy."""
        if self.shared is not None:  # what the folder holds, whoever indexed it
            digest = _digest(key)
            path = self.root / "objects" / digest[:2] / digest
            if path.exists():
                # found and removed under the ledger, and counted only if this removed
                # it: a sibling's drop or scan may remove it first
                with self.shared.ledger() as totals:
                    _unlink(path.with_suffix(".meta"))
                    try:
                        size = path.stat().st_size
                        os.unlink(path)
                    except FileNotFoundError:
                        size = None
                    except OSError as exc:
                        log.warning("cannot remove %s: %s", path, exc)
                        size = None
                    if size is not None:
                        totals[0] -= size
                        totals[1] -= 1
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes -= entry.size
        if self.shared is not None or entry is None:
            return
        _unlink(entry.path.with_suffix(".meta"))
        _unlink(entry.path)

    def _make_room(self, size: int, place: Callable[[], None], *, wait: bool = True) -> bool:
        """Room for one more object of ``size`` bytes, and its file put into the folder by
        ``place`` (OSError when it cannot be): evicted for locally, or reserved in the
        shared ledger, evicting across the folder when it is full; False when there is
        no room (nothing placed). ``wait=False``: see :meth:`adopt`.

        With siblings the file is placed while the ledger is held: a sibling's scan
        (which rewrites the ledger from what the folder holds) then never finds a
        reservation without its file, which it would forget, letting the folder pass
        the bound."""
        if self.shared is None:
            self._evict(room_for=size, entries=1)
            place()
            return True
        failed: OSError | None = None
        with self.shared.ledger(wait=wait) as totals:
            if totals[0] + size > self.max_bytes or totals[1] + 1 > MAX_ENTRIES:
                if not wait:  # a scan reads the whole folder: not on an event loop
                    raise LedgerBusy("the folder is full: a scan is needed")
                totals[:] = self._scan_evict(size)
            if totals[0] + size > self.max_bytes:
                return False  # what is left is being written by siblings right now
            try:
                place()
            except OSError as exc:  # raised once the ledger (and any scan's count) is written
                failed = exc
            else:
                totals[0] += size
                totals[1] += 1
        if failed is not None:
            raise failed
        return True

    def _unreserve(self, size: int) -> None:
        if self.shared is not None:
            with self.shared.ledger() as totals:
                totals[0] -= size
                totals[1] -= 1

    def _scan_evict(self, room_for: int) -> list[int]:
        """(Under the ledger's lock.) Count what the folder holds and evict the least
        recently used objects, by their meta files' mtimes, until ``room_for`` more
        bytes fit under :data:`~.shared.LOW_WATER` of the bound; the totals left."""
        from .shared import LOW_WATER

        sizes: dict[Path, int] = {}
        used: list[tuple[float, Path]] = []
        for folder in (self.root / "objects").iterdir():
            try:
                names = list(os.scandir(folder))
            except OSError:
                continue
            for e in names:
                if e.name.startswith("."):
                    continue  # spools and temporary files: the spool budget's
                try:
                    st = e.stat()
                except OSError:
                    continue
                if e.name.endswith(".meta"):
                    used.append((st.st_mtime, Path(e.path).with_suffix("")))
                else:
                    # data without meta is being renamed into place: counted, not evicted
                    sizes[Path(e.path)] = st.st_size
        total, objects = sum(sizes.values()), len(sizes)
        target = max(0, min(int(self.max_bytes * LOW_WATER), self.max_bytes - room_for))
        for _, path in sorted(used):
            if total <= target and objects < MAX_ENTRIES:
                break
            if path not in sizes:
                continue
            _unlink(path.with_suffix(".meta"))
            _unlink(path)
            total -= sizes[path]
            objects -= 1
            self.evictions += 1
        return [total, objects]

    def _evict(self, room_for: int = 0, entries: int = 0) -> None:
        """Drop least recently used entries until ``room_for`` more bytes, and
        ``entries`` more entries, fit."""
        if self.shared is not None:  # the bound is the ledger's; the index only forgets
            with self._lock:
                while len(self._index) > MAX_ENTRIES:
                    self._index.popitem(last=False)
            return
        while True:
            with self._lock:
                fits = len(self._index) + entries <= MAX_ENTRIES
                if (fits and self._bytes + room_for <= self.max_bytes) or not self._index:
                    return
                key, entry = self._index.popitem(last=False)
                self._bytes -= entry.size
                self.evictions += 1
            _unlink(entry.path.with_suffix(".meta"))
            _unlink(entry.path)
            log.debug("evicted %s (%d bytes)", key, entry.size)


_spools = count()  # numbers each spool of this process


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _write_all(fd: int, pieces: list[bytes], offset: int) -> None:
    """Write ``pieces`` one after another from ``offset``: a vectored write each time
    (no copy into one buffer first), short writes resumed."""
    views = [memoryview(p) for p in pieces if p]
    while views:
        n = os.pwritev(fd, views[:IOV_MAX], offset)
        offset += n
        done = 0
        while done < len(views) and n >= len(views[done]):
            n -= len(views[done])
            done += 1
        del views[:done]
        if n:
            views[0] = views[0][n:]


def _write_atomic(tmp: Path, final: Path, data: bytes) -> None:
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, final)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
