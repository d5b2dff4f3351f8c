"""One object as an HTTP response: its ETag and Cache-Control, conditional requests
(``If-Match``, ``If-None-Match``, ``If-Range``), one byte range (206, 416), and
the body: from memory, from the file with sendfile(2), or through the shaped link.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from .fill import Found
from .metrics import Metrics
from .s3api import error_xml
from .shaping import PIECE, LinkShaper

_RANGE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$")  # 19 digits: any real offset


@dataclass
class Reply:
    """What a GET or HEAD of an object is answered, decided from its ETag and size and
    the request's conditional and range headers alone: one decision for the aiohttp
    path and the hit path (:mod:`.hits`). ``error`` (an S3 code and a message) is set
    for 412 and 416, whose bodies each path renders its own way."""

    status: int
    headers: dict[str, str]
    content_type: str
    start: int  # the body: bytes [start, start + count) of the object
    count: int
    error: tuple[str, str] | None = None


def reply_for(
    header: Callable[[str], str | None],
    key: str,
    etag: str,
    size: int,
    *,
    cache_control: str,
    stale: bool = False,
    age_s: float = 0.0,
) -> Reply:
    """The answer to a request whose headers ``header(name)`` gives (None: absent) for
    the object ``key`` of ``size`` bytes: 200, 206, 304, 412 or 416."""
    headers = {
        "ETag": etag,
        "Cache-Control": cache_control,
        "Accept-Ranges": "bytes",
    }
    if stale:  # RFC 9111's stale-if-error: the origin is down
        headers["Warning"] = '110 - "Response is Stale"'
        headers["Age"] = str(int(age_s))
    content_type = "application/json" if key.endswith(".json") else "application/octet-stream"
    if_match = header("If-Match")
    if if_match is not None and not matches(if_match, etag):
        return Reply(412, headers, content_type, 0, 0,
                     ("PreconditionFailed", "the object's ETag differs"))  # fmt: skip
    if matches(header("If-None-Match"), etag):
        return Reply(304, headers, content_type, 0, 0)
    status, start, end = 200, 0, size - 1
    spec, if_range = header("Range"), header("If-Range")
    if spec is not None and (if_range is None or matches(if_range, etag)):
        span = parse_range(spec, size)
        if span == "unsatisfiable":
            headers["Content-Range"] = f"bytes */{size}"
            return Reply(416, headers, content_type, 0, 0,
                         ("InvalidRange", "the range is not satisfiable"))  # fmt: skip
        if isinstance(span, tuple) and span != (0, size - 1):
            status, (start, end) = 206, span
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return Reply(status, headers, content_type, start, end + 1 - start)


def answer(
    request: web.Request,
    key: str,
    found: Found,
    *,
    cache_control: str,
    s3: bool,
    metrics: Metrics,
    shaper: LinkShaper | None,
) -> web.StreamResponse:
    """The response to a GET or HEAD of ``found``: 200, 206, 304, 412 or 416; S3's
    error documents when ``s3``. ``found``'s file, if any, is taken by the body."""
    reply = reply_for(request.headers.get, key, found.etag, found.size, cache_control=cache_control,
                      stale=found.stale, age_s=found.age_s)  # fmt: skip
    status, headers, content_type = reply.status, reply.headers, reply.content_type
    if reply.error is not None:
        if s3:
            return s3_error(status, *reply.error, key)
        text = "If-Match does not match\n" if status == 412 else None
        return web.Response(status=status, headers=headers, text=text)
    if status == 304:
        return web.Response(status=304, headers=headers)
    start, count = reply.start, reply.count
    if request.method != "HEAD":
        metrics.bytes_served += count
    if shaper is not None and request.method != "HEAD":
        if found.file is not None:
            return ShapedBody(shaper, status, headers, content_type, start, count,
                              file=found.take_file())  # fmt: skip
        return ShapedBody(shaper, status, headers, content_type, start, count,
                          data=found.data, sent=found.take_sent())  # fmt: skip
    if found.file is not None:
        return FileBody(found.take_file(), start, count, status, headers, content_type)
    if found.sent is not None and request.method != "HEAD":
        # a spool's bytes held in memory: sent a piece at a time as the client reads
        # (the transport buffers a piece, not the object), let go once sent
        return ShapedBody(None, status, headers, content_type, start, count,
                          data=found.data, sent=found.take_sent())  # fmt: skip
    body = found.data if count == found.size else found.data[start : start + count]
    return web.Response(status=status, body=body, headers=headers, content_type=content_type)


