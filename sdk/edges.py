"""Reading through edge nodes: placement, failover, and warming.

Placement is rendezvous (highest-random-weight) hashing: every edge gets a
weight ``sha256(edge, key)`` and a key's edges are the edges in descending
weight. A document's chunk objects (and its codec profile) are placed by the
document's chain hash, so they stay together on one edge, and adding an
edge moves only the documents that now weigh most on it. A document's
manifest is placed by its name, the one thing known before the manifest is.

:class:`EdgeStore` reads keys from the placed edges in order, moving on after
a connection error, a timeout, a 5xx, a 404, a body larger than the caller
expects or too slow to arrive, or bytes that fail the caller's check (a
checksum, a signature), and finally from the origin store if one is given.
An edge that failed is a circuit breaker's open circuit: skipped for a while
(:data:`DOWN_S`, doubling with failures in a row) as long as another edge or
the origin can serve, then probed by one read. A read's deadline (its
:class:`~kvcdn.store.Cancel`'s) bounds every wait: connecting, the headers,
the body.
Each read reports its source, and :attr:`EdgeStore.rejected` lists the edges
that served bad bytes. An edge can lie; the origin is the authority: a reader
without trust keys (:mod:`kvcdn.signing`) reads manifests and pointers from
the origin when it has one, so that no edge decides which objects it loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3

from kvcdn.errors import (
    AccessDenied,
    DeadlineExceeded,
    FormatError,
    FreshnessError,
    InputError,
    KvcdnError,
    NotFound,
    StoreError,
)
from kvcdn.keys import manifest_key, parse_key
from kvcdn.manifest import MAX_OBJECT_BYTES, Manifest, ObjectRef, ObjectSpan
from kvcdn.store import (
    Cancel,
    Check,
    FetchCancelled,
    Fetched,
    ReaderBase,
    Store,
    key_of,
    read_bounds,
)

log = logging.getLogger(__name__)

#: After a failure (no connection, a timeout, a 5xx), an edge's circuit is open: it is
#: skipped for this long while another edge or the origin can serve, doubling with
#: each failure in a row up to MAX_DOWN_S; then one read probes it again.
DOWN_S = 5.0
MAX_DOWN_S = 60.0
#: A probe of an edge whose circuit is half-open waits at most this long for each
#: answer (its headers, each piece of its body): an edge that still does not answer
#: costs a load this, not the load's whole budget, before the next source is read.
PROBE_READ_TIMEOUT_S = 2.0
BAD_BYTES_DOWN_S = 60.0  # after it served bad bytes, it is skipped for this long
PIECE = 64 << 10  # bodies are read in pieces of this size, reporting progress
MIN_BODY_BPS = 32 << 10  # a body arriving slower than this on average is abandoned
MAX_LISTING_BYTES = 16 << 20  # one page of a listing
#: Keys per warm job: what an edge accepts in one request (edge.admin.MAX_WARM_KEYS),
#: so a corpus of any size is warmed in jobs every edge takes.
WARM_BATCH_KEYS = 4096
#: Warm jobs one call keeps running on an edge at once; the next start as they finish
#: (an edge runs at most 64 jobs, from all its admins).
WARM_JOBS_PER_EDGE = 4


class _EdgeFailed(Exception):
    """One edge could not serve one key; the next source is tried."""


def _check_content_range(resp: Any, span: tuple[int, int] | None) -> None:
    """A ranged answer must be the range asked for (a server may answer another)."""
    if span is None:
        return
    got = resp.headers.get("Content-Range", "")
    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", got)
    if m is None or (int(m.group(1)), int(m.group(2)) + 1) != span:
        raise _EdgeFailed(f"it answered range {got!r}, not bytes {span[0]}-{span[1] - 1}")


_EDGE_URL = re.compile(r"^https?://[^/\s?#]+(/[^\s?#]*)?$")
#: Keys that say which objects to load; read from the origin by untrusting readers.
_DOCUMENT_KINDS = ("manifest", "pointer", "index", "prefix-index", "profile-pointer")


def rendezvous(edges: Sequence[str], key: str) -> list[str]:
    """``edges`` in the order ``key`` prefers them (highest random weight first)."""

    def weight(edge: str) -> int:
        digest = hashlib.sha256(f"{edge}\0{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big")

    return sorted(edges, key=weight, reverse=True)


def placement_key(key: str) -> str:
    """What a store key is placed by when the caller gives nothing better: a document's
    name for its manifests and pointer, else the key itself."""
    info = parse_key(key)
    return info.name if info is not None and info.name else key


def check_edges(edges: Sequence[str]) -> list[str]:
    """Normalised edge URLs; :class:`InputError` for anything that is not one."""
    if isinstance(edges, (str, bytes)) or not isinstance(edges, Sequence):
        raise InputError(
            f"edges must be a list of edge URLs, not {type(edges).__name__} "
            "(for one edge, give [url])"
        )
    out = []
    for edge in edges:
        if not isinstance(edge, str):
            raise InputError(f"an edge URL must be a string, not {type(edge).__name__}")
        url = edge.strip().rstrip("/")
        if not _EDGE_URL.match(url):
            raise InputError(f"{edge!r} is not an edge URL (http://host:port)")
        if "@" in url.split("://", 1)[1].split("/", 1)[0]:
            # never echoed: what is before the @ is likely a password, and an edge URL is
            # logged and exported as a metrics label
            raise InputError("an edge URL carries no credentials (user:password@): edges "
                             "take a bearer token (edge_token, --edge-token)")  # fmt: skip
        if url not in out:
            out.append(url)
    if not out:
        raise InputError("no edge URL given")
    return out


@dataclass(frozen=True)
class Rejected:
    """An edge that served bytes failing the reader's check (or too many, or too
    slowly), or a signed pointer past its expiry (``stale``)."""

    edge: str
    key: str
    reason: str
    #: A stale pointer is no sign of a broken edge (an honest one passes on what its
    #: origin holds), so that edge is not skipped for other keys.
    stale: bool = False

    def __str__(self) -> str:
        what = "a stale pointer" if self.stale else "bad bytes"
        return f"{self.edge} served {what} for {self.key}: {self.reason}"


class EdgeStore(ReaderBase):
    """Store keys read through edges, with failover to the next edge and to ``origin``.

    It is a :class:`~kvcdn.store.Reader` like every store, so documents
    resolve and load through it unchanged, and :meth:`fetch` says which
    source served a key. ``documents_from_origin`` reads manifests and
    pointers from ``origin`` (when given) rather than from the edges.
    """

    local = False

    def __init__(
        self,
        edges: Sequence[str],
        origin: Store | None = None,
        *,
        token: str | None = None,
        connect_timeout_s: float = 1.0,
        read_timeout_s: float = 30.0,
        concurrency: int = 8,
        documents_from_origin: bool = False,
        min_body_bps: float = MIN_BODY_BPS,
    ) -> None:
        self.edges = check_edges(edges)
        if origin is not None and not isinstance(origin, Store):
            raise InputError(f"origin must be a Store, not {type(origin).__name__}")
        if token is not None and not isinstance(token, str):
            raise InputError(f"edge_token must be a string, not {type(token).__name__}")
        self.origin = origin
        self.url = ", ".join(self.edges) + (f" (origin {origin.url})" if origin else "")
        self.concurrency = concurrency
        self.read_timeout_s = read_timeout_s
        self.min_body_bps = min_body_bps
        self.documents_from_origin = documents_from_origin and origin is not None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = urllib3.PoolManager(
            num_pools=max(4, len(self.edges)),
            maxsize=concurrency,
            retries=False,  # failing over is this class's job
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
        )
        self._down: dict[str, float] = {}  # edge -> until when its circuit is open
        self._failures: dict[str, int] = {}  # edge -> failures in a row
        self._probing: set[str] = set()  # edges whose circuit one read is probing
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        #: Edges that served bad bytes, in the order it happened (most recent 100).
        self.rejected: list[Rejected] = []

    def __repr__(self) -> str:
        return f"EdgeStore({self.url!r})"

    def close(self) -> None:
        """Close the connections to the edges."""
        self._http.clear()

    def order(self, placement: str) -> list[str]:
        """The edges to try for ``placement``: by weight, recently failed ones last."""
        now = time.monotonic()
        with self._lock:
            down = {e for e, until in self._down.items() if until > now}
        ranked = rendezvous(self.edges, placement)
        return [e for e in ranked if e not in down] + [e for e in ranked if e in down]

    def _mark_down(self, edge: str, seconds: float | None = None) -> None:
        """Open ``edge``'s circuit: for ``seconds``, or by its failures in a row."""
        with self._lock:
            failures = self._failures[edge] = self._failures.get(edge, 0) + 1
            if seconds is None:
                seconds = min(MAX_DOWN_S, DOWN_S * 2 ** (failures - 1))
            self._down[edge] = time.monotonic() + seconds
            self._probing.discard(edge)

    def _mark_up(self, edge: str) -> None:
        if edge in self._failures or edge in self._probing:
            with self._lock:
                self._failures.pop(edge, None)
                self._down.pop(edge, None)
                self._probing.discard(edge)

    def _admit(self, ranked: list[str]) -> tuple[list[str], list[str]]:
        """The edges of ``ranked`` a read tries: those whose circuit is closed, and one
        whose circuit is half-open (its time down is over) if no other read is probing
        it; every edge when none is admitted and there is no origin to read instead.
        Also the probes this read took, which it must release (:meth:`_release_probes`)."""
        now = time.monotonic()
        admitted, probes = [], []
        with self._lock:
            for edge in ranked:
                if self._down.get(edge, 0.0) > now:
                    continue  # open
                if edge in self._failures:  # half-open: one read probes it
                    if edge in self._probing:
                        continue
                    self._probing.add(edge)
                    probes.append(edge)
                admitted.append(edge)
        if not admitted and self.origin is None:
            return list(ranked), probes
        return admitted, probes

    def _reject(self, edge: str, key: str, reason: str, *, stale: bool = False) -> None:
        rejected = Rejected(edge, key, reason, stale)
        if stale:
            log.warning("%s; trying the next source", rejected)
        else:
            self._mark_down(edge, BAD_BYTES_DOWN_S)
            log.error("%s; trying the next source", rejected)
        with self._lock:
            self.rejected = [*self.rejected[-99:], rejected]

    # ---- reading ---------------------------------------------------------------
    def fetch(
        self,
        key: str | ObjectRef | ObjectSpan,
        *,
        max_bytes: int | None = None,
        check: Check | None = None,
        placement: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
        cancel: Cancel | None = None,
    ) -> Fetched:
        """Read ``key`` (or an :class:`ObjectRef`'s, bounded and checked by it, or an
        :class:`ObjectSpan`'s byte range, asked for with ``Range``) from the first edge
        that serves it well (then the origin).

        At most ``max_bytes`` are read from any source (default: the largest
        object a manifest may name), and ``check`` must pass on them. The body
        is read in pieces: ``on_bytes(n)`` is called as each piece arrives, and
        setting ``cancel`` stops the read (:class:`FetchCancelled`).
        """
        started = time.perf_counter()
        what = key  # what the origin is asked for, when the edges fail
        spec = read_bounds(key, max_bytes, check)
        key, max_bytes, check = spec.key, spec.max_bytes, spec.check
        limit = MAX_OBJECT_BYTES if max_bytes is None else max_bytes
        headers = self._headers
        if spec.span is not None:  # one range, answered 206 with exactly that range
            headers = {**headers, "Range": f"bytes={spec.span[0]}-{spec.span[1] - 1}"}
        ok_status = 200 if spec.span is None else 206
        info = parse_key(key)
        if self.documents_from_origin and info is not None and info.kind in _DOCUMENT_KINDS:
            return self._from_origin(what, max_bytes, check, on_bytes, cancel, started)
        failures: list[str] = []
        bad: list[KvcdnError] = []  # bytes served that failed ``check``
        missing = refused = 0
        tried, probes = self._admit(rendezvous(self.edges, placement or placement_key(key)))
        try:
            for edge in tried:
                if cancel is not None and cancel.is_set():
                    raise FetchCancelled
                timeout = self._timeout(cancel, probe=edge in probes)
                if timeout is None:
                    raise DeadlineExceeded(f"{key}: no time left to read it from {edge}")
                try:
                    resp = self._http.request(
                        "GET", f"{edge}/{quote(key)}", headers=headers,
                        preload_content=False, timeout=timeout,
                    )  # fmt: skip
                except (urllib3.exceptions.HTTPError, OSError) as exc:  # refused, reset, timed out
                    if cancel is not None and cancel.deadline_passed():
                        self._mark_down(edge)  # no answer by the read's deadline: skipped a while
                        raise DeadlineExceeded(f"{key}: {edge} did not answer in time") from None
                    if cancel is not None and cancel.is_set():
                        raise FetchCancelled from None  # our own shutdown of the socket
                    self._mark_down(edge)
                    failures.append(f"{edge}: {exc}")
                    log.warning("edge %s failed on %s, trying the next source: %s", edge, key, exc)
                    continue
                if resp.status == ok_status:
                    try:
                        data = self._read_body(resp, limit, on_bytes, cancel, spec.span)
                    except _EdgeFailed as exc:
                        self._reject(edge, key, str(exc))
                        failures.append(f"{edge}: {exc}")
                        bad.append(FormatError(str(exc)))
                        continue
                    except DeadlineExceeded:
                        self._mark_down(edge)  # no answer in time: others are tried first
                        raise
                    except (urllib3.exceptions.HTTPError, OSError) as exc:
                        if cancel is not None and cancel.deadline_passed():
                            self._mark_down(edge)
                            raise DeadlineExceeded(
                                f"{key}: {edge} did not send it in time"
                            ) from None
                        if cancel is not None and cancel.is_set():
                            raise FetchCancelled from None
                        self._mark_down(edge)
                        failures.append(f"{edge}: {exc}")
                        log.warning("edge %s failed on %s, trying the next source: %s", edge,
                                    key, exc)  # fmt: skip
                        continue
                    if check is not None:
                        try:
                            check(data)
                        except KvcdnError as exc:
                            self._reject(edge, key, str(exc),
                                         stale=isinstance(exc, FreshnessError))  # fmt: skip
                            failures.append(f"{edge}: {exc}")
                            bad.append(exc)
                            continue
                    self._mark_up(edge)
                    return Fetched(key, data, edge, time.perf_counter() - started)
                reason = _error_reason(resp)
                failures.append(f"{edge}: {resp.status} {reason}")
                if resp.status >= 500 or resp.status in (408, 429):  # failing, or overloaded
                    self._mark_down(edge)
                else:  # it answered: a missing key, a refusal, anything else
                    self._mark_up(edge)
                    missing += resp.status == 404
                    refused += resp.status in (401, 403)
                log.warning(
                    "edge %s answered %d for %s, trying the next source", edge, resp.status, key
                )
        finally:
            self._release_probes(probes)  # those not answered for already, whatever happened
        skipped = len(self.edges) - len(tried)
        if self.origin is not None:
            return self._from_origin(what, max_bytes, check, on_bytes, cancel, started)
        if skipped:
            failures.append(f"{skipped} edge(s) skipped while they recover from failures")
        if bad and len(bad) == len(failures):  # say what was wrong, in its own terms
            what = "a stale pointer" if isinstance(bad[-1], FreshnessError) else "bad bytes"
            raise type(bad[-1])(f"every edge served {what} for {key}: {'; '.join(failures)}")
        if missing and missing + refused == len(failures):
            raise NotFound(f"{key}: not found ({'; '.join(failures)})")
        if refused and refused == len(failures):
            raise AccessDenied(f"the edges refused to serve {key}; check the edge token")
        raise StoreError(f"no edge could serve {key}: {'; '.join(failures)}")

    def _from_origin(self, what: str | ObjectRef | ObjectSpan, max_bytes: int | None,
                     check: Check | None, on_bytes: Callable[[int], None] | None,
                     cancel: Cancel | None, started: float) -> Fetched:  # fmt: skip
        """``what`` (a key, a ref or a span) from the origin: bounded and checked as the
        edges' reads were (``check`` already holds the ref's own check)."""
        assert self.origin is not None
        key = key_of(what)
        if isinstance(what, ObjectSpan):
            got = self.origin.fetch(what, check=check, on_bytes=on_bytes, cancel=cancel)
        else:
            limit = MAX_OBJECT_BYTES if max_bytes is None else max_bytes
            got = self.origin.fetch(key, max_bytes=limit, check=check, on_bytes=on_bytes,
                                    cancel=cancel)  # fmt: skip
        return Fetched(key, got.data, "origin", time.perf_counter() - started)

    def _release_probes(self, edges: list[str]) -> None:
        """Probes a read took: each edge may be probed again by the next read (if its
        answer did not close or reopen its circuit already)."""
        if edges:
            with self._lock:
                self._probing.difference_update(edges)

    def _timeout(self, cancel: Cancel | None, probe: bool = False) -> urllib3.Timeout | None:
        """This request's timeouts: the reader's (a probe's read at most
        :data:`PROBE_READ_TIMEOUT_S`), cut to the time its read has left (None: no time
        left)."""
        read = min(self.read_timeout_s, PROBE_READ_TIMEOUT_S) if probe else self.read_timeout_s
        left = cancel.time_left() if cancel is not None else None
        if left is None:
            return urllib3.Timeout(connect=self.connect_timeout_s, read=read)
        if left <= 0:
            return None
        return urllib3.Timeout(connect=min(self.connect_timeout_s, left), read=min(read, left))

    def _read_body(
        self,
        resp: Any,
        max_bytes: int,
        on_bytes: Callable[[int], None] | None,
        cancel: Cancel | None,
        span: tuple[int, int] | None = None,
    ) -> bytes:
        """The body, at most ``max_bytes`` of it, within a time budget of the read
        timeout plus ``max_bytes`` at :data:`MIN_BODY_BPS` (a slow drip is cut off);
        for a ranged read, the range asked for (``span``)."""
        too_slow = threading.Event()

        def cut_off() -> None:
            too_slow.set()
            try:
                resp.shutdown()
            except (OSError, ValueError, RuntimeError):
                pass

        pieces: list[bytes] = []
        received = 0
        budget = self.read_timeout_s + max_bytes / self.min_body_bps
        left = cancel.time_left() if cancel is not None else None
        by_deadline = left is not None and left < budget  # cut off by the read's deadline
        watchdog = threading.Timer(min(budget, left) if by_deadline else budget, cut_off)
        watchdog.daemon = True
        try:
            _check_content_range(resp, span)
            declared = resp.headers.get("Content-Length")
            if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
                raise _EdgeFailed(
                    f"it announced {declared} bytes, more than the {max_bytes} expected"
                )
            if cancel is not None:
                cancel.bind(resp.shutdown)
            watchdog.start()
            for piece in resp.stream(PIECE):
                received += len(piece)
                if received > max_bytes:
                    raise _EdgeFailed(f"it sent more than the {max_bytes} bytes expected")
                pieces.append(piece)
                if on_bytes is not None:
                    on_bytes(len(piece))
                if cancel is not None and cancel.is_set():
                    raise FetchCancelled
            if cancel is not None and cancel.is_set():
                raise FetchCancelled  # the shut socket ended the body early
            if too_slow.is_set() and by_deadline:
                raise DeadlineExceeded("its body did not arrive by the read's deadline")
            if too_slow.is_set():
                raise _EdgeFailed("its body arrived too slowly")
        except (urllib3.exceptions.HTTPError, OSError):
            if too_slow.is_set() and by_deadline:
                raise DeadlineExceeded("its body did not arrive by the read's deadline") from None
            if too_slow.is_set():
                raise _EdgeFailed(
                    f"its body arrived slower than {self.min_body_bps / 1024:.0f} KiB/s"
                ) from None
            resp.close()
            raise
        except BaseException:
            resp.close()  # the rest of the body is unread: the connection cannot be reused
            raise
        finally:
            watchdog.cancel()
            if cancel is not None:
                cancel.bind(None)
            resp.release_conn()
        return b"".join(pieces)

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``: from the origin when there is one, else an edge's listing."""
        if self.origin is not None:
            return self.origin.list(prefix)
        failures = []
        for edge in self.order(placement_key(prefix)):
            keys: list[str] = []
            fields: dict[str, str] = {"list-type": "2", "prefix": prefix}
            try:
                while True:
                    resp = self._http.request(
                        "GET", f"{edge}/", fields=fields, headers=self._headers,
                        preload_content=False,
                    )  # fmt: skip
                    if resp.status != 200:
                        raise StoreError(f"answered {resp.status} {_error_reason(resp)}")
                    page, token = _parse_listing(
                        self._read_body(resp, MAX_LISTING_BYTES, None, None)
                    )
                    keys += page
                    if token is None:
                        return sorted(keys)
                    fields["continuation-token"] = token
            except (urllib3.exceptions.HTTPError, OSError, StoreError, _EdgeFailed) as exc:
                failures.append(f"{edge}: {exc}")
            except (ET.ParseError, ValueError) as exc:
                failures.append(f"{edge}: not a listing ({exc})")
        raise StoreError(f"no edge could list {prefix or '/'}: {'; '.join(failures)}")


