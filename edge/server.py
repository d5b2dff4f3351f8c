"""The edge cache node: an asyncio HTTP server in front of the object store.

``GET``/``HEAD /{key}`` serve any servable store key (see :mod:`.verify`) with
byte ranges (206, 416), ETags and conditional GETs, and Cache-Control that
lets any standard HTTP cache sit in front of or behind the edge. A miss is
read through from the origin (or a parent edge first); concurrent misses for
one key share a single origin fetch. Bytes are verified before they are
cached and every time they are served from disk.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from dataclasses import dataclass, field

from aiohttp import web

from .cache import DiskCache
from .origin import Origin, OriginFailed, OriginMissing
from .verify import VerifyError, cache_control, check_key, etag, verify

log = logging.getLogger(__name__)

POINTER_TTL_S = 5.0  # how long the edge itself reuses a pointer (latest.json, ...)
MAX_LINE = 8190
MAX_FIELD = 8190
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class FetchError(Exception):
    """A miss that could not be served; one instance is shared by coalesced waiters."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Metrics:
    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    bytes_served: int = 0
    origin_fetches: int = 0
    origin_seconds: float = 0.0
    origin_errors: int = 0
    verify_failures: int = 0
    requests: dict[int, int] = field(default_factory=dict)


class Edge:
    def __init__(
        self,
        cache: DiskCache,
        origins: list[Origin],
        read_token: str | None = None,
    ) -> None:
        self.cache = cache
        self.origins = origins
        self.read_token = read_token
        self.metrics = Metrics()
        self._inflight: dict[str, asyncio.Future[tuple[bytes, str]]] = {}
        self._pointers: dict[str, tuple[float, bytes, str]] = {}

    # ---- the app -------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20, middlewares=[self._count])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/{key:.+}", self.serve)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        for origin in self.origins:
            await origin.close()

    @web.middleware
    async def _count(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            self.metrics.requests[exc.status] = self.metrics.requests.get(exc.status, 0) + 1
            raise
        self.metrics.requests[response.status] = self.metrics.requests.get(response.status, 0) + 1
        return response

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics_page(self, request: web.Request) -> web.Response:
        m = self.metrics
        lines = [
            "# TYPE kvcdn_edge_hits_total counter",
            f"kvcdn_edge_hits_total {m.hits}",
            "# TYPE kvcdn_edge_misses_total counter",
            f"kvcdn_edge_misses_total {m.misses}",
            "# TYPE kvcdn_edge_coalesced_waiters_total counter",
            f"kvcdn_edge_coalesced_waiters_total {m.coalesced}",
            "# TYPE kvcdn_edge_bytes_served_total counter",
            f"kvcdn_edge_bytes_served_total {m.bytes_served}",
            "# TYPE kvcdn_edge_origin_fetch_seconds summary",
            f"kvcdn_edge_origin_fetch_seconds_sum {m.origin_seconds:.6f}",
            f"kvcdn_edge_origin_fetch_seconds_count {m.origin_fetches}",
            "# TYPE kvcdn_edge_origin_errors_total counter",
            f"kvcdn_edge_origin_errors_total {m.origin_errors}",
            "# TYPE kvcdn_edge_evictions_total counter",
            f"kvcdn_edge_evictions_total {self.cache.evictions}",
            "# TYPE kvcdn_edge_verify_failures_total counter",
            f"kvcdn_edge_verify_failures_total {m.verify_failures}",
            "# TYPE kvcdn_edge_cache_bytes gauge",
            f"kvcdn_edge_cache_bytes {self.cache.bytes}",
            "# TYPE kvcdn_edge_cache_objects gauge",
            f"kvcdn_edge_cache_objects {len(self.cache)}",
            "# TYPE kvcdn_edge_responses_total counter",
            *(
                f'kvcdn_edge_responses_total{{code="{c}"}} {n}'
                for c, n in sorted(m.requests.items())
            ),
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # ---- serving -------------------------------------------------------------
    async def serve(self, request: web.Request) -> web.StreamResponse:
        self._authorise(request, self.read_token)
        key = request.match_info["key"]
        kind = check_key(key)
        if kind is None:
            raise web.HTTPNotFound(text=f"not a kvcdn key: {key[:200]}\n")
        try:
            data, tag = await self._object(key, kind)
        except FetchError as exc:  # a fresh response per request, even for shared failures
            return web.Response(status=exc.status, text=f"{exc}\n")
        headers = {"ETag": tag, "Cache-Control": cache_control(kind), "Accept-Ranges": "bytes"}
        if _matches(request.headers.get("If-None-Match"), tag):
            return web.Response(status=304, headers=headers)
        content_type = "application/json" if key.endswith(".json") else "application/octet-stream"
        status, body = 200, data
        spec = request.headers.get("Range")
        span = None
        if spec is not None and _matches(request.headers.get("If-Range", tag), tag):
            span = _parse_range(spec, len(data))
            if span == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{len(data)}"
                return web.Response(status=416, headers=headers)
        if isinstance(span, tuple) and span != (0, len(data) - 1):
            start, end = span
            status, body = 206, data[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        if request.method != "HEAD":
            self.metrics.bytes_served += len(body)
        return web.Response(status=status, body=body, headers=headers, content_type=content_type)

    def _authorise(self, request: web.Request, token: str | None) -> None:
        if token is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise web.HTTPUnauthorized(
                text="a valid bearer token is required\n",
                headers={"WWW-Authenticate": 'Bearer realm="kvcdn-edge"'},
            )

    async def _object(self, key: str, kind: str) -> tuple[bytes, str]:
        if kind == "pointer":
            cached = self._pointers.get(key)
            if cached and time.monotonic() - cached[0] < POINTER_TTL_S:
                self.metrics.hits += 1
                return cached[1], cached[2]
        else:
            entry = self.cache.lookup(key)
            if entry is not None:
                data = await asyncio.to_thread(self.cache.read, entry)
                if data is not None:
                    try:
                        await asyncio.to_thread(verify, key, kind, data)
                        self.metrics.hits += 1
                        return data, entry.etag
                    except VerifyError as exc:
                        self.metrics.verify_failures += 1
                        log.warning("cached copy of %s is damaged, refetching: %s", key, exc)
                        self.cache.drop(key)
        waiting = self._inflight.get(key)
        if waiting is not None:
            self.metrics.coalesced += 1
            return await asyncio.shield(waiting)
        self.metrics.misses += 1
        future: asyncio.Future[tuple[bytes, str]] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await self._fetch(key, kind)
            future.set_result(result)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
        finally:
            del self._inflight[key]
        return await future

    async def _fetch(self, key: str, kind: str) -> tuple[bytes, str]:
        last: Exception | None = None
        for origin in self.origins:
            start = time.perf_counter()
            try:
                data = await origin.fetch(key)
            except OriginMissing:
                raise FetchError(404, f"{key} does not exist at the origin") from None
            except OriginFailed as exc:
                self.metrics.origin_errors += 1
                last = exc
                continue
            finally:
                self.metrics.origin_fetches += 1
                self.metrics.origin_seconds += time.perf_counter() - start
            try:
                await asyncio.to_thread(verify, key, kind, data)
            except VerifyError as exc:
                self.metrics.verify_failures += 1
                log.error("origin %s sent bad bytes for %s: %s", origin.url, key, exc)
                last = OriginFailed(f"{origin.url} sent bytes that fail verification: {exc}")
                continue
            tag = etag(data)
            if kind == "pointer":
                self._pointers[key] = (time.monotonic(), data, tag)
            else:
                await asyncio.to_thread(self.cache.store, key, data, tag)
            return data, tag
        assert last is not None
        if isinstance(last, OriginFailed) and last.timeout:
            raise FetchError(504, f"origin timed out fetching {key}: {last}")
        raise FetchError(502, f"cannot fetch {key}: {last}")


def _matches(header: str | None, tag: str) -> bool:
    if header is None:
        return False
    values = [v.strip().removeprefix("W/") for v in header.split(",")]
    return "*" in values or tag in values


def _parse_range(spec: str, size: int) -> tuple[int, int] | str | None:
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


def run(edge: Edge, host: str, port: int) -> None:
    """Serve until interrupted."""
    web.run_app(
        edge.app(),
        host=host,
        port=port,
        access_log=None,
        print=None,
        handler_args={"max_line_size": MAX_LINE, "max_field_size": MAX_FIELD},
    )
