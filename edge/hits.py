"""The hit path: a cached object sent without aiohttp's per-request machinery.

Most of what an edge serves is the same few hundred thousand immutable objects,
again and again. aiohttp parses each request into a request object, runs the
router and middleware, and builds a response object: 0.13-0.16 ms of user CPU
a hit (bench/edge.py), where nginx spends 0.02 ms and the kernel's sendfile about
0.3 ms. So each connection's bytes pass
through :class:`HitHandler` first (a subclass of aiohttp's own protocol, one
per connection). It takes a request for itself only when all of these hold:

* aiohttp has nothing of the connection's: no request queued or being
  answered, no body being read, no upgrade; requests arrive one whole head at
  a time, in order, and one that finds aiohttp busy is aiohttp's too;
* the head is complete and strictly well-formed: ``GET`` or ``HEAD``, a path of
  key characters only, ``HTTP/1.1``, CRLF line ends, token header names, no
  repeated header, no control bytes, and nothing that announces a body
  (``Content-Length`` other than 0, ``Transfer-Encoding``, ``Expect``, ``Upgrade``);
* the edge can answer it from what it holds, at once (:meth:`.server.Edge.hit`):
  an immutable object cached and verified as its file is now, a reader the
  edge's access rules let through, an answer of 200, 206 or 304.

A miss the edge would fill from its origins and send from the file it cached (an
immutable content-addressed object, read plainly: :meth:`.server.Edge.miss`) is
taken the same way: the connection's later requests wait while the fill runs,
then the answer goes out as a hit's would, or (a fill that failed, a 412, a 416)
as the same answer aiohttp gives. Bytes held in memory, because the disk filled
while they came, go to aiohttp, which fetches them again (a full disk makes the
edge leave its misses to aiohttp from then on).

Anything else goes to aiohttp as it came, and a head that is not strictly
well-formed, or announces a body, hands aiohttp the connection for good: the
two parsers can never disagree about where one request ends and the next begins
(no request smuggling between them), and every request the hit path does not
take is answered exactly as before. The hit path's bytes are the same headers
aiohttp would send and the file's bytes by sendfile(2), with the same counts in
``/metrics``.

The handler uses some of aiohttp's protocol internals (its queue, its waiter, its
keep-alive clock); :func:`supported` checks that the installed aiohttp has them,
and without them the edge serves everything through aiohttp (and says so).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_protocol import RequestHandler

from .linger import linger
from .respond import Reply, sendfile_now

log = logging.getLogger(__name__)

#: A head longer than this without its end is aiohttp's (which has its own limits).
MAX_HEAD = 16 << 10
#: Bytes a client may send ahead while its connection waits (a fill, a body the socket
#: has not taken): past them the connection is not read until the wait ends.
MAX_PENDING = 4 * MAX_HEAD
#: A whole head the hit path may take: the method, a path of key characters, HTTP/1.1,
#: then fields of a token name and a value without control bytes, each ended by CRLF.
_HEAD = re.compile(
    rb"(GET|HEAD) (/[A-Za-z0-9/._-]{1,1024}) HTTP/1\.1\r\n"
    rb"((?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*)\r\n"
)
_REASONS = {200: "OK", 206: "Partial Content", 304: "Not Modified"}
#: aiohttp's protocol attributes the handler reads or sets (see the module's text).
_INTERNALS = (
    "max_line_size", "max_field_size", "max_headers", "_waiter", "_messages",
    "_request_in_progress", "_payload_parser", "_upgraded", "_handler_waiter",
    "_next_keepalive_close_time", "_keepalive_timeout", "_keepalive_handle", "_force_close",
    "_close", "_process_keepalive", "_loop",
)  # fmt: skip


@dataclass(frozen=True)
class Head:
    """A request head the hit path may answer: names of ``headers`` in lower case;
    ``raw`` its bytes (what the edge's answers are remembered by)."""

    method: str
    path: str
    headers: dict[str, str]
    raw: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def close(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


@dataclass
class Hit:
    """What :meth:`.server.Edge.hit` answers: the reply, the open file it sends
    (closed once sent), and the reply's head up to its ``Date`` (:func:`render_fixed`)."""

    reply: Reply
    fd: int
    fixed: bytes


@dataclass
class Refusal:
    """An answer without an object (a fill that failed, a 412 or 416 after one), as
    aiohttp renders ``web.Response(status=, headers=, text=)``: ``fixed`` is its head
    up to ``Date``."""

    status: int
    fixed: bytes
    body: bytes


def refusal(status: int, text: str | None, headers: dict[str, str] | None = None, *,
            method: str = "GET") -> Refusal:  # fmt: skip
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    body = b"" if text is None else text.encode()
    if text is not None:
        lines.append("Content-Type: text/plain; charset=utf-8")
    if body or method != "HEAD":  # aiohttp gives a HEAD's empty answer no length
        lines.append(f"Content-Length: {len(body)}")
    return Refusal(status, ("\r\n".join(lines) + "\r\n").encode("latin-1"), body)


#: What :meth:`.server.Edge.miss` gives for a miss it fills: the fill, which ends in
#: a :class:`Hit` to send, a :class:`Refusal` to send, or None (aiohttp answers).
Filling = Awaitable["Hit | Refusal | None"]

#: Heads up to this long are parsed once while they are among the last
#: :data:`PARSED_HEADS` seen (a client asks with the same few heads again and again):
#: at most 4 MiB of heads, whatever the requests.
SHORT_HEAD = 1024
PARSED_HEADS = 4096


def parse_head(raw: bytes, *, max_line: int = 8190, max_headers: int = 100) -> Head | None:
    """``raw`` (a head up to and including its blank line) if it is strictly a bodyless
    ``GET`` or ``HEAD`` of a key-like path in HTTP/1.1, no line longer than
    ``max_line`` and at most ``max_headers`` fields; None for anything else."""
    if len(raw) <= SHORT_HEAD:
        return _parse_short(raw, max_line, max_headers)
    return _parse(raw, max_line, max_headers)


def _parse(raw: bytes, max_line: int, max_headers: int) -> Head | None:
    m = _HEAD.fullmatch(raw)
    if m is None:
        return None
    lines = m.group(3).split(b"\r\n")[:-1]
    if len(lines) > max_headers or max(map(len, lines), default=0) > max_line:
        return None  # over aiohttp's limits: its answer (400, 431) is the edge's
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        lower = name.decode("ascii").lower()
        if lower in headers:
            return None
        headers[lower] = value.strip(b" \t").decode("latin-1")
    if headers.get("content-length", "0") != "0" or any(
        h in headers for h in ("transfer-encoding", "expect", "upgrade")
    ):
        return None
    if headers.get("connection", "keep-alive").lower() not in ("keep-alive", "close"):
        return None
    return Head(m.group(1).decode("ascii"), m.group(2).decode("ascii"), headers, raw)


# a Head is frozen and its headers are only read: one parse serves every request alike
_parse_short = functools.lru_cache(maxsize=PARSED_HEADS)(_parse)


def render_fixed(reply: Reply) -> bytes:
    """The status line and headers of ``reply`` as aiohttp would send them, up to its
    ``Date`` (sent with the rest, :func:`_date_tail`, by :class:`HitHandler`)."""
    lines = [f"HTTP/1.1 {reply.status} {_REASONS[reply.status]}"]
    lines += [f"{k}: {v}" for k, v in reply.headers.items()]
    if reply.status != 304:
        lines += [f"Content-Type: {reply.content_type}", f"Content-Length: {reply.count}"]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


def _date_tail(close: bool) -> bytes:
    """The head's last lines (``Date``, ``Server``, a ``Connection: close``), formatted
    once a second."""
    return _date_tail_at(int(time.time()), close)


@functools.lru_cache(maxsize=2)
def _date_tail_at(second: int, close: bool) -> bytes:
    tail = f"Date: {formatdate(second, usegmt=True)}\r\nServer: {SERVER_SOFTWARE}\r\n"
    return (tail + ("Connection: close\r\n\r\n" if close else "\r\n")).encode("latin-1")


def supported(server: web.Server) -> bool:
    """Whether the installed aiohttp has the internals :class:`HitHandler` uses, and
    ``server`` the arguments its handlers are made with."""
    slots = {s for cls in RequestHandler.__mro__ for s in getattr(cls, "__slots__", ())}
    names = slots | set(dir(RequestHandler))
    made_with = getattr(server, "_kwargs", None)
    return all(name in names for name in _INTERNALS) and isinstance(made_with, dict)


def handler_factory(server: web.Server, hit: Callable[[Head], Hit | None],
                    miss: Callable[[Head], Filling | None] | None = None
                    ) -> Callable[[], RequestHandler]:  # fmt: skip
    """What makes each connection's protocol: a :class:`HitHandler` made as ``server``
    makes its own handlers, or (an aiohttp without the internals) ``server`` itself."""
    if not supported(server):
        log.warning("this aiohttp (%s) lacks what the edge's hit path uses: every request "
                    "goes through aiohttp, at several times the CPU a hit", SERVER_SOFTWARE)
        return server
    kwargs = server._kwargs  # what web.Server.__call__ passes its RequestHandler
    loop = asyncio.get_running_loop()
    return lambda: HitHandler(server, hit=hit, miss=miss, loop=loop, **kwargs)


class HitHandler(RequestHandler):
    """aiohttp's protocol for one connection, answering hits itself (see the module).

    ``hit(head)`` is the edge's decision: a :class:`Hit` to send, or None; then
    ``miss(head)``: a fill to wait for, or None for aiohttp."""

    __slots__ = ("_hit", "_miss", "_pending", "_aiohttps", "_sending", "_held", "_plain")

    def __init__(self, manager: web.Server, *, hit: Callable[[Head], Hit | None],
                 miss: Callable[[Head], Filling | None] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(manager, **kwargs)
        self._hit = hit
        self._miss = miss
        self._pending = bytearray()  # received, not yet answered nor handed to aiohttp
        self._aiohttps = False  # the connection is aiohttp's for good
        self._sending = False  # a hit's body is being sent: later requests wait
        self._held = False  # reading paused: MAX_PENDING bytes wait
        self._plain: Any = None  # the connection's socket, unless TLS: to linger on

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # sendfile(2) would bypass TLS: an encrypted connection is aiohttp's
        self._aiohttps = transport.get_extra_info("ssl_object") is not None
        if not self._aiohttps:
            self._plain = transport.get_extra_info("socket")

    def connection_lost(self, exc: BaseException | None) -> None:
        # (asyncio calls this just before it closes the socket.) Closed with the client's
        # bytes unread, the connection would be reset and the last answer's tail lost:
        # it lingers instead (:mod:`.linger`), whoever closed it: the hit path, aiohttp,
        # or aiohttp's force_close (which lets go of the transport before this)
        try:
            if exc is None and self._plain is not None:
                linger(self._loop, self._plain)
        finally:
            self._plain = None
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._aiohttps or self._force_close or self._close:
            super().data_received(data)
            return
        self._pending += data
        self._answer_pending()
        if self._sending and len(self._pending) > MAX_PENDING:  # (a wait this read began too)
            self._hold(True)

    def _hold(self, held: bool) -> None:
        """Stop reading the connection (or start again), for the hit path's own buffer:
        never while aiohttp holds the connection, whose flow control is its own."""
        if held != self._held and self.transport is not None:
            self._held = held
            if held:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _idle(self) -> bool:
        """Whether aiohttp holds nothing of this connection: waiting for a request."""
        waiter = self._waiter
        return (waiter is not None and not waiter.done() and not self._messages
                and not self._request_in_progress and self._payload_parser is None
                and not self._upgraded)  # fmt: skip

    def _answer_pending(self) -> None:
        pending = self._pending
        while pending and not self._sending and not self._aiohttps:
            end = pending.find(b"\r\n\r\n")
            if end < 0:
                # a partial head waits for its end, unless it can never be ours: too
                # long, or with a line end that is not CRLF (aiohttp takes bare LFs)
                if len(pending) > MAX_HEAD or pending.replace(b"\r\n", b"").find(b"\n") >= 0:
                    self._hand_over()
                    return
                break
            raw = bytes(pending[: end + 4])
            head = parse_head(raw, max_line=min(self.max_line_size, self.max_field_size),
                              max_headers=self.max_headers)  # fmt: skip
            if head is None:  # not strictly one of ours: aiohttp parses from here on
                self._hand_over()
                return
            del pending[: end + 4]
            idle = self._idle()
            hit = self._hit(head) if idle else None
            if hit is not None:
                self._send(head, hit)
                continue
            filling = self._miss(head) if idle and self._miss is not None else None
            if filling is None:
                super().data_received(raw)  # a whole bodyless head: aiohttp answers it
                continue
            # the requests after this one wait for its fill, as they wait for a body
            self._sending = self._request_in_progress = True
            task = asyncio.get_running_loop().create_task(self._filled(head, raw, filling))
            task.add_done_callback(_seen)
        if self._held and not self._sending and not self._aiohttps:
            self._hold(False)  # what waited is answered or handed on: at most a partial head

    async def _filled(self, head: Head, raw: bytes, filling: Filling) -> None:
        """A miss's fill has ended: its answer is sent (or, None, aiohttp's), then the
        requests that waited for it are answered. A fill that failed unexpectedly (a
        bug, no descriptor left) is aiohttp's too, which answers it as its own
        handlers' failures (500, the connection closed) unless it succeeds then."""
        try:
            answer = await filling
        except asyncio.CancelledError:
            self._sending = self._request_in_progress = False
            self._request_done()
            raise
        except Exception:
            log.exception("filling a miss failed; aiohttp answers it")
            answer = None
        self._sending = self._request_in_progress = False
        if isinstance(answer, Hit):
            self._send(head, answer)
        elif isinstance(answer, Refusal):
            transport = self.transport
            if transport is not None and not transport.is_closing():
                body = answer.body if head.method != "HEAD" else b""
                transport.write(answer.fixed + _date_tail(head.close) + body)
                self._sent(head)
        else:
            super().data_received(raw)  # aiohttp's, and what follows is queued behind it
        if not self._sending:  # else _send_rest tells a shutdown, once the body is out
            self._request_done()
        self._answer_pending()

    def _request_done(self) -> None:
        """A shutdown waiting for this connection's request (aiohttp's) may go on."""
        if self._handler_waiter is not None and not self._handler_waiter.done():
            self._handler_waiter.set_result(None)

    def _hand_over(self) -> None:
        """The connection is aiohttp's from here on, what is pending first."""
        data, self._pending = bytes(self._pending), bytearray()
        self._aiohttps = True
        self._hold(False)
        super().data_received(data)

    def _send(self, head: Head, hit: Hit) -> None:
        transport = self.transport
        reply, body = hit.reply, head.method != "HEAD" and hit.reply.status != 304
        if transport is None or transport.is_closing():
            os.close(hit.fd)
            return
        offset, count = reply.start, reply.count if body else 0
        sock = transport.get_extra_info("socket")
        # The head goes out on its own: corked to leave with the body's first bytes
        # (nginx's tcp_nopush), hits took twice the CPU (docs/edge.md).
        transport.write(hit.fixed + _date_tail(head.close))  # a HEAD's headers are a GET's
        if count and sock is not None and transport.get_write_buffer_size() == 0:
            sent = sendfile_now(sock.fileno(), hit.fd, offset, count)
            offset, count = offset + sent, count - sent
        if not count:
            os.close(hit.fd)
            self._sent(head)
            return
        # the socket is full: the rest is sent as it drains, and the requests after this
        # one wait for it (aiohttp's shutdown waits for it as for one of its own)
        self._sending = self._request_in_progress = True
        task = asyncio.get_running_loop().create_task(self._send_rest(head, hit, offset, count))
        task.add_done_callback(_seen)

    async def _send_rest(self, head: Head, hit: Hit, offset: int, count: int) -> None:
        try:
            transport = self.transport
            if transport is None:
                return
            try:
                with open(hit.fd, "rb", buffering=0, closefd=False) as file:
                    await asyncio.get_running_loop().sendfile(transport, file, offset, count,
                                                              fallback=False)  # fmt: skip
            except (NotImplementedError, asyncio.SendfileNotAvailableError):
                transport.close()  # no sendfile here after all: the client asks again
                return
            except (OSError, RuntimeError):  # the client went away
                return
        finally:
            os.close(hit.fd)
            self._sending = self._request_in_progress = False
            self._request_done()
        self._sent(head)
        self._answer_pending()

    def _sent(self, head: Head) -> None:
        """A hit's response is out: the connection's idle clock starts again, or it ends."""
        if head.close:
            if self.transport is not None:
                self.transport.close()
            self._aiohttps = True  # nothing more is read
            return
        self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout

    def _process_keepalive(self) -> None:
        if self._sending:  # a slow reader of a hit's body is not an idle connection
            self._keepalive_handle = self._loop.call_at(
                self._loop.time() + self._keepalive_timeout, self._process_keepalive
            )
            return
        super()._process_keepalive()


def _seen(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sending a hit failed", exc_info=task.exception())
