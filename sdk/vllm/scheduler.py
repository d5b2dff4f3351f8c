"""The connector's scheduler role (vLLM's engine-core process): which requests begin
with a published document, how many of their tokens kvcdn claims, and what each load did.

A request's prompt's first ``chunk_tokens`` tokens are hashed as kvcdn chains chunk
hashes and looked up once in the store's prefix index (one small read, shared by the
requests that ask within ``lookup_ttl_s``; a request waits for it at most
``lookup_timeout_s``). A manifest found is checked against the served model once,
here; the tokens the prompt shares with the document, less at least one and rounded
down to vLLM's block size, are claimed, and the workers are told to load them.
"""

from __future__ import annotations

import logging
import math
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcdn.errors import KvcdnError
from kvcdn.kv import chain_hash
from kvcdn.manifest import Manifest

from ..bounded import deadline_in
from ..loader import AUTO, check_against_model
from ..stats import lookup_failure
from .config import (
    CAPTURE_PARAM,
    DEADLINE_PARAM,
    LOAD_MODE_PARAM,
    LOAD_MODES,
    LOAD_PARAM,
    QUALITY_PARAM,
    ConnectorSetup,
    seconds,
)
from .metadata import CaptureSpec, KvcdnMetadata, KvcdnWorkerMeta, LoadSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_CAPTURE_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_LOOKUPS = 4096
#: vLLM's prefill speed assumed until the workers have timed a forward pass (a 135M
#: model prefills about 2,700 tokens a second on 2 CPUs; larger models on GPUs more).
PRIOR_PREFILL_TOKENS_PER_S = 1000.0
#: A load's budget is at least this: a healthy store answers well within it.
MIN_LOAD_BUDGET_S = 0.25
#: After a lookup the store did not answer in time, requests are not looked up
#: (vLLM computes them at once) for this long; then one lookup tries again.
LOOKUP_PAUSE_S = 10.0


@dataclass
class _Match:
    manifest: Manifest
    start: int  # tokens vLLM has already (its own prefix cache)
    end: int  # tokens kvcdn loads up to
    quality: str
    deadline_s: float | None
    sync: bool
    tenant: str


@dataclass
class _Lookup:
    """One read of the prefix index (and the manifest it names), shared by requests."""

    future: Future[Manifest | None] = field(default_factory=Future)
    done_at: float = math.inf
    outcome: tuple[str, str] = ("miss", "")  # its (result, reason) labels in the stats


