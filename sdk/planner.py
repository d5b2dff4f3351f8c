"""Choosing each chunk's quality: the adaptive-bitrate planner of ``load_context``.

Like a video player choosing each segment's bitrate, but for a deadline on
the time to first token rather than a playback buffer. Every remaining chunk
gets a level (fetched over the network, then decoded on the device) or
``text`` (recomputed on the device from its tokens, in parallel with the
fetches of other chunks). The plan maximises the summed quality of the chunks
subject to finishing by the deadline, and is made again after every chunk
completes, with what the transfers so far say about the link.

The time model has two resources that work in parallel:
- the link, which carries the fetched chunks one after another at the
  predicted throughput: ``link = latency + sum(bytes) / throughput``;
- the device, which decodes fetched chunks and recomputes ``text`` chunks:
  ``device = sum(decode) + sum(recompute)``.

The load finishes at ``max(link + the last chunk's decode, device)``.

Choosing is a multiple-choice knapsack. The planner starts from the best
option of every chunk and, while the estimate misses the deadline, takes the
downgrade that saves the most time per unit of quality lost (free
downgrades first), until the estimate fits or nothing saves time; then the
plan is the best effort and says so.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

TEXT = "text"


@dataclass(frozen=True)
class Option:
    """One way to obtain a chunk: a level (``bytes`` > 0) or ``text`` (recompute)."""

    level: str
    bytes: int
    quality: float  # higher is better; 1.0 is exactly the model's own KV


@dataclass(frozen=True)
class ChunkChoice:
    index: int
    tokens: int
    options: tuple[Option, ...]  # the chunk's levels and ``text``


class ThroughputPredictor(Protocol):
    """How long a transfer will take, learnt from the transfers so far.

    A learned predictor can replace the default by implementing these two.
    """

    def predict_seconds(self, nbytes: int) -> float: ...

    def observe(self, nbytes: int, seconds: float) -> None: ...


class HarmonicPredictor:
    """RobustMPC's predictor: the harmonic mean of the last ``window`` throughput
    samples, divided by ``1 + the largest recent relative prediction error``.

    Until the first sample it assumes ``initial_bps``. A sample of zero bytes
    carries no throughput and is ignored; a transfer that took no measurable
    time counts as ``max_bps``.
    """

    def __init__(
        self,
        initial_bps: float = 12.5e6,
        *,
        window: int = 5,
        latency_s: float = 0.0,
        max_bps: float = 100e9,
    ) -> None:
        if initial_bps <= 0:
            raise ValueError("initial_bps must be positive")
        self.initial_bps = initial_bps
        self.latency_s = latency_s
        self.max_bps = max_bps
        self._samples: deque[float] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=window)

    def throughput(self) -> float:
        """Predicted bytes per second, with the error margin applied."""
        return self._harmonic() / (1.0 + max(self._errors, default=0.0))

    def _harmonic(self) -> float:
        if not self._samples:
            return self.initial_bps
        return len(self._samples) / sum(1.0 / s for s in self._samples)

    def predict_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.throughput()

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0:
            return
        measured = self.max_bps if seconds <= 0 else min(nbytes / seconds, self.max_bps)
        if self._samples:  # the initial guess is not a prediction to hold against the link
            self._errors.append(abs(self._harmonic() - measured) / measured)
        self._samples.append(measured)


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast this device decodes fetched chunks and recomputes text chunks."""

    decode_bytes_per_s: float
    prefill_tokens_per_s: float

    def decode_seconds(self, nbytes: int) -> float:
        return nbytes / self.decode_bytes_per_s

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s


@dataclass
class Plan:
    choices: dict[int, Option]  # chunk index -> chosen option
    predicted_s: float  # estimated seconds from now until every chunk is loaded
    feasible: bool  # the estimate meets the deadline (always True without one)

    @property
    def quality(self) -> float:
        return sum(o.quality for o in self.choices.values())


