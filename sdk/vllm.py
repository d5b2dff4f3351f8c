"""kvcdn inside vLLM: a KV connector that loads published documents into vLLM's paged
KV cache, and captures vLLM's prefill for publishing.

Configure it with vLLM's ``--kv-transfer-config`` (docs/vllm.md)::

    {"kv_connector": "KvcdnConnector", "kv_connector_module_path": "kvcdn.sdk.vllm",
     "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"store": "s3://bucket/kv", "edges": ["http://edge:8080"]}}

How a request meets kvcdn. The scheduler (vLLM's engine-core process) hashes
the prompt's first ``chunk_tokens`` tokens as kvcdn chains chunk hashes, and
looks that hash up once in the store's prefix index (one small read, cached;
the request waits for it at most ``lookup_timeout_s``). A manifest found is
checked against the served model like every load, and the tokens the prompt
shares with the document, less at least one and rounded down to vLLM's block
size, are claimed. The worker (vLLM's model process) fetches those chunks
through the SDK's loader (edges with failover, every object verified against its
manifest before it is decoded) and decodes them into the blocks vLLM allocated,
in vLLM's layout. A chunk
that fails, or that is not in by the load's deadline, ends the load: its blocks and
all after it are reported to vLLM as failed, and vLLM recomputes them
(``kv_load_failure_policy`` ``recompute``). Nothing unverified is written, so
nothing wrong enters vLLM's prefix cache. kvcdn never makes the engine fail:
anything unexpected in the connector is logged and the request is computed by
vLLM.

A load never makes a request much slower than vLLM without kvcdn. Its deadline
is ``deadline_s`` (or the request's ``kvcdn_deadline_s``), else a budget: what
vLLM's own prefill of the claimed tokens is predicted to take, from its forward
passes as the workers measure them (:data:`PRIOR_PREFILL_TOKENS_PER_S` before
the first), and at least :data:`MIN_LOAD_BUDGET_S`. Every read is given up at
that deadline (:class:`~kvcdn.sdk.bounded.BoundedReader`: a hung mount or an
endpoint that never answers holds a thread, not the load), an edge that fails is
skipped for a while (the edge reader's circuit breaker), and a lookup the store
does not answer in ``lookup_timeout_s`` pauses lookups for
:data:`LOOKUP_PAUSE_S`, so later requests do not wait for it.

Two ways to load (``load_mode``). *async*: the request waits in
``WAITING_FOR_REMOTE_KVS`` while the load runs beside the engine, which keeps
serving other requests; right when bytes cross a link. *sync*: the load runs
inside the step that first computes the request, as vLLM's own ExampleConnector
does: no extra scheduler steps and no idle steps polling for the load, but every
request in that step waits for it; right when the bytes are on a local disk
(tens of milliseconds, less than the prefill it replaces). ``auto`` (the default)
loads a local folder store without edges synchronously and everything else
asynchronously.

Producer (``kv_producer``/``kv_both``): a request whose ``kv_transfer_params``
hold ``{"kvcdn_capture": ID}`` has its prompt's KV copied out of vLLM's blocks
when its prefill completes, to ``{capture_dir}/{ID}.safetensors``;
:class:`VllmPrefill` drives this for ``kvcdn publish --engine vllm``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvcdn.errors import KvcdnError
from kvcdn.kernels.paged import gather_token_major, scatter_token_major
from kvcdn.kv import DEFAULT_CHUNK_TOKENS, chain_hash
from kvcdn.manifest import Manifest
from kvcdn.models import ModelIdentity, model_identity
from kvcdn.profile_store import ProfileCache
from kvcdn.signing import TrustPolicy

from . import checks
from .bounded import deadline_in
from .loader import AUTO, load_prefix_into, open_reader
from .planner import HarmonicPredictor, plan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcdn.kernels.permuted import PermutedBlocks

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
_CAPTURE_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_LOOKUPS = 4096
#: A step that runs no model (the engine only waits for loads) waits this long for one
#: to finish: vLLM otherwise spins such steps, and its spinning thread starves the load's
#: threads of the GIL (a 0.1 s load took 10 s in an engine without multiprocessing).
IDLE_STEP_WAIT_S = 0.005
#: vLLM's prefill speed assumed until the workers have timed a forward pass (a 135M
#: model prefills about 2,700 tokens a second on 2 CPUs; larger models on GPUs more).
PRIOR_PREFILL_TOKENS_PER_S = 1000.0
#: A load's budget is at least this: a healthy store answers well within it.
MIN_LOAD_BUDGET_S = 0.25
#: Forward passes of at least this many tokens are timed for the budget.
MIN_TIMED_TOKENS = 128
#: After a lookup the store did not answer in time, requests are not looked up
#: (vLLM computes them at once) for this long; then one lookup tries again.
LOOKUP_PAUSE_S = 10.0


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked once."""

    store: str | None = None  # where manifests and objects are (a folder, s3://...)
    endpoint_url: str | None = None  # an S3 endpoint other than AWS's
    edges: list[str] | None = None  # edge caches to read objects through, in front of store
    edge_token: str | None = None
    trust: str | None = None  # a trust file: manifests must be signed by its keys
    model: str | None = None  # the kvcdn model name (default: the model vLLM serves)
    quality: str = AUTO  # a level, or auto
    deadline_s: float | None = None  # a load not in by then is left to vLLM's prefill
    load_mode: str = "auto"  # sync, async, or auto: sync for a local folder without edges
    lookup_timeout_s: float = 2.0  # a request waits this long for a document lookup
    lookup_ttl_s: float = 30.0  # a lookup's answer (found or not) is reused this long
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the chunk size documents were published with
    capture_dir: str | None = None  # producer: where captured prompt KV is written

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise KvcdnError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        config = cls(**extra)
        checks.optional_string(config.store, "store")
        checks.optional_string(config.endpoint_url, "endpoint_url")
        checks.optional_string(config.edge_token, "edge_token")
        checks.optional_string(config.trust, "trust")
        checks.optional_string(config.model, "model")
        checks.optional_string(config.capture_dir, "capture_dir")
        if config.edges is not None and (
            not isinstance(config.edges, list) or not all(isinstance(e, str) for e in config.edges)
        ):
            raise KvcdnError("edges must be a list of edge URLs")
        if not isinstance(config.quality, str) or not config.quality:
            raise KvcdnError("quality must be a level name or 'auto'")
        if config.load_mode not in LOAD_MODES:
            raise KvcdnError(f"load_mode must be one of {', '.join(LOAD_MODES)}")
        for key in ("deadline_s", "lookup_timeout_s", "lookup_ttl_s"):
            value = getattr(config, key)
            if value is not None and not _seconds(value, zero=key == "lookup_ttl_s"):
                raise KvcdnError(f"{key} must be a positive number of seconds")
        if type(config.chunk_tokens) is not int or config.chunk_tokens < 16:
            raise KvcdnError("chunk_tokens must be an integer of at least 16")
        return config