def _error_reason(resp: Any) -> str:
    """The start of an error body; the rest is drained so the connection is reused."""
    try:
        body = resp.read(300)
        resp.drain_conn()
    except (urllib3.exceptions.HTTPError, OSError):
        body = b""
    finally:
        resp.release_conn()
    return body.decode("utf-8", "replace").strip()


def _parse_listing(data: bytes) -> tuple[list[str], str | None]:
    root = ET.fromstring(data)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    keys = [item.findtext(f"{ns}Key", "") for item in root.iter(f"{ns}Contents")]
    truncated = root.findtext(f"{ns}IsTruncated", "false") == "true"
    return keys, root.findtext(f"{ns}NextContinuationToken") if truncated else None


# ---- warming ---------------------------------------------------------------------


@dataclass
class WarmAssignment:
    """The keys one edge is asked to hold, and the documents they belong to."""

    edge: str
    keys: list[str]
    documents: list[str]
    bytes: int  # the size of the keys' objects, where the manifest says it


def warm_keys(manifest: Manifest, levels: Sequence[str] | None = None) -> tuple[list[str], int]:
    """The chunk objects of ``levels`` (default: every stored level) and the codec
    profile, with their total size."""
    stored = [name for name in manifest.levels if any(name in c.objects for c in manifest.chunks)]
    chosen = list(levels) if levels else stored
    missing = [name for name in chosen if name not in stored]
    if missing:
        raise InputError(
            f"{manifest.name}@{manifest.version} has no stored level {', '.join(missing)} "
            f"(it has {', '.join(stored) or 'none'})"
        )
    keys: list[str] = []
    size = 0
    if manifest.codec_profile is not None:
        keys.append(manifest.codec_profile.key)
        size += manifest.codec_profile.bytes
    seen: set[str] = set()
    for chunk in manifest.chunks:
        for name in chosen:
            ref = chunk.objects[name]
            if ref.key not in seen:  # a nested ladder's levels share one object a chunk
                seen.add(ref.key)
                keys.append(ref.key)
                size += ref.bytes
    return keys, size


