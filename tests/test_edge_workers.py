"""`kvcdn edge serve --workers 2`: real worker processes behind one port, on one cache
folder, in front of moto's S3 server (which counts the GETs that reach it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvcdn.edge.admin import ADMIN_AT_ONCE
from kvcdn.keys import latest_key
from kvcdn.manifest import pointer_bytes
from tests.edge_helpers import EdgeProcess, MotoOrigin, chunk_object, get, post_json

PREFIX = "kv"


@pytest.fixture
def origin(moto_endpoint):
    o = MotoOrigin(moto_endpoint, PREFIX)
    o.objects = dict(chunk_object(i) for i in range(31, 37))
    for key, data in o.objects.items():
        o.client.put_object(Bucket=o.bucket, Key=f"{PREFIX}/{key}", Body=data)
    yield o
    o.stop_recording()


def _workers(pid: int) -> set[int]:
    """The supervisor's child processes (its workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(c) for c in children}


def _cores_of(pids: set[int]) -> list[tuple[int, ...]]:
    """Each process's cores (its CPU affinity), sorted."""
    return sorted(tuple(sorted(os.sched_getaffinity(pid))) for pid in pids)


def _start(origin: MotoOrigin, cache: Path, *extra: str) -> EdgeProcess:
    node = EdgeProcess(origin.url, cache, origin.endpoint, "--workers", "2", *extra).start()
    deadline = time.monotonic() + 30
    # both workers listening: each writes its counters within a second of its start
    while len(list((cache / "workers").glob("*.json"))) < 2:
        assert time.monotonic() < deadline, "the workers did not both start"
        time.sleep(0.1)
    return node


def _on_disk(cache: Path) -> int:
    return sum(
        p.stat().st_size
        for p in (cache / "objects").glob("*/*")
        if p.suffix != ".meta" and not p.name.startswith(".")
    )


def _until(check, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return found


def test_two_workers_fetch_a_cold_object_once_and_sum_their_metrics(origin, tmp_path):
    cache = tmp_path / "cache"
    node = _start(origin, cache)
    try:
        key, data = next(iter(origin.objects.items()))
        origin.start_recording()
        # each request a new connection: the kernel spreads them over both workers
        with ThreadPoolExecutor(48) as pool:
            results = list(pool.map(lambda _: get(f"{node.url}/{key}"), range(48)))
        assert all(status == 200 and body == data for status, _, body in results)
        assert origin.origin_gets(key) == 1  # counted by the origin itself

        with ThreadPoolExecutor(8) as pool:
            assert all(r[0] == 200 for r in pool.map(lambda _: get(f"{node.url}/{key}"),
                                                      range(40)))  # fmt: skip
        per_worker = [json.loads(p.read_text()) for p in (cache / "workers").glob("*.json")]
        assert len(per_worker) == 2

        def summed() -> dict[str, float] | None:
            m = node.metrics()
            served = (m["kvcdn_edge_hits_total"] + m["kvcdn_edge_misses_total"]
                      + m["kvcdn_edge_coalesced_waiters_total"])  # fmt: skip
            return m if served == 88 else None  # a sibling's counts are <= 1 s old

        m = _until(summed)
        assert m['kvcdn_edge_responses_total{code="200"}'] >= 88
        assert m["kvcdn_edge_origin_fetch_seconds_count"] == 1
        per_worker = [json.loads(p.read_text()) for p in (cache / "workers").glob("*.json")]
        hits = [w["kvcdn_edge_hits_total"] for w in per_worker]
        assert all(h > 0 for h in hits), hits  # both workers served, and both are counted
        assert m["kvcdn_edge_hits_total"] == sum(hits)
    finally:
        node.kill()
    assert node.proc is not None and node.proc.returncode == 0


def test_a_worker_trusts_what_a_sibling_verified_in_this_run_and_not_after_a_restart(
    origin, tmp_path
):
    cache = tmp_path / "cache"
    items = list(origin.objects.items())
    node = _start(origin, cache)
    try:
        for key, data in items:  # each fetched and verified once, by one worker or the other
            assert get(f"{node.url}/{key}")[2] == data
        # new connections spread over both workers: each serves what the other cached
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda kv: get(f"{node.url}/{kv[0]}")[2], items * 8))
        assert got == [data for _, data in items * 8]
        m = _until(lambda: (m := node.metrics())["kvcdn_edge_hits_total"] == 48 and m)
        per_worker = [json.loads(p.read_text()) for p in (cache / "workers").glob("*.json")]
        assert all(w["kvcdn_edge_hits_total"] > 0 for w in per_worker)
        assert m["kvcdn_edge_cache_verifications_total"] == 0  # no file hashed twice
    finally:
        node.kill()
    node = _start(origin, cache)  # a new run: each file is verified at its first use
    try:
        for key, data in items:
            assert get(f"{node.url}/{key}")[2] == data
        m = _until(lambda: (m := node.metrics())["kvcdn_edge_hits_total"] == len(items) and m)
        assert m["kvcdn_edge_cache_verifications_total"] == len(items)
        assert m["kvcdn_edge_misses_total"] == 0
    finally:
        node.kill()


