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

A full disk stops caching, not serving: on ``ENOSPC`` the cache turns itself
read-only for a while and the server streams misses straight through.
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
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FULL_DISK_BACKOFF_S = 30.0
# Entries indexed in memory (about 1 KiB each, so 1 GiB at most), least recently
# used dropped beyond it as beyond max_bytes: the index is keyed by what readers
# ask for, and a cache of many small objects (pointers, index entries) would
# otherwise grow it far beyond its bytes on disk. Chunk objects are about a MiB:
# a cache of them reaches any max_bytes below a TiB first.
MAX_ENTRIES = 1_000_000


TOUCH_EVERY_S = 10.0  # recency is written to disk at most this often per entry

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


class DiskCache:
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._index: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._read_only_until = 0.0
        self.evictions = 0
        self.writes = 0  # objects written since start
        self.skips = 0  # objects not written: too big, disk full, write errors
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
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
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

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
        if len(data) > self.max_bytes or time.monotonic() < self._read_only_until:
            self.skips += 1
            return False
        self.drop(key)
        self._evict(room_for=len(data), entries=1)
        digest = _digest(key)
        folder = self.root / "objects" / digest[:2]
        data_path = folder / digest
        meta_path = folder / f"{digest}.meta"
        tmp = folder / f".{digest}.{os.getpid()}.{threading.get_ident()}"
        try:
            folder.mkdir(exist_ok=True)
            _write_atomic(tmp, data_path, data)
            written = stamp_of(data_path.stat())
            meta = json.dumps({"key": key, "size": len(data), "etag": etag}).encode()
            _write_atomic(tmp, meta_path, meta)
        except OSError as exc:
            _unlink(tmp)
            _unlink(data_path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("edge cache disk is full: serving without caching for a while")
                self._read_only_until = time.monotonic() + FULL_DISK_BACKOFF_S
            else:
                log.warning("cannot cache %s: %s", key, exc)
            self.skips += 1
            return False
        with self._lock:
            self._index[key] = Entry(key, len(data), etag, data_path, verified=written)
            self._bytes += len(data)
            self.writes += 1
        self._evict()  # another thread may have stored meanwhile
        return True

    def drop(self, key: str) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return
            self._bytes -= entry.size
        _unlink(entry.path.with_suffix(".meta"))
        _unlink(entry.path)

    def _evict(self, room_for: int = 0, entries: int = 0) -> None:
        """Drop least recently used entries until ``room_for`` more bytes, and
        ``entries`` more entries, fit."""
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


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


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