def plan_warm(
    manifests: Sequence[Manifest],
    edges: Sequence[str],
    levels: Sequence[str] | None = None,
    replicas: int = 1,
    batch_keys: int = WARM_BATCH_KEYS,
) -> list[WarmAssignment]:
    """Which keys each edge should hold so that readers find them where they look:
    one assignment (one warm job) per edge and per ``batch_keys`` keys, so that a
    corpus of any size goes in requests an edge accepts."""
    edges = check_edges(edges)
    if not 1 <= replicas <= len(edges):
        raise InputError(f"replicas must be between 1 and the number of edges ({len(edges)})")
    if batch_keys < 1:
        raise InputError(f"a warm job holds 1 key or more (not {batch_keys})")
    by_edge: dict[str, list[WarmAssignment]] = {e: [] for e in edges}
    held: dict[str, set[str]] = {e: set() for e in edges}  # a shared profile once per edge

    def add(edge: str, keys: list[str], size: int, ref: str | None) -> None:
        new = [k for k in keys if k not in held[edge]]
        if not new and ref is None:
            return
        jobs = by_edge[edge]
        if not jobs or len(jobs[-1].keys) + len(new) > batch_keys:
            jobs.append(WarmAssignment(edge, [], [], 0))
        held[edge].update(new)
        jobs[-1].keys += new
        jobs[-1].bytes += size
        if ref is not None:
            jobs[-1].documents.append(ref)

    for manifest in manifests:
        ref = f"{manifest.name}@{manifest.version}"
        keys, size = warm_keys(manifest, levels)
        version_key = manifest_key(manifest.name, manifest.version)
        for edge in rendezvous(edges, manifest.name)[:replicas]:
            add(edge, [version_key], 0, None)
        for edge in rendezvous(edges, manifest.chain_hash)[:replicas]:
            add(edge, keys, size, ref)
    return [job for e in edges for job in by_edge[e] if job.keys]


