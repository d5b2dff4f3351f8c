"""Where an edge fetches what it does not hold: the object store, or a parent edge."""

from __future__ import annotations

import asyncio
import logging
import re
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol
from urllib.parse import quote

import aiohttp

from kvcdn.errors import NotFound
from kvcdn.store import Cancel, check_endpoint_url, open_store

from .cache import Spool, SpoolFull
from .origin_errors import OriginFailed, OriginMissing, Unexpected
from .presigned import PresignedGets

log = logging.getLogger(__name__)

FETCH_THREADS = 64
MAX_LISTING_BYTES = 16 << 20  # one page of a parent's listing, held in memory to parse
#: Listings read from an HTTP origin at once: each holds up to MAX_LISTING_BYTES.
LISTINGS_AT_ONCE = 4
LISTING_PIECE = 1 << 20  # bytes of a listing's body read at a time
#: Answers to a presigned GET that say it will never work here: a bucket in another
#: region (301, 400), a store that refuses query signatures (400, 403, 501).
SIGNING_REFUSED = frozenset({301, 307, 400, 403, 501})
PROBE_KEY = "kvcdn-edge-probe"  # signed, never fetched


class Origin(Protocol):
    url: str

    async def fetch(self, key: str, spool: Spool) -> None:
        """Write the bytes of ``key`` into ``spool`` as they arrive; :class:`OriginMissing`
        when the origin does not have it, :class:`OriginFailed` when it fails or sends
        more than the spool takes."""
        ...

    async def list(self, prefix: str) -> dict[str, int]:
        """Keys starting with ``prefix`` and their sizes."""
        ...

    async def close(self) -> None: ...


class StoreOrigin:
    """An object store (``s3://bucket/prefix`` or a folder) through kvcdn's store layer.

    Where the store gives presigned URLs (S3), an object is one GET on the edge's own
    event loop (:mod:`.presigned`), streamed into its spool as it arrives: no thread,
    no second event loop (s3fs's) and no per-piece hand-over between them, which had
    cost a miss several times nginx's CPU. Anything but a 200 with a length or a 404
    there (a bucket in another region, a throttled request) is read once more through
    the store's client, with its retries and redirects; so is every read of a folder
    store."""

    def __init__(self, url: str, timeout_s: float, endpoint_url: str | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        # an edge never makes its origin
        self._store = open_store(url, endpoint_url=endpoint_url, create=False)
        # The store's client blocks; its own pool keeps many fetches in flight
        # (the default executor has only a few threads, shared with hashing).
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="origin")
        self._gets = PresignedGets(url, timeout_s)
        self._presigned = True
        # the signer (a botocore client, ~0.1 s to make) is made now, not by the first miss
        self._store.presigned_get(PROBE_KEY)

    async def fetch(self, key: str, spool: Spool) -> None:
        signed = self._store.presigned_get(key) if self._presigned else None
        if signed is not None:
            try:
                # a redirect is not followed: where a store sends a signed request is the
                # store client's business (region redirects), never an arbitrary host's
                return await self._gets.fetch(signed, key, spool.write, spool.limit)
            except Unexpected as exc:
                if exc.status in SIGNING_REFUSED:
                    # the bucket is elsewhere, or the store does not take query signatures:
                    # the store's client (which follows redirects) reads from now on
                    self._presigned = False
                    log.warning("%s to a presigned GET; the edge reads %s through the "
                                "store's client from now on", exc, self.url)  # fmt: skip
                else:
                    log.info("%s; reading it through the store's client", exc)
        await self._fetch_in_thread(key, spool)

    async def _fetch_in_thread(self, key: str, spool: Spool) -> None:
        loop = asyncio.get_running_loop()
        cancel = Cancel()  # the thread stops between two pieces once the fetch is given up

        def copy() -> None:
            for piece in self._store.pieces(key, max_bytes=spool.limit, cancel=cancel):
                spool.write(piece)

        try:
            await asyncio.wait_for(loop.run_in_executor(self._pool, copy), self.timeout_s)
        except NotFound:
            raise OriginMissing(key) from None
        except asyncio.TimeoutError:
            raise OriginFailed(f"origin {self.url} timed out on {key}", timeout=True) from None
        except Exception as exc:  # the store raises typed errors; anything else is a failure too
            raise OriginFailed(f"origin {self.url} failed on {key}: {exc}") from None
        finally:
            cancel.set()

    async def list(self, prefix: str) -> dict[str, int]:
        folder = prefix[: prefix.rfind("/") + 1]  # the store lists folder-like prefixes
        try:
            found = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(
                    self._pool, self._store.list_sizes, folder
                ),
                self.timeout_s,
            )
        except asyncio.TimeoutError:
            raise OriginFailed(
                f"origin {self.url} timed out listing {prefix}", timeout=True
            ) from None
        except Exception as exc:
            raise OriginFailed(f"origin {self.url} failed listing {prefix}: {exc}") from None
        return {k: n for k, n in found.items() if k.startswith(prefix)}

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        await self._gets.close()


