"""What kvcdn's readers did, as Prometheus counters and histograms: one set of metrics
for an app's :class:`~kvcdn.sdk.Client` (``client.stats``) and for the vLLM connector
(on vLLM's ``/metrics``). Names, labels and meanings are in docs/sdk.md.

Label values are bounded: a source is a configured edge's URL, ``origin`` or
``store``; a level one the codecs name (else ``other``); reasons and results come from
fixed sets. Document names are never labels: an operator's series stay few however
many documents are published.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvcdn.codec import ALL_LEVEL_NAMES
from kvcdn.codec_profile import NESTED_TIERS
from kvcdn.errors import (
    DeadlineExceeded,
    FormatError,
    ModelError,
    NotFound,
    StoreError,
    TrustError,
)

from .streaming import SKIPPED, TEXT, ChunkReport, failure_kind

LOOKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: What a lookup of a request's (or a load's) document found.
LOOKUP_RESULTS = ("hit", "miss", "refused", "failed")


@dataclass(frozen=True)
class Metric:
    name: str  # a counter's without its ``_total``
    kind: str  # "counter" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("kvcdn_lookups", "counter",
           "Documents looked up for a request or a load, by result (hit, miss, refused, "
           "failed) and, where refused or failed, why", ("result", "reason")),
    Metric("kvcdn_lookup_seconds", "histogram",
           "Time to find a document: the prefix index and its manifest (vLLM), or the "
           "pointer and the manifest (the SDK)", (), LOOKUP_BUCKETS),
    Metric("kvcdn_claimed_tokens", "counter",
           "Prompt tokens kvcdn undertook to load (vLLM: claimed from the scheduler)"),
    Metric("kvcdn_loaded_tokens", "counter", "Prompt tokens kvcdn loaded into the cache"),
    Metric("kvcdn_read_bytes", "counter",
           "Bytes of KV objects read, by source (an edge's URL, origin, store) and level",
           ("source", "level")),
    Metric("kvcdn_chunks", "counter",
           "Chunks (or a rank's part of one) written into the cache, by level", ("level",)),
    Metric("kvcdn_recomputed_chunks", "counter",
           "Chunks (or parts) computed by the model instead of loaded, by reason: missing, "
           "corrupt, refused (untrusted), unreachable, late, planned (cheaper to compute), "
           "after_failure (an earlier chunk of the prefix failed)", ("reason",)),
    Metric("kvcdn_refinements", "counter",
           "Nested chunks raised to a better level after loading, by result (raised, "
           "dropped)", ("result",)),
    Metric("kvcdn_load_seconds", "histogram",
           "Time of a load, from its start to its last chunk in the cache", (), LOAD_BUCKETS),
)}  # fmt: skip

_LEVELS = frozenset([*ALL_LEVEL_NAMES, *NESTED_TIERS])


def lookup_failure(error: BaseException) -> tuple[str, str]:
    """A lookup that raised, as its (result, reason) labels."""
    if isinstance(error, NotFound):
        return "miss", ""
    if isinstance(error, TrustError):
        return "refused", "untrusted"
    if isinstance(error, ModelError):
        return "refused", "model"
    if isinstance(error, (FormatError, DeadlineExceeded, StoreError)):
        return "failed", failure_kind(error)
    return "failed", "error"


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0


class ReaderStats:
    """Counters and histograms of lookups and loads, safe to record from any thread.

    ``snapshot()`` gives the totals as plain data; ``collect()`` makes the object a
    ``prometheus_client`` collector (``REGISTRY.register(client.stats)``). With
    ``keep_observations`` (the vLLM connector), :meth:`drain` also hands over what was
    recorded since it was last called, observations included, to be sent to vLLM's
    metrics process.
    """

    def __init__(self, edges: Sequence[str] = (), *, keep_observations: bool = False) -> None:
        self._edges = _urls(edges)
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._histograms: dict[tuple[str, tuple[str, ...]], _Histogram] = {}
        self._keep = keep_observations
        self._new_counts: dict[tuple[str, tuple[str, ...]], float] = {}
        self._new_observations: dict[tuple[str, tuple[str, ...]], list[float]] = {}

    # ---- recording ------------------------------------------------------------------
    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = self._key(name, "counter", labels)
        if value <= 0:
            return
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value
            if self._keep:
                self._new_counts[key] = self._new_counts.get(key, 0.0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = self._key(name, "histogram", labels)
        buckets = METRICS[name].buckets
        with self._lock:
            h = self._histograms.get(key)
            if h is None:
                h = self._histograms[key] = _Histogram(len(buckets))
            h.counts[bisect.bisect_left(buckets, value)] += 1
            h.sum += value
            h.count += 1
            if self._keep:
                self._new_observations.setdefault(key, []).append(value)

    def lookup(self, result: str, reason: str = "", seconds: float | None = None) -> None:
        """A document looked up: ``result`` one of :data:`LOOKUP_RESULTS`."""
        self.inc("kvcdn_lookups", result=result, reason=reason)
        if seconds is not None:
            self.observe("kvcdn_lookup_seconds", seconds)

    def load(self, chunks: Iterable[ChunkReport], seconds: float | None, *,
             refinements_dropped: int = 0, loaded_tokens: int | None = None) -> None:  # fmt: skip
        """A load's chunks: bytes by source and level, chunks by level, recomputes by
        reason, refinements; its time; its tokens (default: those of its loaded chunks)."""
        tokens = 0
        for c in chunks:
            level = c.level if c.level in _LEVELS else "other"
            if c.bytes:
                self.inc("kvcdn_read_bytes", c.bytes, source=self.source(c.source), level=level)
            if c.level in (TEXT, SKIPPED):
                self.inc("kvcdn_recomputed_chunks", reason=c.recompute_reason or "planned")
            else:
                self.inc("kvcdn_chunks", level=level)
                tokens += c.tokens
            if c.refined_from:
                self.inc("kvcdn_refinements", len(c.refined_from), result="raised")
        self.inc("kvcdn_refinements", refinements_dropped, result="dropped")
        self.inc("kvcdn_loaded_tokens", tokens if loaded_tokens is None else loaded_tokens)
        if seconds is not None:
            self.observe("kvcdn_load_seconds", seconds)

    def add_edges(self, edges: Iterable[str]) -> None:
        """More edges whose URLs are source labels (a client made by ``with_options``)."""
        with self._lock:
            self._edges = self._edges | _urls(edges)

    def source(self, source: str) -> str:
        """A fetch's source as a label: a configured edge, ``origin`` or ``store``."""
        if source in self._edges or source == "origin":
            return source
        return "store"

    # ---- reading --------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every series recorded so far: ``{name: [{"labels": {...}, "value": v}]}``
        for counters (``name`` with ``_total``), and for histograms ``"buckets"`` (the
        cumulative count at or below each bound, the last ``+Inf``), ``"sum"`` and
        ``"count"``."""
        out: dict[str, list[dict[str, Any]]] = {}
        with self._lock:
            for (name, values), v in sorted(self._counters.items()):
                labels = dict(zip(METRICS[name].labels, values, strict=True))
                out.setdefault(f"{name}_total", []).append({"labels": labels, "value": v})
            for (name, values), h in sorted(self._histograms.items()):
                labels = dict(zip(METRICS[name].labels, values, strict=True))
                cumulative, total = [], 0
                for n in h.counts:
                    total += n
                    cumulative.append(total)
                out.setdefault(name, []).append({"labels": labels, "buckets": cumulative,
                                                 "sum": h.sum, "count": h.count})  # fmt: skip
        return out

    def value(self, name: str, **labels: str) -> float:
        """A counter's total over the series whose labels include ``labels``."""
        with self._lock:
            return sum(v for (n, values), v in self._counters.items() if n == name
                       and _matches(METRICS[name].labels, values, labels))  # fmt: skip

    def collect(self) -> Iterator[Any]:
        """``prometheus_client``'s collector protocol (needs ``prometheus_client``)."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snap = self.snapshot()
        for metric in METRICS.values():
            if metric.kind == "counter":
                family = CounterMetricFamily(metric.name, metric.help, labels=metric.labels)
                for s in snap.get(f"{metric.name}_total", []):
                    family.add_metric([s["labels"][k] for k in metric.labels], s["value"])
            else:
                family = HistogramMetricFamily(metric.name, metric.help, labels=metric.labels)
                bounds = [*(str(b) for b in metric.buckets), "+Inf"]
                for s in snap.get(metric.name, []):
                    family.add_metric([s["labels"][k] for k in metric.labels],
                                      list(zip(bounds, s["buckets"], strict=True)),
                                      s["sum"])  # fmt: skip
            yield family

    def drain(self, leading: Sequence[str] = ()) -> dict[str, list[list[Any]]]:
        """What was recorded since the last drain, as plain lists (vLLM sends it between
        processes): ``{"counters": [[name, labels, delta]], "observations": [[name,
        labels, [values]]]}``, each entry's label values after ``leading`` ones (the
        connector's tenant). Empty without ``keep_observations``."""
        with self._lock:
            counts, self._new_counts = self._new_counts, {}
            seen, self._new_observations = self._new_observations, {}
        first = list(leading)
        return {
            "counters": [[n, [*first, *labels], v] for (n, labels), v in counts.items()],
            "observations": [[n, [*first, *labels], vs] for (n, labels), vs in seen.items()],
        }

    def _key(self, name: str, kind: str, labels: dict[str, str]) -> tuple[str, tuple[str, ...]]:
        metric = METRICS.get(name)
        if metric is None or metric.kind != kind or set(labels) != set(metric.labels):
            raise ValueError(f"no {kind} {name} with labels {sorted(labels)}")
        return name, tuple(str(labels[k]) for k in metric.labels)


