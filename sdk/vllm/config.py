"""The connector's configuration (``kv_connector_extra_config``), the per-request
parameters it reads from ``kv_transfer_params``, and what both roles set up from them:
the model the KV is for, the trust policy, and the reader (opened once)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcdn.errors import ArgumentError, KvcdnError
from kvcdn.kv import DEFAULT_CHUNK_TOKENS
from kvcdn.models import ModelIdentity, model_identity
from kvcdn.signing import TrustPolicy

from .. import checks
from ..bounded import BoundedReader
from ..edges import check_edges
from ..loader import AUTO, open_reader
from ..stats import ReaderStats, merge_drained

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

#: ``kv_transfer_params`` key of a request whose prompt KV is to be captured.
CAPTURE_PARAM = "kvcdn_capture"
#: ``kv_transfer_params`` key that, set to false, keeps kvcdn out of one request.
LOAD_PARAM = "kvcdn_load"
#: ``kv_transfer_params`` key: the quality (a level, or auto) one request loads at.
QUALITY_PARAM = "kvcdn_quality"
#: ``kv_transfer_params`` key: one request's load deadline in seconds.
DEADLINE_PARAM = "kvcdn_deadline_s"
#: ``kv_transfer_params`` key: how one request is loaded (one of LOAD_MODES).
LOAD_MODE_PARAM = "kvcdn_load_mode"
LOAD_MODES = ("auto", "sync", "async")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked once."""

    store: str | None = None  # where manifests and objects are (a folder, s3://...)
    endpoint_url: str | None = None  # an S3 endpoint other than AWS's
    edges: list[str] | None = None  # edge caches to read objects through, in front of store
    edge_token: str | None = None
    trust: str | None = None  # a trust file: manifests must be signed by its keys
    #: With ``trust``: a document is found only while its signed latest pointer is
    #: current (docs/trust.md, Freshness), so a store cannot replay a withdrawn one.
    require_expiry: bool = False
    #: With ``trust``: a file recording the newest version of each document this
    #: connector has verified, so that rollback protection outlasts a restart (without
    #: it the record is the process's; the SDK's ``state_path``, docs/trust.md).
    trust_state: str | None = None
    model: str | None = None  # the kvcdn model name (default: the model vLLM serves)
    quality: str = AUTO  # a level, or auto
    deadline_s: float | None = None  # a load not in by then is left to vLLM's prefill
    load_mode: str = "auto"  # sync, async, or auto: sync for a local folder without edges
    lookup_timeout_s: float = 2.0  # a request waits this long for a document lookup
    lookup_ttl_s: float = 30.0  # a lookup's answer (found or not) is reused this long
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the chunk size documents were published with
    capture_dir: str | None = None  # producer: where captured prompt KV is written
    #: A synchronous load of sectioned objects runs in this many groups of layers, in
    #: layer order, beside the forward pass, which waits per layer (1: whole, before it;
    #: docs/vllm.md says when more pays).
    layer_groups: int = 1
    #: vLLM's ``cache_salt`` -> what a salted request reads: ``{"sha256:HEX" (of the salt;
    #: or the salt itself): {"store": ..., "endpoint_url", "edges", "edge_token",
    #: "trust", "require_expiry", "trust_state", "name"}}``. A salted request with no
    #: entry gets nothing from kvcdn; unsalted requests read ``store`` (docs/vllm.md,
    #: "Tenants").
    tenants: dict[str, dict[str, Any]] | None = None

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise KvcdnError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        config = cls(**extra)
        for key in ("store", "endpoint_url", "edge_token", "trust", "trust_state", "model",
                    "capture_dir"):  # fmt: skip
            _optional_text(getattr(config, key), key, "")
        _edge_list(config.edges, "")
        _freshness(config.require_expiry, config.trust_state, config.trust, "")
        if not isinstance(config.quality, str) or not config.quality:
            raise KvcdnError("quality must be a level name or 'auto'")
        if config.load_mode not in LOAD_MODES:
            raise KvcdnError(f"load_mode must be one of {', '.join(LOAD_MODES)}")
        for key in ("deadline_s", "lookup_timeout_s", "lookup_ttl_s"):
            value = getattr(config, key)
            if value is not None and seconds(value, zero=key == "lookup_ttl_s") is None:
                raise KvcdnError(f"{key} must be a positive number of seconds")
        if type(config.chunk_tokens) is not int or config.chunk_tokens < 16:
            raise KvcdnError("chunk_tokens must be an integer of at least 16")
        if type(config.layer_groups) is not int or not 1 <= config.layer_groups <= 1024:
            raise KvcdnError("layer_groups must be an integer from 1 to 1024")
        # checked here: a mistake is named at start
        _distinct_records(config.trust_state, tenant_sources(config.tenants))
        return config