class _HTTPReads:
    """GETs whose bodies stream into spools, on the edge's event loop: one session,
    made on first use (a session belongs to the loop it was made on)."""

    def __init__(self, origin: str, timeout_s: float, headers: dict[str, str]) -> None:
        self.origin = origin  # named in errors, never the URL asked (a presigned one is a key)
        self.timeout_s = timeout_s
        # Bodies are taken as sent: a compressed body would be a few megabytes on
        # the wire and gigabytes in memory (and it fails verification anyway).
        self.headers = {"Accept-Encoding": "identity", **headers}
        self._session: aiohttp.ClientSession | None = None

    def client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers=self.headers,
                auto_decompress=False,
            )
        return self._session

    async def stream(self, url: str, key: str, spool: Spool) -> None:
        """GET ``url`` (the object ``key``) into ``spool``: :class:`OriginMissing` on a
        404, :class:`Unexpected` on another answer, :class:`OriginFailed` when the
        request fails or sends more than the spool takes."""
        try:
            async with self.client().get(url) as resp:
                if resp.status == 404:
                    raise OriginMissing(key)
                if resp.status != 200:
                    raise Unexpected(
                        f"origin {self.origin} answered {resp.status} for {key}", resp.status
                    )
                check_length(self.origin, resp, spool.limit, key)
                # written and hashed as it arrives, on the event loop (Spool.write): the
                # edge holds a read of the socket per miss, never an object
                async for data in resp.content.iter_any():
                    spool.write(data)
        except asyncio.TimeoutError:
            raise OriginFailed(f"origin {self.origin} timed out on {key}", timeout=True) from None
        except aiohttp.ClientError as exc:
            # the exception's text may hold the URL, and a presigned URL's query is a credential
            text = re.sub(r"\?\S*", "?...", str(exc) or type(exc).__name__)
            raise OriginFailed(f"origin {self.origin} failed on {key}: {text}") from None
        except SpoolFull as exc:
            raise OriginFailed(f"origin {self.origin} sent {key}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def check_length(origin: str, resp: aiohttp.ClientResponse, max_bytes: int, what: str) -> None:
    """Refuse a body announced longer than ``max_bytes`` before reading it."""
    if (resp.content_length or 0) > max_bytes:
        raise OriginFailed(
            f"origin {origin} announced {resp.content_length} bytes for {what}, more than it can be"
        )


class HTTPOrigin:
    """Any HTTP server with keys as paths: a parent edge, or a CDN in front of the store."""

    def __init__(self, url: str, timeout_s: float, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = _HTTPReads(self.url, timeout_s, {"Authorization": f"Bearer {token}"}
                                if token else {})  # fmt: skip
        self._listings = asyncio.Semaphore(LISTINGS_AT_ONCE)

    async def fetch(self, key: str, spool: Spool) -> None:
        await self._http.stream(f"{self.url}/{quote(key)}", key, spool)

    async def _body(self, resp: aiohttp.ClientResponse, max_bytes: int, what: str) -> bytes:
        """A small response body (a listing), refused past ``max_bytes``."""
        check_length(self.url, resp, max_bytes, what)
        pieces, size = [], 0
        async for piece in resp.content.iter_chunked(LISTING_PIECE):
            size += len(piece)
            if size > max_bytes:
                raise OriginFailed(f"origin {self.url} sent more than {max_bytes} bytes for {what}")
            pieces.append(piece)
        return b"".join(pieces)

    async def list(self, prefix: str) -> dict[str, int]:
        """A parent edge lists store keys at its root (``GET /?list-type=2``)."""
        found: dict[str, int] = {}
        query = {"list-type": "2", "prefix": prefix}
        try:
            while True:
                async with self._listings, self._http.client().get(f"{self.url}/", params=query
                                                              ) as resp:  # fmt: skip
                    if resp.status != 200:
                        raise OriginFailed(f"origin {self.url} answered {resp.status} to a listing")
                    root = ET.fromstring(await self._body(resp, MAX_LISTING_BYTES, "a listing"))
                ns = {"s3": root.tag[1 : root.tag.index("}")]} if root.tag.startswith("{") else {}
                p = "s3:" if ns else ""
                for item in root.iterfind(f"{p}Contents", ns):
                    found[item.findtext(f"{p}Key", "", ns)] = int(
                        item.findtext(f"{p}Size", "0", ns)
                    )
                token = root.findtext(f"{p}NextContinuationToken", None, ns)
                if root.findtext(f"{p}IsTruncated", "false", ns) != "true" or not token:
                    return found
                query["continuation-token"] = token
        except asyncio.TimeoutError:
            raise OriginFailed(
                f"origin {self.url} timed out listing {prefix}", timeout=True
            ) from None
        except (aiohttp.ClientError, ET.ParseError, ValueError) as exc:
            raise OriginFailed(f"origin {self.url} failed listing {prefix}: {exc}") from None

    async def close(self) -> None:
        await self._http.close()


def open_origin(
    url: str,
    timeout_s: float = 30.0,
    token: str | None = None,
    *,
    endpoint_url: str | None = None,
) -> Origin:
    """A parent edge (``http(s)://``), else a store, which must exist.

    ``endpoint_url`` is the S3-compatible endpoint of an ``s3://`` store
    (None: boto's own configuration, ``AWS_ENDPOINT_URL`` included)."""
    if url.startswith(("http://", "https://")):
        return HTTPOrigin(check_endpoint_url(url) or url, timeout_s, token)
    return StoreOrigin(url, timeout_s, check_endpoint_url(endpoint_url))
