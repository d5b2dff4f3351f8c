"""Reads a caller can abandon: every read returns by its deadline or when cancelled,
whatever the store underneath does.

A read from an object store can block far longer than any load may wait: a hung
NFS or FUSE mount blocks ``open()`` for good, an S3 endpoint that accepts
connections and never answers holds a request for its read timeout, times its
retries. :class:`BoundedReader` runs each read of the reader it wraps in a
thread of its own and waits for it only until the read's deadline (a
:class:`~kvcdn.store.Cancel`'s, or the one a :meth:`BoundedReader.within` view
sets): then it gives the read up, with :class:`~kvcdn.errors.DeadlineExceeded`,
and the thread ends whenever the store lets it. Its result is never used.

Abandoned reads still running are counted: past :data:`MAX_STUCK` of them the
store is not read at all (:class:`~kvcdn.errors.StoreError` at once) until some
of them return, so a store that never answers costs a bounded number of
threads, and every later read fails fast instead of waiting out its deadline.

The threads are daemons that run no numerical code (reads, hashes, parsing):
one still blocked at interpreter exit does not hold the process.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvcdn.errors import DeadlineExceeded, StoreError
from kvcdn.manifest import ObjectRef
from kvcdn.store import Cancel, FetchCancelled, Fetched, Reader, ReaderBase, key_of

from . import daemons

log = logging.getLogger(__name__)

#: Abandoned reads of one reader that may still be running before it refuses to read.
MAX_STUCK = 16
_POLL_S = 0.05  # how often a wait without a deadline looks at its cancel flag

T = TypeVar("T")


class _Stuck:
    """Abandoned reads of one store still running, shared by every view of a reader."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0


class BoundedReader(ReaderBase):
    """A :class:`~kvcdn.store.Reader` over ``inner`` whose reads end by their deadline.

    ``fetch`` takes the deadline of its ``cancel`` (:attr:`Cancel.deadline`,
    ``time.monotonic()`` seconds); :meth:`within` makes a view whose every read
    (``get`` and ``list`` included) ends by a given deadline.
    """

    def __init__(self, inner: Reader) -> None:
        self.inner = inner
        self.url = inner.url
        self.local = getattr(inner, "local", False)
        # this view's deadline, asked at each read (a load's clock can be paused meanwhile)
        self._deadline: Callable[[], float | None] = lambda: None
        self._stuck = _Stuck()

    def __repr__(self) -> str:
        return f"BoundedReader({self.inner!r})"

    @property
    def stuck(self) -> int:
        """Abandoned reads of this store still running."""
        return self._stuck.count

    @property
    def rejected(self) -> list[Any]:
        """The inner reader's record of edges that served bad bytes (an edge reader's)."""
        return getattr(self.inner, "rejected", [])

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def within(self, deadline: float | Callable[[], float | None] | None) -> BoundedReader:
        """A view of this reader whose reads end by ``deadline`` (None: no deadline), or
        by what ``deadline()`` says at each read."""
        view = copy.copy(self)  # the same store, the same count of stuck reads
        view._deadline = deadline if callable(deadline) else lambda: deadline
        return view

    # ---- the Reader protocol ------------------------------------------------------
    def fetch(
        self, key: str | ObjectRef, *, cancel: Cancel | None = None, **options: Any
    ) -> Fetched:
        """The inner reader's fetch (its options as :meth:`Reader.fetch`'s), given up at
        ``cancel``'s deadline or this view's, whichever is sooner."""
        cancel = self._cancel(cancel)
        return self._run(
            f"reading {key_of(key)}", lambda: self.inner.fetch(key, cancel=cancel, **options),
            cancel,
        )  # fmt: skip

    def list(self, prefix: str = "") -> list[str]:
        return self._run(f"listing {prefix or '/'}", lambda: self.inner.list(prefix),
                         self._cancel(None))  # fmt: skip

    # ---- running a read ---------------------------------------------------------
    def _cancel(self, cancel: Cancel | None) -> Cancel:
        cancel = cancel if cancel is not None else Cancel()
        cancel.limit(self._deadline())
        return cancel

    def _run(self, what: str, read: Callable[[], T], cancel: Cancel) -> T:
        """``read()`` in a thread of its own, waited for until ``cancel``'s deadline or
        until ``cancel`` is set; given up otherwise."""
        stuck = self._stuck
        with stuck.lock:
            if stuck.count >= MAX_STUCK:
                raise StoreError(
                    f"{what}: {stuck.count} earlier reads of {self.url} never returned; "
                    "not reading it until they do"
                )
        left = cancel.time_left()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"{what}: no time left to read {self.url}")
        done = threading.Event()
        outcome: list[Any] = []
        abandoned: list[bool] = []  # set once the caller gives the read up

        def work() -> None:
            try:
                outcome.append((True, read()))
            except BaseException as exc:  # handed to the caller, if it still waits
                outcome.append((False, exc))
            finally:
                with stuck.lock:
                    done.set()
                    if abandoned:
                        stuck.count -= 1

        daemons.start(work, "kvcdn-read")
        while not done.wait(_wait_step(cancel)):
            left = cancel.time_left()
            if cancel.is_set() or (left is not None and left <= 0):
                with stuck.lock:
                    if not done.is_set():  # else it ended in time after all
                        abandoned.append(True)
                        stuck.count += 1
                        break
        if abandoned:
            cancel.set()  # an edge read shuts its socket: the thread ends soon
            if not cancel.deadline_passed():
                raise FetchCancelled
            log.info("%s: gave up at the deadline; %d reads of %s still running", what,
                     stuck.count, self.url)  # fmt: skip
            raise DeadlineExceeded(f"{what}: {self.url} did not answer in time")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def _wait_step(cancel: Cancel) -> float:
    left = cancel.time_left()
    return _POLL_S if left is None else max(0.0, min(left, _POLL_S))


def deadline_in(seconds: float | None) -> float | None:
    """The ``time.monotonic()`` deadline ``seconds`` from now (None: none)."""
    return None if seconds is None else time.monotonic() + seconds
