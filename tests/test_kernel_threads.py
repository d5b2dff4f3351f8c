"""The kernels' own threads (kvcdn.kernels.parallel): bound to the host's OpenMP places
as vLLM's CPU workers set them, also in a forked child; every range ended before an
error is raised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvcdn.kernels import parallel

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
    or not {0, 1} <= os.sched_getaffinity(0),
    reason="needs CPUs 0 and 1",
)  # fmt: skip

_PROBE = textwrap.dedent(
    """
    import json, os, sys
    os.sched_setaffinity(0, {0})  # as libgomp binds the main thread to the first place
    from kvcdn.kernels import parallel

    def where(start, end, seen):
        seen[start] = sorted(os.sched_getaffinity(0))

    def probe():
        seen = {}
        parallel.run(where, 2, seen)
        return [seen[0], seen[1]]

    report = {"threads": parallel.get_threads(), "parent": probe()}
    child_out, child_in = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(child_in, json.dumps(probe()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    report["child"] = json.loads(os.read(child_out, 4096))
    print(json.dumps(report))
    """
)


@needs_two_cpus
@pytest.mark.parametrize(
    "env",
    [
        {"GOMP_CPU_AFFINITY": "0 1"},  # vLLM with PyTorch's libgomp preloaded
        {"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "true"},
        {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]"},  # Intel OpenMP
    ],
    ids=["gomp", "omp-places", "kmp"],
)
def test_kernel_threads_take_the_hosts_places_not_the_main_threads_cpu(env):
    """Where the host binds the main thread to its first place, the kernels' second
    range runs on the second place, not on the main thread's CPU (before: both on
    CPU 0, half the decode speed in vLLM's workers); a forked child binds afresh."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_CPU_AFFINITY", "OMP_PLACES", "KMP_AFFINITY", "OMP_PROC_BIND",
                          "NUMBA_NUM_THREADS")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["threads"] == 2
    assert report["parent"] == [[0], [1]]
    assert report["child"] == [[0], [1]]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0 1", [{0}, {1}]),
        ("0-1", [{0}, {1}]),
        ("0-1:2", [{0}]),  # a stride, not CPU 2
        ("0-1 x", []),  # not a list: nothing bound
    ],
)
def test_gomp_cpu_affinity_is_read_as_a_list_or_not_at_all(monkeypatch, spec, expected):
    for name in ("OMP_PLACES", "KMP_AFFINITY", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", spec)
    existing = os.cpu_count() or 1
    assert parallel._host_places() == [p for p in expected if max(p) < existing]


@pytest.mark.parametrize("spec", ["threads(4)", "cores", "{0:4}", "{0:2}:4:2", "^{0}"])
def test_abstract_omp_places_bind_nothing(monkeypatch, spec):
    monkeypatch.delenv("GOMP_CPU_AFFINITY", raising=False)
    monkeypatch.setenv("OMP_PLACES", spec)
    assert parallel._host_places() == []


def test_every_range_has_ended_before_an_error_is_raised(monkeypatch):
    """A range that fails on the calling thread does not leave another still writing."""
    monkeypatch.setattr(parallel, "_threads", 2)
    finished = threading.Event()

    def kernel(start, end):
        if start == 0:
            raise ValueError("the first range failed")
        time.sleep(0.3)
        finished.set()

    with pytest.raises(ValueError, match="first range"):
        parallel.run(kernel, 2)
    assert finished.is_set()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_balance_gives_each_range_about_the_same_cost(monkeypatch, threads):
    """Items of uneven costs (a decoder's blocks, sorted as a planner left them): in the
    order ``balance`` gives, the ranges ``run`` splits them into cost about the same,
    far closer than in the given order, and every item is run once."""
    monkeypatch.setattr(parallel, "_threads", threads)
    costs = np.array([0, 0, 0, 4, 8, 12, 20, 36, 64, 68, 116, 72], dtype=np.int64)
    order = parallel.balance(costs)
    assert sorted(order.tolist()) == list(range(len(costs)))
    ran: list[tuple[int, int]] = []
    parallel.run(lambda a, b, o: ran.append((a, b)), len(order), order)
    loads = sorted(int(costs[order[a:b]].sum()) for a, b in ran)
    given = sorted(int(costs[a:b].sum()) for a, b in ran)
    assert len(loads) == threads
    assert loads[-1] - loads[0] <= costs.max() // 2
    if threads > 1:
        assert loads[-1] < given[-1]
