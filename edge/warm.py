"""Warm jobs: fetch a list of keys into the cache in the background, bounded, observable.

A job is named by the set of keys it was given, so posting the same list twice
is the same job: while it runs the second post just returns it, and after it
has finished a new run finds everything cached and finishes at once. Fetches
go through the edge's ordinary miss path, so a warm fetch and a client
request for the same key still make one origin fetch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Jobs held, running or finished: anyone who may warm can post new key lists,
# each up to 100,000 keys, so the map is bounded. Finished jobs are forgotten
# first, oldest first; with MAX_JOBS running, a new one is refused (WarmBusy).
MAX_JOBS = 64
MAX_ERRORS = 20  # per job, the first failures are kept for the report

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


class Warmer:
    def __init__(self, ensure: Ensure, concurrency: int) -> None:
        self._ensure = ensure
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)  # shared by all jobs of this edge
        self.jobs: OrderedDict[str, WarmJob] = OrderedDict()

    def submit(self, keys: list[str]) -> tuple[WarmJob, bool]:
        """Start (or find) the job for ``keys``; True when a new run was started.
        :class:`WarmBusy` when MAX_JOBS other jobs are running."""
        unique = list(dict.fromkeys(keys))
        ident = job_id(unique)
        running = self.jobs.get(ident)
        if running is not None and running.finished is None:
            return running, False
        self.jobs.pop(ident, None)  # a finished run of the same keys: replaced
        while len(self.jobs) >= MAX_JOBS:
            oldest = next((j for j in self.jobs.values() if j.finished is not None), None)
            if oldest is None:
                raise WarmBusy(f"{MAX_JOBS} warm jobs are running; try again when one finishes")
            del self.jobs[oldest.id]
        job = WarmJob(ident, unique)
        self.jobs[ident] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        return job, True

    async def _run(self, job: WarmJob) -> None:
        pending = iter(job.keys)

        async def worker() -> None:
            for key in pending:  # one shared iterator: each key is taken once
                await self._one(job, key)

        await asyncio.gather(*(worker() for _ in range(min(self._concurrency, len(job.keys)))))
        job.finished = time.time()
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

    async def close(self) -> None:
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
