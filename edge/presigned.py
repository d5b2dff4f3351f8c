"""Presigned GETs of an object store, read straight into spools.

A miss from an S3 origin is one GET of a query-signed URL whose answer, for an
object that exists, is a 200 with a ``Content-Length``: S3, MinIO, Ceph RGW and R2
all send one for GetObject. aiohttp's client cost each such GET its request
machinery and two copies of every body byte in user space (each read into a new
``bytes``, then its parser's slice of it), where the edge needs none.
:class:`PresignedGets` reads every answer into one buffer, reused for every read,
and hands each read to the spool, which hashes it and writes it to the page cache
from there: 0.80x aiohttp's user CPU a 1 MiB GET from moto, 0.83-0.91x its CPU in
all (``bench/edge_origin.py``).

It takes only the answer it can take whole and bounded, and parses it strictly:

* a status line ``HTTP/1.x NNN``, then fields of a token name and a value
  without control bytes, each ended by CRLF, the head at most :data:`MAX_HEAD`;
* for a 200: one ``Content-Length`` (repeated only with the same value), no
  ``Transfer-Encoding``, and at most the spool's limit, refused before a body
  byte is read; then exactly that many bytes (fewer fail the GET; bytes past them
  are no answer to anything, and the connection goes with them).

Anything else is not read: a 404 is :class:`~.origin.OriginMissing`, any other
status (a redirect is never followed) or a 200 without a length is
:class:`~.origin.Unexpected`, which the store origin answers by reading the
object through the store's own client. A connection is reused (HTTP/1.1, no
``Connection: close``) only after a whole answer with nothing after it, and only if
nothing (bytes or its end) has come on it since; one the store closed while it sat
idle is dialled again once, before anything of the answer came. A connection the
edge ends is aborted, not closed: TLS's close would wait for the store's
close_notify, up to 30 s a miss.
"""

from __future__ import annotations

import asyncio
import re
import select
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from .cache import SpoolFull
from .origin_errors import OriginFailed, OriginMissing, Unexpected

#: The most bytes of an answer's status line and fields (S3's are under 2 KiB).
MAX_HEAD = 32 << 10
#: Bytes read from a socket at a time, into one buffer all connections reuse.
READ_BUFFER = 256 << 10
#: Idle connections kept per store host, and for how long (S3 closes its own after
#: about 20 s idle; a connection it closed meanwhile is dialled again).
IDLE_PER_HOST = 64
IDLE_FOR_S = 15.0
RESOLVED_FOR_S = 10.0  # a store host's addresses are looked up again after this

_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
# The value is taken greedily and trimmed after: a lazy value before optional
# whitespace backtracks, quadratic in a run of spaces (a 32 KiB head: seconds).
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)")
_URL_BYTES = re.compile(r"[\x21-\x7e]+")  # no space or control byte can reach a request


class _Answer:
    """What :class:`_Connection` parsed of one answer's head."""

    def __init__(self, status: int, length: int | None, reusable: bool) -> None:
        self.status = status
        self.length = length
        self.reusable = reusable


def parse_head(head: bytes) -> _Answer:
    """An answer's head (without its final CRLF CRLF), parsed strictly; ValueError
    when it is not well-formed."""
    status_line, *lines = head.split(b"\r\n")
    status = _STATUS.fullmatch(status_line)
    if status is None:
        raise ValueError("a malformed status line")
    minor, code = status.groups()
    length: int | None = None
    chunked = close = False
    for line in lines:
        field = _FIELD.fullmatch(line)
        if field is None:
            raise ValueError("a malformed header field")
        name, value = field.group(1).lower(), field.group(2).rstrip(b" \t")
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:
                raise ValueError("a malformed Content-Length")
            if length is not None and int(value) != length:
                raise ValueError("two different Content-Lengths")
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"connection":
            close |= b"close" in value.lower()
    if chunked:  # a length that a transfer coding overrides is no length
        length = None
    return _Answer(int(code), length, reusable=minor == b"1" and not close)


