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
    bytes_served: int = 0
    origin_fetches: int = 0
    origin_seconds: float = 0.0
    origin_errors: int = 0
    verify_failures: int = 0
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

    def prometheus(self, cache: DiskCache) -> str:
        """The text exposition format: these counters, and the disk cache's."""
        lines = [
            "# TYPE kvcdn_edge_hits_total counter",
            f"kvcdn_edge_hits_total {self.hits}",
            "# TYPE kvcdn_edge_misses_total counter",
            f"kvcdn_edge_misses_total {self.misses}",
            "# TYPE kvcdn_edge_coalesced_waiters_total counter",
            f"kvcdn_edge_coalesced_waiters_total {self.coalesced}",
            "# TYPE kvcdn_edge_bytes_served_total counter",
            f"kvcdn_edge_bytes_served_total {self.bytes_served}",
            "# TYPE kvcdn_edge_origin_fetch_seconds summary",
            f"kvcdn_edge_origin_fetch_seconds_sum {self.origin_seconds:.6f}",
            f"kvcdn_edge_origin_fetch_seconds_count {self.origin_fetches}",
            "# TYPE kvcdn_edge_origin_errors_total counter",
            f"kvcdn_edge_origin_errors_total {self.origin_errors}",
            "# TYPE kvcdn_edge_cache_writes_total counter",
            f"kvcdn_edge_cache_writes_total {cache.writes}",
            "# TYPE kvcdn_edge_cache_write_skips_total counter",
            f"kvcdn_edge_cache_write_skips_total {cache.skips}",
            "# TYPE kvcdn_edge_evictions_total counter",
            f"kvcdn_edge_evictions_total {cache.evictions}",
            "# TYPE kvcdn_edge_verify_failures_total counter",
            f"kvcdn_edge_verify_failures_total {self.verify_failures}",
            "# TYPE kvcdn_edge_stale_served_total counter",
            f"kvcdn_edge_stale_served_total {self.stale_served}",
            "# TYPE kvcdn_edge_stale_expired_refused_total counter",
            f"kvcdn_edge_stale_expired_refused_total {self.stale_expired_refused}",
            "# TYPE kvcdn_edge_expired_pointers_fetched_total counter",
            f"kvcdn_edge_expired_pointers_fetched_total {self.expired_pointers_fetched}",
            "# TYPE kvcdn_edge_rollbacks_refused_total counter",
            f"kvcdn_edge_rollbacks_refused_total {self.rollbacks_refused}",
            "# TYPE kvcdn_edge_cache_bytes gauge",
            f"kvcdn_edge_cache_bytes {cache.bytes}",
            "# TYPE kvcdn_edge_cache_objects gauge",
            f"kvcdn_edge_cache_objects {len(cache)}",
            "# TYPE kvcdn_edge_responses_total counter",
            *(
                f'kvcdn_edge_responses_total{{code="{c}"}} {n}'
                for c, n in sorted(self.requests.items())
            ),
        ]
        return "\n".join(lines) + "\n"
