"""The admin endpoints, behind the admin token (:mod:`.auth`).

* ``POST /warm`` with ``{"keys": [...]}`` starts a warm job (:mod:`.warm`),
  ``GET /warm/{id}`` is one job's progress and ``GET /warm`` all recent jobs;
* ``GET /shaping`` reads a shaped edge's trace clock, and ``POST /shaping``
  with ``{"offset_s": S}`` replays its trace from ``S`` (:mod:`.shaping`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from .auth import Access
from .shaping import LinkShaper
from .verify import check_key
from .warm import Ensure, JobBoard, WarmBusy, Warmer

log = logging.getLogger(__name__)

#: Keys in one warm request: a store key is at most about 190 characters, so 4,096 of
#: them fit in MAX_BODY (clients send larger sets as several jobs).
MAX_WARM_KEYS = 4096
#: The largest request body an edge reads (only admin requests have one).
MAX_BODY = 1 << 20
#: Admin requests served at once; more are answered 503 before their body is read,
#: so bodies in memory are at most ADMIN_AT_ONCE * MAX_BODY.
ADMIN_AT_ONCE = 4
#: A request body must have arrived this long after its headers.
BODY_TIMEOUT_S = 10.0


class Admin:
    """The admin routes of one edge; ``ensure`` fetches one key for warm jobs."""

    def __init__(
        self,
        access: Access,
        ensure: Ensure,
        *,
        warm_concurrency: int = 8,
        shaper: LinkShaper | None = None,
        board: JobBoard | None = None,
    ) -> None:
        self.access = access
        self.shaper = shaper
        self._ensure = ensure
        self._board = board  # several workers: warm jobs shown to each other
        self._warm_concurrency = warm_concurrency
        self.warmer: Warmer | None = None  # made on start-up, inside the event loop
        self._busy = 0  # admin requests being served

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/warm", self.warm)
        router.add_get("/warm", self.warm_jobs)
        router.add_get("/warm/{id:[0-9a-f]{16}}", self.warm_status)
        router.add_get("/shaping", self.shaping)
        router.add_post("/shaping", self.shaping)

    async def start(self) -> None:
        self.warmer = Warmer(self._ensure, self._warm_concurrency, self._board)

    async def close(self) -> None:
        if self.warmer is not None:
            await self.warmer.close()

    # ---- request bodies ----------------------------------------------------------
    async def _json_body(self, request: web.Request, shape: str) -> object:
        """The request's JSON body: at most MAX_BODY bytes, arrived within BODY_TIMEOUT_S,
        read by at most ADMIN_AT_ONCE requests at a time (503 beyond)."""
        if request.content_length is not None and request.content_length > MAX_BODY:
            raise web.HTTPRequestEntityTooLarge(
                max_size=MAX_BODY, actual_size=request.content_length,
                text=f"a request body is at most {MAX_BODY} bytes\n",
            )  # fmt: skip
        if self._busy >= ADMIN_AT_ONCE:
            raise web.HTTPServiceUnavailable(
                text=f"{ADMIN_AT_ONCE} admin requests are being served; try again\n",
                headers={"Retry-After": "1"},
            )
        self._busy += 1
        try:
            data = await asyncio.wait_for(_read_at_most(request, MAX_BODY), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(text="the request body did not arrive in time\n") from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            # the client went away: there is no one to answer
            log.info("admin request from %s ended early: %s", request.remote, exc)
            raise web.HTTPBadRequest(text="the request body ended early\n") from None
        finally:
            self._busy -= 1
        if data is None:
            raise web.HTTPRequestEntityTooLarge(
                max_size=MAX_BODY, actual_size=MAX_BODY + 1,
                text=f"a request body is at most {MAX_BODY} bytes\n",
            )  # fmt: skip
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise web.HTTPBadRequest(text=f"the body must be JSON: {shape}\n") from None

    # ---- warming -------------------------------------------------------------
    async def warm(self, request: web.Request) -> web.Response:
        """``POST /warm`` with ``{"keys": [...]}``: fetch them in the background."""
        self.access.check_admin(request)
        assert self.warmer is not None
        body = await self._json_body(request, '{"keys": [...]}')
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise web.HTTPBadRequest(text='the body must be JSON: {"keys": ["objects/..", ...]}\n')
        if len(keys) > MAX_WARM_KEYS:
            raise web.HTTPRequestEntityTooLarge(
                max_size=MAX_WARM_KEYS,
                actual_size=len(keys),
                text=f"at most {MAX_WARM_KEYS} keys\n",
            )
        bad = [k for k in keys if check_key(k) is None]
        if bad:
            shown = ", ".join(repr(k[:200]) for k in bad[:5])
            raise web.HTTPBadRequest(text=f"{len(bad)} keys are not kvcdn keys: {shown}\n")
        try:
            job, started = self.warmer.submit(keys)
        except WarmBusy as exc:
            raise web.HTTPServiceUnavailable(text=f"{exc}\n") from None
        return web.json_response(
            job, status=202 if started else 200, headers={"Location": f"/warm/{job['id']}"}
        )

    async def warm_status(self, request: web.Request) -> web.Response:
        self.access.check_admin(request)
        assert self.warmer is not None
        job = self.warmer.status(request.match_info["id"])
        if job is None:
            raise web.HTTPNotFound(text="no such warm job (finished jobs are kept a while)\n")
        return web.json_response(job)

    async def warm_jobs(self, request: web.Request) -> web.Response:
        self.access.check_admin(request)
        assert self.warmer is not None
        jobs = [{k: v for k, v in j.items() if k != "errors"} for j in self.warmer.statuses()]
        return web.json_response({"jobs": jobs})

    # ---- link shaping ----------------------------------------------------------
    async def shaping(self, request: web.Request) -> web.Response:
        """``GET /shaping``: the shaped link's trace clock. ``POST /shaping`` with
        ``{"offset_s": S}``: replay the trace from ``S`` now, on an idle link, so
        that runs of an experiment see the same bandwidth (admin token)."""
        self.access.check_admin(request)
        if self.shaper is None:
            raise web.HTTPNotFound(text="this edge does not shape its link\n")
        if request.method == "POST":
            body = await self._json_body(request, '{"offset_s": S}')
            try:
                offset = float(body["offset_s"])  # type: ignore[index]
            except (ValueError, KeyError, TypeError):
                raise web.HTTPBadRequest(text='the body must be JSON: {"offset_s": S}\n') from None
            if not 0 <= offset < 1e9:
                raise web.HTTPBadRequest(text="offset_s must be a non-negative number\n")
            self.shaper.restart(offset)
        return web.json_response({"trace_time_s": self.shaper.trace_time()})


async def _read_at_most(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None when it is longer than ``limit`` bytes (nothing of it
    is kept then: an error raised here would hold the part read until the response is
    gone, and aiohttp's own ``read()`` does)."""
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)