@dataclass(frozen=True)
class Source:
    """Where one tenant's documents are read from, and whose signatures it trusts."""

    store: str | None
    endpoint_url: str | None = None
    edges: list[str] | None = None
    edge_token: str | None = None
    trust: str | None = None
    require_expiry: bool = False
    trust_state: str | None = None
    #: The tenant's ``tenant`` label on vLLM's /metrics (default: ``sha256:`` and the
    #: first 12 hex digits of its salt's digest).
    name: str | None = None


#: The ``tenant`` label of unsalted requests, and of salted ones no tenant has.
DEFAULT_TENANT, UNMAPPED_TENANT = "default", "unmapped"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: no "name\n"
_SALT_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_DIGEST_PREFIX = "sha256:"  # a key starting so (any case) must be a digest


def tenant_key(salt: str) -> str:
    """What a tenant is known by: the sha256 of its salt (a salt is a secret; its
    digest can be logged, sent to workers and written in a configuration). A salt
    that is not valid UTF-8 (lone surrogates, which Python's API lets through) is
    hashed as its code points are, so it is some tenant's or none's, never an error."""
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()


def _optional_text(value: Any, name: str, where: str) -> None:
    """``value`` is None or a non-empty string: an empty one is a mistake (an unset
    template variable), and for ``trust`` it would silently mean no trust at all."""
    if value is not None and (not isinstance(value, str) or not value):
        raise KvcdnError(f"{where}{name} must be a non-empty string (or left out)")


def _freshness(require_expiry: Any, trust_state: str | None, trust: str | None,
               where: str) -> None:  # fmt: skip
    if not isinstance(require_expiry, bool):
        raise KvcdnError(f"{where}require_expiry must be true or false")
    if require_expiry and trust is None:
        raise KvcdnError(f"{where}require_expiry needs a trust file (trust): only signed "
                         "pointers carry an expiry")  # fmt: skip
    if trust_state is not None and trust is None:
        raise KvcdnError(f"{where}trust_state needs a trust file (trust): it records the "
                         "versions of signed documents")  # fmt: skip


def _distinct_records(main: str | None, tenants: dict[str, Source]) -> None:
    """Each tenant keeps its own record of seen versions: document names belong to a
    store, so one tenant's ``guide@7`` in a shared record would refuse another's
    ``guide@3`` as a rollback. One file however named: links followed, a record that
    exists compared by its inode (a hard link), and by its folder's inode and its name
    (a folder mounted twice); nor is one record another's lock."""
    owners: dict[Any, str] = {}
    records = [("the main store", "", main)] + [
        (f"tenant #{n + 1}", f"tenant #{n + 1}: ", s.trust_state)
        for n, s in enumerate(tenants.values())
    ]
    for owner, where, path in records:
        if path is None:
            continue
        try:
            real = os.path.realpath(path)
            names: list[Any] = [real, real + ".lock"]  # one record's lock is no other's record
            if os.path.exists(real):
                found = os.stat(real)
                names.append((found.st_dev, found.st_ino))
            folder, base = os.path.split(real)
            if os.path.isdir(folder):  # one folder by two names (a bind mount): one record
                place = os.stat(folder)
                names += [(place.st_dev, place.st_ino, name) for name in (base, base + ".lock")]
        except (OSError, ValueError) as exc:  # a NUL byte
            raise KvcdnError(f"{where}trust_state is not a usable path: {exc}") from None
        for name in names:
            if name in owners:
                raise KvcdnError(f"{where}trust_state is the record of {owners[name]} too (or "
                                 "its lock): each store's documents need a record of their "
                                 "own")  # fmt: skip
        owners.update(dict.fromkeys(names, owner))


def _edge_list(edges: Any, where: str) -> None:
    """``edges`` is None or a list of edge URLs, checked as the reader will check them,
    so that a mistake is named at start, not at the first load."""
    if edges is None:
        return
    if not isinstance(edges, list) or not all(isinstance(e, str) and e for e in edges):
        raise KvcdnError(f"{where}edges must be a list of edge URLs")
    try:
        check_edges(edges)
    except KvcdnError as exc:
        raise KvcdnError(f"{where}edges: {exc}") from None


