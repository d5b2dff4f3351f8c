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

import logging

from aiohttp import web

from kvcdn.errors import InputError
from kvcdn.keys import KeyInfo
from kvcdn.signing import TrustPolicy

from .admin import Admin
from .auth import Access
from .cache import DiskCache
from .fill import MAX_STALE_S, FetchError, Filler
from .metrics import Metrics
from .origin import Origin
from .respond import answer, s3_error
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
from .verify import cache_control, check_key

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20  # only POST /warm has a body: one of admin.MAX_WARM_KEYS keys fits
MAX_LINE = 8190
MAX_FIELD = 8190


class Edge:
    """One edge node: a disk cache, its origins (parent edges first), its tokens.

    ``trust`` (publisher keys) lets the edge verify signed manifests and keep
    them for good, and refuse unsigned ones; ``s3_keys`` makes S3 clients
    authenticate with AWS Signature V4.
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
        max_stale_s: float = MAX_STALE_S,
    ) -> None:
        self.cache = cache
        self.origins = origins
        self.trust = trust
        self.access = Access(read_token, admin_token, s3_keys)
        self.view = view or BucketView("kvcdn")
        self.shaper = shaper  # sends bodies no faster than a rate or a trace
        self.metrics = Metrics()
        self.fill = Filler(cache, origins, self.metrics, trust=trust, max_stale_s=max_stale_s)
        self.admin = Admin(
            self.access, self.fill.ensure, warm_concurrency=warm_concurrency, shaper=shaper
        )

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

    async def _close(self, app: web.Application) -> None:
        await self.fill.finish_writes(timeout_s=10)
        await self.admin.close()
        for origin in self.origins:
            await origin.close()

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
        return web.Response(text=self.metrics.prometheus(self.cache), content_type="text/plain")

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
        try:
            return answer(
                request, key, found, cache_control=cache_control(info, self.trust), s3=s3,
                metrics=self.metrics, shaper=self.shaper,
            )  # fmt: skip
        finally:
            found.release()  # FileBody takes its own handle; anything unsent is closed here


def run(edge: Edge, host: str, port: int) -> None:
    """Serve until interrupted; :class:`InputError` when the address cannot be listened on."""
    try:
        web.run_app(
            edge.app(),
            host=host,
            port=port,
            access_log=None,
            print=None,
            max_line_size=MAX_LINE,  # passed on to each connection's request parser
            max_field_size=MAX_FIELD,
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputError(f"cannot listen on {host}:{port}: {reason}") from None
