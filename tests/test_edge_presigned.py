"""The edge's presigned GETs (edge/presigned.py) against a real TCP server on
127.0.0.1 that answers with exactly the bytes each case gives: strict parsing of
what a store sends, bounds before a body byte is read, and connections kept only
after a whole answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvcdn.edge.origin_errors import OriginFailed, OriginMissing, Unexpected
from kvcdn.edge.presigned import MAX_HEAD, PresignedGets, parse_head

BODY = bytes(range(256)) * 1024  # 256 KiB
SIGNED = "?X-Amz-Signature=secret-signature"


class RawStore:
    """Answers each request on a connection with the next of ``answers`` (bytes, sent
    in pieces of ``piece`` bytes), then keeps the connection open unless told to
    close; counts connections and requests."""

    def __init__(self, answers: list[bytes], piece: int = 1 << 20, close: bool = False) -> None:
        self.answers = answers
        self.piece = piece
        self.close = close
        self.connections = 0
        self.ended = 0  # connections the client has closed (or the store)
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                answer = self.answers.pop(0)
                for at in range(0, len(answer), self.piece):
                    writer.write(answer[at : at + self.piece])
                    await writer.drain()
                if self.close:
                    return
            await reader.read()  # until the client goes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.ended += 1
            writer.close()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/bucket/key{SIGNED}"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


def collect(pieces: list[bytes]) -> Callable[[memoryview], None]:
    """A sink that keeps a copy of each read (the view is the connection's buffer)."""
    return lambda view: pieces.append(bytes(view))


def ok(body: bytes = BODY, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def run(answers: list[bytes], fetches: int = 1, limit: int = 1 << 30, **store: object
        ) -> tuple[list[bytes | Exception], RawStore]:  # fmt: skip
    """Fetch the store's URL ``fetches`` times in turn: each fetch's bytes or error."""
    raw = RawStore(answers, **store)  # type: ignore[arg-type]

    async def main() -> list[bytes | Exception]:
        gets, got = PresignedGets("s3://bucket", timeout_s=10), []
        async with raw as url:
            for _ in range(fetches):
                pieces: list[bytes] = []
                try:
                    await gets.fetch(url, "key", collect(pieces), limit)
                    got.append(b"".join(pieces))
                except Exception as exc:  # noqa: BLE001 (the case's outcome)
                    got.append(exc)
            await gets.close()
        return got

    return asyncio.run(main()), raw


def test_a_body_is_read_whole_and_the_connection_kept():
    got, raw = run([ok(), ok(b"second")], fetches=2)
    assert got == [BODY, b"second"]
    assert raw.connections == 1 and len(raw.requests) == 2
    request = raw.requests[0].decode()
    assert request.startswith(f"GET /bucket/key{SIGNED} HTTP/1.1\r\n")
    assert "Host: 127.0.0.1:" in request and "Accept-Encoding: identity" in request


def test_an_answer_arriving_a_byte_at_a_time_is_parsed_the_same():
    body = b"x" * 3000
    got, _ = run([ok(body, "ETag: \"e\"\r\n")], piece=1)
    assert got == [body]


def test_connection_close_and_http_1_0_are_not_reused():
    close = ok(b"one", "Connection: close\r\n")
    got, raw = run([close, ok(b"two")], fetches=2, close=True)
    assert got == [b"one", b"two"] and raw.connections == 2
    old = b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold"
    got, raw = run([old, ok(b"two")], fetches=2, close=True)
    assert got == [b"old", b"two"] and raw.connections == 2


def test_a_kept_connection_the_store_closed_is_dialled_again():
    got, raw = run([ok(b"one"), ok(b"two")], fetches=2, close=True)  # closed after each
    assert got == [b"one", b"two"] and raw.connections == 2


@pytest.mark.parametrize(
    ("answer", "error", "words"),
    [
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", OriginMissing, "key"),
        (b"HTTP/1.1 301 Moved\r\nLocation: http://x/\r\n\r\n", Unexpected, "answered 301"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
         Unexpected, "without a Content-Length"),
        (b"HTTP/1.1 200 OK\r\n\r\nbody", Unexpected, "without a Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
         OriginFailed, "two different Content-Lengths"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc", OriginFailed, "Content-Length"),
        (b"HTTP/1.1 200 OK\r\n Folded: yes\r\nContent-Length: 3\r\n\r\nabc",
         OriginFailed, "malformed header field"),
        (b"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc", OriginFailed, "closed the connection"),
        (b"ICY 200 OK\r\nContent-Length: 3\r\n\r\nabc", OriginFailed, "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 3\r\n\r\nabc",
         OriginFailed, "malformed header field"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", OriginFailed, "6 bytes of the body"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n", OriginFailed,
         "head of more than"),
    ],
)
def test_what_a_store_sends_is_parsed_strictly(answer, error, words):
    """Each answer fails as it should, its message naming the origin and never the
    signed URL's query."""
    got, _ = run([answer], close=b"Content-Length: 9" in answer or b"\n\n" in answer)
    assert isinstance(got[0], error), got[0]
    assert words in str(got[0]) and "secret-signature" not in str(got[0])


def test_a_field_with_a_long_run_of_spaces_parses_at_once():
    """A field's value is matched greedily and trimmed: a lazy match before optional
    whitespace took seconds on a 32 KiB run of spaces, the event loop stalled."""
    import time

    for value in (b"a" + b" " * 32_000 + b"b", b"a" + b" " * 32_000):
        start = time.perf_counter()
        answer = parse_head(b"HTTP/1.1 200 OK\r\nX: " + value + b"\r\nContent-Length: 1")
        assert time.perf_counter() - start < 0.5 and answer.length == 1


def test_bytes_past_an_answer_are_dropped_with_its_connection():
    """Bytes after a body's length, in the same read or queued after it, are no
    answer to anything: the body is the length's bytes (verified later, as always),
    and the connection is not used again, so a queued "answer" is never taken for the
    next GET's."""
    got, raw = run([ok(b"abc") + b"junk", ok(b"two")], fetches=2, close=True)
    assert got == [b"abc", b"two"] and raw.connections == 2
    # A store in a thread of its own (its bytes arrive while the client's loop is busy)
    import socket
    import threading
    import time

    evil = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nEVIL"
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []

    def store() -> None:
        listener.settimeout(10)
        for _ in range(2):
            with listener.accept()[0] as conn:
                connections.append(1)
                conn.recv(65536)  # the GET (one small packet)
                conn.sendall(ok(b"first"))
                time.sleep(0.01)
                conn.sendall(evil)  # before any second GET
                conn.settimeout(1)
                try:
                    if conn.recv(65536):
                        conn.sendall(ok(b"real second"))
                        conn.recv(1)
                except OSError:
                    pass

    thread = threading.Thread(target=store, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/bucket/key{SIGNED}"

    async def main() -> list[bytes]:
        gets, out = PresignedGets("s3://bucket", timeout_s=10), []
        for _ in range(2):
            pieces: list[bytes] = []
            await gets.fetch(url, "key", collect(pieces), 1 << 30)
            out.append(b"".join(pieces))
            time.sleep(0.1)  # the loop busy elsewhere: the queued bytes are not read yet
        await gets.close()
        return out

    assert asyncio.run(main()) == [b"first", b"first"]  # each on a connection of its own
    thread.join(5)
    listener.close()
    assert len(connections) == 2


def test_a_length_past_the_limit_is_refused_before_its_body():
    """The head alone says the body is too long: refused at once, though the store
    would go on sending."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n"
    got, _ = run([head + bytes(1 << 20)], limit=1 << 20)
    assert isinstance(got[0], OriginFailed) and "more than the object can be" in str(got[0])


def test_what_the_sink_refuses_stops_the_read():
    """A sink that raises (a full spool) ends the GET with the connection closed."""
    from kvcdn.edge.cache import SpoolFull

    raw = RawStore([ok(), ok(b"two")])

    async def main() -> tuple[Exception | None, bytes]:
        gets = PresignedGets("s3://bucket", timeout_s=10)
        async with raw as url:
            def full(view: memoryview) -> None:
                raise SpoolFull("no room")

            try:
                await gets.fetch(url, "key", full, 1 << 30)
                failed = None
            except OriginFailed as exc:
                failed = exc
            pieces: list[bytes] = []
            await gets.fetch(url, "key", collect(pieces), 1 << 30)
            await gets.close()
        return failed, b"".join(pieces)

    failed, second = asyncio.run(main())
    assert failed is not None and "no room" in str(failed)
    assert second == b"two" and raw.connections == 2


def _self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1, signed by its own key: (cert file, key file)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvcdn test store")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(
            "127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = folder / "store.pem", folder / "store.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return str(cert_file), str(key_file)


def test_https_stores_are_read_over_verified_tls(tmp_path, monkeypatch):
    """An https URL (AWS S3's) is read over TLS, the body whole through the same
    buffer, on a connection kept for the next GET; a certificate the machine does
    not trust is refused."""
    import ssl

    cert, key = _self_signed(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    raw = RawStore([ok(), ok(b"second")])

    async def fetch_twice() -> list[bytes | Exception]:
        server = await asyncio.start_server(raw._serve, "127.0.0.1", 0, ssl=server_side)
        port = server.sockets[0].getsockname()[1]
        url = f"https://127.0.0.1:{port}/bucket/key{SIGNED}"
        gets, got = PresignedGets("s3://bucket", timeout_s=10), []
        for _ in range(2):
            pieces: list[bytes] = []
            try:
                await gets.fetch(url, "key", collect(pieces), 1 << 30)
                got.append(b"".join(pieces))
            except OriginFailed as exc:
                got.append(exc)
        await gets.close()
        server.close()
        return got

    monkeypatch.setenv("SSL_CERT_FILE", cert)  # read when the client makes its context
    assert asyncio.run(fetch_twice()) == [BODY, b"second"]
    assert raw.connections == 1
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))
    refused = asyncio.run(fetch_twice())
    assert all(isinstance(e, OriginFailed) and "CERTIFICATE_VERIFY_FAILED" in str(e)
               for e in refused), refused  # fmt: skip


def test_concurrent_gets_share_one_buffer_and_get_their_own_bytes():
    """Eight GETs at once, their answers arriving interleaved in small pieces: every
    connection reads into the one buffer, and each body is whole and its own."""
    bodies = [bytes([i]) * 300_000 + bytes(range(i, 256)) for i in range(8)]
    raw = RawStore([ok(b) for b in bodies], piece=4096)

    async def main() -> list[bytes]:
        gets = PresignedGets("s3://bucket", timeout_s=30)
        async with raw as url:

            async def one() -> bytes:
                pieces: list[bytes] = []
                await gets.fetch(url, "key", collect(pieces), 1 << 30)
                return b"".join(pieces)

            got = await asyncio.gather(*(one() for _ in bodies))
            await gets.close()
        return list(got)

    assert sorted(asyncio.run(main())) == sorted(bodies)
    assert raw.connections == 8


def test_tls_connections_end_at_once_and_never_read_into_a_finished_get(tmp_path, monkeypatch):
    """Over TLS, a connection the edge ends is aborted: no wait for the store's
    close_notify (up to 30 s, a descriptor held for each miss a silent store answers
    with a 404), and nothing asyncio still decrypts while closing reaches a GET that
    has ended: a sink that refuses part way (records of 10,000 bytes, which do not
    divide the buffer) fails the GET with OriginFailed, not an assertion."""
    import os
    import ssl
    import time

    from kvcdn.edge.cache import SpoolFull

    cert, key = _self_signed(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    raw = RawStore([ok(bytes(4 << 20))], piece=10_000)

    # a store in a thread that answers and then reads nothing more: no close_notify
    # comes back for the edge's (asyncio's own TLS servers would send one)
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held_open: list[socket.socket] = []

    def answer(conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            pass

    def silent() -> None:
        listener.settimeout(10)
        for _ in range(10):
            try:
                conn = server_side.wrap_socket(listener.accept()[0], server_side=True)
            except OSError:
                return
            held_open.append(conn)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=silent, daemon=True).start()

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0

    async def main() -> tuple[Exception, list[Exception], int]:
        server = await asyncio.start_server(raw._serve, "127.0.0.1", 0, ssl=server_side)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/bucket/key{SIGNED}"
        quiet_url = f"https://127.0.0.1:{listener.getsockname()[1]}/b/k{SIGNED}"
        gets, reads = PresignedGets("s3://bucket", timeout_s=20), [0]

        def refusing(view: memoryview) -> None:
            reads[0] += 1
            time.sleep(0.005)  # a slow write: the socket fills meanwhile
            if reads[0] == 20:
                raise SpoolFull("no room")

        try:
            await gets.fetch(url, "key", refusing, 1 << 30)
        except Exception as exc:  # noqa: BLE001 (the case's outcome)
            refused = exc
        before, missing = open_fds(), []
        for _ in range(10):
            try:
                await gets.fetch(quiet_url, "key", collect([]), 1 << 30)
            except Exception as exc:  # noqa: BLE001
                missing.append(exc)
        await asyncio.sleep(0.5)
        held = open_fds() - before - len(held_open)  # less the store's own ends
        await gets.close()
        server.close()
        return refused, missing, held

    refused, missing, held = asyncio.run(main())
    assert isinstance(refused, OriginFailed) and "no room" in str(refused), repr(refused)
    assert len(missing) == 10 and all(isinstance(e, OriginMissing) for e in missing), missing
    assert held <= 1, f"{held} descriptors held past ten 404s: the edge's ends linger"
    for conn in held_open:
        conn.close()
    listener.close()
