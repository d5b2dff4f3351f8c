"""kvcdn's metrics on vLLM's ``/metrics``, through vLLM's connector stats hooks.

Each role (the scheduler in the engine core, each worker) records into its own
:class:`~kvcdn.sdk.stats.ReaderStats`; vLLM asks both for what is new every step
(``get_kv_connector_stats``), adds the workers' together and the scheduler's to them
(:meth:`KvcdnConnectorStats.aggregate`), and hands the sum to its metrics process,
where :class:`KvcdnPromMetrics` adds it to Prometheus counters and histograms named as
the SDK's (docs/sdk.md), with vLLM's own ``model_name`` and ``engine`` labels first,
then ``tenant`` (:meth:`ConnectorSetup.tenant_label`).
"""

from __future__ import annotations

import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..stats import METRICS, checked_drained, merge_drained

#: The label the connector puts before each metric's own: whose requests they were.
TENANT_LABEL = "tenant"


class KvcdnConnectorStats(KVConnectorStats):
    """What the roles recorded since vLLM last asked: ``ReaderStats.drain()``'s plain
    lists (vLLM sends them between processes)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": [], "observations": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge_drained(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("observations")

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals for vLLM's periodic log line."""
        totals: dict[str, float] = {}
        for metric, labels, kind, value in checked_drained(self.data, leading=1):
            if kind != "counter" or not _number(value):
                continue
            name = metric.name.removeprefix("kvcdn_")
            if metric.name == "kvcdn_lookups":
                name = f"lookups {labels[1]}"
            elif metric.name == "kvcdn_read_bytes":
                name, value = "read MB", value / 1e6
            totals[name] = totals.get(name, 0.0) + value
        return {k: round(v, 3) for k, v in sorted(totals.items())}


class KvcdnPromMetrics(KVConnectorPromMetrics):
    """The SDK's metrics as Prometheus families in vLLM's metrics process."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()  # an earlier logger's (vLLM builds one per engine client)
        self._families: dict[str, Any] = {}
        for metric in METRICS.values():
            names = [*labelnames, TENANT_LABEL, *metric.labels]
            if metric.kind == "counter":
                family = self._counter_cls(name=metric.name, documentation=metric.help,
                                           labelnames=names)  # fmt: skip
            else:
                family = self._histogram_cls(name=metric.name, documentation=metric.help,
                                             labelnames=names,
                                             buckets=list(metric.buckets))  # fmt: skip
            self._families[metric.name] = family

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx)
        if engine is None:
            return
        for metric, labels, kind, value in checked_drained(transfer_stats_data, leading=1):
            child = self._families[metric.name].labels(*engine, *labels)
            if kind == "counter":
                if _number(value) and value > 0:
                    child.inc(value)
            elif isinstance(value, list):
                for v in value:
                    if _number(v):
                        child.observe(v)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unregister_ours() -> None:
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("kvcdn_"):
            REGISTRY.unregister(collector)
