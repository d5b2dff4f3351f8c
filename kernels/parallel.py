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

Threads: :func:`set_threads`, else ``NUMBA_NUM_THREADS`` when set, else the CPUs of
the host's OpenMP places (below), else the CPUs this process may run on.

Where the host binds OpenMP threads to CPUs (vLLM's CPU workers set
``GOMP_CPU_AFFINITY``, ``OMP_PLACES`` or ``KMP_AFFINITY=...proclist=[...]``), the
OpenMP runtime binds the process's main thread to the first place, and every thread
started from it inherits that one CPU: the kernels' own threads are then bound one
to each following place, as the OpenMP runtime binds its threads, so that they do
not all share one CPU. Only explicit lists are read (``0 1 2``, ``0-7:2``,
``{0,1},{2,3}``, ``proclist=[0-3]``); abstract places (``cores``, ``threads(4)``),
intervals (``{0:4}``) and anything else bind nothing. CPUs that do not exist are
dropped; one outside the process's cpuset is refused by the kernel and the thread
keeps its CPUs.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_place_index = itertools.count(1)  # pool threads take places 1, 2, ... (0: the main thread)
_SPAN = re.compile(r"(\d{1,6})(?:-(\d{1,6})(?::(\d{1,6}))?)?")


def _cpu_list(spec: str) -> list[int] | None:
    """The CPUs of a plain list (``0 1 2``, ``0,1``, ``0-3``, ``0-7:2``), in order; None
    for anything else."""
    cpus: list[int] = []
    for token in re.split(r"[\s,]+", spec.strip()):
        span = _SPAN.fullmatch(token)
        if span is None:
            return None
        first = int(span[1])
        last = int(span[2]) if span[2] else first
        step = int(span[3]) if span[3] else 1
        if last < first or step < 1:
            return None
        cpus.extend(range(first, last + 1, step))
    return list(dict.fromkeys(cpus)) or None


def _host_places() -> list[frozenset[int]]:
    """Where the host's OpenMP runtime binds its threads, one set of CPUs per thread in
    order (OMP_PLACES first, as the runtimes read it); empty where it binds none or
    says so in a form not read here."""
    env = os.environ
    if env.get("OMP_PROC_BIND", "").strip().lower() == "false":
        return []
    places: list[frozenset[int]] = []
    if spec := env.get("OMP_PLACES", "").strip():
        if re.fullmatch(r"\{[^{}]*\}(\s*,\s*\{[^{}]*\})*", spec) is None:
            return []
        for group in re.findall(r"\{([^{}]*)\}", spec):
            cpus = _cpu_list(group)
            if cpus is None or "-" in group:  # OMP_PLACES lists CPUs, not GOMP's ranges
                return []
            places.append(frozenset(cpus))
    elif spec := env.get("GOMP_CPU_AFFINITY", "").strip():
        places = [frozenset({cpu}) for cpu in _cpu_list(spec) or []]
    elif found := re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", "")):
        places = [frozenset({cpu}) for cpu in _cpu_list(found[1]) or []]
    existing = os.cpu_count() or 1
    places = [frozenset(c for c in place if c < existing) for place in places]
    return [place for place in places if place]


