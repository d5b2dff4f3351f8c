"""CacheGen's controller and throughput estimate: the baseline ``bench/abr.py`` compares against.

They live here, not in :mod:`kvcdn.sdk.planner`, because nothing but the
benchmark uses them; ``load_context`` takes them through its ``predictor``
and ``policy`` arguments like any other predictor and policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcdn.sdk.planner import (
    IDLE,
    INITIAL_BPS,
    TEXT,
    Busy,
    ChunkChoice,
    Option,
    Plan,
    ThroughputPredictor,
    estimate,
)


class LastSamplePredictor:
    """CacheGen's estimate: the throughput of the last transfer (the baseline's predictor)."""

    def __init__(self, initial_bps: float = INITIAL_BPS) -> None:
        self.bps = initial_bps
        self.samples = 0

    def predict_seconds(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else nbytes / self.bps

    def observe(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.bps = max(nbytes / seconds, 1e3)
            self.samples += 1


def cachegen_plan(
    chunks: Sequence[ChunkChoice],
    predictor: ThroughputPredictor,
    deadline_s: float | None,
    busy: Busy = IDLE,
) -> Plan:
    """CacheGen's controller.

    Each chunk gets an even share of the time left; it takes the best level
    whose transfer fits its share at the predicted throughput, else ``text``.
    """
    chosen: dict[int, Option] = {}
    share = None if deadline_s is None or not chunks else deadline_s / len(chunks)
    for chunk in chunks:
        fetched = sorted(
            (o for o in chunk.options if o.level != TEXT), key=lambda o: (-o.quality, o.bytes)
        )
        text = [o for o in chunk.options if o.level == TEXT]
        fits = [o for o in fetched if share is None or predictor.predict_seconds(o.bytes) <= share]
        chosen[chunk.index] = (fits or text or fetched[-1:])[0]
    finish = estimate(chunks, chosen, predictor, busy)
    return Plan(chosen, finish, deadline_s is None or finish <= deadline_s)