class _Connection(asyncio.BufferedProtocol):
    """One connection to the store: one GET at a time, its answer read into
    ``buffer`` and each read of its body handed to the current sink.

    The buffer is shared by every connection of one event loop: asyncio fills it
    (``get_buffer``, then ``recv_into``) and calls :meth:`buffer_updated` at once,
    which hands the read to the sink (written and hashed, nothing of it kept) or
    copies a head's start before it returns, so no read outlives the next one.
    Memory is one buffer, however many misses are under way."""

    def __init__(self, key: tuple[str, str, int], buffer: bytearray) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buffer = buffer
        self._view = memoryview(buffer)
        self._head = bytearray()
        self._answer: _Answer | None = None
        self._left = 0  # body bytes still to come
        self._limit = 0
        self._sink: Callable[[memoryview], None] | None = None
        self._done: asyncio.Future[_Answer] | None = None
        self.received = 0  # bytes of the current answer so far

    # ---- asyncio's side ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:  # what a closing transport still hands over (TLS does)
            return
        if self._done is None or self._done.done():
            self._fail(OriginFailed("the store sent bytes nobody asked for"))
            return
        self.received += nbytes
        data = self._view[:nbytes]
        try:
            if self._answer is None:
                data = self._take_head(data)
                if data is None:
                    return
            self._take_body(data)
        except Exception as exc:  # a malformed head, a refused length, a full spool
            self._fail(exc)

    def eof_received(self) -> bool | None:
        self._lost("closed the connection")
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost(f"dropped the connection ({exc})" if exc else "closed the connection")

    # ---- one GET ------------------------------------------------------------------------

    def get(self, request: bytes, limit: int, sink: Callable[[memoryview], None]
            ) -> asyncio.Future[_Answer]:  # fmt: skip
        """Send ``request``; the future is the answer, once its head (anything but a
        200) or its whole body (a 200, each read given to ``sink``) has come."""
        assert self.transport is not None and not self.closed
        self._head.clear()
        self._answer, self._left, self._limit, self._sink = None, 0, limit, sink
        self.received = 0
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._done

    def _take_head(self, data: memoryview) -> memoryview | None:
        """Gather the head; once whole, parse it and return what came after it (a view
        of this read: a head that came in one read is never copied whole)."""
        before = len(self._head)  # bytes of the head that came in earlier reads
        if before:
            self._head += data[: MAX_HEAD + 4]
            end = self._head.find(b"\r\n\r\n", max(0, before - 3))
            if end >= 0:
                head, data = bytes(self._head[:end]), data[end + 4 - before :]
        else:
            end = self._buffer.find(b"\r\n\r\n", 0, min(len(data), MAX_HEAD + 4))
            if end >= 0:
                head, data = bytes(data[:end]), data[end + 4 :]
            else:
                self._head += data[: MAX_HEAD + 4]
        if end < 0 and len(self._head) <= MAX_HEAD:
            return None
        if end < 0 or end > MAX_HEAD:
            raise OriginFailed(f"the store sent a head of more than {MAX_HEAD} bytes")
        self._head.clear()
        try:
            answer = parse_head(head)
        except ValueError as exc:
            raise OriginFailed(f"the store sent {exc}") from None
        self._answer = answer
        if answer.status != 200:
            self._settle(answer, reuse=False)  # its body is not read: the connection goes
            return None
        if answer.length is None:
            raise Unexpected("the store answered 200 without a Content-Length", 200)
        if answer.length > self._limit:
            raise OriginFailed(
                f"the store announced {answer.length} bytes, more than the object can be"
            )
        self._left = answer.length
        return data

    def _take_body(self, data: memoryview) -> None:
        """The body's bytes go to the sink; past its length, nothing more is read and the
        connection is not reused (what follows is no answer to anything)."""
        extra = len(data) > self._left
        if extra:
            data = data[: self._left]
        if data:
            assert self._sink is not None
            self._sink(data)
            self._left -= len(data)
        if self._left == 0:
            assert self._answer is not None
            self._settle(self._answer, reuse=self._answer.reusable and not extra)

    def _settle(self, answer: _Answer, *, reuse: bool) -> None:
        assert self._done is not None
        self._sink = None
        self._done.set_result(answer)
        if not reuse:
            self.close()

    def _fail(self, exc: BaseException) -> None:
        self._sink = None
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        self.close()

    def _lost(self, how: str) -> None:
        self.closed = True
        if self._done is not None and not self._done.done():
            left = f", {self._left} bytes of the body short" if self._answer else ""
            self._fail(_Closed(f"the store {how}{left}", before_answer=self.received == 0))

    def quiet(self) -> bool:
        """Whether nothing came since the last answer, not even the end: bytes a store
        sent after an answer (queued before this connection's next GET is written)
        would otherwise be read as that GET's answer."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        sock = self.transport.get_extra_info("socket")
        try:
            return sock is None or not select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Ended at once: a GET never needs a graceful close, and TLS's waits up to
        30 s for the store's close_notify, holding the descriptor (and re-entering
        :meth:`buffer_updated` with what it still decrypts)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Closed(OriginFailed):
    """The connection ended before the answer did; ``before_answer``: before any of it
    (a kept connection the store had closed: dial again)."""

    def __init__(self, message: str, before_answer: bool) -> None:
        super().__init__(message)
        self.before_answer = before_answer


class PresignedGets:
    """GETs of presigned URLs into spools, on the event loop that calls them, over
    connections kept per store host."""

    def __init__(self, origin: str, timeout_s: float) -> None:
        self.origin = origin  # named in errors, never the URL (its query is a credential)
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._buffer = bytearray(READ_BUFFER)  # every connection's reads (see _Connection)
        # (host, port): until when, and its addresses
        self._resolved: dict[tuple[str, int], tuple[float, list[tuple[int, tuple]]]] = {}

    async def fetch(self, url: str, key: str, sink: Callable[[memoryview], None], limit: int
                    ) -> None:  # fmt: skip
        """GET ``url`` (the object ``key``), each read of its body given to ``sink``:
        :class:`OriginMissing` on a 404, :class:`Unexpected` on another status or a 200
        without a length, :class:`OriginFailed` when it fails, is malformed, is longer
        than ``limit`` or takes longer than the timeout (with ``timeout`` set)."""
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            port = 0
        if parts.scheme not in ("http", "https") or not parts.hostname or not port or (
            "@" in parts.netloc
        ) or not (_URL_BYTES.fullmatch(target) and _URL_BYTES.fullmatch(parts.netloc)):  # fmt: skip
            raise OriginFailed(f"origin {self.origin} gave a URL that cannot be requested")
        where = (parts.scheme, parts.hostname, port)
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Accept-Encoding: identity\r\nUser-Agent: kvcdn-edge\r\n\r\n"
        ).encode("ascii")
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await self._exchange(where, request, limit, sink)
        except TimeoutError:
            raise OriginFailed(f"origin {self.origin} timed out on {key}", timeout=True) from None
        except OSError as exc:
            raise OriginFailed(f"origin {self.origin} failed on {key}: {exc}") from None
        except SpoolFull as exc:
            raise OriginFailed(f"origin {self.origin} sent {key}: {exc}") from None
        except Unexpected as exc:
            raise Unexpected(f"origin {self.origin}: {exc} ({key})", exc.status) from None
        except OriginFailed as exc:
            raise OriginFailed(f"origin {self.origin} failed on {key}: {exc}") from None
        if answer.status == 404:
            raise OriginMissing(key)
        if answer.status != 200:
            raise Unexpected(f"origin {self.origin} answered {answer.status} for {key}",
                             answer.status)  # fmt: skip

    async def _exchange(self, where: tuple[str, str, int], request: bytes, limit: int,
                        sink: Callable[[memoryview], None]) -> _Answer:  # fmt: skip
        """One request and its answer, on a kept connection if one is open (dialled
        again once if the store had closed it), else on a new one."""
        conn = self._kept(where)
        if conn is not None:
            try:
                return await self._on(conn, request, limit, sink)
            except _Closed as exc:
                if not exc.before_answer:
                    raise
        return await self._on(await self._dial(where), request, limit, sink)

    async def _on(self, conn: _Connection, request: bytes, limit: int,
                  sink: Callable[[memoryview], None]) -> _Answer:  # fmt: skip
        try:
            answer = await conn.get(request, limit, sink)
        except BaseException:
            conn.close()  # failed or given up (a timeout, a cancel): never reused
            raise
        if not conn.closed:
            conn.idle_since = time.monotonic()
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < IDLE_PER_HOST:
                idle.append(conn)
            else:
                conn.close()
        return answer

    def _kept(self, where: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(where)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest still open
            if now - conn.idle_since < IDLE_FOR_S and conn.quiet():
                return conn
            conn.close()
        return None

    async def _dial(self, where: tuple[str, str, int]) -> _Connection:
        """A new connection to ``where``: its addresses resolved once a while (as
        aiohttp's client does), tried in turn."""
        scheme, host, port = where
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        loop = asyncio.get_running_loop()
        failed: OSError | None = None
        for family, address in await self._addresses(host, port):
            try:
                _, conn = await loop.create_connection(
                    lambda: _Connection(where, self._buffer), address[0], address[1], family=family,
                    ssl=context, server_hostname=host if context else None,
                )  # fmt: skip
                return conn
            except OSError as exc:
                failed = exc
        raise failed or OSError(f"{host} has no address")

    async def _addresses(self, host: str, port: int) -> list[tuple[int, tuple]]:
        held = self._resolved.get((host, port))
        now = time.monotonic()
        if held is not None and now < held[0]:
            return held[1]
        found = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
        addresses = [(family, sockaddr) for family, _, _, _, sockaddr in found]
        self._resolved[(host, port)] = (now + RESOLVED_FOR_S, addresses)
        return addresses

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
