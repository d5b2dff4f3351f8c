"""``kvcdn edge serve --workers N``: N worker processes, one port, one cache folder.

The process the user starts is a supervisor: it rebuilds the cache folder once
(removing interrupted writes, evicting down to ``--max-bytes``, counting what is
left into the shared ledger, see :mod:`.shared`), then starts N workers, each
``kvcdn edge serve`` with the same options and a worker name. Each worker binds
the port with ``SO_REUSEPORT``, so the kernel spreads new connections across
them (no shared accept queue, no thundering herd), and serves on its own event
loop with its own memory bounds. With ``--cpu-affinity auto`` (the default) worker
``i`` runs on the ``i``-th core the supervisor may use, as nginx's
``worker_cpu_affinity auto`` places its workers: a worker the scheduler moves between
cores finds its connections' state in another core's caches (docs/edge.md measures it).
The supervisor restarts a worker that dies (giving up on one that keeps dying within
seconds of its start), on the same core, and on SIGTERM or SIGINT asks every worker
to stop, as a single edge would, and waits for them.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: A worker that exits sooner than this after its start, this many times in a row,
#: is not started again: it cannot serve (a port taken by another program, ...).
QUICK_EXIT_S = 3.0
QUICK_EXITS = 5
STOP_WAIT_S = 20.0


def remove_leftovers(cache_root: Path, pid: int) -> None:
    """The temporary files a dead worker left in the cache folder (spools of misses it
    was fetching, half-written entries, a warm job's status being replaced): named
    with its pid, see :mod:`.cache` and :class:`.warm.JobBoard`."""
    for path in [*(cache_root / "objects").glob(f"*/.*.{pid}.*"),
                 *(cache_root / "warm-jobs").glob(f".*.{pid}.tmp")]:  # fmt: skip
        path.unlink(missing_ok=True)


def available_cores() -> int:
    """The CPUs this process may run on (its affinity, which containers set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_command(argv: list[str], name: str) -> list[str]:
    """``argv`` (a ``kvcdn edge serve`` command line, the program's name left out) run
    as the worker ``name``: the options given last win in click."""
    return [sys.executable, "-m", "kvcdn.cli.main", *argv, "--workers", "1", "--worker-name",
            name]  # fmt: skip


def worker_cores(affinity: str) -> list[int] | None:
    """The cores the workers are placed on in turn (``affinity`` ``auto``: those this
    process may use, in order), or None: the kernel places them (``off``, or a
    platform without ``sched_setaffinity``)."""
    if affinity not in ("auto", "off"):
        raise ValueError(f"CPU affinity {affinity!r} is not auto or off")
    if affinity == "off" or not hasattr(os, "sched_setaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def _in_worker(core: int | None) -> None:
    """(In the worker, before exec.) Linux: a worker gets SIGTERM when its supervisor
    dies, even by SIGKILL, rather than serving on, unsupervised; and it runs on
    ``core`` (None: anywhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if core is not None:
        try:
            os.sched_setaffinity(0, {core})
        except OSError:  # the core went offline since: serve wherever the kernel says
            pass


def supervise(command: Callable[[str], list[str]], workers: int, counters: Path,
              exited: Callable[[int], None] | None = None,
              cores: list[int] | None = None) -> int:  # fmt: skip
    """Run ``workers`` worker processes (``command(name)`` starts the one named
    ``name``) until SIGTERM or SIGINT; the exit status. ``counters`` is the folder
    of the workers' counters, emptied first: a new edge counts from zero.
    ``exited(pid)`` is called for a worker that died, before it is started again.
    ``cores``: worker ``i`` runs on ``cores[i % len(cores)]``, and so does a worker
    started again in its place (None: wherever the kernel places it)."""
    counters.mkdir(parents=True, exist_ok=True)
    for old in counters.iterdir():
        old.unlink(missing_ok=True)
    stop = []

    procs: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
    signalled: set[int] = set()

    def on_signal(signum: int, frame: object) -> None:
        stop.append(signum)
        # at once, not at the next turn of the loop: a stopped edge stops taking
        # requests as soon as one process would (its clients fail over then)
        stop_workers()

    def stop_workers() -> None:
        # once each: a second SIGTERM would reach a worker while it closes
        for proc, _ in list(procs.values()):
            if proc.pid not in signalled and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                signalled.add(proc.pid)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    starts = [0] * workers
    quick = [0] * workers

    def start(slot: int) -> None:
        starts[slot] += 1
        name = f"{slot}-{starts[slot]}"  # a restarted worker's counters are a new file
        core = cores[slot % len(cores)] if cores else None
        proc = subprocess.Popen(command(name), preexec_fn=functools.partial(_in_worker, core))
        procs[slot] = (proc, time.monotonic())
        where = f" on core {core}" if core is not None else ""
        log.info("started worker %s (pid %d)%s", name, proc.pid, where)

    status = 0
    try:
        for slot in range(workers):
            start(slot)
        while not stop:
            time.sleep(0.2)
            for slot, (proc, started) in list(procs.items()):
                code = proc.poll()
                if code is None or stop:
                    continue
                quick[slot] = quick[slot] + 1 if time.monotonic() - started < QUICK_EXIT_S else 0
                if quick[slot] >= QUICK_EXITS:
                    log.error("worker %d exited %d times within %g s of its start (status "
                              "%s): stopping", slot, QUICK_EXITS, QUICK_EXIT_S, code)  # fmt: skip
                    status = 1
                    stop.append(0)
                    break
                log.warning("worker %d (pid %d) exited with status %s: starting it again",
                            slot, proc.pid, code)  # fmt: skip
                if exited is not None:
                    exited(proc.pid)
                start(slot)
    finally:
        stop_workers()
        deadline = time.monotonic() + STOP_WAIT_S
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return status
