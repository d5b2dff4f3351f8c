"""The CPU kernels' threads: a kernel's independent items (rANS groups, tokens) split
into one range per thread, each range run by a numba kernel that releases the GIL.

numba's own ``parallel=True`` is not used. Its default threading layer is an OpenMP
runtime of its own (the system's libgomp) beside the one PyTorch ships, and once it
has run in a process, PyTorch's CPU forward passes there take over twice as long on
2 cores (a 1,048-token prefill of the embedded model: 1.9 s before any decode, 3.9-4.8
s after one: the cause of CacheBlend's bench losing to prefill, docs/blend.md).
numba's other layer (``workqueue``) avoids that but decodes 1.4-2x slower; choosing
it would also change numba for the whole host process. Plain threads running
``nogil`` kernels give the OpenMP layer's decode speed and leave PyTorch alone.

Threads: :func:`set_threads`, else ``NUMBA_NUM_THREADS`` when set, else the CPUs
this process may run on. Where the host binds OpenMP threads to CPUs
(``GOMP_CPU_AFFINITY`` or ``OMP_PLACES``, as vLLM's CPU workers do), the calling
thread is bound to the first of them and threads it starts inherit that one CPU:
the kernels' own threads are then bound one to each of the host's places, as the
OpenMP runtime binds its threads, so that they do not all share one CPU.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_started = 0  # pool threads started (each takes the next place)


def _places() -> list[int]:
    """The CPUs the host binds OpenMP threads to, in order (empty: it binds none)."""
    spec = os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_PLACES") or ""
    cpus: list[int] = []
    for first, last in re.findall(r"(\d+)(?:-(\d+))?", spec):
        cpus.extend(range(int(first), int(last or first) + 1))
    return list(dict.fromkeys(cpus))


def _default_threads() -> int:
    configured = os.environ.get("NUMBA_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    if _places():
        return len(_places())
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_threads = _default_threads()


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
    (the first error is raised once all have ended). Where no pool thread can be had
    (the interpreter is exiting), every range runs on the calling thread."""
    parts = min(_threads, items)
    if parts <= 1:
        kernel(0, items, *args)
        return
    bounds = [items * i // parts for i in range(parts + 1)]
    futures = []
    for i in range(1, parts):
        try:
            futures.append(_workers(parts - 1).submit(kernel, bounds[i], bounds[i + 1], *args))
        except RuntimeError:  # the interpreter shuts its pools down: no new threads
            kernel(bounds[i], bounds[i + 1], *args)
    try:
        kernel(bounds[0], bounds[1], *args)
    finally:
        errors = [f.exception() for f in futures]  # waits for every range
    for error in errors:
        if error is not None:
            raise error


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least ``n`` threads (Python joins them at exit: a thread inside a
    kernel then finishes it first). A smaller pool is left to finish what it holds,
    never shut down under a caller that is submitting to it."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            _pool = ThreadPoolExecutor(n, thread_name_prefix="kvcdn-kernel",
                                       initializer=_bind_to_a_place)  # fmt: skip
            _pool_size = n
        return _pool


def _bind_to_a_place() -> None:
    """A new pool thread takes the next of the host's OpenMP places (none: it keeps the
    CPUs it inherited)."""
    global _started
    places = _places()
    with _lock:
        _started += 1
        index = _started
    if not places:
        return
    try:
        os.sched_setaffinity(0, {places[index % len(places)]})
    except (AttributeError, OSError) as exc:  # not on Linux, or a CPU outside the cpuset
        log.debug("kernel thread keeps its CPUs: %s", exc)


def _forget_pool_in_child() -> None:
    """A forked child has none of its parent's pool threads: it starts its own."""
    global _pool, _pool_size, _lock
    _pool, _pool_size, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