def _default_threads() -> int:
    configured = os.environ.get("NUMBA_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    if places := _host_places():
        return len(frozenset().union(*places))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_threads = _default_threads()
_threads_set = False  # by set_threads: kept in a forked child


def set_threads(n: int) -> None:
    """Run kernels on ``n`` threads (the caller's included) from now on, in this process
    (a publishing actor given ``n`` CPUs)."""
    global _threads, _threads_set
    if type(n) is not int or n < 1:
        raise ValueError(f"threads must be a positive integer, not {n!r}")
    _threads, _threads_set = n, True


def get_threads() -> int:
    """The threads kernels run on."""
    return _threads


def run(kernel: Callable[..., Any], items: int, *args: Any) -> None:
    """``kernel(start, end, *args)`` over ``[0, items)`` split into one range per thread:
    the first range on the calling thread, the others on the pool's. Every range has
    ended when this returns or raises (the calling thread's error first, else the
    first range's that failed). Ranges the pool cannot take (the interpreter is
    exiting) run on the calling thread."""
    parts = min(_threads, items)
    if parts <= 1:
        kernel(0, items, *args)
        return
    bounds = [items * i // parts for i in range(parts + 1)]
    ranges = [(bounds[i], bounds[i + 1]) for i in range(parts)]
    futures = []
    try:
        pool = _workers(parts - 1)
        while len(ranges) > 1:
            futures.append(pool.submit(kernel, *ranges[-1], *args))
            ranges.pop()  # only once the pool holds it
    except RuntimeError:  # exiting: refused before anything was queued
        pass
    error: BaseException | None = None
    try:
        for start, end in ranges:
            kernel(start, end, *args)
    except BaseException as exc:  # raised below, once every range has ended
        error = exc
    for future in futures:
        failed = future.exception()  # waits
        if error is None:
            error = failed
    if error is not None:
        raise error


def balance(costs: np.ndarray) -> np.ndarray:
    """The items ``0..len(costs) - 1`` in an order whose ranges, as :func:`run` splits
    them now, cost about the same (``costs``: each item's), for ``run(kernel,
    len(order), order, ...)``: a call ends when its slowest range does. The costliest
    item first, each to the range that costs least so far and has room, then swaps."""
    items = len(costs)
    parts = min(_threads, items)
    order = np.arange(items, dtype=np.int64)
    if parts <= 1:
        return order
    bounds = [items * i // parts for i in range(parts + 1)]
    room = [bounds[i + 1] - bounds[i] for i in range(parts)]
    loads = [0.0] * parts
    taken: list[list[int]] = [[] for _ in range(parts)]
    cost = [float(c) for c in costs]
    for item in sorted(range(items), key=lambda i: -cost[i]):
        part = min((p for p in range(parts) if len(taken[p]) < room[p]), key=loads.__getitem__)
        taken[part].append(item)
        loads[part] += cost[item]
    # then swaps out of the costliest range while one lowers it (its ranges have as
    # many items as run's, so a better split than the greedy one is often a swap away)
    while True:
        worst = max(range(parts), key=loads.__getitem__)
        best = (loads[worst], -1, -1, -1)
        for p in range(parts):
            for i, a in enumerate(taken[worst]):
                for j, b in enumerate(taken[p]):
                    moved = cost[a] - cost[b]
                    if p != worst and moved > 0:
                        peak = max(loads[worst] - moved, loads[p] + moved)
                        if peak < best[0]:
                            best = (peak, p, i, j)
        if best[1] < 0:
            break
        _, p, i, j = best
        a, b = taken[worst][i], taken[p][j]
        taken[worst][i], taken[p][j] = b, a
        loads[worst] += cost[b] - cost[a]
        loads[p] += cost[a] - cost[b]
    return np.array([item for part in taken for item in part], dtype=np.int64)


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least ``n`` threads, all started (Python joins them at exit: a
    thread inside a kernel then finishes it first). Started up front, so that a later
    ``submit`` never starts a thread: one that failed to would already have queued
    its work. A smaller pool is left to finish what it holds, never shut down under
    a caller that is submitting to it. RuntimeError where threads cannot start."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            pool = ThreadPoolExecutor(n, thread_name_prefix="kvcdn-kernel",
                                      initializer=_bind_to_a_place)  # fmt: skip
            ready = threading.Barrier(n + 1)
            try:
                for _ in range(n):  # none is idle yet: each submit starts a thread
                    pool.submit(ready.wait)
                ready.wait(timeout=30)
            except (RuntimeError, threading.BrokenBarrierError) as exc:
                ready.abort()
                pool.shutdown(wait=False)
                raise RuntimeError(f"kernel threads could not start: {exc}") from None
            _pool, _pool_size = pool, n
        return _pool


def _bind_to_a_place() -> None:
    """A new pool thread takes the next of the host's OpenMP places (none: it keeps the
    CPUs it inherited)."""
    places = _host_places()
    if not places:
        return
    place = places[next(_place_index) % len(places)]
    try:
        os.sched_setaffinity(0, place)
    except (AttributeError, OSError) as exc:  # not on Linux, or CPUs outside the cpuset
        log.debug("kernel thread keeps its CPUs: %s", exc)


def _forget_pool_in_child() -> None:
    """A forked child has none of its parent's pool threads: it starts its own, bound
    afresh, and sizes them by its own environment unless told a number."""
    global _pool, _pool_size, _lock, _place_index, _threads
    _pool, _pool_size, _lock = None, 0, threading.Lock()
    _place_index = itertools.count(1)
    if not _threads_set:
        _threads = _default_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