class EdgeAdmin:
    """The admin side of edges: start warm jobs and follow them."""

    def __init__(self, token: str | None = None, timeout_s: float = 30.0) -> None:
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = urllib3.PoolManager(retries=False, timeout=timeout_s)

    def _call(self, method: str, url: str, body: Any = None) -> dict[str, Any]:
        try:
            if body is None:
                resp = self._http.request(method, url, headers=self._headers)
            else:
                resp = self._http.request(method, url, json=body, headers=self._headers)
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(f"cannot reach {url}: {exc}") from None
        if resp.status in (401, 403):
            raise AccessDenied(
                f"{url} refused the admin token ({resp.status}); give the edge's admin token "
                "(--admin-token-file)"
            )
        if resp.status not in (200, 202):
            reason = resp.data[:300].decode("utf-8", "replace").strip()
            raise StoreError(f"{url} answered {resp.status}: {reason}")
        try:
            return json.loads(resp.data)
        except ValueError:
            raise StoreError(f"{url} did not answer JSON; is it a kvcdn edge?") from None

    def warm(self, edge: str, keys: list[str]) -> dict[str, Any]:
        """Start (or find, if the same keys are being warmed) a warm job; its status."""
        return self._call("POST", f"{edge}/warm", {"keys": keys})

    def job(self, edge: str, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"{edge}/warm/{job_id}")


