"""The edge's hit path (kvcdn.edge.hits) against aiohttp's answers to the same bytes.

One real edge in this process serves its cache on two ports over real TCP: one
with the hit path, one without it (aiohttp answers everything). Raw sockets send
both the same bytes; their answers must be the same (but for ``Date``), and the
hit path's own answers (hits, and misses it filled) are counted, so each test
knows which path answered. Misses are compared across two such edges, each with
a cold cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from kvcdn.edge import hits, linger
from kvcdn.edge.cache import DiskCache
from kvcdn.edge.origin import open_origin
from kvcdn.edge.server import Edge, _LimitedSite
from tests.edge_helpers import chunk_object, large_chunk_object


@dataclass
class Served:
    edge: Edge
    hit_port: int  # the hit path first, aiohttp for the rest
    plain_port: int  # aiohttp alone
    answered: list[int]  # statuses the hit path answered itself
    filled: list[int | None]  # misses it filled: the status it answered (None: aiohttp's)


@contextlib.contextmanager
def serving(folder, cache_dir, *, token: str | None = None, idle_s: float = 15.0,
            origin: str | None = None) -> Iterator[Served]:  # fmt: skip
    """An edge over the store folder ``folder`` (or ``origin``) on two ports, on a loop
    in a thread."""
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()
    served: list[Served] = []

    async def main() -> None:
        edge = Edge(DiskCache(cache_dir, 1 << 30), [open_origin(origin or str(folder))], token)
        answered: list[int] = []
        filled: list[int | None] = []

        def counted(head: hits.Head) -> hits.Hit | None:
            hit = edge.hit(head)
            if hit is not None:
                answered.append(hit.reply.status)
            return hit

        def counted_miss(head: hits.Head) -> hits.Filling | None:
            filling = edge.miss(head)
            if filling is None:
                return None

            async def fill() -> hits.Hit | hits.Refusal | None:
                answer = await filling
                filled.append(None if answer is None else
                              answer.reply.status if isinstance(answer, hits.Hit)
                              else answer.status)  # fmt: skip
                return answer

            return fill()

        runner = web.AppRunner(edge.app(), handle_signals=False, access_log=None,
                               keepalive_timeout=idle_s)  # fmt: skip
        await runner.setup()
        # Port 0: the kernel's own choice, bound at once, with no gap between choosing
        # a port and binding it (in one CI run a "dead" origin's port answered and
        # never finished a fill, a 504 after the origin's 30 s, as it would had it
        # become this edge's own hit port).
        await _LimitedSite(runner, "127.0.0.1", 0, 1000, hit=counted,
                           miss=counted_miss).start()  # fmt: skip
        await _LimitedSite(runner, "127.0.0.1", 0, 1000).start()
        ports = [address[1] for address in runner.addresses]
        served.append(Served(edge, *ports, answered, filled))
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(20), "the edge did not start"
    try:
        yield served[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        loop.close()


def exchange(port: int, data: bytes | list[bytes], *, answers: int | None = 1,
             bodies: bool = True, quiet_s: float = 0.5, rcvbuf: int | None = None,
             wait_s: float = 0.0) -> bytes:  # fmt: skip
    """Send ``data`` (pieces sent one by one), then read ``answers`` whole responses (with
    bodies of their Content-Length unless not ``bodies``: HEAD) or, with None, until the
    server closes or is quiet for ``quiet_s``. ``wait_s`` of not reading first (with a
    small ``rcvbuf``: a slow reader)."""
    with socket.socket() as s:
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", port))
        got = bytearray()
        pieces = [data] if isinstance(data, bytes) else data
        for i, piece in enumerate(pieces):
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):  # the server closed first
                break
            if i + 1 < len(pieces):  # what came back so far: a reset would discard it
                time.sleep(0.05)
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError, ConnectionResetError):
                    while chunk := s.recv(1 << 20):
                        got += chunk
                s.setblocking(True)
        time.sleep(wait_s)
        s.settimeout(quiet_s if answers is None else 20)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while answers is None or _whole(got, bodies) < answers:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                got += chunk
        return bytes(got)


def _whole(raw: bytes, bodies: bool) -> int:
    """How many whole responses ``raw`` holds."""
    n, at = 0, 0
    while (end := raw.find(b"\r\n\r\n", at)) >= 0:
        length = re.search(rb"\r\nContent-Length: (\d+)", raw[at:end])
        status = int(raw[at + 9 : at + 12])
        size = int(length.group(1)) if length and bodies and status != 304 else 0
        if len(raw) < end + 4 + size:
            break
        n, at = n + 1, end + 4 + size
    return n


def same_answer(a: bytes, b: bytes) -> bool:
    date = re.compile(rb"\r\nDate: [^\r]*")
    return date.sub(b"", a) == date.sub(b"", b)


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in ``raw``, each (status, headers, body) by Content-Length."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        n = int(headers.get("Content-Length", 0))
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        raw = rest[n:]
    return out


def get(key: str, *extra: str, method: str = "GET") -> bytes:
    fields = "".join(f"{h}\r\n" for h in ("Host: 127.0.0.1", *extra))
    return f"{method} /{key} HTTP/1.1\r\n{fields}\r\n".encode()


@pytest.fixture
def store(tmp_path):
    """A store folder with two real chunk objects; their keys and bytes."""
    objects = dict(chunk_object(i) for i in (11, 12))
    for key, data in objects.items():
        (tmp_path / "store" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "store" / key).write_bytes(data)
    return tmp_path / "store", objects


def test_the_installed_aiohttp_has_what_the_hit_path_uses():
    # an aiohttp upgrade that drops them would silently send every hit through aiohttp
    loop = asyncio.new_event_loop()
    try:
        assert hits.supported(web.Server(lambda request: None, loop=loop))
    finally:
        loop.close()


def test_hits_are_answered_as_aiohttp_answers_them(store, tmp_path):
    folder, objects = store
    (key, data), (other, _) = objects.items()
    with serving(folder, tmp_path / "cache") as s:
        first = responses(exchange(s.hit_port, get(key)))  # a miss, filled by the hit path
        assert first[0][0] == 200 and first[0][2] == data and s.answered == []
        assert s.filled == [200]
        tag = first[0][1]["ETag"]
        cases = {  # request headers: the status the hit path answers, or None: aiohttp's
            (): 200,
            ("Range: bytes=0-99",): 206,
            ("Range: bytes=-100",): 206,
            ("Range: bytes=1000-",): 206,
            (f"Range: bytes=0-{len(data) + 5}",): 200,
            ("Range: bytes=0-1,5-9",): 200,  # several ranges: the whole object
            (f"If-None-Match: {tag}",): 304,
            ('If-None-Match: "other"',): 200,
            ('If-Range: "other"', "Range: bytes=0-9"): 200,
            (f"If-Range: {tag}", "Range: bytes=0-9"): 206,
            ("Connection: keep-alive", "Accept-Encoding: gzip"): 200,
            ('If-Match: "other"',): None,  # 412
            (f"Range: bytes={len(data)}-",): None,  # 416
            ("Content-Length: 0",): 200,
        }
        for extra, status in cases.items():
            for method in ("GET", "HEAD"):
                before = len(s.answered)
                request, bodies = get(key, *extra, method=method), method == "GET"
                fast = exchange(s.hit_port, request, bodies=bodies)
                plain = exchange(s.plain_port, request, bodies=bodies)
                assert same_answer(fast, plain), (extra, method, fast[:300], plain[:300])
                assert s.answered[before:] == ([status] if status else []), (extra, method)
        # the bytes themselves, and the counts /metrics gives
        status, headers, body = responses(exchange(s.hit_port, get(key, "Range: bytes=10-19")))[0]
        assert (status, body, headers["Content-Range"]) == (206, data[10:20],
                                                            f"bytes 10-19/{len(data)}")  # fmt: skip
        metrics = s.edge.metrics
        # every answer counted as a hit: the plain port's, and the 412s and 416s aiohttp
        # answered for the hit path's port
        assert metrics.hits == len(s.answered) + 2 * len(cases) + 2 * 2
        assert metrics.misses == 1
        # a key the edge has not cached is filled, and then a hit
        assert responses(exchange(s.hit_port, get(other)))[0][0] == 200
        before = len(s.answered)
        assert responses(exchange(s.hit_port, get(other)))[0][0] == 200
        assert s.answered[before:] == [200] and s.filled == [200, 200]


def test_pipelined_split_and_closing_requests(store, tmp_path):
    folder, objects = store
    (key, data), (other, data2) = objects.items()
    with serving(folder, tmp_path / "cache") as s:
        exchange(s.hit_port, get(key))  # cached
        # a hit, a miss (filled while the next head waits), a hit
        raw = exchange(s.hit_port, get(key) + get(other) + get(key), answers=3)
        assert [(st, body) for st, _, body in responses(raw)] == [(200, data), (200, data2),
                                                                  (200, data)]  # fmt: skip
        # a head arriving a few bytes at a time
        request = get(key, "Range: bytes=5-9")
        raw = exchange(s.hit_port, [request[i : i + 7] for i in range(0, len(request), 7)])
        assert [(st, body) for st, _, body in responses(raw)] == [(206, data[5:10])]
        # Connection: close ends the connection after the answer
        with socket.create_connection(("127.0.0.1", s.hit_port), timeout=5) as c:
            c.sendall(get(key, "Connection: close"))
            got = bytearray()
            while chunk := c.recv(1 << 20):  # returns b"" once the edge closes
                got += chunk
        (status, headers, body), = responses(bytes(got))
        assert status == 200 and body == data and headers["Connection"] == "close"


@pytest.mark.parametrize("name,request_bytes", [
    # a body that holds a request: only aiohttp reads it, as a body
    ("content-length", "GET /{k} HTTP/1.1\r\nHost: a\r\nContent-Length: {n}\r\n\r\n{inner}"),
    ("chunked", "GET /{k} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                "{n:x}\r\n{inner}\r\n0\r\n\r\n"),
    ("two lengths", "GET /{k} HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: {n}\r\n\r\n"
                    "{inner}"),
    ("length and chunked", "GET /{k} HTTP/1.1\r\nContent-Length: 5\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n{inner}"),
    ("space before colon", "GET /{k} HTTP/1.1\r\nContent-Length : {n}\r\n\r\n{inner}"),
    ("folded line", "GET /{k} HTTP/1.1\r\nX-A: b\r\n c\r\n\r\n{inner}"),
    ("bare LF", "GET /{k} HTTP/1.1\nHost: a\n\n{inner}"),
    ("bare LF alone", "GET /{k} HTTP/1.1\nHost: a\n\n"),
    ("LF in a field", "GET /{k} HTTP/1.1\r\nHost: a\nContent-Length: {n}\r\n\r\n{inner}"),
    # (kept alive: a close before the rest arrives would reset what the client had not read)
    ("HTTP/1.0", "GET /{k} HTTP/1.0\r\nConnection: keep-alive\r\n\r\n{inner}"),
    ("expect", "GET /{k} HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {n}\r\n\r\n"
               "{inner}"),
    ("encoded path", "GET /{k}%2e HTTP/1.1\r\n\r\n{inner}"),
    ("absolute form", "GET http://a/{k} HTTP/1.1\r\n\r\n{inner}"),
    ("NUL in a field", "GET /{k} HTTP/1.1\r\nX-A: \x00\r\n\r\n{inner}"),
    ("long field", "GET /{k} HTTP/1.1\r\nX-A: " + "a" * 9000 + "\r\n\r\n{inner}"),
])  # fmt: skip
def test_a_head_the_hit_path_is_unsure_of_is_aiohttp_s_for_good(store, tmp_path, name,
                                                                request_bytes):  # fmt: skip
    """No request smuggling between the two parsers: whatever the hit path does not take
    strictly, aiohttp parses, this request and every byte after it, whether they come
    at once or the head first and the rest later."""
    folder, objects = store
    (key, _), (other, _) = objects.items()
    inner = get(other).decode()
    raw = request_bytes.format(k=key, n=len(inner), inner=inner).encode("latin-1")
    with serving(folder, tmp_path / "cache") as s:
        for k in objects:  # both cached: any request the hit path took would be answered
            exchange(s.hit_port, get(k))
        cut = raw.find(b"\n\n") + 2 if b"\n\n" in raw else raw.find(b"\r\n\r\n") + 4
        for pieces in (raw, [raw[:cut], raw[cut:]]):
            fast = exchange(s.hit_port, pieces, answers=None)
            plain = exchange(s.plain_port, pieces, answers=None)
            assert same_answer(fast, plain), (fast[:400], plain[:400])
        assert s.answered == [], name


def test_a_slow_reader_gets_the_whole_object_then_its_next_answer(tmp_path):
    """A body larger than the socket takes is sent as the client reads (even past the
    idle timeout), and the request pipelined behind it waits for it."""
    key, data = large_chunk_object(8 << 20)
    small_key, small = chunk_object(13)
    for k, d in ((key, data), (small_key, small)):
        (tmp_path / "store" / k).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "store" / k).write_bytes(d)
    with serving(tmp_path / "store", tmp_path / "cache", idle_s=0.5) as s:
        for k in (key, small_key):
            exchange(s.hit_port, get(k))
        raw = exchange(s.hit_port, get(key) + get(small_key), answers=2, rcvbuf=4096, wait_s=1.5)
        got = responses(raw)
        assert [(st, len(b)) for st, _, b in got] == [(200, len(data)), (200, len(small))]
        assert hashlib.sha256(got[0][2]).digest() == hashlib.sha256(data).digest()
        assert got[1][2] == small and s.answered == [200, 200]
        # an idle connection is still closed after the idle timeout
        with socket.create_connection(("127.0.0.1", s.hit_port), timeout=5) as c:
            c.sendall(get(small_key))
            time.sleep(1.5)
            c.settimeout(5)
            got = bytearray()
            while chunk := c.recv(1 << 20):
                got += chunk
            assert responses(bytes(got))[0][2] == small  # answered, then closed


def test_the_hit_path_keeps_the_edge_s_access_rules_and_checks(store, tmp_path):
    folder, objects = store
    key, data = next(iter(objects.items()))
    with serving(folder, tmp_path / "cache", token="s3cret") as s:
        good = "Authorization: Bearer s3cret"
        assert responses(exchange(s.hit_port, get(key, good)))[0][2] == data  # cached
        for extra in ((), ("Authorization: Bearer wrong",), ("Authorization: s3cret",)):
            fast, plain = exchange(s.hit_port, get(key, *extra)), exchange(s.plain_port,
                                                                           get(key, *extra))
            assert responses(fast)[0][0] == 401 and same_answer(fast, plain)
        assert s.answered == []
        assert responses(exchange(s.hit_port, get(key, good)))[0][2] == data
        assert s.answered == [200]
        # a cached file changed on disk is not sent as it is: the fill verifies it,
        # drops it and fetches the object again
        path = next(p for p in (tmp_path / "cache" / "objects").glob("*/*")
                    if p.suffix != ".meta")  # fmt: skip
        damaged = bytearray(path.read_bytes())
        damaged[-1] ^= 0xFF
        path.write_bytes(bytes(damaged))
        assert responses(exchange(s.hit_port, get(key, good)))[0][2] == data
        assert s.answered == [200] and s.edge.metrics.verify_failures == 1  # detected
        assert s.edge.metrics.misses == 2  # damaged, so fetched again
        assert responses(exchange(s.hit_port, get(key, good)))[0][2] == data
        assert s.answered == [200, 200]


def test_misses_are_filled_and_answered_as_aiohttp_answers_them(tmp_path):
    """Each request for an uncached object, sent to two edges with cold caches (one
    with the hit path, one without), gets the same answer, the same counts in
    /metrics, and one origin read each."""
    folder = tmp_path / "store"
    seeds = iter(range(100, 200))
    tag_of = {}

    def new_object() -> str:
        key, data = chunk_object(next(seeds), layers=1)
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(data)
        tag_of[key] = '"' + hashlib.sha256(data).hexdigest()[:32] + '"'
        return key

    new_object()
    cases = [  # request headers (the key's own ETag as {tag}): the status the fill answers
        ((), 200),
        (("Range: bytes=0-99",), 206),
        (("If-None-Match: {tag}",), 304),
        (('If-None-Match: "other"',), 200),
        (('If-Match: "other"',), 412),
        (("Range: bytes=999999999-",), 416),
    ]
    with serving(folder, tmp_path / "fast") as a, serving(folder, tmp_path / "plain") as b:
        for extra, status in cases:
            for method in ("GET", "HEAD"):
                key = new_object()
                fields = [e.format(tag=tag_of[key]) for e in extra]
                request, bodies = get(key, *fields, method=method), method == "GET"
                before = len(a.filled)
                fast = exchange(a.hit_port, request, bodies=bodies)
                plain = exchange(b.plain_port, request, bodies=bodies)
                assert same_answer(fast, plain), (extra, method, fast[:300], plain[:300])
                assert a.filled[before:] == [status], (extra, method)
        # a key the origin does not have: the same 404, from the hit path
        missing, _ = chunk_object(7, layers=1)  # never written to the store
        for method in ("GET", "HEAD"):
            request = get(missing, method=method)
            fast = exchange(a.hit_port, request, bodies=method == "GET")
            plain = exchange(b.plain_port, request, bodies=method == "GET")
            assert responses(fast)[0][0] == 404 and same_answer(fast, plain), (fast, plain)
        assert a.filled[-2:] == [404, 404]
        assert a.answered == [] and b.answered == []
        # the two edges counted alike
        for name in ("requests", "hits", "misses", "bytes_served", "origin_fetches",
                     "origin_errors", "verify_failures"):  # fmt: skip
            assert getattr(a.edge.metrics, name) == getattr(b.edge.metrics, name), name
        assert a.edge.metrics.origin_fetches == 2 * len(cases) + 2


def test_a_fill_that_fails_is_answered_as_aiohttp_answers_it(tmp_path):
    """An origin that cannot be reached: the hit path's 502 is aiohttp's, and the
    connection serves its next request."""
    key, _ = chunk_object(21, layers=1)
    (tmp_path / "store").mkdir()
    # A socket bound and never listening: connecting to it is refused, and no other
    # server (nor this edge) can take its port while the test holds it.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{held.getsockname()[1]}"
        with serving(tmp_path / "store", tmp_path / "cache", origin=dead) as s:
            fast = exchange(s.hit_port, get(key) + get(key), answers=2)
            plain = exchange(s.plain_port, get(key) + get(key), answers=2)
            assert same_answer(fast, plain), (fast, plain)
            assert [st for st, _, _ in responses(fast)] == [502, 502]
            assert s.filled == [502, 502]


def test_misses_pipelined_and_at_once(tmp_path):
    """On one connection, misses and hits are answered in order, each fill holding the
    requests behind it; on many connections at once, one key is read from the origin
    once; a client that goes away while its miss is filled leaves the edge serving."""
    folder = tmp_path / "store"
    objects = dict(chunk_object(seed, layers=2) for seed in (31, 32, 33))
    for key, data in objects.items():
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(data)
    (k1, d1), (k2, d2), (k3, d3) = objects.items()
    with serving(folder, tmp_path / "cache") as s:
        raw = exchange(s.hit_port, get(k1) + get(k1, "Range: bytes=3-7") + get(k2)
                       + get(k1, "Connection: close"), answers=None)  # fmt: skip
        got = [(st, body) for st, _, body in responses(raw)]
        assert got == [(200, d1), (206, d1[3:8]), (200, d2), (200, d1)]
        assert s.filled == [200, 200] and s.answered == [206, 200]
        # a client gone before its fill ends: the fill still caches the object
        with socket.create_connection(("127.0.0.1", s.hit_port), timeout=5) as c:
            c.sendall(get(k3))
        deadline = time.monotonic() + 10
        while s.edge.cache.lookup(k3) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert responses(exchange(s.hit_port, get(k3)))[0][2] == d3
        # eight connections at once, one new key: one origin read
        key, data = chunk_object(34, layers=4)
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(data)
        before = s.edge.metrics.origin_fetches
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda: results.append(exchange(s.hit_port, get(key))))
                   for _ in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [responses(r)[0][2] == data for r in results] == [True] * 8
        assert s.edge.metrics.origin_fetches - before == 1


def _slow_fills(edge: Edge, delay_s: float) -> None:
    """Every fill of ``edge`` waits ``delay_s`` first (a slow origin)."""
    real = edge.fill.object

    async def slow(key, info):  # type: ignore[no-untyped-def]
        await asyncio.sleep(delay_s)
        return await real(key, info)

    edge.fill.object = slow  # type: ignore[method-assign]


def test_a_fill_that_fails_unexpectedly_is_aiohttp_s_to_answer(store, tmp_path):
    """A fill that raises (a bug, no descriptor left) leaves the request to aiohttp, which
    answers it as it answers its own handlers' failures; nothing answers out of turn."""
    folder, objects = store
    (key, _), (other, _) = objects.items()
    with serving(folder, tmp_path / "cache") as s:
        real = s.edge.fill.object

        async def failing(k, info):  # type: ignore[no-untyped-def]
            if k == key:
                raise RuntimeError("no descriptor left")
            return await real(k, info)

        s.edge.fill.object = failing  # type: ignore[method-assign]
        fast = exchange(s.hit_port, get(key) + get(other), answers=None)
        plain = exchange(s.plain_port, get(key) + get(other), answers=None)
        assert same_answer(fast, plain), (fast[:300], plain[:300])
        assert [st for st, _, _ in responses(fast)] == [500]  # and the connection closed
        assert s.filled == []