def _seconds(value: Any, *, zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


# ---- what the scheduler tells the worker -------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of ``manifest`` into ``block_ids``' slots; ``sync``:
    within the step (see the module's documentation)."""

    req_id: str
    manifest: Manifest
    start: int
    end: int
    block_ids: list[int]
    quality: str
    deadline_s: float | None
    sync: bool = False


@dataclass(frozen=True)
class CaptureSpec:
    """Copy the KV of the first ``tokens`` tokens out of ``block_ids`` to ``path``."""

    req_id: str
    tokens: int
    block_ids: list[int]
    path: str


@dataclass
class KvcdnMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)
    idle: bool = False  # the step runs no model
    scheduled_tokens: int = 0  # tokens the step computes (its forward pass is timed)


@dataclass
class KvcdnWorkerMeta(KVConnectorWorkerMetadata):
    """What workers tell the scheduler: vLLM's prefill speed as they time it, and why
    a worker cannot load (the scheduler then claims nothing)."""

    seconds_per_token: float | None = None
    disabled: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcdnWorkerMeta)
        speeds = [s for s in (self.seconds_per_token, other.seconds_per_token) if s]
        return KvcdnWorkerMeta(max(speeds, default=None), self.disabled or other.disabled)


@dataclass
class _Match:
    manifest: Manifest
    start: int  # tokens vLLM has already (its own prefix cache)
    end: int  # tokens kvcdn loads up to
    quality: str
    deadline_s: float | None
    sync: bool


@dataclass
class _Lookup:
    """One read of the prefix index (and the manifest it names), shared by requests."""

    future: Future[Manifest | None] = field(default_factory=Future)
    done_at: float = math.inf


@dataclass
class _Capture:
    tokens: int
    path: str
    block_ids: list[int] = field(default_factory=list)


class KvcdnConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvcdn (see the module's documentation)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.loads_enabled = bool(transfer.is_kv_consumer)
        self.captures_enabled = bool(transfer.is_kv_producer)
        self.identity: ModelIdentity | None = None
        self.config = ConnectorConfig()
        self._trust: TrustPolicy | None = None
        try:
            self.config = ConnectorConfig.parse(dict(transfer.kv_connector_extra_config or {}))
            self.identity = model_identity(self.config.model or vllm_config.model_config.model)
            if self.config.trust:
                self._trust = TrustPolicy.from_file(self.config.trust)
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
            parallel = vllm_config.parallel_config
            split = [f"{what}={n}" for what, n in (
                ("tensor_parallel_size", parallel.tensor_parallel_size),
                ("pipeline_parallel_size", parallel.pipeline_parallel_size)) if n > 1]  # fmt: skip
            if split:
                raise KvcdnError(
                    f"vLLM runs with {' and '.join(split)}: each worker holds part of the "
                    "model's KV, which kvcdn does not load yet; vLLM computes every request"
                )
        except Exception as exc:  # the engine runs on without kvcdn, and says why
            log.error("kvcdn connector disabled: %s", exc)
            self.identity = None
        self._reader: Any = None
        self._reader_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._lookups: dict[str, _Lookup] = {}  # by the first chunk's chain hash
            # req_id -> the lookup it waits for, and since when
            self._asked: dict[str, tuple[_Lookup, float]] = {}
            self._matches: dict[str, _Match] = {}
            self._pending_loads: list[LoadSpec] = []
            self._loading: dict[str, LoadSpec] = {}  # sent to the worker, not finished
            self._sync_sent: dict[str, LoadSpec] = {}  # sync loads of the step in flight
            self._sync_default: bool | None = None  # the connector's own choice
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
            self._lookups_paused_until = 0.0
            self._seconds_per_token: float | None = None  # vLLM's prefill, as workers time it
            if self.identity is not None and self.loads_enabled:  # not on a lookup's clock
                threading.Thread(target=self._open_reader, name="kvcdn-open", daemon=True).start()
        else:
            self._writer: _PagedLayout | None = None
            self._load_pool = ThreadPoolExecutor(2, thread_name_prefix="kvcdn-load")
            self._done_lock = threading.Condition()
            self._done: dict[str, set[int]] = {}  # req_id -> blocks that failed
            self._in_flight = 0  # loads submitted, not finished
            self._failed_now: set[int] = set()
            self._profiles = ProfileCache()
            self._predictor = HarmonicPredictor()
            self._prefill = _PrefillTimer()
            self._disabled: str | None = None  # told to the scheduler once
            self._told: tuple[float | None, str | None] = (None, None)

    def reader(self) -> Any:
        with self._reader_lock:
            if self._reader is None:
                c = self.config
                self._reader = open_reader(
                    c.store, endpoint_url=c.endpoint_url, edges=c.edges,
                    edge_token=c.edge_token, trust=self._trust,
                )  # fmt: skip
            return self._reader

    # ---- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.identity is None or not self.loads_enabled:
            return 0, False
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:
            log.warning("kvcdn: request %s computed by vLLM: %s", request.request_id, exc)
            return 0, False

    def _matched(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        assert self.identity is not None
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
        quality = params.get(QUALITY_PARAM, self.config.quality)
        deadline_s = params.get(DEADLINE_PARAM, self.config.deadline_s)
        if deadline_s is not None and not _seconds(deadline_s):
            log.info("kvcdn: request %s: ignoring %s=%r", request.request_id, DEADLINE_PARAM,
                     deadline_s)  # fmt: skip
            deadline_s = self.config.deadline_s
        now = time.monotonic()
        waited = self._asked.get(request.request_id)
        if waited is None:
            if now < self._lookups_paused_until:
                return 0, False  # the store did not answer lately: no request waits for it
            lookup = self._lookup_of(chain_hash(self.identity.fingerprint, "", ids[:chunk]), now)
            waited = self._asked[request.request_id] = (lookup, now)
        lookup, asked = waited
        if not lookup.future.done():
            if now - asked < self.config.lookup_timeout_s:
                return None, False  # vLLM asks again at its next step
            self._asked.pop(request.request_id, None)
            if now >= self._lookups_paused_until:
                log.warning("kvcdn: %s did not answer a document lookup in %g s; requests are "
                            "computed by vLLM without waiting for it for %g s",
                            self.config.store or "the store", self.config.lookup_timeout_s,
                            LOOKUP_PAUSE_S)  # fmt: skip
            self._lookups_paused_until = now + LOOKUP_PAUSE_S
            return 0, False
        self._asked.pop(request.request_id, None)
        try:
            manifest = lookup.future.result()
        except Exception as exc:
            log.warning("kvcdn: document lookup failed: %s", exc)
            return 0, False
        if manifest is None:
            return 0, False
        if not isinstance(quality, str) or (quality != AUTO and quality not in manifest.levels):
            log.info("kvcdn: request %s asks for quality %r, which %s does not have",
                     request.request_id, quality, manifest.ref)  # fmt: skip
            return 0, False
        sync = self._loads_sync(params.get(LOAD_MODE_PARAM), req_id)
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
        self._matches[req_id] = _Match(manifest, num_computed, end, quality, deadline_s, sync)
        return end - num_computed, not sync

    def _budget(self, tokens: int) -> float:
        """A load's deadline when none is configured: what vLLM's own prefill of
        ``tokens`` is predicted to take (the module's documentation)."""
        per_token = self._seconds_per_token or 1.0 / PRIOR_PREFILL_TOKENS_PER_S
        return max(MIN_LOAD_BUDGET_S, tokens * per_token)

    def _loads_sync(self, asked: Any, req_id: str) -> bool:
        """Whether this request's load is synchronous: where the connector's own choice
        is (``load_mode``); a request may ask for ``async``, never force ``sync`` (one
        request's synchronous load stalls every request in its step)."""
        if self._sync_default is None:
            from kvcdn.store import LocalStore

            mode = self.config.load_mode
            local = mode == "auto" and isinstance(self.reader().inner, LocalStore)
            self._sync_default = self._sync_possible and (mode == "sync" or local)
        if asked is not None and asked not in LOAD_MODES:
            log.info("kvcdn: request %s: ignoring %s=%r", req_id, LOAD_MODE_PARAM, asked)
        return self._sync_default and asked != "async"

    def _lookup_of(self, first_chunk_hash: str, now: float) -> _Lookup:
        """The lookup of the document starting with this chunk: a recent one, or a new one."""
        ttl = self.config.lookup_ttl_s
        lookup = self._lookups.get(first_chunk_hash)
        if lookup is not None and (not lookup.future.done() or now - lookup.done_at < ttl):
            return lookup
        if len(self._lookups) >= MAX_LOOKUPS:
            self._lookups = {k: v for k, v in self._lookups.items() if not v.future.done()}
        lookup = _Lookup()

        def run() -> Manifest | None:
            try:
                return self._lookup(first_chunk_hash)
            finally:
                lookup.done_at = time.monotonic()

        lookup.future = self._lookup_pool.submit(run)
        self._lookups[first_chunk_hash] = lookup
        return lookup

    def _lookup(self, first_chunk_hash: str) -> Manifest | None:
        from kvcdn import catalog

        from .loader import check_against_model

        assert self.identity is not None
        reader = self.reader().within(deadline_in(self.config.lookup_timeout_s))
        manifest = catalog.find_by_prefix(
            reader, self.identity.fingerprint, first_chunk_hash, trust=self._trust
        )
        if manifest is None:
            return None
        if manifest.chunk_tokens != self.config.chunk_tokens:
            log.warning("kvcdn: %s has chunks of %d tokens, this connector %d: not loaded",
                        manifest.ref, manifest.chunk_tokens, self.config.chunk_tokens)  # fmt: skip
            return None
        try:
            check_against_model(manifest, self.identity)
        except KvcdnError as exc:
            log.warning("kvcdn: %s is not loaded into %s: %s", manifest.ref, self.identity.name,
                        exc)  # fmt: skip
            return None
        return manifest

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        params = request.kv_transfer_params or {}
        if self.captures_enabled and self.identity is not None and CAPTURE_PARAM in params:
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
                        match.quality, match.deadline_s, match.sync)  # fmt: skip
        self._pending_loads.append(spec)

    def _capture_of(self, capture_id: Any, tokens: int) -> _Capture | None:
        if self.config.capture_dir is None:
            log.warning("kvcdn: a capture was asked for but capture_dir is not configured")
            return None
        if not isinstance(capture_id, str) or not _CAPTURE_ID.match(capture_id):
            log.warning("kvcdn: ignoring capture id %r (32 hex digits expected)", capture_id)
            return None
        return _Capture(tokens, str(Path(self.config.capture_dir) / f"{capture_id}.safetensors"))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.total_num_scheduled_tokens
        meta = KvcdnMetadata(loads=self._pending_loads, idle=scheduled == 0,
                             scheduled_tokens=scheduled)  # fmt: skip
        for spec in self._pending_loads:
            (self._sync_sent if spec.sync else self._loading)[spec.req_id] = spec
        self._pending_loads = []
        if not self._captures:
            return meta
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
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            capture = self._captures.get(req_id)
            if capture is not None and computed.get(req_id, 0) + n >= capture.tokens:
                del self._captures[req_id]  # its prompt's KV is complete after this step
                meta.captures.append(
                    CaptureSpec(req_id, capture.tokens, capture.block_ids, capture.path)
                )
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        told = connector_output.kv_connector_worker_meta
        if isinstance(told, KvcdnWorkerMeta):
            if told.seconds_per_token:
                self._seconds_per_token = told.seconds_per_token
            if told.disabled and self.identity is not None:
                log.error("kvcdn connector disabled: a worker cannot load (%s); vLLM computes "
                          "every request", told.disabled)  # fmt: skip
                self.identity = None
        failed = connector_output.invalid_block_ids or set()
        # a synchronous load ends within its step, whose failed blocks come in this
        # output (synchronous loads are made only where vLLM reports each step's
        # output before it schedules the next)
        done = [*self._sync_sent.values()]
        self._sync_sent = {}
        for req_id in connector_output.finished_recving or ():
            spec = self._loading.pop(req_id, None)
            if spec is not None:
                done.append(spec)
        for spec in done:
            self._outcomes[spec.req_id] = self._outcome(spec, failed)

    def _outcome(self, spec: LoadSpec, failed: set[int]) -> dict[str, Any]:
        bs = self.block_size
        loaded_to = spec.end
        for index in range(spec.start // bs, -(-spec.end // bs)):
            if spec.block_ids[index] in failed:
                loaded_to = max(spec.start, index * bs)
                break
        return {
            "document": spec.manifest.ref,
            "quality": spec.quality,
            "mode": "sync" if spec.sync else "async",
            "claimed_tokens": spec.end - spec.start,
            "loaded_tokens": loaded_to - spec.start,
            "deadline_s": spec.deadline_s,
        }

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """What kvcdn did for the request, in its output's ``kv_transfer_params``."""
        req_id = request.request_id
        self._matches.pop(req_id, None)
        self._asked.pop(req_id, None)
        self._captures.pop(req_id, None)
        self._loading.pop(req_id, None)
        sent = self._sync_sent.pop(req_id, None)
        outcome = self._outcomes.pop(req_id, None)
        if outcome is None and sent is not None and request.status.name != "FINISHED_ABORTED":
            # it finished in its load's step, before that step's output reached
            # update_connector_output: vLLM finishes no request whose load failed
            # (an abort says nothing of the load)
            outcome = self._outcome(sent, set())
        return False, ({"kvcdn": outcome} if outcome is not None else None)

    # ---- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.identity is None:
            return
        try:
            self._writer = _PagedLayout.detect(kv_caches, self.identity, self.block_size)
        except Exception as exc:
            log.error("kvcdn connector disabled: %s", exc)
            self.identity = None
            self._disabled = str(exc)  # the scheduler stops claiming when it hears
            return
        # The decode kernels load, and the store opens, now: not on a request's clock.
        # The kernels in a thread Python joins at exit (a daemon thread inside torch
        # code at exit aborts the process); the store in a daemon thread.
        threading.Thread(target=_warm_up, args=(self._writer, self.identity.layout.head_dim),
                         name="kvcdn-warm-up").start()  # fmt: skip
        threading.Thread(target=self._open_reader, name="kvcdn-open", daemon=True).start()

    def _open_reader(self) -> None:
        try:
            self.reader()
        except Exception as exc:  # the first load meets it, and says so
            log.warning("kvcdn: cannot open %s yet: %s", self.config.store, exc)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # called before the step's forward pass: timed until get_finished, after it
        tokens = getattr(connector_metadata, "scheduled_tokens", 0)
        self._prefill.start(tokens)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcdnMetadata)
        for spec in meta.loads:
            if spec.sync:  # vLLM reads its failed blocks after this step's forward
                with self._prefill.paused():
                    self._failed_now |= self._load(spec)
            elif self._writer is None:
                self._finish(spec.req_id, unfilled_blocks(spec.block_ids, spec.start, spec.end,
                                                          spec.start, self.block_size))  # fmt: skip
            else:
                with self._done_lock:
                    self._in_flight += 1
                self._load_pool.submit(self._load_async, spec)

    def _load_async(self, spec: LoadSpec) -> None:
        failed = self._load(spec)
        with self._done_lock:
            self._in_flight -= 1
        self._finish(spec.req_id, failed)

    def _load(self, spec: LoadSpec) -> set[int]:
        """Load ``spec``; the ids of the blocks it did not fill."""
        if self._writer is None or self.identity is None:
            return unfilled_blocks(spec.block_ids, spec.start, spec.end, spec.start,
                                   self.block_size)  # fmt: skip
        loaded_to = spec.start
        try:
            chunk = self.config.chunk_tokens
            first_chunk = spec.start // chunk
            target = PagedTarget(self._writer, spec)
            result = load_prefix_into(
                target,
                spec.manifest,
                self.identity,
                self.reader(),
                chunks=(first_chunk, -(-spec.end // chunk)),
                quality=spec.quality,
                device=self._writer.device,
                predictor=self._predictor,
                policy=plan,
                profiles=self._profiles,
                deadline_s=spec.deadline_s,
            )
            loaded_to = min(spec.end, (first_chunk + result.loaded_chunks) * chunk)
        except Exception as exc:
            log.warning("kvcdn: loading %s for request %s failed: %s", spec.manifest.ref,
                        spec.req_id, exc)  # fmt: skip
        failed = unfilled_blocks(spec.block_ids, spec.start, spec.end, loaded_to, self.block_size)
        if failed:
            log.info("kvcdn: request %s: %d of %d tokens loaded; vLLM computes the rest",
                     spec.req_id, max(loaded_to - spec.start, 0),
                     spec.end - spec.start)  # fmt: skip
        return failed

    def _finish(self, req_id: str, failed_blocks: set[int]) -> None:
        with self._done_lock:
            self._done[req_id] = failed_blocks
            self._done_lock.notify_all()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a synchronous load is whole before the forward starts (start_load_kv)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # captures copy whole prompts after the step (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._writer is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcdnMetadata)
        for spec in meta.captures:
            try:
                _write_capture(self._writer.read(spec.block_ids, spec.tokens), spec.path)
            except Exception as exc:
                log.error("kvcdn: capturing request %s failed: %s", spec.req_id, exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        idle = self.has_connector_metadata() and getattr(
            self._get_connector_metadata(), "idle", False
        )
        self._prefill.stop()
        with self._done_lock:
            if idle and self._in_flight and not self._done:
                self._done_lock.wait(IDLE_STEP_WAIT_S)
            done, self._done = self._done, {}
        for blocks in done.values():
            self._failed_now |= blocks
        return None, (set(done) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_now = self._failed_now, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """vLLM's prefill speed when it changed, and why this worker cannot load."""
        if not hasattr(self, "_prefill"):
            return None  # the scheduler's instance
        news = (self._prefill.seconds_per_token, self._disabled)
        if news == self._told:
            return None
        self._told = news
        return KvcdnWorkerMeta(*news)

    def shutdown(self) -> None:
        pool = getattr(self, "_load_pool", None) or getattr(self, "_lookup_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class _PrefillTimer:
    """vLLM's forward passes, timed on the worker from ``bind_connector_metadata`` (before
    the forward) to ``get_finished`` (after it), less the synchronous loads between:
    the seconds a token of prefill takes, a moving average of passes of at least
    :data:`MIN_TIMED_TOKENS` tokens (on a GPU, the host's view of them)."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None
        self._started: float | None = None
        self._tokens = 0
        self._excluded = 0.0

    def start(self, tokens: int) -> None:
        self._started, self._tokens, self._excluded = time.perf_counter(), tokens, 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - t

    def stop(self) -> None:
        if self._started is None or self._tokens < MIN_TIMED_TOKENS:
            self._started = None
            return
        sample = (time.perf_counter() - self._started - self._excluded) / self._tokens
        self._started = None
        if sample <= 0:
            return
        old = self.seconds_per_token
        self.seconds_per_token = sample if old is None else 0.7 * old + 0.3 * sample


def _log_like_vllm() -> None:
    """kvcdn's log lines inside vLLM, with the level, time and process tag of vLLM's own:
    kvcdn's logger writes through vLLM's handlers, at its level, unless someone gave it
    handlers of its own."""
    ours, theirs = logging.getLogger("kvcdn"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False  # vLLM's own lines do not reach the root logger either


def _warm_up(layout: _PagedLayout, dim: int) -> None:
    """Load the decode and write kernels now, not on the first request's clock."""
    from kvcdn import codec

    device = layout.device
    try:
        codec.warm_up(device, torch.float32 if device == "cpu" else layout.dtype, dim)
        empty = torch.empty((len(layout.caches), 2, layout.heads, 0, layout.head_dim))
        layout.write(empty.to(device), [], 0)
        into = layout.permuted([], 0, 0, 0, 0)
        if into is not None:  # the decoders that write into these blocks
            from kvcdn.kernels import rans_numba

            rans_numba.warm_up_permuted(into)
    except Exception as exc:  # only a first load's speed depends on it
        log.info("kvcdn: warming the decoder up failed: %s", exc)


def unfilled_blocks(block_ids: list[int], start: int, end: int, loaded_to: int,
                    block_size: int) -> set[int]:  # fmt: skip
    """The blocks of a load of tokens ``[start, end)`` that stopped at ``loaded_to``,
    for vLLM to recompute: the block holding the first token not loaded and every
    claimed block after it, never one wholly vLLM's own before ``start`` (a
    prefix-cache hit other requests may share; a load from inside a chunk that
    failed in that chunk stopped at the chunk's start, before ``start``)."""
    loaded_to = max(loaded_to, start)
    if loaded_to >= end:
        return set()
    bs = block_size
    return {b for i, b in enumerate(block_ids)
            if (i + 1) * bs > loaded_to and i * bs < end and (i + 1) * bs > start}  # fmt: skip


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---- vLLM's KV memory -------------------------------------------------------------------
class _PagedLayout:
    """vLLM's KV cache tensors, one per layer, and how to write and read tokens in them.

    On CPU (``CPU_ATTN``) each layer is ``[blocks, heads, block_size, 2 * head_dim]``
    whose interior order depends on the CPU's attention kernel (AMX, AVX-512):
    tokens are written with vLLM's own op, and read back through the permutation
    that op is observed to apply. On CUDA (FlashAttention's layout) each layer is
    ``[2, blocks, block_size, heads, head_dim]``: token-major, written and read by
    indexing (:mod:`kvcdn.kernels.paged`).
    """

    def __init__(self, caches: dict[int, torch.Tensor], kind: str, block_size: int,
                 heads: int, head_dim: int) -> None:  # fmt: skip
        self.caches = caches
        self.kind = kind
        self.block_size = block_size
        self.heads = heads
        self.head_dim = head_dim
        first = next(iter(caches.values()))
        self.dtype = first.dtype
        self.device = str(first.device)
        self._isa: str | None = None
        self._k_perm: torch.Tensor | None = None
        self._v_perm: torch.Tensor | None = None
        # the CPU layout written by kvcdn's kernel: the layers' blocks as one numpy view
        # [layers, blocks, heads, K|V, block_size * head_dim], and where each element goes
        self._rows: np.ndarray | None = None
        self._k_pos: np.ndarray | None = None
        self._v_pos: np.ndarray | None = None
        if kind == "cpu":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            self._isa = _get_attn_isa(self.dtype, block_size, head_dim)
            if self.dtype in (torch.bfloat16, torch.float32):
                self._k_perm, self._v_perm = self._probe_cpu_order()
                self._k_pos = torch.argsort(self._k_perm).numpy()
                self._v_pos = torch.argsort(self._v_perm).numpy()
                self._rows = _stacked_rows(caches, heads, block_size * head_dim)

    @classmethod
    def detect(cls, kv_caches: dict[str, torch.Tensor], model: ModelIdentity,
               block_size: int) -> _PagedLayout:  # fmt: skip
        layout = model.layout
        caches: dict[int, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m is None:
                raise KvcdnError(f"unexpected KV cache layer name {name!r}")
            caches[int(m.group(1))] = tensor
        if sorted(caches) != list(range(layout.layers)):
            raise KvcdnError(
                f"vLLM has KV for layers {sorted(caches)[:4]}..., {model.name} has {layout.layers}"
            )
        first = caches[0]
        if first.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise KvcdnError(f"vLLM's KV cache is {first.dtype}: kvcdn loads float KV only")
        h, d, bs = layout.kv_heads, layout.head_dim, block_size
        shape = tuple(first.shape)
        if first.device.type == "cpu" and len(shape) == 4 and shape[1:] == (h, bs, 2 * d):
            kind = "cpu"
        elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
            kind = "flash"
        else:
            raise KvcdnError(
                f"vLLM's KV cache layout {shape} on {first.device.type} is not one kvcdn writes "
                f"({h} heads x {d}, blocks of {bs})"
            )
        return cls(caches, kind, bs, h, d)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        blocks = torch.tensor(block_ids, dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long)
        return (blocks[positions // bs] * bs + positions % bs).to(self.device)

    def permuted(self, block_ids: list[int], first: int, tokens: int, lo: int, hi: int
                 ) -> PermutedBlocks | None:  # fmt: skip
        """Where kvcdn's CPU kernels write a chunk of ``tokens`` whose token 0 is the
        request's token ``first``, its tokens ``lo .. hi`` only; None for a layout they
        do not write."""
        if self._rows is None:
            return None
        from kvcdn.kernels.permuted import PermutedBlocks

        assert self._k_pos is not None and self._v_pos is not None
        blocks = np.asarray(block_ids, dtype=np.int64)
        return PermutedBlocks(self._rows, blocks, first, lo, hi, self._k_pos, self._v_pos,
                              tokens, self.head_dim)  # fmt: skip

    def write(self, kv: torch.Tensor, block_ids: list[int], start: int) -> None:
        """Write ``kv`` (``[L, 2, H, T, D]``, tokens ``start .. start + T``) into the slots
        of ``block_ids`` (the request's blocks from token 0)."""
        into = self.permuted(block_ids, start, kv.shape[3], 0, kv.shape[3])
        if into is not None and kv.device.type == "cpu" and kv.dtype == torch.float32:
            from kvcdn.kernels.paged_cpu import write_permuted

            write_permuted(kv.numpy(), into)
            return
        self.write_with_op(kv, block_ids, start)

    def write_with_op(self, kv: torch.Tensor, block_ids: list[int], start: int) -> None:
        """:meth:`write` with vLLM's own CPU op (float16 caches; the kernel's reference),
        or by indexing into the token-major layout."""
        slots = self._slots(block_ids, start, start + kv.shape[3])
        for layer, cache in self.caches.items():
            k = kv[layer, 0].transpose(0, 1).to(self.dtype).contiguous()  # [T, H, D]
            v = kv[layer, 1].transpose(0, 1).to(self.dtype).contiguous()
            if self.kind == "cpu":
                from vllm import _custom_ops as ops

                nb = cache.shape[0]
                kc, vc = cache.view(nb, self.heads, 2 * self.block_size, self.head_dim).chunk(2, 2)
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, self._isa)
            else:
                scatter_token_major(cache[0], k, slots)
                scatter_token_major(cache[1], v, slots)

    def read(self, block_ids: list[int], tokens: int) -> torch.Tensor:
        """The KV ``[L, 2, H, tokens, D]`` (float32, on the CPU) of the first ``tokens``
        tokens held in ``block_ids``."""
        slots = self._slots(block_ids, 0, tokens)
        out = torch.empty(
            (len(self.caches), 2, self.heads, tokens, self.head_dim), dtype=torch.float32
        )
        for layer, cache in self.caches.items():
            if self.kind == "cpu":
                k, v = self._read_cpu(cache, block_ids, tokens)
            else:
                k = gather_token_major(cache[0], slots)
                v = gather_token_major(cache[1], slots)
            out[layer, 0] = k.transpose(0, 1).float().cpu()
            out[layer, 1] = v.transpose(0, 1).float().cpu()
        return out

    def _read_cpu(self, cache: torch.Tensor, block_ids: list[int], tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """K and V ``[tokens, H, D]`` from CPU blocks, by the inverse of the write op."""
        if self._k_perm is None:
            self._k_perm, self._v_perm = self._probe_cpu_order()
        assert self._v_perm is not None
        h, d, bs = self.heads, self.head_dim, self.block_size
        n = -(-tokens // bs)
        blocks = cache[torch.tensor(block_ids[:n], dtype=torch.long)].view(n, h, 2, bs * d)
        k = torch.empty((n, h, bs * d), dtype=cache.dtype)
        v = torch.empty((n, h, bs * d), dtype=cache.dtype)
        k[:, :, self._k_perm] = blocks[:, :, 0]  # position p holds element perm[p]
        v[:, :, self._v_perm] = blocks[:, :, 1]
        k = k.view(n, h, bs, d).permute(0, 2, 1, 3).reshape(n * bs, h, d)[:tokens]
        v = v.view(n, h, bs, d).permute(0, 2, 1, 3).reshape(n * bs, h, d)[:tokens]
        return k, v

    def _probe_cpu_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where vLLM's CPU write op puts each element of a block's K and V.

        vLLM has no op that reads its CPU layout back, and the order differs by
        kernel (AMX packs pairs of tokens, AVX-512 transposes K). Writing each
        element's own index (in two bf16-exact parts below 256) through the op
        into a scratch block shows where it goes, once per process.
        """
        from vllm import _custom_ops as ops

        h, d, bs = self.heads, self.head_dim, self.block_size
        scratch = torch.zeros((1, h, bs, 2 * d), dtype=self.dtype)
        kc, vc = scratch.view(1, h, 2 * bs, d).chunk(2, 2)
        element = torch.arange(bs * d).view(bs, 1, d).expand(bs, h, d)  # index within a head
        seen = []
        for part in (element % 256, element // 256):
            scratch.zero_()
            p = part.to(self.dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(p, p, kc, vc, torch.arange(bs), self._isa)
            seen.append(scratch.view(h, 2, bs * d).long())
        where = seen[0] + 256 * seen[1]  # [H, 2, bs * d]: the element at each position
        k_perm, v_perm = where[0, 0], where[0, 1]
        expected = torch.arange(bs * d)
        if not (torch.equal(k_perm.sort().values, expected)
                and torch.equal(v_perm.sort().values, expected)
                and torch.equal(where[:, 0], k_perm.expand(h, -1))
                and torch.equal(where[:, 1], v_perm.expand(h, -1))):  # fmt: skip
            raise KvcdnError("vLLM's CPU KV layout is not a per-head permutation of tokens")
        return k_perm, v_perm


def _stacked_rows(caches: dict[int, torch.Tensor], heads: int, row: int) -> np.ndarray | None:
    """The CPU caches of layers ``0 .. L-1`` as one numpy view ``[L, blocks, heads, 2,
    row]`` (bfloat16 as uint16 bits), when the layers sit at equal steps in one buffer
    (as vLLM allocates them); None otherwise (each layer is then written by vLLM's op)."""
    first = caches[0]
    as_bits = torch.int16 if first.dtype == torch.bfloat16 else first.dtype
    nb = first.shape[0]
    layers = [caches[i].view(as_bits).view(nb, heads, 2, row) for i in range(len(caches))]
    base = layers[0]
    size = base.element_size()
    step = (layers[1].data_ptr() - base.data_ptr()) // size if len(layers) > 1 else base.numel()
    regular = step >= base.numel() and all(
        t.shape == base.shape and t.stride() == base.stride()
        and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and t.data_ptr() - base.data_ptr() == i * step * size
        for i, t in enumerate(layers)
    )  # fmt: skip
    if not regular:
        return None
    stacked = torch.as_strided(
        base, (len(layers), *base.shape), (step, *base.stride()), base.storage_offset()
    ).numpy()
    return stacked.view(np.uint16) if first.dtype == torch.bfloat16 else stacked


class PagedTarget:
    """A :class:`~kvcdn.sdk.KVTarget` over vLLM's blocks, of which only the tokens the
    load claimed are written (vLLM has the others). In vLLM's CPU layouts a chunk is
    decoded straight into the blocks; otherwise into a staging tensor of one chunk,
    written to the blocks once decoded from verified bytes (the loader decodes one
    chunk at a time, so one chunk is staged at a time)."""

    def __init__(self, layout: _PagedLayout, spec: LoadSpec) -> None:
        self.layout = layout
        self.spec = spec
        self.tokens = spec.end
        # decoded in float32 on the CPU (the codec's exact output), cast when written
        self.dtype = torch.float32 if layout.device == "cpu" else layout.dtype
        self._staged: dict[int, torch.Tensor] = {}

    def chunk(self, start: int, end: int) -> torch.Tensor | PermutedBlocks:
        lo, hi = max(start, self.spec.start), min(end, self.spec.end)
        into = self.layout.permuted(self.spec.block_ids, start, end - start, lo - start,
                                    max(lo, hi) - start)  # fmt: skip
        if into is not None:
            return into
        shape = (len(self.layout.caches), 2, self.layout.heads, end - start, self.layout.head_dim)
        staged = torch.empty(shape, dtype=self.dtype, device=self.layout.device)
        self._staged[start] = staged
        return staged

    def prefix(self, end: int) -> torch.Tensor:
        raise KvcdnError("an engine's load does not recompute chunks")

    def commit(self, start: int, end: int) -> None:
        staged = self._staged.pop(start, None)
        if staged is None:
            return  # decoded into the blocks
        lo, hi = max(start, self.spec.start), min(end, self.spec.end)
        if lo < hi:
            self.layout.write(staged[:, :, :, lo - start : hi - start], self.spec.block_ids, lo)


def _write_capture(kv: torch.Tensor, path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.{os.getpid()}.tmp"
    save_file({"kv": kv.contiguous()}, tmp)
    os.replace(tmp, path)


# ---- the producer's engine ------------------------------------------------------------
def producer_config(capture_dir: str, model: str | None = None, *, role: str = "kv_producer",
                    **extra: Any) -> Any:  # fmt: skip
    """vLLM's ``KVTransferConfig`` for this connector capturing into ``capture_dir``."""
    from vllm.config import KVTransferConfig

    config: dict[str, Any] = {"capture_dir": capture_dir, **extra}
    if model is not None:
        config["model"] = model
    return KVTransferConfig(
        kv_connector="KvcdnConnector", kv_connector_module_path=__name__, kv_role=role,
        kv_load_failure_policy="recompute", kv_connector_extra_config=config,
    )  # fmt: skip


class VllmPrefill:
    """vLLM as a publisher's prefill: ``prefill(ids)`` runs a document's tokens
    through ``llm`` (whose kvcdn connector captures into ``capture_dir``, see
    :func:`producer_config`) and returns their KV ``[L, 2, H, T, D]`` as float32:
    what ``kvcdn publish --engine vllm`` encodes and publishes."""

    def __init__(self, llm: Any, capture_dir: str) -> None:
        self.llm = llm
        self.capture_dir = Path(capture_dir)

    @classmethod
    def start(cls, model: str | None, capture_dir: str, *, block_size: int = 256,
              **engine: Any) -> VllmPrefill:  # fmt: skip
        """A vLLM engine for ``model`` (a kvcdn model name) with a capturing connector."""
        from vllm import LLM

        identity = model_identity(model)
        llm = LLM(
            model=identity.folder,
            kv_transfer_config=producer_config(capture_dir, model or identity.name),
            block_size=block_size, enable_prefix_caching=False,
            max_model_len=identity.context_window, **engine,
        )  # fmt: skip
        return cls(llm, capture_dir)

    def __call__(self, ids: list[int]) -> torch.Tensor:
        from safetensors.torch import load_file
        from vllm import SamplingParams

        capture_id = uuid.uuid4().hex
        params = SamplingParams(max_tokens=1, extra_args={
            "kv_transfer_params": {CAPTURE_PARAM: capture_id, LOAD_PARAM: False}})  # fmt: skip
        self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        path = self.capture_dir / f"{capture_id}.safetensors"
        if not path.is_file():
            raise KvcdnError("vLLM ran the prefill but its KV was not captured (see its log)")
        try:
            return load_file(path)["kv"]
        finally:
            path.unlink()
