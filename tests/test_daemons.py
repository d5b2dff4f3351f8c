"""Daemon threads for reads (kvcdn.sdk.daemons): reused once finished, never shared
with a read still running, and gone from a forked child."""

from __future__ import annotations

import os
import threading

from kvcdn.sdk import daemons


def _run(name: str, block: threading.Event | None = None) -> tuple[threading.Event, list]:
    done, seen = threading.Event(), []

    def work() -> None:
        seen.append((threading.current_thread().ident, threading.current_thread().name,
                     threading.current_thread().daemon))  # fmt: skip
        if block is not None:
            block.wait(10)
        done.set()

    daemons.start(work, name)
    return done, seen


def test_a_finished_thread_takes_the_next_read_and_a_busy_one_does_not() -> None:
    together = threading.Event()  # two reads at once: two threads, both then waiting
    first, seen1 = _run("kvcdn-test-a", block=together)
    beside, _ = _run("kvcdn-test-a2", block=together)
    together.set()
    assert first.wait(10) and beside.wait(10)
    # the first thread (and any an earlier test's reads left) now waits for work: the
    # next read runs on one of those, under its own name, and starts no thread
    for _ in range(100):
        if daemons._waiting >= 2:
            break
        threading.Event().wait(0.01)
    alive = {t.ident for t in threading.enumerate()}
    assert seen1[0][0] in alive
    second, seen2 = _run("kvcdn-test-b")
    assert second.wait(10)
    assert seen2[0][0] in alive and seen2[0][1] == "kvcdn-test-b" and seen2[0][2]
    # a read that does not return keeps its thread: a read started after it began
    # runs on another
    stuck = threading.Event()
    held, seen3 = _run("kvcdn-test-stuck", block=stuck)
    for _ in range(1000):
        if seen3:
            break
        threading.Event().wait(0.01)
    other, seen4 = _run("kvcdn-test-c")
    assert other.wait(10) and not held.is_set()
    assert seen3 and seen4 and seen4[0][0] != seen3[0][0]
    stuck.set()
    assert held.wait(10)


def test_a_read_that_raises_leaves_its_thread_serving(caplog) -> None:
    def bad() -> None:
        raise RuntimeError("a bug in a read")

    with caplog.at_level("ERROR", logger="kvcdn.sdk.daemons"):
        daemons.start(bad, "kvcdn-test-bad")
        done, _ = _run("kvcdn-test-after")
        assert done.wait(10)
        for _ in range(1000):
            if "a read thread's work raised" in caplog.text:
                break
            threading.Event().wait(0.01)
    assert "a bug in a read" in caplog.text


def test_a_forked_child_starts_its_own_threads() -> None:
    done, _ = _run("kvcdn-test-parent")
    assert done.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent waits here, so a new one runs it
        try:
            ok = daemons._waiting == 0
            child_done, _ = _run("kvcdn-test-child")
            ok = ok and child_done.wait(10)
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