class _Estimate:
    """The time model, kept as running sums so a swap is evaluated in O(1)."""

    def __init__(self, predictor: ThroughputPredictor, device: DeviceSpeed) -> None:
        self.predictor = predictor
        self.device = device
        self.bytes = 0
        self.device_s = 0.0
        self.decode_max = 0.0

    def cost(self, chunk: ChunkChoice, option: Option) -> tuple[int, float]:
        if option.level == TEXT:
            return 0, self.device.recompute_seconds(chunk.tokens)
        return option.bytes, self.device.decode_seconds(option.bytes)

    def finish(self, nbytes: int, device_s: float, decode_max: float) -> float:
        link = self.predictor.predict_seconds(nbytes)
        return max(link + decode_max, device_s)


def plan(
    chunks: Sequence[ChunkChoice],
    predictor: ThroughputPredictor,
    device: DeviceSpeed,
    deadline_s: float | None,
) -> Plan:
    """The options that maximise quality while finishing within ``deadline_s``
    seconds from now (None: no deadline, every chunk at its best level)."""
    if deadline_s is None:
        best = {c.index: _best_fetched(c) for c in chunks}
        return Plan(best, _finish_of(chunks, best, predictor, device), True)

    est = _Estimate(predictor, device)
    chosen: dict[int, Option] = {}
    for chunk in chunks:
        chosen[chunk.index] = max(chunk.options, key=lambda o: (o.quality, -_time(est, chunk, o)))
    by_index = {c.index: c for c in chunks}
    for chunk in chunks:
        nbytes, dev = est.cost(chunk, chosen[chunk.index])
        est.bytes += nbytes
        est.device_s += dev
    decode_of = {
        c.index: est.cost(c, chosen[c.index])[1] if chosen[c.index].level != TEXT else 0.0
        for c in chunks
    }

    def current() -> float:
        return est.finish(est.bytes, est.device_s, max(decode_of.values(), default=0.0))

    finish = current()
    while finish > deadline_s:
        best_swap: tuple[float, int, Option] | None = None
        # the largest decode time without chunk i, in O(1): keep the top two
        top = sorted(decode_of.items(), key=lambda kv: kv[1], reverse=True)[:2] + [(-1, 0.0)]
        for index, option in chosen.items():
            chunk = by_index[index]
            old_bytes, old_dev = est.cost(chunk, option)
            for alt in chunk.options:
                if alt is option or alt.quality > option.quality:
                    continue
                new_bytes, new_dev = est.cost(chunk, alt)
                new_decode = new_dev if alt.level != TEXT else 0.0
                others = top[1][1] if top[0][0] == index else top[0][1]
                after = est.finish(
                    est.bytes - old_bytes + new_bytes,
                    est.device_s - old_dev + new_dev,
                    max(others, new_decode),
                )
                saved = finish - after
                if saved <= 1e-12:
                    continue
                loss = option.quality - alt.quality
                score = math.inf if loss <= 0 else saved / loss
                if best_swap is None or score > best_swap[0]:
                    best_swap = (score, index, alt)
        if best_swap is None:
            break  # nothing saves time: the best effort
        _, index, alt = best_swap
        chunk = by_index[index]
        old_bytes, old_dev = est.cost(chunk, chosen[index])
        new_bytes, new_dev = est.cost(chunk, alt)
        est.bytes += new_bytes - old_bytes
        est.device_s += new_dev - old_dev
        decode_of[index] = new_dev if alt.level != TEXT else 0.0
        chosen[index] = alt
        finish = current()
    return Plan(chosen, finish, finish <= deadline_s)


def _best_fetched(chunk: ChunkChoice) -> Option:
    fetched = [o for o in chunk.options if o.level != TEXT] or list(chunk.options)
    return max(fetched, key=lambda o: (o.quality, -o.bytes))


def _time(est: _Estimate, chunk: ChunkChoice, option: Option) -> float:
    nbytes, dev = est.cost(chunk, option)
    return est.predictor.predict_seconds(nbytes) + dev


def _finish_of(
    chunks: Sequence[ChunkChoice],
    chosen: dict[int, Option],
    predictor: ThroughputPredictor,
    device: DeviceSpeed,
) -> float:
    est = _Estimate(predictor, device)
    nbytes, device_s, decode_max = 0, 0.0, 0.0
    for chunk in chunks:
        b, d = est.cost(chunk, chosen[chunk.index])
        nbytes += b
        device_s += d
        if chosen[chunk.index].level != TEXT:
            decode_max = max(decode_max, d)
    return est.finish(nbytes, device_s, decode_max)
