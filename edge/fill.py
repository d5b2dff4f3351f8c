"""Filling the edge from its origins: what a request for a key finds, and listings.

A miss is read through from the origins in order (parent edges first, the
object store last). Concurrent misses for one key share a single fetch, which
runs as a task of its own so that a client going away does not cancel it for
the others. A fetch streams into a spool in the cache folder, hashed as it
arrives (:class:`~.cache.Spool`), so the edge holds one read of the socket for
each miss in memory, never an object; the spooled bytes are verified (:mod:`.verify`)
before anyone sees them, renamed into the cache, and sent from the file.
Cached bytes are verified again on their first use from disk after a start,
or after their file changed, a piece at a time.

Pointers (and manifests the edge cannot verify) are revalidated: held in
memory for a few seconds, then fetched again; while the origin is down the
last good copy is served stale (RFC 9111's stale-if-error), but never past
the expiry its publisher signed into it, and a refreshed pointer never goes
back to an older version than the one held.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import BinaryIO, Generic, NamedTuple, TypeVar

from kvcdn.keys import KeyInfo
from kvcdn.manifest import format_expiry
from kvcdn.signing import TrustPolicy

from .cache import DiskCache, Entry, Spool, SpoolFull, stamp_of
from .metrics import Metrics
from .origin import Origin, OriginFailed, OriginMissing
from .shared import LedgerBusy
from .verify import (
    CONTENT_ADDRESSED,
    Verified,
    VerifyError,
    check_key,
    max_bytes,
    revalidated,
    verify,
    verify_content,
    verify_file,
)

log = logging.getLogger(__name__)

POINTER_TTL_S = 5  # how long the edge itself reuses a pointer (latest.json, ...), by default
LISTING_TTL_S = 5.0  # and a listing of the origin
MAX_STALE_S = 86400.0  # a pointer is served this stale at most while the origin is down

# Every map below is keyed by what requests name, so each has a bound; beyond it
# the least recently used entries are dropped (or, for fills, new ones refused).
#
# Pointers (and, without trust keys, manifests) held in memory. Any number of
# document names can be asked for; 10,000 covers the documents a busy edge serves
# at once. A dropped one is fetched again, and its disk copy still serves
# stale-if-error and the rollback check.
MAX_POINTERS = 10_000
# ... and their bytes: a pointer is at most 64 KiB, but an unsigned manifest held
# here may be 64 MiB, and 10,000 of those would not fit in any edge's memory.
MAX_POINTERS_BYTES = 256 << 20
# Listings of the origin, by prefix (any prefix can be asked for): 1,024 of them,
# and a million keys in all (a key and its size take about 250 bytes here); a
# larger listing is answered but not kept.
MAX_LISTINGS = 1024
MAX_LISTED_KEYS = 1_000_000
# Keys being fetched at once. Each holds a task and a spool (a file, whose bytes
# all spools share a budget of): beyond this a new miss is answered 503 rather than
# queued without end. Far above what the store's 64 fetch threads can move at
# once, so only a flood reaches it.
MAX_FILLS = 4096
# Documents (manifests, pointers) read into memory at once to be verified: each is
# at most 64 MiB (a real one a few MiB at most), so a flood of fetched manifests
# holds at most this many of them.
PARSES_AT_ONCE = 4

K = TypeVar("K")
V = TypeVar("V")


class FetchError(Exception):
    """A miss that could not be served; one instance is shared by coalesced waiters."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Found:
    """An object to send: its bytes in memory, or an open file of verified bytes.

    ``sent`` (bytes of a spool held in memory while the disk is full) is called once
    the response is done with them, whether it was sent or not: the memory counts
    against the spool budget until then."""

    def __init__(
        self,
        etag: str,
        size: int,
        *,
        data: bytes = b"",
        file: BinaryIO | None = None,
        stale: bool = False,
        age_s: float = 0.0,
        sent: Callable[[], None] | None = None,
        expires: int | None = None,
    ) -> None:
        self.etag = etag
        self.size = size
        self.data = data
        self.file = file
        self.stale = stale  # a revalidated object served while the origin is down
        self.age_s = age_s
        self.sent = sent
        self.expires = expires  # a pointer's signed expiry: no cache below keeps it longer

    def take_file(self) -> BinaryIO:
        assert self.file is not None
        f, self.file = self.file, None
        return f

    def take_sent(self) -> Callable[[], None] | None:
        sent, self.sent = self.sent, None
        return sent

    def release(self) -> None:
        """What the response did not take: a file is closed, held bytes let go."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.sent is not None:
            self.take_sent()()  # type: ignore[misc]


class CachedFile(NamedTuple):
    """A verified cached copy, open: the caller closes ``fd``."""

    etag: str
    size: int
    fd: int


class Filled:
    """A fetched, verified object, shared by the requests that waited for its fetch:
    its spool (on disk, or in memory while the disk is full), or a document's bytes."""

    def __init__(self, verified: Verified, size: int, *, spool: Spool | None = None,
                 data: bytes = b"", file: BinaryIO | None = None) -> None:  # fmt: skip
        self.verified = verified
        self.size = size
        self.spool = spool
        self.data = data
        self.file = file  # verified bytes a sibling worker cached while this one waited

    def found(self) -> Found:
        """What one waiter sends, with its own handle on a spooled (or cached) file."""
        etag, expires = self.verified.etag, self.verified.expires
        if self.file is not None:
            dup = os.fdopen(os.dup(self.file.fileno()), "rb")
            return Found(etag, self.size, file=dup, expires=expires)
        if self.spool is None:
            return Found(etag, self.size, data=self.data, expires=expires)
        file, data, sent = self.spool.source()
        return Found(etag, self.size, data=data, file=file, sent=sent, expires=expires)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.discard()
        if self.file is not None:
            self.file.close()


