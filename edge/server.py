"""The edge cache node: an asyncio HTTP server in front of the object store.

``GET``/``HEAD /{key}`` serve any servable store key (see :mod:`.verify`) with
byte ranges (206, 416), ETags and conditional GETs (:mod:`.respond`), and
Cache-Control that lets any standard HTTP cache sit in front of or behind the
edge. A miss is read through from the origin, or a parent edge first
(:mod:`.fill`): concurrent misses for one key share a single origin fetch,
and bytes are verified before they are cached.

The same objects are readable through a path-style S3 API (:mod:`.s3api`),
and the admin endpoints (:mod:`.admin`) warm lists of keys in the background.
This module routes requests to those parts and runs the app.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvcdn.errors import InputError
from kvcdn.keys import KeyInfo
from kvcdn.signing import TrustPolicy

from . import linger
from .admin import MAX_BODY, Admin
from .auth import Access
from .cache import DiskCache
from .fill import MAX_STALE_S, POINTER_TTL_S, FetchError, Filler
from .hits import (
    SHORT_HEAD,
    Filling,
    Head,
    Hit,
    Refusal,
    handler_factory,
    refusal,
    render_fixed,
)
from .metrics import Metrics
from .origin import Origin
from .respond import Reply, answer, reply_for, s3_error
from .s3api import (
    ERROR_CODES,
    BucketView,
    ListRequest,
    S3RequestError,
    list_page,
    list_xml,
)
from .s3auth import S3Keys
from .shaping import LinkShaper
from .shared import summed_counters, write_counters
from .verify import CONTENT_ADDRESSED, cache_control, check_key
from .warm import JobBoard

log = logging.getLogger(__name__)

MAX_LINE = 8190
MAX_FIELD = 8190
MAX_HEADERS = 100  # in one request: ranges, auth, S3's signature headers fit easily
#: Hit replies remembered by their heads (each at most SHORT_HEAD): a few MiB at most
HIT_ANSWERS = 4096
#: A connection that has sent no whole request for this long (since it opened, or
#: since its last response) is closed: slow or silent clients hold no descriptor.
IDLE_TIMEOUT_S = 15.0
#: Malformed requests logged per minute, one short line each; the rest are counted.
BAD_REQUEST_LINES = 20


class Edge:
    """One edge node: a disk cache, its origins (parent edges first), its tokens.

    ``trust`` (publisher keys) lets the edge verify signed manifests and keep
    them for good, and refuse unsigned ones; ``s3_keys`` makes S3 clients
    authenticate with AWS Signature V4. ``admin_open=False`` refuses the admin
    endpoints when no token protects them (an edge listening beyond loopback).
    """

    def __init__(
        self,
        cache: DiskCache,
        origins: list[Origin],
        read_token: str | None = None,
        *,
        admin_token: str | None = None,
        view: BucketView | None = None,
        warm_concurrency: int = 8,
        shaper: LinkShaper | None = None,
        trust: TrustPolicy | None = None,
        s3_keys: S3Keys | None = None,
        pointer_ttl_s: int = POINTER_TTL_S,
        max_stale_s: float = MAX_STALE_S,
        admin_open: bool = True,
        worker: str | None = None,
    ) -> None:
        self.cache = cache
        # one of several worker processes (named ``worker``) on a shared cache folder:
        # its counters go to the folder, and /metrics answers every worker's sum
        self.worker = worker
        self._publishing: asyncio.Task[None] | None = None
        self.origins = origins
        self.trust = trust
        self.access = Access(read_token, admin_token, s3_keys, admin_open=admin_open)
        #: :meth:`hit`'s replies by the head they answer (bounded: :data:`HIT_ANSWERS`)
        self._hit_answers: dict[bytes, tuple[tuple[str, int], Reply, bytes]] = {}
        self.view = view or BucketView("kvcdn")
        self.shaper = shaper  # sends bodies no faster than a rate or a trace
        self.metrics = Metrics()
        self.fill = Filler(cache, origins, self.metrics, trust=trust,
                           pointer_ttl_s=pointer_ttl_s, max_stale_s=max_stale_s)  # fmt: skip
        board = None
        if worker is not None and cache.shared is not None:
            board = JobBoard(cache.root / "warm-jobs", cache.shared)
        self.admin = Admin(self.access, self.fill.ensure, warm_concurrency=warm_concurrency,
                           shaper=shaper, board=board)  # fmt: skip

    # ---- the app -------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._count])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_page)
        self.admin.add_routes(app.router)  # before "/{path}", which would take them
        app.router.add_get("/", self.root_listing)
        app.router.add_get("/{path:.+}", self.serve)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)
        return app

    async def _start(self, app: web.Application) -> None:
        await self.admin.start()
        if self.worker is not None:
            self._publishing = asyncio.get_running_loop().create_task(self._publish_often())

    async def _close(self, app: web.Application) -> None:
        if self._publishing is not None:
            self._publishing.cancel()
        await self.fill.finish_writes(timeout_s=10)
        if self.worker is not None:
            self._publish()  # the last counts of a worker that stops
        await self.admin.close()
        for origin in self.origins:
            await origin.close()
        linger.end_all(asyncio.get_running_loop())  # the last answers had their time

    @web.middleware
    async def _count(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            self.metrics.count_response(exc.status)
            raise
        self.metrics.count_response(response.status)
        return response

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics_page(self, request: web.Request) -> web.Response:
        summed = None
        if self.worker is not None:  # this worker's counts fresh, its siblings' <= 1 s old
            self._publish()
            summed = summed_counters(self.cache.root / "workers")
        text = self.metrics.prometheus(self.cache, summed)
        return web.Response(text=text, content_type="text/plain")

    def _publish(self) -> None:
        assert self.worker is not None
        try:
            write_counters(self.cache.root / "workers", self.worker,
                           self.metrics.counters(self.cache))  # fmt: skip
        except OSError as exc:
            log.warning("cannot write this worker's counters: %s", exc)

    async def _publish_often(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._publish()

    # ---- serving -------------------------------------------------------------
    async def serve(self, request: web.Request) -> web.StreamResponse:
        """``/{store key}``, or an S3 path ``/{bucket}[/{key}]``."""
        path = request.match_info["path"]
        info = check_key(path)
        if info is not None:
            try:
                self.access.check_read(request)
            except S3RequestError as exc:
                return web.Response(status=exc.status, text=f"{exc}\n")
            return await self._respond(request, path, info, s3=False)
        try:
            self.access.check_read(request)
            return await self._s3(request, path)
        except S3RequestError as exc:
            return s3_error(exc.status, exc.code, str(exc), path)
        except web.HTTPUnauthorized as exc:  # S3 clients expect an S3 error document
            return s3_error(403, "AccessDenied", exc.text or "", path)

    def hit(self, head: Head) -> Hit | None:
        """A request the edge answers at once from a verified cached file (200, 206 or
        304: :mod:`.hits`), counted as :meth:`serve` counts it; None when
        :meth:`serve` must decide (a miss, a pointer, a refusal, an error status...)."""
        plain = self._plain_read(head)
        if plain is None:
            return None
        key, info = plain
        copy = self.fill.cached(key, info)
        if copy is None:
            return None
        # the reply is decided by the head and the object's ETag and size alone (and by
        # this edge's settings, fixed): decided again only when one of them is new
        answer = self._hit_answers.get(head.raw)
        if answer is None or answer[0] != (copy.etag, copy.size):
            control = cache_control(info, self.trust, self.fill.pointer_ttl_s)
            reply = reply_for(head.header, key, copy.etag, copy.size, cache_control=control)
            if reply.error is not None:  # 412, 416: aiohttp's, as their bodies are
                os.close(copy.fd)
                return None
            answer = ((copy.etag, copy.size), reply, render_fixed(reply))
            if len(head.raw) <= SHORT_HEAD:
                if len(self._hit_answers) >= HIT_ANSWERS:
                    self._hit_answers.clear()
                self._hit_answers[head.raw] = answer
        _, reply, fixed = answer
        self.metrics.hits += 1
        self.metrics.count_response(reply.status)
        if head.method != "HEAD" and reply.status != 304:
            self.metrics.bytes_served += reply.count
        return Hit(reply, copy.fd, fixed)

    def _plain_read(self, head: Head) -> tuple[str, KeyInfo] | None:
        """The key a request reads, when :meth:`serve` would read it unshaped and let
        the reader through at once (no token, or the right one)."""
        if self.shaper is not None or not self.access.reads_plainly(head.header("Authorization")):
            return None
        key = head.path[1:]
        info = check_key(key)
        return None if info is None else (key, info)

    def miss(self, head: Head) -> Filling | None:
        """For a request :meth:`hit` did not take: the fill of an immutable
        content-addressed object (:mod:`.hits`), answered as :meth:`serve` answers it,
        or None when :meth:`serve` must decide (another kind, a full disk...)."""
        plain = self._plain_read(head)
        if plain is None or plain[1].kind not in CONTENT_ADDRESSED or self.cache.read_only:
            return None
        held = self.cache.lookup(plain[0])
        if held is not None and held.verified is not None:
            return None  # cached and verified, yet no hit: a 412, a 416, a file that changed
        return self._fill_miss(head, *plain)

    async def _fill_miss(self, head: Head, key: str, info: KeyInfo) -> Hit | Refusal | None:
        try:
            found = await self.fill.object(key, info)
        except FetchError as exc:  # answered as _respond answers it
            self.metrics.count_response(exc.status)
            return refusal(exc.status, f"{exc}\n", method=head.method)
        try:
            if found.file is None:  # held in memory (the disk filled meanwhile): aiohttp's
                return None
            control = cache_control(info, self.trust, self.fill.pointer_ttl_s)
            reply = reply_for(head.header, key, found.etag, found.size, cache_control=control)
            if reply.error is not None:  # as answer() renders them
                self.metrics.count_response(reply.status)
                text = "If-Match does not match\n" if reply.status == 412 else None
                return refusal(reply.status, text, reply.headers, method=head.method)
            hit = Hit(reply, os.dup(found.file.fileno()), render_fixed(reply))
            self.metrics.count_response(reply.status)  # (once nothing more can fail)
            if head.method != "HEAD" and reply.status != 304:
                self.metrics.bytes_served += reply.count
            return hit
        finally:
            found.release()

    async def _s3(self, request: web.Request, path: str) -> web.StreamResponse:
        bucket, _, s3_key = path.partition("/")
        if bucket != self.view.bucket:
            raise S3RequestError(
                404,
                "NoSuchBucket",
                f"{path[:200]} is neither a kvcdn key nor in bucket {self.view.bucket}",
            )
        if not s3_key:  # bucket-level requests
            if request.method == "HEAD":
                return web.Response(status=200)
            if "location" in request.query:
                return web.Response(
                    body=b'<?xml version="1.0" encoding="UTF-8"?>\n<LocationConstraint '
                    b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>\n',
                    content_type="application/xml",
                )
            return await self._list(request, self.view)
        key = self.view.store_key(s3_key)
        info = check_key(key) if key is not None else None
        if key is None or info is None:
            raise S3RequestError(404, "NoSuchKey", f"no kvcdn object {s3_key[:200]}")
        return await self._respond(request, key, info, s3=True)

    async def root_listing(self, request: web.Request) -> web.StreamResponse:
        """``GET /?list-type=2&prefix=``: store keys, for child edges and tools."""
        try:
            self.access.check_read(request)
        except S3RequestError as exc:
            return s3_error(exc.status, exc.code, str(exc), "/")
        except web.HTTPUnauthorized as exc:
            return s3_error(403, "AccessDenied", exc.text or "", "/")
        try:
            return await self._list(request, BucketView(""))
        except S3RequestError as exc:
            return s3_error(exc.status, exc.code, str(exc), "/")

    async def _list(self, request: web.Request, view: BucketView) -> web.StreamResponse:
        query = ListRequest.parse(dict(request.query))
        prefix = view.store_prefix(query.prefix)
        sizes: dict[str, int] = {}
        if prefix is not None:
            try:
                found = await self.fill.listing(prefix)
            except FetchError as exc:
                raise S3RequestError(exc.status, ERROR_CODES[exc.status], str(exc)) from None
            sizes = {view.prefix + k: n for k, n in found.items()}
        page = list_page(sizes, query)
        return web.Response(body=list_xml(view.bucket, query, page), content_type="application/xml")

    async def _respond(
        self, request: web.Request, key: str, info: KeyInfo, *, s3: bool
    ) -> web.StreamResponse:
        try:
            found = await self.fill.object(key, info)
        except FetchError as exc:  # a fresh response per request, even for shared failures
            if s3:
                return s3_error(
                    exc.status, ERROR_CODES.get(exc.status, "InternalError"), str(exc), key
                )
            return web.Response(status=exc.status, text=f"{exc}\n")
        control = cache_control(info, self.trust, self.fill.pointer_ttl_s, found.expires)
        try:
            return answer(request, key, found, cache_control=control, s3=s3, metrics=self.metrics,
                          shaper=self.shaper)  # fmt: skip
        finally:
            found.release()  # FileBody takes its own handle; anything unsent is closed here


def run(
    edge: Edge,
    host: str,
    port: int,
    *,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    max_connections: int | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve until SIGINT or SIGTERM; :class:`InputError` when the address cannot be
    listened on.

    Connections are bounded so that no client exhausts the process's file
    descriptors: one that has sent no whole request ``idle_timeout_s`` after it
    opened or after its last response is closed, and beyond ``max_connections``
    open ones (default: :func:`connection_limit`) a new one is answered 503. A
    malformed request costs one short log line, at most :data:`BAD_REQUEST_LINES`
    of them a minute. ``reuse_port``: the socket is bound with ``SO_REUSEPORT``, so
    that the worker processes of one edge listen on one port, the kernel spreading
    new connections across them."""
    logging.getLogger("aiohttp.server").addFilter(_BadRequestLines())
    limit = max_connections or connection_limit()
    try:
        asyncio.run(_serve(edge, host, port, idle_timeout_s, limit, reuse_port))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputError(f"cannot listen on {host}:{port}: {reason}") from None