def test_two_workers_ask_the_origin_for_a_pointer_as_often_as_one(origin, tmp_path):
    """A pointer is revalidated every 5 s: by one worker for all of them, which reuse
    the copy it keeps on disk while it is fresh."""
    key = latest_key("guide")
    origin.client.put_object(Bucket=origin.bucket, Key=f"{PREFIX}/{key}",
                             Body=pointer_bytes("guide", 1))  # fmt: skip
    node = _start(origin, tmp_path / "cache")
    try:
        origin.start_recording()
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: get(f"{node.url}/{key}"), range(40)))
        assert time.monotonic() - started < 4, "too slow to stay within one revalidation"
        assert all(status == 200 and body == pointer_bytes("guide", 1)
                   for status, _, body in results)  # fmt: skip
        assert origin.origin_gets(key) == 1  # counted by the origin itself
        def serving() -> int:  # workers that served it (their counters: <= 1 s old)
            files = (tmp_path / "cache" / "workers").glob("*.json")
            counts = [json.loads(p.read_text()) for p in files]
            return sum(w["kvcdn_edge_hits_total"] + w["kvcdn_edge_misses_total"] > 0
                       for w in counts)  # fmt: skip

        _until(lambda: serving() == 2)  # both workers served it
        time.sleep(5.2)  # stale now: asked again, once
        with ThreadPoolExecutor(8) as pool:
            assert all(r[0] == 200 for r in pool.map(lambda _: get(f"{node.url}/{key}"),
                                                      range(40)))  # fmt: skip
        assert origin.origin_gets(key) == 2
    finally:
        node.kill()


def test_two_workers_keep_the_folder_under_max_bytes(origin, tmp_path):
    cache = tmp_path / "cache"
    size = len(next(iter(origin.objects.values())))
    limit = int(size * 2.5)
    node = _start(origin, cache, "--max-bytes", str(limit))
    try:
        items = list(origin.objects.items())
        for round_ in range(2):  # all at once (both workers write), then one at a time
            if round_ == 0:
                with ThreadPoolExecutor(6) as pool:
                    got = list(pool.map(lambda kv: get(f"{node.url}/{kv[0]}")[2], items))
                assert got == [data for _, data in items]
            else:
                for key, data in items:
                    assert get(f"{node.url}/{key}")[2] == data
                    assert _on_disk(cache) <= limit
            _until(lambda: not list((cache / "objects").glob("*/.*")))  # writes settled
            assert _on_disk(cache) <= limit
        m = node.metrics()
        assert m["kvcdn_edge_cache_bytes"] <= limit
        assert m["kvcdn_edge_cache_bytes"] == _on_disk(cache)  # the shared ledger is exact
        # both workers evicted; a sibling's counts reach the sum within a second
        _until(lambda: node.metrics()["kvcdn_edge_evictions_total"] >= len(items) - 2)
    finally:
        node.kill()