_JOB_STATES = ("running", "done", "failed")
_JOB_COUNTS = ("total", "done", "cached", "fetched", "failed", "bytes_fetched")
MAX_JOB_ERRORS = 100  # an edge's list of failed keys, as far as it is kept


@dataclass
class WarmJobStatus:
    """An edge's account of one warm job, checked: the answer comes over the network."""

    id: str
    state: str  # running, done (every key held) or failed (some key could not be fetched)
    total: int
    done: int
    cached: int  # already held before the job
    fetched: int
    failed: int
    bytes_fetched: int
    errors: list[dict[str, str]]  # {"key", "error"} for keys that failed

    @classmethod
    def from_json(cls, edge: str, data: Any) -> WarmJobStatus:
        """Parse an edge's answer; :class:`StoreError` when it is not a warm job."""
        try:
            counts = {name: data[name] for name in _JOB_COUNTS}
            job_id, state = data["id"], data["state"]
            errors = data.get("errors", [])
            ok = (
                isinstance(job_id, str)
                and state in _JOB_STATES
                and all(type(v) is int and v >= 0 for v in counts.values())
                and isinstance(errors, list)
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise StoreError(f"{edge} answered something that is not a warm job")
        return cls(
            id=job_id,
            state=state,
            errors=[
                {"key": str(e.get("key", "")), "error": str(e.get("error", ""))}
                for e in errors[:MAX_JOB_ERRORS]
                if isinstance(e, dict)
            ],
            **counts,
        )


@dataclass
class WarmOutcome:
    """What happened on one edge of a :func:`warm_edges` call."""

    assignment: WarmAssignment
    #: running (not waited for), done, failed (some keys), unreachable (the
    #: edge did not answer or answered nonsense) or refused (the admin token);
    #: queued only while :func:`warm_edges` runs.
    state: str
    job: WarmJobStatus | None = None
    error: str | None = None  # why the edge is unreachable or refused

    @property
    def ok(self) -> bool:
        return self.state in ("running", "done")


def warm_edges(
    manifests: Sequence[Manifest],
    edges: Sequence[str],
    *,
    levels: Sequence[str] | None = None,
    replicas: int = 1,
    admin_token: str | None = None,
    wait: bool = True,
    poll_s: float = 0.2,
    on_progress: Callable[[WarmAssignment, int, int], None] | None = None,
    batch_keys: int = WARM_BATCH_KEYS,
) -> list[WarmOutcome]:
    """Ask each edge to hold the objects placed on it (:func:`plan_warm`: one job
    per edge and per ``batch_keys`` keys) and, with ``wait``, follow the jobs until
    every one has finished, running at most :data:`WARM_JOBS_PER_EDGE` on an edge
    at once. Without ``wait`` every job is started at once (an edge refuses more
    than 64 running ones: its outcome says so).

    ``on_progress(assignment, done, total)`` is called as jobs advance. An
    edge that fails (unreachable, refused, nonsense) does not stop the others;
    its outcome says why.
    """
    plan = plan_warm(manifests, edges, levels, replicas, batch_keys)
    admin = EdgeAdmin(admin_token)
    outcomes = [WarmOutcome(assignment, "queued") for assignment in plan]

    def start(outcome: WarmOutcome) -> None:
        edge = outcome.assignment.edge
        try:
            job = WarmJobStatus.from_json(edge, admin.warm(edge, outcome.assignment.keys))
            outcome.job, outcome.state = job, job.state
        except KvcdnError as exc:
            outcome.state = "refused" if isinstance(exc, AccessDenied) else "unreachable"
            outcome.error = str(exc)

    def start_more() -> None:
        """Start queued jobs: up to WARM_JOBS_PER_EDGE running per edge (all of them
        without ``wait``); none more on an edge that failed."""
        running: dict[str, int] = {}
        failed: set[str] = set()
        for o in outcomes:
            if o.state == "running":
                running[o.assignment.edge] = running.get(o.assignment.edge, 0) + 1
            elif o.state in ("refused", "unreachable"):
                failed.add(o.assignment.edge)
        for o in outcomes:
            edge = o.assignment.edge
            if o.state != "queued" or edge in failed:
                continue
            if wait and running.get(edge, 0) >= WARM_JOBS_PER_EDGE:
                continue
            start(o)
            if o.state == "running":
                running[edge] = running.get(edge, 0) + 1
            elif o.state in ("refused", "unreachable"):
                failed.add(edge)
        for o in outcomes:  # an edge that failed gets no more of its jobs
            if o.state == "queued" and o.assignment.edge in failed:
                o.state, o.error = "unreachable", f"{o.assignment.edge} failed an earlier job"

    start_more()
    while wait:
        for outcome in outcomes:
            if outcome.state != "running" or outcome.job is None:
                continue
            try:
                raw = admin.job(outcome.assignment.edge, outcome.job.id)
                outcome.job = WarmJobStatus.from_json(outcome.assignment.edge, raw)
                outcome.state = outcome.job.state
            except KvcdnError as exc:  # the edge went away mid-job
                outcome.state, outcome.error = "unreachable", str(exc)
            if on_progress is not None and outcome.job is not None:
                on_progress(outcome.assignment, outcome.job.done, outcome.job.total)
        start_more()
        if all(o.state not in ("running", "queued") for o in outcomes):
            break
        time.sleep(poll_s)
    return outcomes