async def _serve(edge: Edge, host: str, port: int, idle_timeout_s: float, limit: int,
                 reuse_port: bool = False) -> None:  # fmt: skip
    runner = web.AppRunner(
        edge.app(),
        handle_signals=False,
        access_log=None,
        # closes a connection that has sent no whole request this long after it
        # opened or after its last response: a header and an idle timeout
        keepalive_timeout=idle_timeout_s,
        max_line_size=MAX_LINE,  # passed on to each connection's request parser
        max_field_size=MAX_FIELD,
        max_headers=MAX_HEADERS,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    _on_stop_signals(loop, stop.set)
    try:
        await _LimitedSite(runner, host, port, limit, reuse_port=reuse_port, hit=edge.hit,
                           miss=edge.miss).start()  # fmt: skip
        await stop.wait()
    finally:
        _signals_while_closing(loop)
        await runner.cleanup()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _on_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """``stop()`` on SIGINT or SIGTERM. asyncio writes each signal into its wakeup
    pipe; a full pipe (a burst of signals) already holds a stop, so the rest are
    dropped without Python's warning. The signals wait while the pipe is swapped."""
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    with _stop_signals_held():
        signal.set_wakeup_fd(signal.set_wakeup_fd(-1), warn_on_full_buffer=False)


def _signals_while_closing(loop: asyncio.AbstractEventLoop) -> None:
    """Once told to stop, the (bounded) close ignores SIGTERM again (systemd and the
    supervisor both send it to a worker): asyncio's close() shuts its wakeup pipe
    before removing its handlers, and a signal between the two prints a traceback.
    A second Ctrl-C (SIGINT: only a person sends it) stops the process at once;
    what it was writing is a spool, removed at the next start."""
    # Python handlers, not SIG_IGN: a signal already caught but not yet handled finds
    # SIG_IGN as "ignored due to race condition", with a traceback. The signals wait
    # while the handlers change (between asyncio's removal and ours, SIGTERM's default
    # would kill the process).
    with _stop_signals_held():
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)  # the last one also clears the wakeup fd
        signal.signal(signal.SIGTERM, _stopping_already)
        signal.signal(signal.SIGINT, _exit_now)
    log.info("stopping: closing connections and finishing cache writes (Ctrl-C again: "
             "stop at once)")  # fmt: skip


@contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (pending, not lost) while their handling changes."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _stopping_already(signum: int, frame: object) -> None:
    pass


def _exit_now(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def connection_limit() -> int:
    """Connections served at once: what the descriptor limit leaves room for, as each
    may also hold an open file while it sends one, and origin fetches need some."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - 256) // 2)


class _LimitedSite(web.TCPSite):
    """aiohttp's TCP site, each new connection beyond ``limit`` open ones answered
    ``503`` and closed at once (nginx's ``worker_connections``); with ``hit`` (and
    ``miss``), each connection's protocol answers hits (and fills misses) itself
    (:mod:`.hits`)."""

    __slots__ = ("_limit", "_hit", "_miss")

    def __init__(self, runner: web.AppRunner, host: str, port: int, limit: int, *,
                 reuse_port: bool = False, hit: Callable[[Head], Hit | None] | None = None,
                 miss: Callable[[Head], Filling | None] | None = None) -> None:  # fmt: skip
        super().__init__(runner, host, port, backlog=1024, reuse_port=reuse_port or None)
        self._limit = limit
        self._hit = hit
        self._miss = miss

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert isinstance(server, web.Server)
        handler = server if self._hit is None else handler_factory(server, self._hit, self._miss)
        limit = self._limit
        refusals = _RateLimited(BAD_REQUEST_LINES)
        loop = asyncio.get_running_loop()
        # Connections accepted in this pass of the event loop: a handler counts in
        # server.connections only from its connection_made, which runs after every
        # accept of the pass; the count is cleared just before those run.
        accepting = [0]

        def accepted() -> None:
            accepting[0] = 0

        def connection() -> asyncio.BaseProtocol:
            if len(server.connections) + accepting[0] < limit:
                if not accepting[0]:
                    loop.call_soon(accepted)
                accepting[0] += 1
                return handler()
            if refusals.allow():
                log.warning("%d connections are open (the most this edge serves): "
                            "refusing more%s", limit, refusals.suppressed_note())  # fmt: skip
            return _Refused()

        self._server = await loop.create_server(
            connection, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
        )  # fmt: skip


class _Refused(asyncio.Protocol):
    """A connection over the limit: told so, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
            b"Content-Length: 0\r\n\r\n"
        )
        transport.close()


class _RateLimited:
    """At most ``per_minute`` events a minute pass; the others are counted, and the
    next to pass says how many were not shown."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._window = 0.0
        self._shown = 0
        self._suppressed = 0

    def allow(self) -> bool:
        now = time.monotonic()
        if now - self._window >= 60.0:
            self._window, self._shown = now, 0
        if self._shown >= self.per_minute:
            self._suppressed += 1
            return False
        self._shown += 1
        return True

    def suppressed_note(self) -> str:
        n, self._suppressed = self._suppressed, 0
        return f" ({n} more not logged in the last minute)" if n else ""


class _BadRequestLines(logging.Filter):
    """aiohttp logs every request it cannot parse, and every client that hangs up,
    with a traceback: any client could flood the log. Each becomes one short line,
    at most :data:`BAD_REQUEST_LINES` a minute. Other errors (the edge's own
    bugs) keep their traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._limit = _RateLimited(BAD_REQUEST_LINES)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (HttpProcessingError, ConnectionError)):
            return True
        if not self._limit.allow():
            return False
        reason = str(exc).splitlines()[0][:160] if str(exc) else ""
        record.msg = "bad request: %s: %s%s"
        record.args = (type(exc).__name__, reason, self._limit.suppressed_note())
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True
