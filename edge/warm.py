"""Warm jobs: fetch a list of keys into the cache in the background, bounded, observable.

A job is named by the set of keys it was given, so posting the same list twice
is the same job: while it runs the second post just returns it, and after it
has finished a new run finds everything cached and finishes at once. Fetches
go through the edge's ordinary miss path, so a warm fetch and a client
request for the same key still make one origin fetch.

The worker processes of one edge (``--workers N``) show each other their jobs
through a :class:`JobBoard` in the cache folder: a client's ``GET /warm/{id}``
reaches whichever worker the kernel gives its connection, not necessarily the one
that runs the job, and posting keys that a sibling is warming returns the
sibling's job rather than starting a second run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .shared import Shared

log = logging.getLogger(__name__)

# Jobs held, running or finished: anyone who may warm can post new key lists,
# each up to 100,000 keys, so the map is bounded. Finished jobs are forgotten
# first, oldest first; with MAX_JOBS running, a new one is refused (WarmBusy).
MAX_JOBS = 64
MAX_ERRORS = 20  # per job, the first failures are kept for the report
#: How often a worker shows its siblings a running job's progress.
POST_EVERY_S = 0.5
#: The largest job file a worker reads (MAX_ERRORS errors of bounded keys and messages).
MAX_JOB_FILE = 1 << 20

#: Fetch one key into the cache: "cached" if it already was, "fetched" (with
#: the bytes' length) otherwise; raises on failure.
Ensure = Callable[[str], Awaitable[tuple[str, int]]]


class WarmBusy(Exception):
    """MAX_JOBS warm jobs are running: a new one must wait for one to finish."""


def job_id(keys: list[str]) -> str:
    digest = hashlib.sha256()
    for key in sorted(set(keys)):
        digest.update(key.encode() + b"\0")
    return digest.hexdigest()[:16]


@dataclass
class WarmJob:
    id: str
    keys: list[str]
    started: float = field(default_factory=time.time)
    finished: float | None = None
    cached: int = 0  # already in the cache
    fetched: int = 0  # fetched from the origin (or a parent) by this job
    failed: int = 0
    bytes_fetched: int = 0
    errors: list[dict[str, str]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    @property
    def done(self) -> int:
        return self.cached + self.fetched + self.failed

    @property
    def state(self) -> str:
        if self.finished is None:
            return "running"
        return "failed" if self.failed else "done"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "total": len(self.keys),
            "done": self.done,
            "cached": self.cached,
            "fetched": self.fetched,
            "failed": self.failed,
            "bytes_fetched": self.bytes_fetched,
            "started": self.started,
            "finished": self.finished,
            "errors": self.errors,
        }


class JobBoard:
    """The warm jobs of an edge's worker processes, shown to each other through files
    in the shared cache folder (``folder/<id>.json``, each replaced whole).

    The worker that runs a job holds the job's lock byte (:class:`~.shared.Shared`) for
    as long as it runs, so a job runs in one worker at a time, and a job whose file
    says "running" while nobody holds its lock was left by a worker that died. Files
    carry the edge's run id: a file of an earlier run of the edge is not a job of
    this one (and is removed when seen)."""

    def __init__(self, folder: Path, shared: Shared) -> None:
        self.folder = folder
        self._shared = shared
        folder.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _lock(ident: str) -> str:
        return hashlib.sha256(b"warm job\0" + ident.encode()).hexdigest()

    def claim(self, ident: str) -> bool:
        """Take the job's lock, unless another worker holds it (runs the job)."""
        return self._shared.try_key(self._lock(ident))

    def release(self, ident: str) -> None:
        self._shared.release_key(self._lock(ident))

    def post(self, job: WarmJob) -> None:
        """Show the job as it is now (a reader sees the old or the new file)."""
        tmp = self.folder / f".{job.id}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps({"run": self._shared.run, "by": os.getpid(),
                                       **job.to_json()}))  # fmt: skip
            os.replace(tmp, self.folder / f"{job.id}.json")
        except OSError as exc:  # the job runs on; siblings see it late or not at all
            log.warning("cannot show warm job %s to the other workers: %s", job.id, exc)

    def drop(self, ident: str) -> None:
        """Remove the job's file if this process posted it (a sibling may have run the
        same keys again since)."""
        path = self.folder / f"{ident}.json"
        if self._load(path, by=True) is not None:
            path.unlink(missing_ok=True)

    def read(self, ident: str) -> dict[str, Any] | None:
        """Another worker's job, or None. A running job whose worker has gone is
        reported failed."""
        shown = self._load(self.folder / f"{ident}.json")
        if shown is None or shown["state"] != "running" or not self.claim(ident):
            return shown
        try:  # nobody runs it: it finished just now, or its worker died
            shown = self._load(self.folder / f"{ident}.json")
            if shown is not None and shown["state"] == "running":
                shown["state"] = "failed"
                shown["errors"] = [*shown["errors"][: MAX_ERRORS - 1], {
                    "error": "the worker running this job stopped before it finished; "
                             "post the keys again"}]  # fmt: skip
        finally:
            self.release(ident)
        return shown

    def all(self, skip: set[str]) -> list[dict[str, Any]]:
        """Every job shown on the board, but those named in ``skip``."""
        found = []
        for path in self.folder.glob("*.json"):
            if path.stem not in skip and (job := self.read(path.stem)) is not None:
                found.append(job)
        return found

    def _load(self, path: Path, *, by: bool = False) -> dict[str, Any] | None:
        """The job in ``path``, checked; with ``by``, only if this process posted it."""
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_JOB_FILE + 1)
            shown = json.loads(raw) if len(raw) <= MAX_JOB_FILE else None
        except (OSError, ValueError):
            return None  # gone, or not whole: not a job
        if not isinstance(shown, dict) or not isinstance(shown.get("errors"), list) or (
                shown.get("state") not in ("running", "done", "failed")):  # fmt: skip
            return None
        if shown.pop("run", None) != self._shared.run:  # an earlier run of the edge
            path.unlink(missing_ok=True)
            return None
        if shown.pop("by", None) != os.getpid() and by:
            return None
        return shown