class _Fill:
    """One fetch under way for a key, and how many requests are waiting for it: the
    last to take its result closes it (waiters take their own handles first)."""

    def __init__(self, task: asyncio.Task[Filled]) -> None:
        self.task = task
        self.waiters = 0

    def close_if_unused(self) -> None:
        task = self.task
        if self.waiters == 0 and task.done() and not task.cancelled() and not task.exception():
            task.result().close()


class BoundedLRU(Generic[K, V]):
    """A map that drops its least recently used entries beyond ``max_items`` of them,
    or beyond ``max_weight`` in all, each entry weighing ``weigh(value)``."""

    def __init__(self, max_items: int, max_weight: int, weigh: Callable[[V], int]) -> None:
        self.max_items = max_items
        self.max_weight = max_weight
        self.weight = 0
        self._weigh = weigh
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value held for ``key``, now marked as just used; None if none is."""
        held = self._entries.get(key)
        if held is None:
            return None
        self._entries.move_to_end(key)
        return held[0]

    def put(self, key: K, value: V) -> None:
        """Hold ``value`` for ``key``, as just used. A value heavier than ``max_weight``
        on its own is not held, and neither is what ``key`` held before."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.weight -= old[1]
        weight = self._weigh(value)
        if weight > self.max_weight:
            return
        self._entries[key] = (value, weight)
        self.weight += weight
        while len(self._entries) > self.max_items or self.weight > self.max_weight:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.weight -= dropped