class _Refused(Exception):
    """The document found is not one this connector loads (``reason``: a stats label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Capture:
    tokens: int
    path: str
    block_ids: list[int] = field(default_factory=list)


class KvcdnScheduler:
    """The scheduler role of :class:`~kvcdn.sdk.vllm.KvcdnConnector`."""

    def __init__(self, setup: ConnectorSetup, vllm_config: VllmConfig) -> None:
        self.setup = setup
        self.config = setup.config
        self.block_size = setup.block_size
        self._lookups: dict[str, _Lookup] = {}  # by tenant and the first chunk's chain hash
        self._asked: dict[str, tuple[_Lookup, float]] = {}  # req_id -> its lookup, since
        self._matches: dict[str, _Match] = {}
        self._pending_loads: list[LoadSpec] = []
        self._loading: dict[str, LoadSpec] = {}  # sent to the worker, not finished
        # blocks of those loads reported failed so far: with several workers, one may
        # report its failed blocks steps before the last worker finishes the load
        self._failed_so_far: dict[str, set[int]] = {}
        self._sync_sent: dict[str, LoadSpec] = {}  # sync loads of the step in flight
        self._sync_default: dict[str, bool] = {}  # the connector's own choice, by tenant
        # With async scheduling (or pipeline parallelism) vLLM schedules step N+1
        # before step N's failed blocks are known: a request scheduled then could
        # reuse a block of a failed sync load (cached at allocation) before vLLM
        # recomputes it. Loads are then asynchronous, whose blocks vLLM caches
        # only once they are in.
        self._sync_possible = vllm_config.max_concurrent_batches == 1
        if self.config.load_mode == "sync" and not self._sync_possible:
            log.warning("kvcdn: load_mode sync needs vLLM without async scheduling or "
                        "pipeline parallelism (--no-async-scheduling); loading "
                        "asynchronously")  # fmt: skip
        self._outcomes: dict[str, dict[str, Any]] = {}  # what each load did
        self._captures: dict[str, _Capture] = {}
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kvcdn-lookup")
        # by tenant: a store that does not answer pauses its own tenant's lookups only
        self._lookups_paused_until: dict[str, float] = {}
        self._seconds_per_token: float | None = None  # vLLM's prefill, as workers time it
        if setup.active and setup.loads_enabled:  # not on a lookup's clock
            setup.open_reader_soon()

    # ---- claiming ---------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.setup.active or not self.setup.loads_enabled:
            return 0, False
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:
            log.warning("kvcdn: request %s computed by vLLM: %s", request.request_id, exc)
            try:
                tenant = self.setup.tenant_of(getattr(request, "cache_salt", None))
            except Exception:  # whatever the request holds, this answers
                tenant = None
            self.setup.stats_of(tenant).lookup("failed", "error")
            return 0, False

    def _matched(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        identity = self.setup.identity
        assert identity is not None
        ids = list(request.prompt_token_ids or [])
        chunk = self.config.chunk_tokens
        params = request.kv_transfer_params or {}
        if len(ids) <= chunk or params.get(LOAD_PARAM) is False:
            return 0, False
        req_id = request.request_id
        if req_id in self._outcomes or req_id in self._loading or req_id in self._sync_sent:
            # one load per request: after a load that fell short, vLLM computes the rest
            # (claiming again would fail the same way, over and over)
            return 0, False
        tenant = self.setup.tenant_of(getattr(request, "cache_salt", None))
        if tenant is None:  # a salt no tenant has: its timing must say nothing of any store
            self.setup.stats_of(None).lookup("refused", "tenant")
            return 0, False
        quality = params.get(QUALITY_PARAM, self.config.quality)
        deadline_s = params.get(DEADLINE_PARAM, self.config.deadline_s)
        if deadline_s is not None and seconds(deadline_s) is None:
            log.info("kvcdn: request %s: ignoring %s=%r", req_id, DEADLINE_PARAM, deadline_s)
            deadline_s = self.config.deadline_s
        manifest = self._manifest(req_id, ids[:chunk], identity.fingerprint, tenant)
        if manifest is None:
            return (None, False) if req_id in self._asked else (0, False)
        stats = self.setup.stats_of(tenant)
        if not isinstance(quality, str) or (quality != AUTO and quality not in manifest.levels):
            log.info("kvcdn: request %s asks for quality %r, which %s does not have",
                     req_id, quality, manifest.ref)  # fmt: skip
            stats.lookup("refused", "quality")
            return 0, False
        stats.lookup("hit")
        sync = self._loads_sync(params.get(LOAD_MODE_PARAM), req_id, tenant)
        shared = _common_prefix(ids, manifest.token_ids)
        # Whole blocks: vLLM counts a finished asynchronous load so. A synchronous load
        # could end inside a block, but the tokens after the last whole block are few,
        # vLLM computes them with the prompt's tail in the same pass at almost no cost,
        # and its own bf16 KV there keeps answers closest to its own prefill.
        end = min(shared, len(ids) - 1) // self.block_size * self.block_size
        if end <= num_computed:
            return 0, False
        if deadline_s is None:
            deadline_s = self._budget(end - num_computed)
        self._matches[req_id] = _Match(manifest, num_computed, end, quality, deadline_s, sync,
                                       tenant)  # fmt: skip
        stats.inc("kvcdn_claimed_tokens", end - num_computed)
        return end - num_computed, not sync

    def _manifest(self, req_id: str, first_chunk: list[int], fingerprint: str, tenant: str
                  ) -> Manifest | None:  # fmt: skip
        """The document the request's first chunk begins, if its lookup has answered; a
        request still waiting for it stays in ``_asked`` (vLLM asks again next step)."""
        now = time.monotonic()
        stats = self.setup.stats_of(tenant)
        waited = self._asked.get(req_id)
        paused_until = self._lookups_paused_until.get(tenant, 0.0)
        if waited is None:
            if now < paused_until:
                stats.lookup("failed", "late")
                return None  # the store did not answer lately: no request waits for it
            lookup = self._lookup_of(tenant, chain_hash(fingerprint, "", first_chunk), now)
            waited = self._asked[req_id] = (lookup, now)
        lookup, asked = waited
        if not lookup.future.done():
            if now - asked < self.config.lookup_timeout_s:
                return None
            self._asked.pop(req_id, None)
            stats.lookup("failed", "late")
            if now >= paused_until:
                log.warning("kvcdn: %s (tenant %s) did not answer a document lookup in %g s; "
                            "its requests are computed by vLLM without waiting for it for %g s",
                            self.setup.store_of(tenant) or "the store",
                            self.setup.tenant_label(tenant), self.config.lookup_timeout_s,
                            LOOKUP_PAUSE_S)  # fmt: skip
            self._lookups_paused_until[tenant] = now + LOOKUP_PAUSE_S
            return None
        self._asked.pop(req_id, None)
        if lookup.outcome[0] != "hit":  # a hit is counted once the request is claimed
            stats.lookup(*lookup.outcome)
        try:
            return lookup.future.result()
        except Exception as exc:
            log.warning("kvcdn: document lookup failed: %s", exc)
            return None

    def _budget(self, tokens: int) -> float:
        """A load's deadline when none is configured: what vLLM's own prefill of
        ``tokens`` is predicted to take (docs/vllm.md)."""
        per_token = self._seconds_per_token or 1.0 / PRIOR_PREFILL_TOKENS_PER_S
        return max(MIN_LOAD_BUDGET_S, tokens * per_token)

    def _loads_sync(self, asked: Any, req_id: str, tenant: str) -> bool:
        """Whether this request's load is synchronous: where the connector's own choice
        is (``load_mode``); a request may ask for ``async``, never force ``sync`` (one
        request's synchronous load stalls every request in its step)."""
        default = self._sync_default.get(tenant)
        if default is None:
            mode = self.config.load_mode
            local = mode == "auto" and self.setup.reader(tenant).local
            default = self._sync_default[tenant] = self._sync_possible and (mode == "sync"
                                                                            or local)  # fmt: skip
        if asked is not None and asked not in LOAD_MODES:
            log.info("kvcdn: request %s: ignoring %s=%r", req_id, LOAD_MODE_PARAM, asked)
        return default and asked != "async"

    def _lookup_of(self, tenant: str, first_chunk_hash: str, now: float) -> _Lookup:
        """The lookup of the document starting with this chunk in ``tenant``'s store: a
        recent one, or a new one (never another tenant's)."""
        ttl = self.config.lookup_ttl_s
        key = f"{tenant}/{first_chunk_hash}"
        lookup = self._lookups.get(key)
        if lookup is not None and (not lookup.future.done() or now - lookup.done_at < ttl):
            return lookup
        if len(self._lookups) >= MAX_LOOKUPS:
            self._lookups = {k: v for k, v in self._lookups.items() if not v.future.done()}
        lookup = _Lookup()

        def run() -> Manifest | None:
            started = time.perf_counter()
            try:
                manifest = self._lookup(tenant, first_chunk_hash)
                lookup.outcome = ("hit", "") if manifest is not None else ("miss", "")
                return manifest
            except _Refused as exc:
                log.warning("kvcdn: %s", exc)
                lookup.outcome = ("refused", exc.reason)
                return None
            except BaseException as exc:
                lookup.outcome = lookup_failure(exc)
                raise
            finally:
                self.setup.stats_of(tenant).observe("kvcdn_lookup_seconds",
                                                    time.perf_counter() - started)
                lookup.done_at = time.monotonic()

        lookup.future = self._lookup_pool.submit(run)
        self._lookups[key] = lookup
        return lookup

    def _lookup(self, tenant: str, first_chunk_hash: str) -> Manifest | None:
        """The manifest the prefix index names for this first chunk, checked against the
        served model (the one check of a load: the workers load what this returns)."""
        from kvcdn import catalog

        identity = self.setup.identity
        assert identity is not None
        reader = self.setup.reader(tenant).within(deadline_in(self.config.lookup_timeout_s))
        manifest = catalog.find_by_prefix(
            reader, identity.fingerprint, first_chunk_hash, trust=self.setup.trust_of(tenant)
        )
        if manifest is None:
            return None
        if manifest.chunk_tokens != self.config.chunk_tokens:
            raise _Refused("chunk_tokens", f"{manifest.ref} has chunks of {manifest.chunk_tokens} "
                           f"tokens, this connector {self.config.chunk_tokens}: not loaded")
        try:
            check_against_model(manifest, identity)
        except KvcdnError as exc:
            raise _Refused("model", f"{manifest.ref} is not loaded into {identity.name}: "
                           f"{exc}") from None
        return manifest

    # ---- after vLLM allocated blocks ----------------------------------------------------
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        if self.setup.captures_enabled and self.setup.active and CAPTURE_PARAM in params:
            capture = self._capture_of(params[CAPTURE_PARAM], len(request.prompt_token_ids or []))
            if capture is not None:
                self._captures.setdefault(req_id, capture)
        match = self._matches.get(req_id)
        if match is None or num_external_tokens == 0:
            return
        if num_external_tokens != match.end - match.start:
            self._matches.pop(req_id, None)
            return
        block_ids = list(blocks.get_block_ids()[0])
        spec = LoadSpec(req_id, match.manifest, match.start, match.end, block_ids,
                        match.quality, match.deadline_s, match.sync, match.tenant)  # fmt: skip
        self._pending_loads.append(spec)

    def _capture_of(self, capture_id: Any, tokens: int) -> _Capture | None:
        if self.config.capture_dir is None:
            log.warning("kvcdn: a capture was asked for but capture_dir is not configured")
            return None
        if not isinstance(capture_id, str) or not _CAPTURE_ID.match(capture_id):
            log.warning("kvcdn: ignoring capture id %r (32 hex digits expected)", capture_id)
            return None
        return _Capture(tokens, str(Path(self.config.capture_dir) / f"{capture_id}.safetensors"))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvcdnMetadata:
        scheduled = scheduler_output.total_num_scheduled_tokens
        meta = KvcdnMetadata(loads=self._pending_loads, idle=scheduled == 0,
                             scheduled_tokens=scheduled)  # fmt: skip
        for spec in self._pending_loads:
            (self._sync_sent if spec.sync else self._loading)[spec.req_id] = spec
        self._pending_loads = []
        if self._captures:
            meta.captures = self._captures_due(scheduler_output)
        return meta

    def _captures_due(self, scheduler_output: SchedulerOutput) -> list[CaptureSpec]:
        """The captures whose prompt's KV is complete after this step (their blocks
        followed as vLLM allocates them)."""
        for new in scheduler_output.scheduled_new_reqs:
            capture = self._captures.get(new.req_id)
            if capture is not None:
                capture.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=False):
            capture = self._captures.get(req_id)
            if capture is not None and new_blocks is not None:
                capture.block_ids.extend(new_blocks[0])
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        due = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            capture = self._captures.get(req_id)
            if capture is not None and computed.get(req_id, 0) + n >= capture.tokens:
                del self._captures[req_id]
                due.append(CaptureSpec(req_id, capture.tokens, capture.block_ids, capture.path))
        return due

    # ---- what happened --------------------------------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        told = connector_output.kv_connector_worker_meta
        if isinstance(told, KvcdnWorkerMeta):
            if told.seconds_per_token:
                self._seconds_per_token = told.seconds_per_token
            if told.disabled and self.setup.active:
                self.setup.disable(f"a worker cannot load ({told.disabled}); vLLM computes "
                                   "every request")  # fmt: skip
        failed = connector_output.invalid_block_ids or set()
        # a synchronous load ends within its step, whose failed blocks come in this
        # output (synchronous loads are made only where vLLM reports each step's
        # output before it schedules the next)
        if failed:
            for req_id, spec in self._loading.items():
                mine = failed.intersection(spec.block_ids)
                if mine:
                    self._failed_so_far.setdefault(req_id, set()).update(mine)
        done = [*self._sync_sent.values()]
        self._sync_sent = {}
        for req_id in connector_output.finished_recving or ():
            spec = self._loading.pop(req_id, None)
            if spec is not None:
                done.append(spec)
        for spec in done:
            seen = failed | self._failed_so_far.pop(spec.req_id, set())
            self._outcomes[spec.req_id] = outcome = self._outcome(spec, seen)
            self.setup.stats_of(spec.tenant).inc("kvcdn_loaded_tokens", outcome["loaded_tokens"])

    def _outcome(self, spec: LoadSpec, failed: set[int]) -> dict[str, Any]:
        return {
            "document": spec.manifest.ref,
            "quality": spec.quality,
            "mode": "sync" if spec.sync else "async",
            "claimed_tokens": spec.end - spec.start,
            "loaded_tokens": spec.loaded_to(failed, self.block_size) - spec.start,
            "deadline_s": spec.deadline_s,
        }

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """What kvcdn did for the request, in its output's ``kv_transfer_params``."""
        req_id = request.request_id
        self._matches.pop(req_id, None)
        self._asked.pop(req_id, None)
        self._captures.pop(req_id, None)
        self._loading.pop(req_id, None)
        self._failed_so_far.pop(req_id, None)
        sent = self._sync_sent.pop(req_id, None)
        outcome = self._outcomes.pop(req_id, None)
        if outcome is None and sent is not None and request.status.name != "FINISHED_ABORTED":
            # it finished in its load's step, before that step's output reached
            # update_connector_output: vLLM finishes no request whose load failed
            # (an abort says nothing of the load)
            outcome = self._outcome(sent, set())
            self.setup.stats_of(sent.tenant).inc("kvcdn_loaded_tokens", outcome["loaded_tokens"])
        return False, ({"kvcdn": outcome} if outcome is not None else None)

    def shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
