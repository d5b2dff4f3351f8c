"""Daemon threads for reads, kept for reuse.

A load runs each read in a thread of its own (each chunk's fetch, each read a
:class:`~.bounded.BoundedReader` bounds), a daemon thread, so that a read blocked
on a hung store never holds the process at exit. Starting a thread waits until the
new thread holds the GIL: on 2 busy CPUs that took the loading thread 0.6-1.3 ms a
start, 16 to 64 times a load of a 4,000-token document (32 to 128 with a bounded
reader). So a thread that has finished waits a while for the next read instead of
exiting, and :func:`start` hands a read to a waiting thread when there is one.

A read that never returns keeps its thread, as before: it is never handed another.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How long a finished thread waits for another read before it exits.
IDLE_S = 30.0

_lock = threading.Lock()
_reads: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()
_waiting = 0  # threads waiting for a read, each counted until one is handed to it


def start(work: Callable[[], None], name: str) -> None:
    """Run ``work`` (which handles its own errors) in a daemon thread named ``name``: a
    waiting one if any, else a new one."""
    global _waiting
    with _lock:
        if _waiting:
            _waiting -= 1
            _reads.put((work, name))
            return
    threading.Thread(target=_serve, args=(work,), name=name, daemon=True).start()


def _serve(work: Callable[[], None] | None) -> None:
    global _waiting
    while work is not None:
        try:
            work()
        except BaseException:  # a read's own errors are its caller's; this is a bug
            log.exception("a read thread's work raised")
        work = None  # what it held (a chunk's bytes) is not kept while waiting
        with _lock:
            _waiting += 1
        try:
            work, name = _reads.get(timeout=IDLE_S)
        except queue.Empty:
            with _lock:
                try:  # handed over as this thread gave up waiting: counted already
                    work, name = _reads.get_nowait()
                except queue.Empty:
                    _waiting -= 1
                    return
        threading.current_thread().name = name


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: none waits there."""
    global _lock, _reads, _waiting
    _lock, _reads, _waiting = threading.Lock(), queue.SimpleQueue(), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