class Filler:
    """What the edge holds or fetches for a key, and what its origins list.

    ``origins`` are asked in order; ``trust`` (publisher keys) decides what
    verifies and what is revalidated; ``pointer_ttl_s`` is how long a revalidated
    copy is reused before the origin is asked again; ``max_stale_s`` bounds how
    stale one may be served while the origins are down.
    """

    def __init__(
        self,
        cache: DiskCache,
        origins: list[Origin],
        metrics: Metrics,
        *,
        trust: TrustPolicy | None = None,
        pointer_ttl_s: int = POINTER_TTL_S,
        max_stale_s: float = MAX_STALE_S,
    ) -> None:
        self.cache = cache
        self.origins = origins
        self.metrics = metrics
        self.trust = trust
        self.pointer_ttl_s = pointer_ttl_s
        self.max_stale_s = max_stale_s
        self._inflight: dict[str, _Fill] = {}  # at most MAX_FILLS
        self._keeping: dict[str, asyncio.Task[None]] = {}  # disk writes of pointers
        self._parses = asyncio.Semaphore(PARSES_AT_ONCE)
        # pointers (and unsigned manifests): when fetched (monotonic), bytes, what they are
        self.pointers: BoundedLRU[str, tuple[float, bytes, Verified]] = BoundedLRU(
            MAX_POINTERS, MAX_POINTERS_BYTES, lambda held: len(held[1])
        )
        # listings by prefix: when fetched (monotonic), servable keys and their sizes
        self._listings: BoundedLRU[str, tuple[float, dict[str, int]]] = BoundedLRU(
            MAX_LISTINGS, MAX_LISTED_KEYS, lambda listing: len(listing[1])
        )

    async def finish_writes(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the disk writes of objects already fetched:
        on shutdown they are worth finishing."""
        if self._keeping:
            await asyncio.wait(list(self._keeping.values()), timeout=timeout_s)

    async def object(self, key: str, info: KeyInfo) -> Found:
        """What to send for ``key``: held, cached or fetched, and verified;
        :class:`FetchError` when it cannot be had."""
        if revalidated(info, self.trust):
            return await self._revalidated(key, info)
        # a worker of several also finds what its siblings cached (a meta file's read)
        entry = self.cache.lookup(key) or self.cache.load(key)
        if entry is not None:
            found = await self._open_cached(entry, info)
            if found is not None:
                self.metrics.hits += 1
                return found
        return await self._miss(key, info)

    def cached(self, key: str, info: KeyInfo) -> CachedFile | None:
        """``key``'s cached copy, opened, when it can be sent at once: an immutable
        object whose file is as it was when last verified. None otherwise (not
        cached, not yet verified in this run, a pointer, a file that vanished): then
        :meth:`object` decides, waiting for what it must."""
        if revalidated(info, self.trust):
            return None
        entry = self.cache.lookup(key) or self.cache.load(key)
        if entry is None or entry.verified is None:
            return None
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            stamp = stamp_of(os.fstat(fd))
        except OSError:
            stamp = None
        if stamp != entry.verified:
            os.close(fd)
            return None
        return CachedFile(entry.etag, stamp[1], fd)

    async def ensure(self, key: str) -> tuple[str, int]:
        """Make ``key`` cached: ("cached", 0) if it was, else ("fetched", its size)."""
        info = check_key(key)
        assert info is not None  # warm requests are checked on arrival
        if not revalidated(info, self.trust) and (
            self.cache.lookup(key) or self.cache.load(key)  # a sibling worker's counts too
        ):
            return "cached", 0
        try:
            found = await self._miss(key, info)
        except FetchError as exc:
            raise RuntimeError(f"{exc} ({exc.status})") from None
        found.release()
        keeping = self._keeping.get(key)
        if keeping is not None:  # "done" means on disk, not only fetched
            await asyncio.shield(keeping)
        return "fetched", found.size

    async def listing(self, prefix: str) -> dict[str, int]:
        """Servable store keys under ``prefix`` with their sizes, from the first origin
        that answers; reused for a few seconds, like pointers. :class:`FetchError`
        (502, or 504 when the last origin timed out) when none answers."""
        cached = self._listings.get(prefix)
        if cached and time.monotonic() - cached[0] < LISTING_TTL_S:
            return cached[1]
        last: Exception | None = None
        for origin in self.origins:
            try:
                found = await origin.list(prefix)
            except OriginFailed as exc:
                last = exc
                continue
            sizes = {k: n for k, n in found.items() if check_key(k) is not None}
            self._listings.put(prefix, (time.monotonic(), sizes))
            return sizes
        status = 504 if isinstance(last, OriginFailed) and last.timeout else 502
        raise FetchError(status, f"cannot list {prefix!r}: {last}")

    async def _revalidated(self, key: str, info: KeyInfo) -> Found:
        """A pointer (or a manifest the edge cannot verify): reused for a few seconds,
        then fetched again; served stale, with a warning, while the origin is down."""
        held = self.pointers.get(key)
        now = time.monotonic()
        if (held is not None and now - held[0] < self.pointer_ttl_s
                and not _expired_since(held[2], now - held[0])):  # fmt: skip
            self.metrics.hits += 1
            return Found(held[2].etag, len(held[1]), data=held[1], expires=held[2].expires)
        try:
            return await self._miss(key, info)
        except FetchError as exc:
            if exc.status == 404:
                raise
            stale = await self._stale_copy(key, info, exc)
            if stale is None:
                raise
            self.metrics.stale_served += 1
            log.warning("origin unavailable: serving %s stale (%.0f s old)", key, stale.age_s)
            return stale

    async def _stale_copy(self, key: str, info: KeyInfo, failure: FetchError) -> Found | None:
        """The last good copy of a revalidated key, if not older than ``max_stale_s``.

        A pointer past the expiry its publisher signed is not served: answering it
        would outlive the publisher's word, which is exactly the replay an expiry
        exists to bound. The origin's ``failure`` is answered instead, saying so.
        No clock-skew allowance here (readers have one): the edge is extending a
        copy's life on its own, so its own clock ends it."""
        held = await self._held(key, info)
        if held is None or held[0] > self.max_stale_s:
            return None
        age, data, verified = held
        if verified.expires is not None and time.time() >= verified.expires:
            self.metrics.stale_expired_refused += 1
            expired = format_expiry(verified.expires)
            log.warning("origin unavailable, and the copy of %s held here expired at %s: "
                        "not serving it stale", key, expired)  # fmt: skip
            raise FetchError(
                failure.status,
                f"{failure}; the copy of {key} this edge holds expired at {expired} "
                "(its publisher's signed expiry), so it is not served stale",
            )
        return Found(verified.etag, len(data), data=data, stale=True, age_s=age,
                     expires=verified.expires)  # fmt: skip

    async def _held(self, key: str, info: KeyInfo) -> tuple[float, bytes, Verified] | None:
        """The copy of a revalidated key this edge holds, and its age in seconds: in
        memory, else on disk (kept before a restart; verified again, its age the file's)."""
        held = self.pointers.get(key)
        if held is not None:
            return time.monotonic() - held[0], held[1], held[2]
        entry = self.cache.lookup(key)
        if entry is None:
            return None
        try:
            age = time.time() - entry.path.stat().st_mtime
            verified, data = await asyncio.to_thread(_verify_path, entry.path, key, info,
                                                     self.trust)  # fmt: skip
        except (OSError, VerifyError) as exc:
            log.warning("dropping the kept copy of %s: %s", key, exc)
            self.cache.drop(key)
            return None
        return age, data, verified

    async def _open_cached(self, entry: Entry, info: KeyInfo) -> Found | None:
        """The cached bytes of ``entry``: sent from the file (sendfile) while the file
        is as it was when last verified; verified again first otherwise (the first use
        after a start, or a file someone changed), a piece at a time."""
        try:
            f = open(entry.path, "rb")  # noqa: SIM115 (handed to the response, which closes it)
        except FileNotFoundError:
            if self.cache.shared is not None:  # a sibling worker evicted it: a plain miss
                self.cache.forget(entry.key)
                return None
            log.warning("cached copy of %s vanished, refetching", entry.key)
            self.cache.drop(entry.key)
            return None
        except OSError as exc:
            log.warning("cached copy of %s is unreadable, refetching: %s", entry.key, exc)
            self.cache.drop(entry.key)
            return None
        try:
            stamp = stamp_of(os.fstat(f.fileno()))
            if stamp != entry.verified:
                self.metrics.cache_verifications += 1
                verified, _ = await asyncio.to_thread(verify_file, entry.key, info, f, self.trust)
                entry.etag = verified.etag  # the same, unless an older edge filled the entry
                if stamp_of(os.fstat(f.fileno())) == stamp:
                    entry.verified = stamp
        except (OSError, VerifyError) as exc:
            f.close()
            self.metrics.verify_failures += isinstance(exc, VerifyError)
            log.warning("cached copy of %s is damaged, refetching: %s", entry.key, exc)
            self.cache.drop(entry.key)
            return None
        return Found(entry.etag, stamp[1], file=f)

    async def _miss(self, key: str, info: KeyInfo) -> Found:
        """Fetch ``key`` once for everyone who asks while the fetch runs."""
        fill = self._inflight.get(key)
        if fill is None:
            if len(self._inflight) >= MAX_FILLS:
                log.debug("refusing a miss for %s: %d fills under way", key, MAX_FILLS)
                raise FetchError(503, f"the edge is fetching {MAX_FILLS} keys: try {key} later")
            self.metrics.misses += 1
            # The fetch is a task of its own: a client that goes away does not
            # cancel the fetch that other clients are waiting for.
            fill = _Fill(asyncio.get_running_loop().create_task(self._fill(key, info)))
            fill.task.add_done_callback(lambda task, f=fill: self._fill_done(key, f))
            self._inflight[key] = fill
        else:
            self.metrics.coalesced += 1
        fill.waiters += 1
        try:
            filled = await asyncio.shield(fill.task)
            return filled.found()  # its own handle, taken before the fill can be closed
        finally:
            fill.waiters -= 1
            fill.close_if_unused()

    def _fill_done(self, key: str, fill: _Fill) -> None:
        if self._inflight.get(key) is fill:
            del self._inflight[key]
        if not fill.task.cancelled():
            fill.task.exception()  # seen: its waiters re-raise it, or nobody waits
        fill.close_if_unused()

    async def _fill(self, key: str, info: KeyInfo) -> Filled:
        shared = self.cache.shared
        if shared is None:
            return await self._fill_here(key, info)
        # Coalescing across worker processes: the worker holding the key's lock fetches
        # it; the others wait for the lock, then find the copy it cached. Polled, so
        # that no thread blocks on it (the pool's threads verify and write for others).
        digest = hashlib.sha256(key.encode()).hexdigest()
        delay = 0.002
        while not shared.try_key(digest):
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.01)  # a sibling's 1 MiB fetch takes ~10 ms
        try:
            if revalidated(info, self.trust):
                return await self._revalidate_shared(key, info)
            entry = self.cache.load(key)
            if entry is not None:
                found = await self._open_cached(entry, info)
                if found is not None:
                    self.metrics.worker_coalesced += 1
                    verified = Verified(etag=found.etag, immutable=True)
                    return Filled(verified, found.size, file=found.take_file())
            return await self._fill_here(key, info)
        finally:
            shared.release_key(digest)

    async def _revalidate_shared(self, key: str, info: KeyInfo) -> Filled:
        """(Holding the key's lock.) A pointer a sibling fetched less than
        :attr:`pointer_ttl_s` ago (its disk copy, written or touched at each fetch, as
        this one's is): verified from its bytes and reused, so N workers ask the origin
        as often as one does. Fetched here otherwise."""
        entry = self.cache.lookup(key) or self.cache.load(key)
        if entry is not None:
            try:
                age = time.time() - entry.path.stat().st_mtime
                if 0 <= age < self.pointer_ttl_s:
                    verified, data = await asyncio.to_thread(
                        _verify_path, entry.path, key, info, self.trust
                    )
                    data, verified, _ = await self._newer_of(key, info, data, verified)
                    if _expired_since(verified, age):  # fetched again, below
                        raise VerifyError(f"{key} passed its signed expiry since it was fetched")
                    self.pointers.put(key, (time.monotonic() - age, data, verified))
                    self.metrics.worker_coalesced += 1
                    return Filled(verified, len(data), data=data)
            except (OSError, VerifyError) as exc:  # gone, or damaged: fetched again
                log.debug("a sibling's copy of %s is not usable: %s", key, exc)
        filled = await self._fill_here(key, info)
        keeping = self._keeping.get(key)
        if keeping is not None:  # on disk before the siblings look
            await asyncio.shield(keeping)
        else:  # unchanged: its copy (whichever worker wrote it) is as fresh as this fetch
            kept = self.cache.lookup(key) or self.cache.load(key)
            if kept is not None:
                with contextlib.suppress(OSError):
                    os.utime(kept.path)
        return filled

    async def _fill_here(self, key: str, info: KeyInfo) -> Filled:
        spool, verified, data = await self._fetch(key, info)
        if not revalidated(info, self.trust):
            # immutable: the verified spool becomes the cached copy (unless it cannot
            # be cached; a content-addressed one already did, see _verify), and waiters
            # send it from the file
            if info.kind not in CONTENT_ADDRESSED:
                await asyncio.to_thread(self.cache.adopt, spool, verified.etag)
            return Filled(verified, spool.size, spool=spool)
        spool.discard()
        assert data is not None  # documents are verified from their bytes
        data, verified, changed = await self._newer_of(key, info, data, verified)
        if verified.expires is not None and time.time() >= verified.expires:
            # Passed on as the origin holds it: the origin is the authority on what is
            # current, and a reader with trust refuses it with a message naming the
            # expiry, which says more than a 502 from here would.
            self.metrics.expired_pointers_fetched += 1
            log.warning("the origin serves %s past its signed expiry (%s): its publisher "
                        "has not refreshed it", key, format_expiry(verified.expires))  # fmt: skip
        self.pointers.put(key, (time.monotonic(), data, verified))
        if changed:  # kept on disk for stale-if-error and restarts: written after
            keeping = asyncio.get_running_loop().create_task(
                self._keep(key, data, verified.etag)
            )
            self._keeping[key] = keeping
        return Filled(verified, len(data), data=data)

    async def _newer_of(
        self, key: str, info: KeyInfo, data: bytes, verified: Verified
    ) -> tuple[bytes, Verified, bool]:
        """What to hold for a refreshed pointer: the fetched one, unless it is older than
        the one held (a replayed signed pointer). Also whether the disk copy must change."""
        held = await self._held(key, info)
        if held is None:
            return data, verified, True
        _, held_data, held_verified = held
        if self.trust is not None and verified.version < held_verified.version:
            self.metrics.rollbacks_refused += 1
            log.error(
                "the origin offers %s at version %d, older than the %d this edge holds: "
                "keeping the newer", key, verified.version, held_verified.version,
            )  # fmt: skip
            return held_data, held_verified, False
        return data, verified, verified.etag != held_verified.etag

    async def _verify(self, key: str, info: KeyInfo, spool: Spool
                      ) -> tuple[Verified, bytes | None]:  # fmt: skip
        """What a fetched spool holds: a content-addressed object by its hash (only its
        header is read back), a document from its bytes (a few at a time).

        A content-addressed object is made the cached copy of its key at once, on the
        event loop: a rename and a small meta file, cheaper than a hand-over to a
        thread. With sibling workers that takes the shared ledger's lock, which a
        sibling may hold for a whole eviction scan: when it is held (or the folder is
        full, and this adopt would scan it), in a thread. A thread for every miss had
        cost about 65 futex calls a miss, the GIL passed back and forth around each of
        the thread's system calls."""
        if info.kind in CONTENT_ADDRESSED:
            checked = verify_content(
                key, info, size=spool.size, sha256=spool.sha256, read_at=spool.read_at
            )
            try:
                self.cache.adopt(spool, checked.etag, wait=False)
            except LedgerBusy:  # nothing was changed: done where waiting is harmless
                await asyncio.to_thread(self.cache.adopt, spool, checked.etag)
            return checked, None
        async with self._parses:
            data = await asyncio.to_thread(spool.read_all)
            return await asyncio.to_thread(verify, key, info, data, self.trust), data

    async def _keep(self, key: str, data: bytes, tag: str) -> None:
        try:
            await asyncio.to_thread(self.cache.store, key, data, tag)
        finally:
            self._keeping.pop(key, None)

    async def _fetch(self, key: str, info: KeyInfo) -> tuple[Spool, Verified, bytes | None]:
        """The first origin's verified spool of ``key``, what it is, and a document's
        bytes (None for a content-addressed object, which is never read whole)."""
        last: Exception | None = None
        for origin in self.origins:
            start = time.perf_counter()
            spool = self.cache.spool(key, max_bytes(info))
            try:
                await origin.fetch(key, spool)
            except OriginMissing:
                spool.discard()
                raise FetchError(404, f"{key} does not exist at the origin") from None
            except OriginFailed as exc:
                spool.discard()
                self.metrics.origin_errors += 1
                last = exc
                continue
            except BaseException:  # cancelled (shutdown), or a bug: nothing is left behind
                spool.discard()
                raise
            finally:
                self.metrics.origin_fetches += 1
                self.metrics.origin_seconds += time.perf_counter() - start
            try:
                verified, data = await self._verify(key, info, spool)
            except VerifyError as exc:
                spool.discard()
                self.metrics.verify_failures += 1
                log.error("origin %s sent bad bytes for %s: %s", origin.url, key, exc)
                last = OriginFailed(f"{origin.url} sent bytes that fail verification: {exc}")
                continue
            except SpoolFull as exc:  # its last piece found the spools' budget spent
                spool.discard()
                last = OriginFailed(f"origin {origin.url} sent {key}: {exc}")
                continue
            except BaseException:
                spool.discard()
                raise
            return spool, verified, data
        assert last is not None
        if isinstance(last, OriginFailed) and last.timeout:
            raise FetchError(504, f"origin unavailable (timed out) fetching {key}: {last}")
        raise FetchError(502, f"origin unavailable: cannot fetch {key}: {last}")


def _expired_since(verified: Verified, age_s: float) -> bool:
    """Whether a pointer fetched ``age_s`` ago has passed its signed expiry since: it is
    then fetched again rather than reused for the rest of ``--pointer-ttl`` (and if the
    origin is down, not served stale either). One the origin served already expired is
    its authority's answer, passed on and reused like any other (readers refuse it)."""
    if verified.expires is None:
        return False
    now = time.time()
    return now - age_s < verified.expires <= now


def _verify_path(
    path: os.PathLike[str], key: str, info: KeyInfo, trust: TrustPolicy | None
) -> tuple[Verified, bytes]:
    """A kept document's verified bytes (pointers and manifests only: small)."""
    with open(path, "rb") as f:
        verified, data = verify_file(key, info, f, trust)
    assert data is not None
    return verified, data
