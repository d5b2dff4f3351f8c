"""An edge's resources stay bounded whatever its clients and origins do: memory under an
origin that sends endless bodies and under floods of admin bodies, descriptors under
half-open connections, the log under malformed requests. Real edge processes, a real
hostile origin process, raw sockets."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.edge_helpers import EdgeProcess, Hostile, chunk_object, get, post_json

MiB = 1 << 20


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _log(edge: EdgeProcess) -> str:
    edge.log.seek(0)
    return edge.log.read().decode(errors="replace")


@pytest.fixture
def origin_folder(tmp_path) -> tuple[Path, str]:
    """A store folder holding one real chunk object; its key."""
    key, data = chunk_object(7)
    path = tmp_path / "origin" / key
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return tmp_path / "origin", key


def test_an_origin_sending_endless_bodies_costs_the_edge_little_memory(origin_folder, tmp_path):
    """Six misses at once, each answered by an endless chunked body: each is refused
    (502) and the edge's memory grows by a few MiB per miss at most, and less after."""
    folder, key = origin_folder
    hostile = Hostile(folder, mode="endless")
    edge = EdgeProcess(hostile.url, tmp_path / "cache", None, "--max-bytes", "512M").start()
    try:
        get(f"{edge.url}/healthz")
        before = _status_kib(edge.proc.pid, "VmRSS")
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: get(f"{edge.url}/{key}"), range(6)))
        assert [status for status, _, _ in answers] == [502] * 6
        peak = _status_kib(edge.proc.pid, "VmHWM")
        after = _status_kib(edge.proc.pid, "VmRSS")
        print(f"edge RSS {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB, "
              f"{after / 1024:.0f} MiB after six endless misses")  # fmt: skip
        # before spooling to disk, two such misses took the edge to 2.1 GB
        assert peak - before < 6 * 8 * 1024  # KiB: under 8 MiB per miss
        assert after - before < 32 * 1024
        assert not [p for p in (tmp_path / "cache").rglob(".*") if p.is_file()]  # no spool left
        assert edge.metrics()["kvcdn_edge_cache_objects"] == 0  # nothing cached
    finally:
        edge.kill()
        hostile.stop()


def test_warm_bodies_are_capped_and_admin_requests_bounded(origin_folder, tmp_path):
    folder, key = origin_folder
    edge = EdgeProcess(str(folder), tmp_path / "cache", None).start()
    try:
        before = _status_kib(edge.proc.pid, "VmRSS")
        # a declared body over the cap is refused before it is read (413) ...
        big = post_json(f"{edge.url}/warm", {"keys": [key] * 20_000})
        assert big[0] == 413
        # ... and so is one that streams past it without a declared length; a hundred at
        # once (15 MiB each): at most four are read at a time, the others answered 503
        def chunked_body() -> int:
            with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as s:
                s.sendall(b"POST /warm HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
                piece = b"%x\r\n%s\r\n" % (MiB, b" " * MiB)
                try:
                    for _ in range(15):
                        s.sendall(piece)
                    s.sendall(b"0\r\n\r\n")
                except OSError:
                    pass  # the edge answered and closed first
                return int(s.recv(64).split()[1])

        with ThreadPoolExecutor(100) as pool:
            statuses = list(pool.map(lambda _: chunked_body(), range(100)))
        assert set(statuses) <= {413, 503} and 413 in statuses
        peak = _status_kib(edge.proc.pid, "VmHWM")
        print(f"edge RSS {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB after 100 "
              "concurrent 15 MiB warm bodies")  # fmt: skip
        assert peak - before < 64 * 1024  # KiB; it was 2.4 GB before the cap
        # a real warm request still works
        status, job = post_json(f"{edge.url}/warm", {"keys": [key]})
        assert status == 202 and job["total"] == 1
    finally:
        edge.kill()


def test_admin_endpoints_need_a_token_beyond_loopback(origin_folder, tmp_path):
    folder, key = origin_folder
    port = free_port()
    edge = EdgeProcess(str(folder), tmp_path / "cache", None, port=port)
    edge.args[edge.args.index(f"127.0.0.1:{port}")] = f"0.0.0.0:{port}"
    edge.start()
    try:
        status, text = post_json(f"{edge.url}/warm", {"keys": [key]})
        assert status == 403 and "--admin-token-file" in text
        assert get(f"{edge.url}/{key}")[0] == 200  # reading stays open
        assert "are refused (403)" in _log(edge)  # said at start
    finally:
        edge.kill()
    token = tmp_path / "admin.token"
    token.write_text("s3cret\n")
    edge = EdgeProcess(str(folder), tmp_path / "cache", None, "--admin-token-file", str(token),
                       port=port)  # fmt: skip
    edge.args[edge.args.index(f"127.0.0.1:{port}")] = f"0.0.0.0:{port}"
    edge.start()
    try:
        assert post_json(f"{edge.url}/warm", {"keys": [key]})[0] == 401
        headers = {"Authorization": "Bearer s3cret"}
        assert post_json(f"{edge.url}/warm", {"keys": [key]}, headers)[0] == 202
    finally:
        edge.kill()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(request)
            return s.recv(200)
        except OSError:
            return b""


def test_malformed_requests_cost_one_short_log_line_each_at_most(origin_folder, tmp_path):
    folder, key = origin_folder
    edge = EdgeProcess(str(folder), tmp_path / "cache", None).start()
    try:
        bad = [
            b"GET /x HTTP/1.1\r\nHost: e\r\nX-Bad: a\rb\r\n\r\n",  # a bare CR in a header
            b"GET /x HTTP/1.1\r\nHost: e\r\nRange: bytes=" + b"1" * 9000 + b"\r\n\r\n",
            b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: e\r\n\r\n",
            b"GET /x HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(5000)) + b"\r\n",
        ]
        for request in bad:
            assert _raw(edge.port, request).startswith((b"HTTP/1.1 4", b""))
        # a client that hangs up in the middle of a warm request's body
        with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as s:
            s.sendall(b"POST /warm HTTP/1.1\r\nHost: e\r\nContent-Length: 5000\r\n\r\n{\"ke")
        # a flood: 200 more malformed requests
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: _raw(edge.port, bad[0]), range(200)))
        assert get(f"{edge.url}/{key}")[0] == 200  # still serving
        time.sleep(0.5)
        log = _log(edge)
        assert "Traceback" not in log, log[-3000:]
        lines = [line for line in log.splitlines() if "bad request" in line]
        print(f"{len(lines)} log lines for 205 malformed requests")
        assert 4 <= len(lines) <= 20 + 1  # one per request, at most 20 a minute
        assert all(len(line) < 300 for line in lines)
    finally:
        edge.kill()