def test_a_client_sending_ahead_of_a_fill_is_not_read_past_a_bound(store, tmp_path):
    """While a miss is filled, what the client sends beyond MAX_PENDING bytes is left in
    the socket (TCP holds the client back), not held in the edge's memory."""
    import gc

    folder, objects = store
    key, data = next(iter(objects.items()))
    with serving(folder, tmp_path / "cache") as s:
        _slow_fills(s.edge, 6.0)
        with socket.create_connection(("127.0.0.1", s.hit_port), timeout=10) as c:
            c.sendall(get(key))
            def send_ahead() -> None:
                with contextlib.suppress(OSError):
                    c.sendall(b"A" * (64 << 20))

            flood = threading.Thread(target=send_ahead, daemon=True)
            flood.start()
            time.sleep(1.0)  # the fill still runs; the client is blocked in sendall
            assert flood.is_alive()  # (before gc's walk, which takes seconds in a big suite)
            held = [len(h._pending) for h in gc.get_objects() if isinstance(h, hits.HitHandler)]
            assert held and max(held) <= hits.MAX_PENDING + (256 << 10), held
            c.settimeout(10)
            got = bytearray()
            with contextlib.suppress(OSError):
                while _whole(bytes(got), True) < 1 and (chunk := c.recv(1 << 20)):
                    got += chunk
            assert responses(bytes(got))[0][2] == data  # then aiohttp has the junk