class FileBody(web.StreamResponse):
    """A byte range of an open file, sent with sendfile(2): no copies through Python.

    The file is read at explicit offsets only (sendfile's own, or pread): a handle
    on a spooled miss shares its offset with the other requests' handles."""

    def __init__(
        self,
        file: BinaryIO,
        offset: int,
        count: int,
        status: int,
        headers: dict[str, str],
        content_type: str,
    ) -> None:
        super().__init__(status=status, headers=headers)
        self.content_type = content_type
        self.content_length = count
        self._file, self._offset, self._count = file, offset, count

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        try:
            writer = await super().prepare(request)  # sends the headers
            assert writer is not None
            if request.method != "HEAD" and self._count:
                transport = request.transport
                if transport is None:
                    raise ConnectionResetError("the client went away")
                offset, count = self._offset, self._count
                sock = transport.get_extra_info("socket")
                plain = transport.get_extra_info("ssl_object") is None  # TLS encrypts
                if sock is not None and plain and transport.get_write_buffer_size() == 0:
                    # As much as the socket takes now, straight from the page cache:
                    # usually the whole body. asyncio's sendfile stops and restarts
                    # reading and watches for writability around each call, which
                    # costs a hit more CPU than the copy itself.
                    sent = sendfile_now(sock.fileno(), self._file.fileno(), offset, count)
                    offset, count = offset + sent, count - sent
                try:
                    if count:
                        await asyncio.get_running_loop().sendfile(
                            transport, self._file, offset, count, fallback=False
                        )
                except (NotImplementedError, asyncio.SendfileNotAvailableError):
                    # no sendfile for this transport (TLS, ...)
                    fd, end = self._file.fileno(), offset + count
                    for at in range(offset, end, PIECE):
                        await writer.write(os.pread(fd, min(PIECE, end - at), at))
            await super().write_eof()
            return writer
        finally:
            self._file.close()


def sendfile_now(out_fd: int, in_fd: int, offset: int, count: int) -> int:
    """Bytes of ``in_fd`` from ``offset`` sent to the non-blocking socket ``out_fd`` until
    it would block (or fails: what is left is sent by asyncio, which raises the error)."""
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(out_fd, in_fd, offset + sent, count - sent)
        except OSError:  # would block, interrupted, or the client went away
            break
        if n == 0:  # the file ends early
            break
        sent += n
    return sent


class ShapedBody(web.StreamResponse):
    """A body sent in pieces, each when the client has read the last (and, with a
    ``shaper``, when the shaped link has room for it); ``sent`` is called once it is
    done, sent or not."""

    def __init__(
        self,
        shaper: LinkShaper | None,
        status: int,
        headers: dict[str, str],
        content_type: str,
        offset: int,
        count: int,
        *,
        data: bytes = b"",
        file: BinaryIO | None = None,
        sent: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(status=status, headers=headers)
        self.content_type = content_type
        self.content_length = count
        self._shaper, self._offset, self._count = shaper, offset, count
        self._data, self._file, self._sent = data, file, sent

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        try:
            writer = await super().prepare(request)
            assert writer is not None
            view = memoryview(self._data)
            for at in range(self._offset, self._offset + self._count, PIECE):
                n = min(PIECE, self._offset + self._count - at)
                if self._shaper is not None:
                    await self._shaper.send(n)
                if self._file is not None:
                    piece = os.pread(self._file.fileno(), n, at)  # explicit offsets (FileBody)
                else:
                    piece = view[at : at + n]
                await writer.write(piece)  # waits while the client has not read enough
            await super().write_eof()
            return writer
        finally:
            if self._file is not None:
                self._file.close()
            if self._sent is not None:
                self._sent()


def s3_error(status: int, code: str, message: str, resource: str) -> web.Response:
    """S3's XML error document, which S3 clients map to their usual exceptions."""
    return web.Response(
        status=status,
        body=error_xml(code, message, resource),
        content_type="application/xml",
    )


def matches(header: str | None, tag: str) -> bool:
    """Whether an ``If-Match``-style header names ``tag`` or ``*`` (a ``W/`` prefix is
    ignored)."""
    if header is None:
        return False
    values = [v.strip().removeprefix("W/") for v in header.split(",")]
    return "*" in values or tag in values


def parse_range(spec: str, size: int) -> tuple[int, int] | str | None:
    """One ``bytes=a-b`` range -> inclusive (start, end); "unsatisfiable"; or None to
    ignore it (malformed or several ranges: the whole object is sent, as RFC 9110 allows)."""
    m = _RANGE.match(spec.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # the last N bytes
        n = int(last)
        return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size - 1)
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size:
        return "unsatisfiable"
    if start > end:
        return None  # "bytes=5-3" is invalid, not unsatisfiable
    return start, end