def tenant_sources(tenants: Any) -> dict[str, Source]:
    """``tenants`` checked, by :func:`tenant_key`."""
    if tenants is None:
        return {}
    if not isinstance(tenants, dict):
        raise KvcdnError("tenants must map cache salts (or sha256:HEX of them) to stores")
    out: dict[str, Source] = {}
    names: set[str] = set()
    for n, (salt, entry) in enumerate(tenants.items()):
        where = f"tenant #{n + 1}"  # never the salt itself: it is a secret
        if not isinstance(salt, str) or not salt:
            raise KvcdnError(f"{where}: a cache salt must be a non-empty string")
        m = _SALT_DIGEST.fullmatch(salt)
        if m is None and salt[: len(_DIGEST_PREFIX)].lower() == _DIGEST_PREFIX:
            raise KvcdnError(f"{where}: a key starting with 'sha256:' must be 'sha256:' and "
                             "the 64 lowercase hex digits of the salt's digest")  # fmt: skip
        key = m.group(1) if m else tenant_key(salt)
        if not isinstance(entry, dict):
            raise KvcdnError(f"{where}: must be an object with a store")
        unknown = sorted(set(entry) - set(Source.__dataclass_fields__))
        if unknown:
            raise KvcdnError(f"{where}: unknown keys {unknown}")
        source = Source(**{"store": None, **entry})
        if not isinstance(source.store, str) or not source.store:
            raise KvcdnError(f"{where}: store must be a store URL or folder")
        for name in ("endpoint_url", "edge_token", "trust", "trust_state", "name"):
            _optional_text(getattr(source, name), name, f"{where}: ")
        if source.name is not None:
            if not _TENANT_NAME.fullmatch(source.name):
                raise KvcdnError(f"{where}: name must be 1 to 64 letters, digits, '_', '.' "
                                 "or '-', starting with a letter or digit")  # fmt: skip
            if source.name in (DEFAULT_TENANT, UNMAPPED_TENANT) or source.name in names:
                raise KvcdnError(f"{where}: the name {source.name!r} is taken")
            names.add(source.name)
        _edge_list(source.edges, f"{where}: ")
        _freshness(source.require_expiry, source.trust_state, source.trust, f"{where}: ")
        if key in out:
            raise KvcdnError(f"{where}: the same salt as another tenant")
        out[key] = source
    return out


def seconds(value: Any, *, zero: bool = False) -> float | None:
    """``value`` as a number of seconds (positive; or zero too), or None if it is not one."""
    if zero and value == 0 and not isinstance(value, bool):
        return 0.0
    try:
        return checks.deadline(value)
    except ArgumentError:
        return None