class Warmer:
    def __init__(self, ensure: Ensure, concurrency: int, board: JobBoard | None = None) -> None:
        self._ensure = ensure
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)  # shared by all jobs of this edge
        self._board = board  # an edge of several workers: their jobs, shown to each other
        self.jobs: OrderedDict[str, WarmJob] = OrderedDict()

    def submit(self, keys: list[str]) -> tuple[dict[str, Any], bool]:
        """Start (or find) the job for ``keys``: its status, and True when a new run
        was started. :class:`WarmBusy` when MAX_JOBS other jobs are running."""
        unique = list(dict.fromkeys(keys))
        ident = job_id(unique)
        running = self.jobs.get(ident)
        if running is not None and running.finished is None:
            return running.to_json(), False
        if self._board is not None and not self._board.claim(ident):
            # a sibling worker is warming these keys: its job (not yet shown, maybe)
            return self._board.read(ident) or WarmJob(ident, unique).to_json(), False
        try:
            self._make_room(ident)
        except WarmBusy:
            if self._board is not None:
                self._board.release(ident)
            raise
        job = WarmJob(ident, unique)
        self.jobs[ident] = job
        if self._board is not None:
            self._board.post(job)
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        return job.to_json(), True

    def status(self, ident: str) -> dict[str, Any] | None:
        """One job's status, whichever worker runs it, or None."""
        job = self.jobs.get(ident)
        if job is not None and (job.finished is None or self._board is None):
            return job.to_json()
        if self._board is None:
            return None
        # the board's: this worker's finished run, or a sibling's run of the same keys since
        return self._board.read(ident) or (job.to_json() if job is not None else None)

    def statuses(self) -> list[dict[str, Any]]:
        """Every recent job's status: this worker's, then its siblings'."""
        if self._board is None:
            return [j.to_json() for j in self.jobs.values()]
        running = {i: j.to_json() for i, j in self.jobs.items() if j.finished is None}
        return [*running.values(), *self._board.all(skip=set(running))]

    def _make_room(self, ident: str) -> None:
        self._forget(ident)  # a finished run of the same keys: replaced
        while len(self.jobs) >= MAX_JOBS:
            oldest = next((j for j in self.jobs.values() if j.finished is not None), None)
            if oldest is None:
                raise WarmBusy(f"{MAX_JOBS} warm jobs are running; try again when one finishes")
            self._forget(oldest.id)

    def _forget(self, ident: str) -> None:
        if self.jobs.pop(ident, None) is not None and self._board is not None:
            self._board.drop(ident)

    async def _run(self, job: WarmJob) -> None:
        pending = iter(job.keys)

        async def worker() -> None:
            for key in pending:  # one shared iterator: each key is taken once
                await self._one(job, key)

        shown = None
        if self._board is not None:
            shown = asyncio.get_running_loop().create_task(self._show_often(job))
        try:
            await asyncio.gather(*(worker() for _ in range(min(self._concurrency,
                                                                len(job.keys)))))  # fmt: skip
            job.finished = time.time()
        finally:
            if shown is not None:
                shown.cancel()
            if self._board is not None:
                if job.finished is not None:
                    self._board.post(job)  # shown finished before the lock is let go
                self._board.release(job.id)
        log.info(
            "warm %s: %d cached, %d fetched (%d bytes), %d failed",
            job.id,
            job.cached,
            job.fetched,
            job.bytes_fetched,
            job.failed,
        )

    async def _one(self, job: WarmJob, key: str) -> None:
        async with self._slots:
            try:
                outcome, size = await self._ensure(key)
            except Exception as exc:  # every failure is reported in the job, none stops it
                job.failed += 1
                if len(job.errors) < MAX_ERRORS:
                    job.errors.append({"key": key, "error": str(exc)})
                return
        if outcome == "cached":
            job.cached += 1
        else:
            job.fetched += 1
            job.bytes_fetched += size

    async def _show_often(self, job: WarmJob) -> None:
        assert self._board is not None
        while True:
            await asyncio.sleep(POST_EVERY_S)
            self._board.post(job)

    async def close(self) -> None:
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
