"""The CPU kernels' threads: a kernel's independent items (rANS groups, tokens) split
into one range per thread, each range run by a numba kernel that releases the GIL.

numba's own ``parallel=True`` is not used. Its default threading layer is an OpenMP
runtime of its own (the system's libgomp) beside the one PyTorch ships, and once it
has run in a process, PyTorch's CPU forward passes there take over twice as long on
2 cores (a 1,048-token prefill of the embedded model: 1.9 s before any decode, 3.9-4.8
s after one, the cause of CacheBlend's bench losing to prefill; docs/blend.md).
numba's other layer (``workqueue``) avoids that but decodes 1.4-2x slower; choosing
it would also change numba for the whole host process. Plain threads running
``nogil`` kernels give the OpenMP layer's decode speed and leave PyTorch alone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_threads = _available_cpus()


def set_threads(n: int) -> None:
    """Run kernels on ``n`` threads (the caller's included) from now on, in this process
    (a publishing actor given ``n`` CPUs)."""
    global _threads
    if type(n) is not int or n < 1:
        raise ValueError(f"threads must be a positive integer, not {n!r}")
    _threads = n


def get_threads() -> int:
    """The threads kernels run on."""
    return _threads


def run(kernel: Callable[..., Any], items: int, *args: Any) -> None:
    """``kernel(start, end, *args)`` over ``[0, items)`` split into one range per thread:
    the first range on the calling thread, the others on the pool's, all waited for
    (the first error is raised once all have ended)."""
    parts = min(_threads, items)
    if parts <= 1:
        kernel(0, items, *args)
        return
    bounds = [items * i // parts for i in range(parts + 1)]
    pool = _workers(parts - 1)
    futures = [pool.submit(kernel, bounds[i], bounds[i + 1], *args) for i in range(1, parts)]
    try:
        kernel(bounds[0], bounds[1], *args)
    finally:
        errors = [f.exception() for f in futures]  # waits for every range
    for error in errors:
        if error is not None:
            raise error


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least ``n`` threads (Python joins them at exit: a thread inside a
    kernel then finishes it first)."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(n, thread_name_prefix="kvcdn-kernel"), n
            if old is not None:
                old.shutdown(wait=False)
        return _pool