def test_a_killed_worker_is_started_again_and_requests_keep_being_served(origin, tmp_path):
    """... on the core it had: with --cpu-affinity auto (the default) worker i runs on the
    i-th core the supervisor may use (nginx's worker_cpu_affinity auto), and the
    supervisor itself is not pinned."""
    cores = sorted(os.sched_getaffinity(0))
    cache = tmp_path / "cache"
    node = _start(origin, cache)
    assert node.proc is not None
    try:
        key, data = next(iter(origin.objects.items()))
        assert get(f"{node.url}/{key}")[2] == data
        before = _workers(node.proc.pid)
        assert len(before) == 2
        placed = _cores_of(before)
        assert placed == sorted([(cores[0],), (cores[1 % len(cores)],)])
        assert os.sched_getaffinity(node.proc.pid) == set(cores)
        victim = min(before)
        place = os.sched_getaffinity(victim)
        os.kill(victim, signal.SIGKILL)
        # Connections the kernel queued at the dying worker's socket are reset, as with
        # nginx's `reuseport`; once its socket is gone the other worker takes them all.
        time.sleep(0.5)  # (its descriptors leave /proc before its socket is gone)
        for _ in range(20):
            assert get(f"{node.url}/{key}")[2] == data
        after = _until(lambda: (w := _workers(node.proc.pid)) - before and len(w) == 2 and w)
        assert victim not in after
        (new,) = after - before
        # a child is listed from its fork on, and placed just before it runs kvcdn
        _until(lambda: os.sched_getaffinity(new) == place)
        assert _cores_of(after) == placed
        _until(lambda: len(list((cache / "workers").glob("*.json"))) == 3)  # the new one too
        for _ in range(10):
            assert get(f"{node.url}/{key}")[2] == data
    finally:
        workers = _workers(node.proc.pid)
        node.kill()  # SIGTERM: the supervisor stops its workers and exits
    assert node.proc.returncode == 0
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status"
                                                                     ).read_text()  # fmt: skip


