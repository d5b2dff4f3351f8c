"""Edge cache nodes as real processes, in front of moto's S3 server on loopback; and
real edges in this process, where the bounds of their in-memory maps can be seen."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import boto3
import pytest
from aiohttp import web

from kvcdn.edge import cache as edge_cache
from kvcdn.edge import fill, warm
from kvcdn.edge.cache import DiskCache
from kvcdn.edge.fill import BoundedLRU
from kvcdn.edge.origin import OriginMissing, open_origin
from kvcdn.edge.server import Edge
from kvcdn.keys import latest_key, object_key
from kvcdn.manifest import pointer_bytes
from tests.conftest import free_port
from tests.edge_helpers import EdgeProcess, MotoOrigin, chunk_object, get, large_chunk_object

BUCKET_PREFIX = "kv"


@pytest.fixture
def origin(moto_endpoint):
    """A fresh bucket with real chunk objects; GETs are counted by moto itself."""
    o = MotoOrigin(moto_endpoint, BUCKET_PREFIX)
    o.objects = dict(chunk_object(i) for i in range(1, 7))
    for key, data in o.objects.items():
        o.client.put_object(Bucket=o.bucket, Key=f"{BUCKET_PREFIX}/{key}", Body=data)
    yield o
    o.stop_recording()


@pytest.fixture
def edge(origin, tmp_path):
    node = EdgeProcess(origin.url, tmp_path / "cache", origin.endpoint, "--max-bytes", "64M")
    yield node.start()
    node.kill()


def test_miss_then_hit_with_http_semantics(origin, edge):
    key, data = next(iter(origin.objects.items()))
    status, headers, body = get(f"{edge.url}/{key}")
    assert status == 200 and body == data
    assert headers["Cache-Control"] == "public, max-age=31536000, immutable"
    tag = headers["ETag"]
    status, _, body = get(f"{edge.url}/{key}")
    assert status == 200 and body == data
    m = edge.metrics()
    assert m["kvcdn_edge_misses_total"] == 1 and m["kvcdn_edge_hits_total"] == 1

    status, headers, body = get(f"{edge.url}/{key}", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(data)
    status, headers, body = get(f"{edge.url}/{key}", {"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20]
    assert headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    status, _, body = get(f"{edge.url}/{key}", {"Range": "bytes=-7"})
    assert status == 206 and body == data[-7:]
    status, headers, _ = get(f"{edge.url}/{key}", {"Range": f"bytes={len(data)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"
    status, _, body = get(f"{edge.url}/{key}", {"If-None-Match": tag})
    assert status == 304 and body == b""
    status, _, body = get(f"{edge.url}/{key}", {"If-None-Match": '"other"'})
    assert status == 200 and body == data


def test_a_client_that_reads_slowly_gets_every_byte_in_order(origin, edge):
    """A body the socket cannot take at once: sent as far as it goes straight away, the
    rest when the client reads (a tiny receive buffer and a client that waits first)."""
    # 16 MiB: more than a socket's send buffer grows to (4 MiB at most by default)
    key, data = large_chunk_object(16 << 20)
    origin.client.put_object(Bucket=origin.bucket, Key=f"{BUCKET_PREFIX}/{key}", Body=data)
    assert get(f"{edge.url}/{key}")[2] == data  # cached: the next one is a hit
    for _ in range(2):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", edge.port))
            sock.sendall(f"GET /{key} HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
            time.sleep(0.3)  # the edge's send blocks meanwhile
            received = bytearray()
            while (end := received.find(b"\r\n\r\n")) < 0 or len(received) < end + 4 + len(data):
                piece = sock.recv(1 << 20)
                assert piece, "the edge closed the connection early"
                received += piece
        head, body = bytes(received[:end]), bytes(received[end + 4 :])
        assert head.startswith(b"HTTP/1.1 200") and body == data


def test_a_second_ctrl_c_stops_an_edge_still_sending_at_once(origin, tmp_path):
    """The first SIGINT closes gracefully, waiting for a response still being sent; a
    second one (a person pressing Ctrl-C again) stops the process at once."""
    key, data = large_chunk_object(16 << 20)
    origin.client.put_object(Bucket=origin.bucket, Key=f"{BUCKET_PREFIX}/{key}", Body=data)
    node = EdgeProcess(origin.url, tmp_path / "cache", origin.endpoint).start()
    assert node.proc is not None
    try:
        assert get(f"{node.url}/{key}")[2] == data
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", node.port))
            sock.sendall(f"GET /{key} HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
            time.sleep(0.3)  # a response the edge cannot finish: nobody reads it
            node.proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
            assert node.proc.poll() is None  # closing, waiting for that response
            node.proc.send_signal(signal.SIGTERM)  # (systemd's, say): ignored
            time.sleep(0.3)
            assert node.proc.poll() is None
            node.proc.send_signal(signal.SIGINT)
            assert node.proc.wait(timeout=5) == 128 + signal.SIGINT
    finally:
        node.kill(signal.SIGKILL)
    node.log.seek(0)
    assert "Traceback" not in node.log.read().decode()


def test_64_concurrent_cold_gets_make_one_origin_get(origin, edge):
    key, data = list(origin.objects.items())[1]
    origin.start_recording()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda _: get(f"{edge.url}/{key}"), range(64)))
    assert all(status == 200 and body == data for status, _, body in results)
    assert origin.origin_gets(key) == 1  # counted by the origin itself
    m = edge.metrics()
    assert m["kvcdn_edge_misses_total"] == 1
    assert m["kvcdn_edge_coalesced_waiters_total"] + m["kvcdn_edge_hits_total"] == 63


def test_corrupted_cache_file_is_detected_and_refetched(origin, edge, tmp_path):
    key, data = list(origin.objects.items())[2]
    assert get(f"{edge.url}/{key}")[0] == 200
    edge.wait_cached(1)
    (cached,) = [p for p in (tmp_path / "cache" / "objects").glob("*/*") if p.suffix != ".meta"]
    raw = bytearray(cached.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    cached.write_bytes(bytes(raw))
    origin.start_recording()
    status, _, body = get(f"{edge.url}/{key}")
    assert status == 200 and body == data
    assert origin.origin_gets(key) == 1
    assert edge.metrics()["kvcdn_edge_verify_failures_total"] == 1
    assert cached.read_bytes() == data  # the good copy replaced the bad one


def test_origin_down_cached_objects_still_served_misses_get_502(tmp_path):
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="down")
    objects = dict(chunk_object(i) for i in (11, 12))
    for key, data in objects.items():
        client.put_object(Bucket="down", Key=f"kv/{key}", Body=data)
    node = EdgeProcess("s3://down/kv", tmp_path / "cache", endpoint).start()
    try:
        (k1, d1), (k2, _) = objects.items()
        assert get(f"{node.url}/{k1}")[0] == 200
        server.stop()
        status, _, body = get(f"{node.url}/{k1}")
        assert status == 200 and body == d1
        status, _, body = get(f"{node.url}/{k2}")
        assert status in (502, 504) and (b"cannot fetch" in body or b"timed out" in body)
    finally:
        node.kill()


class _SlowOrigin(BaseHTTPRequestHandler):
    """Sends half an object, then stalls: a download the test can kill the edge in."""

    objects: dict[str, bytes] = {}
    started = threading.Event()

    def do_GET(self) -> None:  # noqa: N802
        data = self.objects.get(self.path.lstrip("/"))
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not getattr(self.server, "fast", False):
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.started.set()
            time.sleep(3)
        else:
            self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_edge_killed_mid_download_never_serves_a_partial_object(tmp_path):
    key, data = chunk_object(21)
    _SlowOrigin.objects = {key: data}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowOrigin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin_url = f"http://127.0.0.1:{server.server_address[1]}"
    cache = tmp_path / "cache"
    node = EdgeProcess(origin_url, cache, None).start()
    try:

        def doomed_get() -> None:
            with contextlib.suppress(OSError):  # the edge dies under this request
                get(f"{node.url}/{key}")

        client = threading.Thread(target=doomed_get, daemon=True)
        client.start()
        assert _SlowOrigin.started.wait(10)
        node.kill(signal.SIGKILL)  # mid-download, no cleanup
        assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".")]
        server.fast = True
        node = EdgeProcess(origin_url, cache, None).start()
        status, _, body = get(f"{node.url}/{key}")
        assert status == 200 and body == data
        node.wait_cached(1)  # the client is answered before this fill's own write ends
        assert not [p for p in cache.rglob(".*") if p.is_file()]  # leftovers cleaned at start
    finally:
        node.kill()
        server.shutdown()


def test_restart_keeps_the_cache(origin, tmp_path):
    cache = tmp_path / "cache"
    key, data = list(origin.objects.items())[3]
    node = EdgeProcess(origin.url, cache, origin.endpoint).start()
    assert get(f"{node.url}/{key}")[0] == 200
    node.kill()
    node = EdgeProcess(origin.url, cache, origin.endpoint).start()
    try:
        origin.start_recording()
        status, _, body = get(f"{node.url}/{key}")
        assert status == 200 and body == data
        assert origin.origin_gets(key) == 0
        assert node.metrics()["kvcdn_edge_hits_total"] == 1
    finally:
        node.kill()


def test_tokens_and_bad_keys_are_rejected(origin, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    node = EdgeProcess(
        origin.url, tmp_path / "cache", origin.endpoint, "--token-file", str(token)
    ).start()
    try:
        key, data = next(iter(origin.objects.items()))
        assert get(f"{node.url}/{key}")[0] == 401
        assert get(f"{node.url}/{key}", {"Authorization": "Bearer wrong"})[0] == 401
        good = {"Authorization": "Bearer s3cret-token"}
        status, _, body = get(f"{node.url}/{key}", good)
        assert status == 200 and body == data
        for bad in (
            "objects/../../etc/passwd",
            "objects/%2e%2e/%2e%2e/etc/passwd",
            "etc/passwd",
            "objects/ab/" + "a" * 64 + "/x.kvc/../../y",
            "docs/" + "x" * 2000 + "/latest.json",
        ):
            status, _, _ = get(f"{node.url}/{bad}", good)
            assert status in (400, 404), bad
        status, _, _ = get(f"{node.url}/{key}", {**good, "X-Big": "a" * 20000})
        assert status in (400, 431)
        assert get(f"{node.url}/healthz")[0] == 200  # health and metrics stay open
    finally:
        node.kill()


def test_eviction_keeps_the_cache_under_its_limit(origin, tmp_path):
    cache = tmp_path / "cache"
    size = len(next(iter(origin.objects.values())))
    limit = int(size * 2.5)
    node = EdgeProcess(origin.url, cache, origin.endpoint, "--max-bytes", str(limit)).start()
    try:
        for i, (key, data) in enumerate(origin.objects.items()):
            status, _, body = get(f"{node.url}/{key}")
            assert status == 200 and body == data
            node.wait_cached(i + 1)
            on_disk = sum(
                p.stat().st_size for p in (cache / "objects").glob("*/*") if p.suffix != ".meta"
            )
            assert on_disk <= limit
        m = node.metrics()
        assert m["kvcdn_edge_evictions_total"] == len(origin.objects) - 2
        assert m["kvcdn_edge_cache_bytes"] <= limit
    finally:
        node.kill()


def test_edge_never_imports_torch():
    code = (
        "import sys, kvcdn.edge.server, kvcdn.edge.cache, kvcdn.edge.origin, kvcdn.cli.main; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_file_damaged_while_the_edge_was_down_is_caught_on_first_use(origin, tmp_path):
    cache = tmp_path / "cache"
    key, data = list(origin.objects.items())[4]
    node = EdgeProcess(origin.url, cache, origin.endpoint).start()
    assert get(f"{node.url}/{key}")[0] == 200
    node.kill()
    (cached,) = [p for p in (cache / "objects").glob("*/*") if p.suffix != ".meta"]
    st = cached.stat()
    raw = bytearray(cached.read_bytes())
    raw[100] ^= 0x01  # one flipped bit, with the old mtime put back
    cached.write_bytes(bytes(raw))
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    node = EdgeProcess(origin.url, cache, origin.endpoint).start()
    try:
        status, _, body = get(f"{node.url}/{key}")
        assert status == 200 and body == data
        assert node.metrics()["kvcdn_edge_verify_failures_total"] == 1
    finally:
        node.kill()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs: a disk that fills up after two cached objects."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_stops_caching_but_keeps_serving(origin, tiny_disk):
    node = EdgeProcess(origin.url, tiny_disk / "cache", origin.endpoint, "--max-bytes", "1G")
    node.start()
    try:
        for key, data in origin.objects.items():
            status, _, body = get(f"{node.url}/{key}")
            assert status == 200 and body == data
        deadline = time.monotonic() + 10  # the disk writes follow the answers
        while (m := node.metrics())["kvcdn_edge_cache_writes_total"] + m[
            "kvcdn_edge_cache_write_skips_total"
        ] < len(origin.objects):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        cached = m["kvcdn_edge_cache_objects"]
        assert m["kvcdn_edge_cache_write_skips_total"] >= 1
        assert 1 <= cached < len(origin.objects)  # the disk filled up
        for key, data in origin.objects.items():  # everything is still served
            status, _, body = get(f"{node.url}/{key}")
            assert status == 200 and body == data
        assert node.metrics()["kvcdn_edge_hits_total"] >= cached
        assert not [p for p in tiny_disk.rglob(".*") if p.is_file()]  # no partial files left
    finally:
        node.kill()


@contextlib.asynccontextmanager
async def _serving(node: Edge):
    """``node``'s app on a loopback port, in this process; yields its URL."""
    runner = web.AppRunner(node.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class _StalledOrigin:
    """An origin whose fetches wait until ``release`` is set, then find nothing."""

    url = "stalled://"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.fetching = 0  # fetches started

    async def fetch(self, key: str, max_bytes: int) -> bytes:
        self.fetching += 1
        await self.release.wait()
        raise OriginMissing(key)

    async def list(self, prefix: str) -> dict[str, int]:
        return {}

    async def close(self) -> None:
        pass


def _object_key(i: int) -> str:
    return object_key(f"{i:064x}", "fp16-0123456789ab", f"{i:064x}")


@contextlib.asynccontextmanager
async def _stalled_edge(tmp_path):
    """A served edge in front of a :class:`_StalledOrigin`: (origin, edge, URL, client)."""
    origin = _StalledOrigin()
    node = Edge(DiskCache(tmp_path / "cache", 1 << 30), [origin])
    async with _serving(node) as url, aiohttp.ClientSession() as client:
        yield origin, node, url, client


def test_the_pointer_cache_stays_bounded_over_many_document_names(tmp_path, monkeypatch):
    monkeypatch.setattr(fill, "MAX_POINTERS", 8)
    root = tmp_path / "origin"
    names = [f"doc{i}" for i in range(40)]
    for name in names:
        path = root / latest_key(name)
        path.parent.mkdir(parents=True)
        path.write_bytes(pointer_bytes(name, 1))

    async def main() -> None:
        node = Edge(DiskCache(tmp_path / "cache", 1 << 30), [open_origin(str(root))])
        async with _serving(node) as url, aiohttp.ClientSession() as client:
            for _ in range(2):  # the second round finds most names dropped: fetched again
                for name in names:
                    async with client.get(f"{url}/{latest_key(name)}") as resp:
                        assert resp.status == 200
                        assert await resp.read() == pointer_bytes(name, 1)
                    assert len(node.fill.pointers) <= 8
        assert len(node.fill.pointers) == 8
        assert node.metrics.misses == 2 * len(names)

    asyncio.run(main())


def test_pointers_are_held_up_to_a_total_weight_too():
    held: BoundedLRU[str, bytes] = BoundedLRU(10, 100, len)
    for i in range(5):
        held.put(f"k{i}", b"x" * 30)
    assert len(held) == 3 and held.weight == 90  # the two least recently used dropped
    assert held.get("k0") is None and held.get("k2") is not None
    held.put("k5", b"x" * 30)  # k3 is now the least recently used
    assert held.get("k3") is None and held.get("k2") is not None
    held.put("huge", b"x" * 101)  # heavier than the whole bound: not held at all
    assert held.get("huge") is None and len(held) == 3


def test_misses_beyond_the_fill_bound_are_refused_not_queued(tmp_path, monkeypatch):
    monkeypatch.setattr(fill, "MAX_FILLS", 3)

    async def main() -> None:
        async with _stalled_edge(tmp_path) as (origin, node, url, client):

            async def status(i: int) -> int:
                async with client.get(f"{url}/{_object_key(i)}") as resp:
                    return resp.status

            stalled = [asyncio.create_task(status(i)) for i in range(3)]
            while origin.fetching < 3:
                await asyncio.sleep(0.01)
            assert await status(3) == 503  # a fourth key: no room
            same = asyncio.create_task(status(0))  # a key under way is still shared
            while node.metrics.coalesced < 1:
                await asyncio.sleep(0.01)
            origin.release.set()
            assert await asyncio.gather(*stalled, same) == [404] * 4
            assert await status(3) == 404  # room again

    asyncio.run(main())


def test_running_warm_jobs_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(warm, "MAX_JOBS", 2)

    async def main() -> None:
        async with _stalled_edge(tmp_path) as (origin, node, url, client):

            async def post(i: int) -> int:
                async with client.post(f"{url}/warm", json={"keys": [_object_key(i)]}) as resp:
                    return resp.status

            assert [await post(0), await post(1), await post(2)] == [202, 202, 503]
            origin.release.set()
            assert node.admin.warmer is not None
            while any(j.finished is None for j in node.admin.warmer.jobs.values()):
                await asyncio.sleep(0.01)
            assert await post(2) == 202  # a finished job makes room
            assert len(node.admin.warmer.jobs) == 2

    asyncio.run(main())


def test_a_miss_past_the_spools_budget_is_refused_and_leaves_no_spool(tmp_path):
    """A piece-sized miss is written to its spool only by the verifier's thread, where
    the spools' budget is checked: past it, the miss is answered 502 and its spool
    removed; with room again the same key is served. The origin is a parent edge
    over HTTP (the path that holds a body's reads in memory until then)."""
    key, data = chunk_object(3, layers=2)  # half a MiB
    root = tmp_path / "origin"
    (root / key).parent.mkdir(parents=True)
    (root / key).write_bytes(data)

    async def main() -> None:
        parent = Edge(DiskCache(tmp_path / "parent", 1 << 30), [open_origin(str(root))])
        async with _serving(parent) as parent_url:
            cache = DiskCache(tmp_path / "cache", 1 << 30)
            cache.max_spool_bytes = len(data) - 1
            node = Edge(cache, [open_origin(parent_url)])
            async with _serving(node) as url, aiohttp.ClientSession() as client:
                async with client.get(f"{url}/{key}") as resp:
                    assert resp.status == 502
                    assert "misses being fetched hold" in await resp.text()
                assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
                assert cache.spooled_bytes == 0 and node.metrics.origin_fetches == 1
                cache.max_spool_bytes = len(data)
                async with client.get(f"{url}/{key}") as resp:
                    assert resp.status == 200 and await resp.read() == data
                assert len(cache) == 1 and cache.spooled_bytes == 0

    asyncio.run(main())


def test_the_disk_cache_index_is_bounded_in_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(edge_cache, "MAX_ENTRIES", 3)
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    for i in range(5):
        assert cache.store(f"k{i}", b"data", '"tag"')
    assert len(cache) == 3 and cache.evictions == 2
    assert cache.lookup("k0") is None and cache.lookup("k4") is not None
    assert len(DiskCache(tmp_path / "cache", 1 << 30)) == 3  # and so is what a start finds