class ConnectorSetup:
    """What both roles set up from vLLM's configuration: the checked configuration, the
    model the KV is for, and for each tenant (``""``: unsalted requests) its trust policy
    and its reader (opened once, on first use).

    Anything wrong disables the connector, with one log line saying why: vLLM then
    serves as if kvcdn were absent (:attr:`disabled` holds the reason)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        self.block_size: int = vllm_config.cache_config.block_size
        self.loads_enabled = bool(transfer.is_kv_consumer)
        self.captures_enabled = bool(transfer.is_kv_producer)
        self.config = ConnectorConfig()
        self.identity: ModelIdentity | None = None
        self.disabled: str | None = None
        self._sources: dict[str, Source] = {}
        self._trust: dict[str, TrustPolicy | None] = {}
        self._readers: dict[str, BoundedReader] = {}
        # one lock a tenant: opening one tenant's reader (a store that hangs) must not
        # hold up another's lookups and loads
        self._reader_locks: dict[str, threading.Lock] = {}
        try:
            self.config = ConnectorConfig.parse(dict(transfer.kv_connector_extra_config or {}))
            self.identity = model_identity(self.config.model or vllm_config.model_config.model)
            c = self.config
            # unsalted requests read the main store (None: $KVCDN_STORE)
            self._sources[""] = Source(c.store, c.endpoint_url, c.edges, c.edge_token, c.trust,
                                       c.require_expiry, c.trust_state)  # fmt: skip
            self._sources.update(tenant_sources(c.tenants))
            self._reader_locks = {key: threading.Lock() for key in self._sources}
            for key, source in self._sources.items():
                # the record's path made absolute now: the engine may change folder later
                record = os.path.abspath(source.trust_state) if source.trust_state else None
                self._trust[key] = (TrustPolicy.from_file(source.trust, state_path=record,
                                                          require_expiry=source.require_expiry)
                                    if source.trust else None)  # fmt: skip
                if self._trust[key] is not None:  # a damaged or unwritable record: at start
                    self._trust[key].check_state()
            if self.config.chunk_tokens % self.block_size:
                raise KvcdnError(
                    f"vLLM's block size {self.block_size} does not divide kvcdn's chunk size "
                    f"{self.config.chunk_tokens}: set --block-size to a divisor of it"
                )
            if self.loads_enabled and transfer.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvcdn: kv_load_failure_policy is %r; with 'recompute' vLLM recomputes a "
                    "chunk kvcdn cannot load instead of failing the request",
                    transfer.kv_load_failure_policy,
                )
            if self.identity.unsupported:
                raise KvcdnError(f"{self.identity.name}: {self.identity.unsupported}")
        except Exception as exc:  # the engine runs on without kvcdn, and says why
            self.disable(str(exc))
        # What this role's lookups and loads did, for vLLM's metrics (:mod:`.stats`), by
        # tenant (None: salts no tenant has): a bounded set, the configured tenants.
        self._stats: dict[str | None, ReaderStats] = {
            key: ReaderStats(source.edges or (), keep_observations=True)
            for key, source in self._sources.items()
        }
        self._stats.setdefault("", ReaderStats(keep_observations=True))  # (disabled early)
        self._stats[None] = ReaderStats(keep_observations=True)

    @property
    def active(self) -> bool:
        """The connector loads or captures (it was not disabled)."""
        return self.identity is not None and self.disabled is None

    def disable(self, reason: str) -> None:
        if self.disabled is None:
            log.error("kvcdn connector disabled: %s", reason)
        self.disabled = reason

    def tenant_of(self, cache_salt: str | None) -> str | None:
        """The tenant a request with this ``cache_salt`` reads as (``""`` unsalted), or
        None: kvcdn gives it nothing (a salt no tenant has)."""
        key = "" if cache_salt is None else tenant_key(cache_salt)
        return key if key in self._sources else None

    def stats_of(self, tenant: str | None) -> ReaderStats:
        """What ``tenant``'s requests did (:meth:`tenant_of`; None: a salt no tenant has)."""
        return self._stats.get(tenant, self._stats[None])

    def drain_stats(self) -> dict[str, list[list[Any]]]:
        """Every tenant's :meth:`ReaderStats.drain`, each entry's labels after its tenant's
        ``tenant`` label."""
        out: dict[str, list[list[Any]]] = {"counters": [], "observations": []}
        for tenant, stats in self._stats.items():
            merge_drained(out, stats.drain((self.tenant_label(tenant),)))
        return out

    def tenant_label(self, tenant: str | None) -> str:
        """A tenant's ``tenant`` label: its configured name, or what it is known by."""
        if tenant is None:
            return UNMAPPED_TENANT
        if tenant == "":
            return DEFAULT_TENANT
        source = self._sources.get(tenant)
        return source.name if source is not None and source.name else f"sha256:{tenant[:12]}"

    @property
    def trust(self) -> TrustPolicy | None:
        """The unsalted requests' trust policy."""
        return self._trust.get("")

    def store_of(self, tenant: str) -> str | None:
        """The store ``tenant`` reads (None: ``$KVCDN_STORE``, or no such tenant)."""
        source = self._sources.get(tenant)
        return source.store if source is not None else None

    def trust_of(self, tenant: str) -> TrustPolicy | None:
        return self._trust.get(tenant)

    def reader(self, tenant: str = "") -> BoundedReader:
        """``tenant``'s reader (:meth:`tenant_of`), opened on first use."""
        lock = self._reader_locks.get(tenant)
        if lock is None:
            raise KvcdnError("no store is configured for these requests")
        with lock:
            reader = self._readers.get(tenant)
            if reader is None:
                s = self._sources[tenant]
                reader = self._readers[tenant] = open_reader(
                    s.store, endpoint_url=s.endpoint_url, edges=s.edges,
                    edge_token=s.edge_token, trust=self._trust[tenant],
                )  # fmt: skip
            return reader

    def open_reader_soon(self) -> None:
        """Open the readers in daemon threads, one a tenant: not on a request's clock (an
        exit need not wait for them; the first load meets an error there, and says so),
        and a tenant's store that hangs holds up only its own."""

        def run(tenant: str, source: Source) -> None:
            try:
                self.reader(tenant)
            except Exception as exc:
                log.warning("kvcdn: cannot open %s yet: %s", source.store, exc)

        for tenant, source in self._sources.items():  # a thread each: one may hang
            threading.Thread(target=run, args=(tenant, source), name="kvcdn-open",
                             daemon=True).start()  # fmt: skip