def _urls(edges: Iterable[str]) -> frozenset[str]:
    return frozenset(e.strip().rstrip("/") for e in edges)  # as the edge reader names them


def _matches(names: tuple[str, ...], values: tuple[str, ...], want: dict[str, str]) -> bool:
    have = dict(zip(names, values, strict=True))
    return all(have.get(k) == v for k, v in want.items())


def merge_drained(into: dict[str, list[list[Any]]], more: dict[str, list[list[Any]]]) -> None:
    """Add one :meth:`ReaderStats.drain` to another (vLLM aggregates the workers')."""
    into.setdefault("counters", []).extend(more.get("counters", []))
    into.setdefault("observations", []).extend(more.get("observations", []))


def checked_drained(data: Any, leading: int = 0
                    ) -> Iterator[tuple[Metric, tuple[str, ...], str, Any]]:  # fmt: skip
    """The entries of a drained dict that name a known metric with its labels (after
    ``leading`` label values of the drain's own): (metric, label values, "counter" or
    "histogram", the delta or the observations)."""
    if not isinstance(data, dict):
        return
    for kind, field in (("counter", "counters"), ("histogram", "observations")):
        for entry in data.get(field) or ():
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
                continue
            name, labels, value = entry
            metric = METRICS.get(name) if isinstance(name, str) else None
            if metric is None or metric.kind != kind or not isinstance(labels, (list, tuple)):
                continue
            if len(labels) != leading + len(metric.labels):
                continue
            yield metric, tuple(str(v) for v in labels), kind, value
