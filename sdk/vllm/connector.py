"""The connector vLLM instantiates, once per role: a facade that hands each of vLLM's
calls to the scheduler role (:mod:`.scheduler`) or the worker role (:mod:`.worker`),
as vLLM's own connectors are split."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .config import ConnectorConfig, ConnectorSetup
from .metadata import KvcdnMetadata
from .scheduler import KvcdnScheduler
from .stats import KvcdnConnectorStats, KvcdnPromMetrics
from .worker import KvcdnWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvcdnConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvcdn (docs/vllm.md)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        self.setup = ConnectorSetup(vllm_config)
        self.scheduler: KvcdnScheduler | None = None
        self.worker: KvcdnWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KvcdnScheduler(self.setup, vllm_config)
        else:
            self.worker = KvcdnWorker(self.setup)

    # ---- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # ---- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.worker is not None
        if isinstance(connector_metadata, KvcdnMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._metadata()
        if meta is not None:
            self.worker.start_load_kv(meta)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-ordered loads wait in ``wait_for_layer_load``, which a captured CUDA graph
        would skip: they need PIECEWISE graphs wherever a load may be synchronous (only
        those are layer-ordered): ``load_mode: async`` or ``layer_groups: 1`` keep
        vLLM's full graphs."""
        groups = extra_config.get("layer_groups", ConnectorConfig.layer_groups)
        return extra_config.get("load_mode", "auto") != "async" and groups != 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer_load(layer_name)  # a layer-ordered load's layer is in

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # captures copy whole prompts after the step (wait_for_save)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._metadata()
        if meta is not None:
            self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished(self._metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self.worker is None else self.worker.build_connector_worker_meta()

    def _metadata(self) -> KvcdnMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvcdnMetadata) else None

    # ---- metrics (vLLM's /metrics and its periodic log line) -------------------------------
    def get_kv_connector_stats(self) -> KvcdnConnectorStats | None:
        """What this role recorded since vLLM last asked (each step)."""
        drained = self.setup.drain_stats()
        stats = KvcdnConnectorStats(data=drained)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcdnConnectorStats:
        return KvcdnConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvcdnPromMetrics:
        return KvcdnPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        role = self.scheduler or self.worker
        if role is not None:
            role.shutdown()


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