def test_an_answer_is_whole_when_its_connection_is_closed_with_bytes_unread(store, tmp_path):
    """A client pipelines junk behind a hit and reads slowly: aiohttp answers the junk 400
    and closes with the client's bytes unread, which would reset the connection and drop
    what the hit's answer still had queued. The connection lingers instead: the answer,
    then the 400, then the end."""
    folder, objects = store
    key, data = next(iter(objects.items()))
    with serving(folder, tmp_path / "cache") as s:
        assert responses(exchange(s.hit_port, get(key)))[0][2] == data  # cached: a hit now
        junk = b"\x00" * (2 << 20)  # more than the socket buffers hold unread
        got = exchange(s.hit_port, get(key) + junk, answers=None, rcvbuf=32 << 10, wait_s=1.0)
        answers = responses(got)
        assert [status for status, _, _ in answers] == [200, 400]
        assert answers[0][2] == data
        deadline = time.monotonic() + 5
        while linger.lingering() and time.monotonic() < deadline:  # the client closed
            time.sleep(0.05)
        assert linger.lingering() == 0


def test_a_lingering_connection_is_closed_after_its_time_whatever_the_client_sends(
        store, tmp_path, monkeypatch):  # fmt: skip
    """A client that never stops sending holds a lingering connection LINGER_S at most,
    and is read a bounded amount a turn (the edge answers others meanwhile)."""
    monkeypatch.setattr(linger, "LINGER_S", 1.0)
    folder, objects = store
    (key, data), (other, other_data) = objects.items()
    with serving(folder, tmp_path / "cache") as s:
        with socket.create_connection(("127.0.0.1", s.hit_port), timeout=10) as c:
            c.sendall(get(key) + b"\x00" * (1 << 20))
            ended = threading.Event()

            def flood() -> None:
                with contextlib.suppress(OSError):
                    while True:
                        c.sendall(b"\x00" * (1 << 20))
                ended.set()

            threading.Thread(target=flood, daemon=True).start()
            time.sleep(0.3)
            assert linger.lingering() == 1
            # the loop serves others while the flood is read and discarded
            assert responses(exchange(s.hit_port, get(other)))[0][2] == other_data
            assert ended.wait(5), "the lingering connection was not closed"
            assert linger.lingering() == 0


def test_a_shutdown_during_a_fill_sends_the_whole_body(tmp_path):
    """The edge stops while a miss is filled for a slow reader: the answer that goes out
    once the fill ends is whole, as aiohttp's is."""
    key, data = large_chunk_object(16 << 20)
    (tmp_path / "store" / key).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "store" / key).write_bytes(data)
    got: list[bytes] = []

    def slow_reader(port: int) -> None:
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(("127.0.0.1", port))
            c.sendall(get(key))
            time.sleep(2.0)  # the fill is done and the shutdown under way
            c.settimeout(20)
            raw = bytearray()
            with contextlib.suppress(OSError):
                while chunk := c.recv(1 << 16):
                    raw += chunk
            got.append(bytes(raw))

    with serving(tmp_path / "store", tmp_path / "cache") as s:
        _slow_fills(s.edge, 1.0)
        reader = threading.Thread(target=slow_reader, args=(s.hit_port,))
        reader.start()
        time.sleep(0.4)  # the fill runs: the edge is told to stop now
    reader.join(60)
    (status, _, body), = responses(got[0])
    assert status == 200 and len(body) == len(data) and body == data
    assert s.filled == [200]
