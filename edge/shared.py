"""What the worker processes of one edge share through its cache folder.

``kvcdn edge serve --workers N`` runs N processes on one cache folder (see
:mod:`.workers`). They share, through files in that folder:

- ``locks``: POSIX record locks (``fcntl.lockf``), one byte per key at an
  offset taken from the key's sha256, and byte 0 for the ledger. A worker
  that fetches a key from the origin holds the key's byte, so its siblings
  wait and then serve the copy it cached: coalescing across workers. Record
  locks die with their process, so a worker that is killed holds nothing.
  They belong to the process, not to a descriptor: the file is opened once
  per process and never closed (closing any descriptor of it would drop all
  of the process's locks), and threads of one process take a
  :class:`threading.Lock` around the ledger's byte as well.
- ``usage``: the ledger, the bytes and objects the cache folder holds, under
  byte 0's lock. Room for an object is reserved in it as the object is
  renamed into place, under the lock (so a scan never counts one without the
  other); when it would pass ``--max-bytes``, the reserving worker scans the
  folder and evicts the least recently used objects (by the meta files'
  mtimes, which hits refresh) down to 90% of the bound, and writes the totals
  it counted (which also corrects any drift, e.g. from a worker killed while
  writing).
- ``run``: a random id the supervisor writes at each start. A worker that
  caches (and so has verified) an object writes the id and the data file's
  stamp into its meta file; a sibling trusts that stamp, and sends the file
  without hashing it again, only if the id is this run's and the file is
  unchanged. After a restart (a power cut, say) every file is verified again.
- ``workers/*.json``: each worker's counters, written every second and on
  each ``/metrics`` request; ``/metrics`` answers their sum.
- ``warm-jobs/*.json``: the warm jobs, each shown by the worker that runs it
  (which holds the job's lock byte meanwhile), so that any worker answers for
  it: :class:`~.warm.JobBoard`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

#: Per-key lock bytes start here; byte 0 is the ledger's.
_KEY_BASE = 1 << 20
#: Evicting stops at this share of the bound, so that scans are rare.
LOW_WATER = 0.9
_USAGE = struct.Struct("<qq")  # bytes, objects


class LedgerBusy(Exception):
    """The ledger is held (a sibling's eviction scan, say) by a caller that would not
    wait for it, or the change would need a scan of the folder: nothing was changed."""


class Shared:
    """One process's handle on the files its edge's workers share."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd = os.open(root / "locks", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._usage = os.open(root / "usage", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._thread_lock = threading.Lock()
        self._held: set[int] = set()  # key bytes this process holds
        try:
            self.run: str | None = (root / "run").read_text().strip() or None
        except OSError:
            self.run = None

    def start_run(self) -> None:
        """(The supervisor, before its workers start.) A new run: the files its workers
        verify from now on may be trusted by their siblings (:attr:`run`)."""
        self.run = secrets.token_hex(16)
        tmp = self.root / ".run.tmp"
        tmp.write_text(self.run)
        os.replace(tmp, self.root / "run")

    # ---- per-key locks (the event loop's thread only) ----------------------------------
    def try_key(self, digest: str) -> bool:
        """Take ``digest``'s key lock if no other process holds it; never blocks."""
        offset = _KEY_BASE + int(digest[:15], 16)
        if offset in self._held:  # another fill of this process (a hash collision)
            return False
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError:
            return False
        self._held.add(offset)
        return True

    def release_key(self, digest: str) -> None:
        offset = _KEY_BASE + int(digest[:15], 16)
        if offset in self._held:
            self._held.discard(offset)
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)

    # ---- the ledger ----------------------------------------------------------------------
    @contextmanager
    def ledger(self, *, wait: bool = True) -> Iterator[list[int]]:
        """``[bytes, objects]`` of the folder, held locked; written back on exit (not
        when the block raises). ``wait=False``: :class:`LedgerBusy` at once if another
        process or thread holds it (an event loop must not wait for a sibling's scan)."""
        if not self._thread_lock.acquire(blocking=wait):
            raise LedgerBusy("the ledger is held by another thread")
        try:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB), 1, 0)
            except OSError as exc:
                if wait or exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise LedgerBusy("the ledger is held by a sibling") from None
            try:
                raw = os.pread(self._usage, _USAGE.size, 0)
                totals = list(_USAGE.unpack(raw)) if len(raw) == _USAGE.size else [0, 0]
                before = list(totals)
                yield totals
                if totals != before:
                    os.pwrite(self._usage, _USAGE.pack(max(0, totals[0]), max(0, totals[1])), 0)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)
        finally:
            self._thread_lock.release()

    def totals(self) -> tuple[int, int]:
        """The ledger's bytes and objects, unlocked (for gauges)."""
        raw = os.pread(self._usage, _USAGE.size, 0)
        return _USAGE.unpack(raw) if len(raw) == _USAGE.size else (0, 0)

    def set_totals(self, size: int, objects: int) -> None:
        with self.ledger() as totals:
            totals[:] = [size, objects]


# ---- metrics -----------------------------------------------------------------------------


def write_counters(folder: Path, name: str, counters: dict[str, float]) -> None:
    """Write one worker's counters atomically (a reader sees the old or the new file)."""
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(counters))
    os.replace(tmp, folder / f"{name}.json")


def summed_counters(folder: Path) -> dict[str, float]:
    """The sum of every worker's counters, those of workers that died included (their
    counts happened; counters must not go back when one is restarted)."""
    total: dict[str, float] = {}
    for path in folder.glob("*.json"):
        try:
            counters = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: the next scrape counts it
        for name, value in counters.items():
            total[name] = total.get(name, 0) + value
    return total