def test_half_open_connections_are_closed_and_bounded(origin_folder, tmp_path):
    """Silent connections, and ones that send half a request, are closed after the idle
    timeout; beyond --max-connections new ones are answered 503 at once."""
    folder, key = origin_folder
    edge = EdgeProcess(str(folder), tmp_path / "cache", None, "--idle-timeout", "2",
                       "--max-connections", "300").start()  # fmt: skip
    held: list[socket.socket] = []
    try:
        idle_fds = _open_fds(edge.proc.pid)
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
            if i % 2:
                s.sendall(b"GET /slowloris HTTP/1.1\r\nHost: e\r\n")  # never finished
            held.append(s)
        time.sleep(0.5)
        assert _open_fds(edge.proc.pid) >= idle_fds + 250  # the edge holds them now
        # the next one is over the limit: told so and closed
        assert _raw(edge.port, b"GET /healthz HTTP/1.1\r\nHost: e\r\n\r\n").startswith(
            b"HTTP/1.1 503"
        )
        time.sleep(3.0)  # the idle timeout passes
        assert _open_fds(edge.proc.pid) <= idle_fds + 5
        assert all(s.recv(1) == b"" for s in held)  # closed by the edge
        assert get(f"{edge.url}/{key}")[0] == 200
    finally:
        for s in held:
            s.close()
        edge.kill()


def test_a_keep_alive_client_is_served_across_the_idle_timeout(origin_folder, tmp_path):
    """The SDK's pooled connections: closed by the edge when idle, reopened by the client."""
    from kvcdn.sdk.edges import EdgeStore

    folder, key = origin_folder
    edge = EdgeProcess(str(folder), tmp_path / "cache", None, "--idle-timeout", "1").start()
    try:
        reader = EdgeStore([edge.url])
        first = reader.fetch(key).data
        time.sleep(1.5)
        assert reader.fetch(key).data == first
        assert reader.fetch(key).source == edge.url
    finally:
        edge.kill()


def test_an_object_larger_than_the_cache_is_served_uncached(origin_folder, tmp_path):
    folder, key = origin_folder
    data = (folder / key).read_bytes()  # about 1 MiB
    edge = EdgeProcess(str(folder), tmp_path / "cache", None, "--max-bytes", "256K").start()
    try:
        for _ in range(2):
            status, _, body = get(f"{edge.url}/{key}")
            assert status == 200 and body == data
        assert edge.metrics()["kvcdn_edge_cache_objects"] == 0
        assert not [p for p in (tmp_path / "cache").rglob(".*") if p.is_file()]
    finally:
        edge.kill()


def test_a_burst_of_connections_stays_within_the_limit(origin_folder, tmp_path):
    folder, _ = origin_folder
    edge = EdgeProcess(str(folder), tmp_path / "cache", None, "--max-connections", "20").start()
    held: list[socket.socket] = []
    try:
        idle_fds = _open_fds(edge.proc.pid)
        with ThreadPoolExecutor(50) as pool:  # all at once: accepted in one loop pass
            held = list(pool.map(lambda _: socket.create_connection(("127.0.0.1", edge.port)),
                                 range(100)))  # fmt: skip
        time.sleep(0.5)
        print(f"{_open_fds(edge.proc.pid) - idle_fds} connections held of 100 opened at once")
        assert _open_fds(edge.proc.pid) <= idle_fds + 20
    finally:
        for s in held:
            s.close()
        edge.kill()
