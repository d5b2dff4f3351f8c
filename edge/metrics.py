"""The edge's counters, and their Prometheus text for ``GET /metrics``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import DiskCache


@dataclass
class Metrics:
    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    #: Misses that waited for a sibling worker's fetch of the key, then served its copy.
    worker_coalesced: int = 0
    bytes_served: int = 0
    origin_fetches: int = 0
    origin_seconds: float = 0.0
    origin_errors: int = 0
    verify_failures: int = 0
    #: Cached copies read and hashed again before use: the first use after a start,
    #: a file that changed, or (with workers) one cached in an earlier run.
    cache_verifications: int = 0
    stale_served: int = 0
    #: Stale copies of pointers not served because their signed expiry had passed.
    stale_expired_refused: int = 0
    #: Pointers the origin served past their signed expiry (passed on as they are).
    expired_pointers_fetched: int = 0
    rollbacks_refused: int = 0
    #: Responses by status code. Bounded without a cap: the statuses are the
    #: edge's own (aiohttp accepts 100-999 only), never taken from a request.
    requests: dict[int, int] = field(default_factory=dict)

    def count_response(self, status: int) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1

    def counters(self, cache: DiskCache) -> dict[str, float]:
        """This process's counters by their Prometheus sample names (what workers sum)."""
        values: dict[str, float] = {
            "kvcdn_edge_hits_total": self.hits,
            "kvcdn_edge_misses_total": self.misses,
            "kvcdn_edge_coalesced_waiters_total": self.coalesced,
            "kvcdn_edge_worker_coalesced_total": self.worker_coalesced,
            "kvcdn_edge_bytes_served_total": self.bytes_served,
            "kvcdn_edge_origin_fetch_seconds_sum": self.origin_seconds,
            "kvcdn_edge_origin_fetch_seconds_count": self.origin_fetches,
            "kvcdn_edge_origin_errors_total": self.origin_errors,
            "kvcdn_edge_cache_writes_total": cache.writes,
            "kvcdn_edge_cache_write_skips_total": cache.skips,
            "kvcdn_edge_evictions_total": cache.evictions,
            "kvcdn_edge_verify_failures_total": self.verify_failures,
            "kvcdn_edge_cache_verifications_total": self.cache_verifications,
            "kvcdn_edge_stale_served_total": self.stale_served,
            "kvcdn_edge_stale_expired_refused_total": self.stale_expired_refused,
            "kvcdn_edge_expired_pointers_fetched_total": self.expired_pointers_fetched,
            "kvcdn_edge_rollbacks_refused_total": self.rollbacks_refused,
        }
        for code, n in self.requests.items():
            values[f'kvcdn_edge_responses_total{{code="{code}"}}'] = n
        return values

    def prometheus(self, cache: DiskCache, summed: dict[str, float] | None = None) -> str:
        """The text exposition format: these counters (or ``summed``, every worker's
        sum), and the disk cache's gauges (of the whole folder, never summed)."""
        values = summed if summed is not None else self.counters(cache)
        lines: list[str] = []
        typed: set[str] = set()
        for name in _ORDER:
            family = _family(name)
            if family not in typed:
                typed.add(family)
                kind = "summary" if family == "kvcdn_edge_origin_fetch_seconds" else "counter"
                lines.append(f"# TYPE {family} {kind}")
            lines.append(f"{name} {_number(values.get(name, 0))}")
        lines += [
            "# TYPE kvcdn_edge_cache_bytes gauge",
            f"kvcdn_edge_cache_bytes {cache.bytes}",
            "# TYPE kvcdn_edge_cache_objects gauge",
            f"kvcdn_edge_cache_objects {len(cache)}",
            "# TYPE kvcdn_edge_responses_total counter",
        ]
        codes = sorted(
            (int(n.split('"')[1]), v) for n, v in values.items()
            if n.startswith("kvcdn_edge_responses_total{")
        )  # fmt: skip
        lines += [f'kvcdn_edge_responses_total{{code="{c}"}} {_number(n)}' for c, n in codes]
        return "\n".join(lines) + "\n"


_ORDER = [
    "kvcdn_edge_hits_total",
    "kvcdn_edge_misses_total",
    "kvcdn_edge_coalesced_waiters_total",
    "kvcdn_edge_worker_coalesced_total",
    "kvcdn_edge_bytes_served_total",
    "kvcdn_edge_origin_fetch_seconds_sum",
    "kvcdn_edge_origin_fetch_seconds_count",
    "kvcdn_edge_origin_errors_total",
    "kvcdn_edge_cache_writes_total",
    "kvcdn_edge_cache_write_skips_total",
    "kvcdn_edge_evictions_total",
    "kvcdn_edge_verify_failures_total",
    "kvcdn_edge_cache_verifications_total",
    "kvcdn_edge_stale_served_total",
    "kvcdn_edge_stale_expired_refused_total",
    "kvcdn_edge_expired_pointers_fetched_total",
    "kvcdn_edge_rollbacks_refused_total",
]


def _family(name: str) -> str:
    return name.removesuffix("_sum").removesuffix("_count")


def _number(value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.6f}"
    return str(int(value))