def test_workers_placed_by_the_kernel_with_cpu_affinity_off(origin, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    node = _start(origin, tmp_path / "cache", "--cpu-affinity", "off")
    assert node.proc is not None
    try:
        assert _cores_of(_workers(node.proc.pid)) == [tuple(cores)] * 2
        key, data = next(iter(origin.objects.items()))
        assert get(f"{node.url}/{key}")[2] == data
    finally:
        node.kill()
    assert node.proc.returncode == 0


@pytest.fixture
def slow_parent(origin, tmp_path):
    """A parent edge that sends 1 MB/s (one process, as every shaped edge): warming the
    origin's six half-MiB objects through it takes about 3 s."""
    parent = EdgeProcess(origin.url, tmp_path / "parent", origin.endpoint,
                         "--rate-limit", "1M").start()  # fmt: skip
    yield parent
    parent.kill()


def _job(url: str, ident: str) -> dict:
    """``GET /warm/{id}`` on a new connection (so on either worker): it must be found."""
    status, _, body = get(f"{url}/warm/{ident}")
    assert status == 200, body
    return json.loads(body)


def _both_answered(cache: Path) -> bool:
    """Both workers have answered admin or object requests (their counters say so)."""
    per_worker = [json.loads(p.read_text()) for p in (cache / "workers").glob("*.json")]
    return len(per_worker) == 2 and all(
        sum(v for k, v in w.items() if k.startswith("kvcdn_edge_responses_total")) > 0
        for w in per_worker
    )


def test_any_worker_answers_for_a_warm_job_and_a_second_post_joins_it(origin, slow_parent,
                                                                      tmp_path):  # fmt: skip
    """A warm job runs in one worker; a client's status requests reach either worker
    (each a new connection) and always find it; posting the same keys again, to
    either worker, joins the running job instead of starting a second run."""
    cache = tmp_path / "cache"
    node = _start(origin, cache, "--parent", slow_parent.url)
    try:
        keys = sorted(origin.objects)
        status, job = post_json(f"{node.url}/warm", {"keys": keys})
        assert status == 202 and job["state"] == "running"
        # as many at once as one worker reads admin bodies (more may all reach one
        # worker, which answers 503 beyond ADMIN_AT_ONCE: by design, not this test's)
        with ThreadPoolExecutor(ADMIN_AT_ONCE) as pool:
            again = list(pool.map(lambda _: post_json(f"{node.url}/warm", {"keys": keys}),
                                  range(12)))  # fmt: skip
        assert [s for s, _ in again] == [200] * 12, again  # joined, never a second run
        assert {j["id"] for _, j in again} == {job["id"]}
        assert all(j["state"] == "running" for _, j in again)

        answers = []

        def finished() -> dict | None:
            answers.append(_job(node.url, job["id"]))
            return answers[-1] if answers[-1]["state"] != "running" else None

        final = _until(finished, 60)
        assert final["state"] == "done", final
        assert (final["fetched"], final["cached"], final["failed"]) == (len(keys), 0, 0)
        assert final["bytes_fetched"] == sum(len(d) for d in origin.objects.values())
        done = [a["done"] for a in answers]
        assert done == sorted(done)  # progress as it went, whichever worker answered
        with ThreadPoolExecutor(8) as pool:
            assert all(a == final for a in pool.map(lambda _: _job(node.url, job["id"]),
                                                    range(24)))  # fmt: skip
            listed = list(pool.map(lambda _: get(f"{node.url}/warm"), range(8)))
        for status, _, body in listed:
            assert status == 200
            assert [j["id"] for j in json.loads(body)["jobs"]] == [job["id"]]
        _until(lambda: _both_answered(cache))  # the requests above reached both workers
        for key, data in origin.objects.items():
            assert get(f"{node.url}/{key}")[:3:2] == (200, data)
        # the parent was asked once per key: one run, and the objects were on the node
        m = slow_parent.metrics()
        assert m["kvcdn_edge_hits_total"] + m["kvcdn_edge_misses_total"] == len(keys)
    finally:
        node.kill()


def test_a_warm_job_whose_worker_dies_is_reported_failed_and_can_be_posted_again(
    origin, slow_parent, tmp_path
):
    cache = tmp_path / "cache"
    node = _start(origin, cache, "--parent", slow_parent.url)
    try:
        keys = sorted(origin.objects)
        status, job = post_json(f"{node.url}/warm", {"keys": keys})
        assert status == 202
        shown = json.loads((cache / "warm-jobs" / f"{job['id']}.json").read_text())
        assert shown["state"] == "running"
        assert node.proc is not None and shown["by"] in _workers(node.proc.pid)
        # as if killed while replacing the job's file: the supervisor removes what is left
        half = cache / "warm-jobs" / f".{job['id']}.{shown['by']}.tmp"
        half.write_text('{"id": ')
        os.kill(shown["by"], signal.SIGKILL)  # the worker running the job


        def settled() -> dict | None:
            try:
                j = _job(node.url, job["id"])
            except ConnectionError:  # queued on the killed worker's socket as it closed
                return None
            return j if j["state"] != "running" else None

        lost = _until(settled)
        assert lost["state"] == "failed" and lost["done"] < len(keys)
        assert "stopped before it finished" in lost["errors"][-1]["error"]
        _until(lambda: not half.exists())  # the supervisor saw the worker die
        _until(lambda: len(_workers(node.proc.pid)) == 2)  # and started it again
        status, rerun = post_json(f"{node.url}/warm", {"keys": keys})
        assert status == 202 and rerun["id"] == job["id"]
        final = _until(settled, 60)
        assert final["state"] == "done" and final["fetched"] + final["cached"] == len(keys)
        for key, data in origin.objects.items():
            assert get(f"{node.url}/{key}")[2] == data
    finally:
        node.kill()


def test_a_shaped_edge_is_one_process(origin, tmp_path):
    """A rate limit or a trace shapes one link: an edge of several workers would send
    at the whole rate from each."""
    base = [sys.executable, "-m", "kvcdn.cli.main", "edge", "serve", "--origin", origin.url,
            "--endpoint-url", origin.endpoint, "--cache-dir", str(tmp_path / "c")]  # fmt: skip
    refused = subprocess.run([*base, "--workers", "2", "--rate-limit", "1M"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2
    assert "--rate-limit and --throttle-trace shape one link" in refused.stderr
    assert "Traceback" not in refused.stderr
    node = EdgeProcess(origin.url, tmp_path / "c", origin.endpoint, "--rate-limit", "1M")
    at = node.args.index("--workers")
    del node.args[at : at + 2]  # the default worker count
    node.start()
    try:
        assert node.proc is not None and _workers(node.proc.pid) == set()
        assert "workers" not in node.output()
    finally:
        node.kill()


def test_workers_must_be_at_least_one(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "edge", "serve", "--origin", str(tmp_path),
         "--cache-dir", str(tmp_path / "c"), "--workers", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--workers" in result.stderr and "0" in result.stderr


def test_workers_stop_quietly_however_often_they_are_told_to(origin, tmp_path):
    """A worker told to stop again while it closes (a supervisor's SIGTERM, then an
    operator's) exits without asyncio's wakeup-pipe traceback, and the supervisor
    tells each worker once."""
    for _ in range(3):
        node = _start(origin, tmp_path / "cache")
        assert node.proc is not None
        workers = _workers(node.proc.pid)
        node.proc.send_signal(signal.SIGTERM)
        while node.proc.poll() is None:  # told again and again until it has gone
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        node.log.seek(0)
        log = node.log.read().decode()
        assert "Traceback" not in log and "Exception ignored" not in log, log[-3000:]


def test_an_event_loop_never_waits_for_the_shared_ledger(tmp_path):
    """A worker adopts a miss on its event loop only when the shared ledger is free at
    once and needs no scan of the folder; otherwise LedgerBusy, with nothing changed,
    and the adopt is done again where waiting is harmless (a thread)."""
    from kvcdn.edge.cache import DiskCache
    from kvcdn.edge.shared import LedgerBusy, Shared

    root = tmp_path / "cache"
    root.mkdir()
    objects = [chunk_object(seed) for seed in (41, 42, 43)]
    size = len(objects[0][1])
    shared = Shared(root)
    cache = DiskCache(root, int(2.5 * size), shared=shared)

    def spooled(key: str, data: bytes):  # type: ignore[no-untyped-def]
        spool = cache.spool(key, len(data))
        spool.write(data)
        return spool

    # a sibling (another process) holds the ledger
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0); print('held', flush=True); sys.stdin.read()",
         str(root / "locks")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        (key, data), *rest = objects
        spool = spooled(key, data)
        with pytest.raises(LedgerBusy):
            cache.adopt(spool, '"a"', wait=False)
        assert spool.path.exists() and cache.lookup(key) is None and shared.totals() == (0, 0)
        with ThreadPoolExecutor(1) as pool:  # adopt() waits for the sibling, in a thread
            waiting = pool.submit(cache.adopt, spool, '"a"')
            time.sleep(0.3)
            assert not waiting.done()
            assert holder.stdin is not None
            holder.stdin.close()
            assert waiting.result(10) is True
    finally:
        holder.kill()
        holder.wait(10)
    assert cache.lookup(key) is not None and shared.totals() == (size, 1)
    # free at once: adopted on the spot; a folder that would pass its bound needs a scan,
    # which is not done without waiting either
    (key2, data2), (key3, data3) = rest
    assert cache.adopt(spooled(key2, data2), '"b"', wait=False) is True
    third = spooled(key3, data3)
    with pytest.raises(LedgerBusy, match="scan"):
        cache.adopt(third, '"c"', wait=False)
    assert third.path.exists() and shared.totals() == (2 * size, 2)
    assert cache.adopt(third, '"c"') is True  # scanned, the least recently used evicted
    assert _on_disk(root) <= int(2.5 * size) and cache.lookup(key3) is not None


def test_a_copy_is_counted_out_of_the_ledger_once(tmp_path):
    """Two workers drop one key at once (one of them between the other's look at the
    file and its hold on the ledger): the ledger loses the copy once; and a replacement
    is not begun by a worker that would not wait."""
    import contextlib

    from kvcdn.edge.cache import DiskCache
    from kvcdn.edge.shared import LedgerBusy, Shared

    root = tmp_path / "cache"
    root.mkdir()
    (key, data), (other, data2) = chunk_object(51), chunk_object(52)
    a = DiskCache(root, 1 << 30, shared=Shared(root))
    b_shared = Shared(root)
    b = DiskCache(root, 1 << 30, shared=b_shared)
    for k, d in ((key, data), (other, data2)):
        spool = a.spool(k, len(d))
        spool.write(d)
        assert a.adopt(spool, '"x"') is True
    assert b_shared.totals() == (len(data) + len(data2), 2)
    # a replacement is one change: not started without waiting
    again = a.spool(key, len(data))
    again.write(data)
    with pytest.raises(LedgerBusy, match="replaced"):
        a.adopt(again, '"x"', wait=False)
    assert b_shared.totals() == (len(data) + len(data2), 2) and a.lookup(key) is not None
    again.discard()
    # worker b has seen the file; worker a removes it before b holds the ledger
    held = b_shared.ledger

    @contextlib.contextmanager
    def late(*args, **kwargs):  # type: ignore[no-untyped-def]
        a.drop(key)
        with held(*args, **kwargs) as totals:
            yield totals

    b_shared.ledger = late  # type: ignore[method-assign]
    b.drop(key)
    b_shared.ledger = held  # type: ignore[method-assign]
    assert b_shared.totals() == (len(data2), 1)
    assert _on_disk(root) == len(data2)
