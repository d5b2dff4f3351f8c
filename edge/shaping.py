"""Link shaping: an edge that sends no faster than a fixed rate or a recorded trace.

nginx has ``limit_rate``; an edge has this, for the same reasons and one more:
replaying a real throughput trace (``../shared/traces``: seconds and Mbit/s
per line, as Pensieve's cooked traces) on loopback turns a test or a
benchmark of adaptive loading into a run over a real, changing link.

All responses of an edge share one shaped link, as clients behind one
bottleneck do: the shaper keeps the link's virtual clock, the time at which
everything queued so far has been sent, and every piece of every body waits
for its own slot.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PIECE = 64 << 10  # bytes sent per wait: small enough to follow the rate closely
MIN_RATE = 1.0  # bytes/s: a link that carries nothing still ends, in principle


class TraceError(ValueError):
    """A trace file that cannot be used."""


@dataclass(frozen=True)
class Trace:
    """Throughput over time, piecewise constant, repeating after its last sample."""

    times: tuple[float, ...]  # seconds, strictly increasing, from 0
    bytes_per_s: tuple[float, ...]

    @classmethod
    def load(cls, path: str | Path, *, scale: float = 1.0) -> Trace:
        """A ``<seconds> <Mbit/s>`` file; ``scale`` multiplies every throughput."""
        if scale <= 0:
            raise TraceError("the trace scale must be positive")
        times: list[float] = []
        rates: list[float] = []
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise TraceError(f"{path} is not a text trace ('<seconds> <Mbit/s>' lines)") from None
        for n, line in enumerate(lines, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = line.split()
            try:
                t, mbps = float(fields[0]), float(fields[1])
            except (IndexError, ValueError):
                raise TraceError(f"{path}:{n}: expected '<seconds> <Mbit/s>'") from None
            if not (math.isfinite(t) and math.isfinite(mbps)) or mbps < 0:
                raise TraceError(f"{path}:{n}: throughput must be a finite number >= 0")
            if times and t <= times[-1]:
                raise TraceError(f"{path}:{n}: times must increase")
            times.append(t)
            rates.append(mbps * 1e6 / 8 * scale)
        if len(times) < 2:
            raise TraceError(f"{path}: a trace needs at least two samples")
        start = times[0]
        return cls(tuple(t - start for t in times), tuple(rates))

    @property
    def period(self) -> float:
        # the last sample lasts as long as the one before it
        return self.times[-1] + (self.times[-1] - self.times[-2])

    def segment(self, t: float) -> tuple[float, float]:
        """(rate, seconds until the rate changes) at time ``t`` (wrapping around)."""
        local = t % self.period
        lo, hi = 0, len(self.times) - 1
        while lo < hi:  # the last sample at or before ``local``
            mid = (lo + hi + 1) // 2
            if self.times[mid] <= local:
                lo = mid
            else:
                hi = mid - 1
        end = self.times[lo + 1] if lo + 1 < len(self.times) else self.period
        return self.bytes_per_s[lo], max(end - local, 1e-9)


def seconds_to_send(rate_at: Callable[[float], tuple[float, float]], start: float, n: int) -> float:
    """When ``n`` bytes started at ``start`` have been sent over the link ``rate_at``."""
    t, left = start, float(n)
    while left > 0:
        rate, span = rate_at(t)
        rate = max(rate, MIN_RATE)
        if rate * span >= left:
            return t + left / rate
        left -= rate * span
        t += span
    return t


class LinkShaper:
    """One shaped link shared by every response of an edge."""

    def __init__(
        self, rate_at: Callable[[float], tuple[float, float]], *, offset_s: float = 0.0
    ) -> None:
        self._rate_at = rate_at
        self._origin = time.monotonic() - offset_s  # trace time 0
        self._free_at = 0.0  # trace time at which the link is next idle

    @classmethod
    def fixed(cls, bytes_per_s: float) -> LinkShaper:
        if bytes_per_s <= 0:
            raise ValueError("the rate must be positive")
        return cls(lambda t: (bytes_per_s, math.inf))

    @classmethod
    def replay(cls, trace: Trace, *, offset_s: float = 0.0) -> LinkShaper:
        return cls(trace.segment, offset_s=offset_s)

    def trace_time(self) -> float:
        """The trace's clock now (seconds since trace time 0, not wrapped)."""
        return time.monotonic() - self._origin

    def restart(self, offset_s: float) -> None:
        """Replay from ``offset_s`` now, on an idle link (for repeatable experiments)."""
        self._origin = time.monotonic() - offset_s
        self._free_at = offset_s

    async def send(self, n: int) -> None:
        """Wait until ``n`` more bytes may go out."""
        now = time.monotonic() - self._origin
        start = max(now, self._free_at)
        self._free_at = seconds_to_send(self._rate_at, start, n)
        delay = self._free_at - now
        if delay > 0:
            await asyncio.sleep(delay)
